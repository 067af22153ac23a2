"""Engine-grade allocation against a full recompute: any chunk schedule, preemption at any
point, speculative decoding with drafts accepted or rejected at random, with and without a
cached prefix, under both full-hit modes.

Two levels. `test_any_schedule_equals_full_recompute` drives `PrefixCache`'s step API and the
model by hand, so hypothesis chooses every chunk, every preemption and every draft (right or
wrong); the `Engine` tests then check the scheduler built on it end to end. The oracle is
`LlamaModel.forward_full` / `generate_greedy_full`, which uses no cache at all, on a model with
sharp attention (`LlamaModel.random`), so a wrong position, page or mask moves the logits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from prefixkv import PrefixCache
from prefixkv.cache import FULL_HIT_MODES
from prefixkv.engine.facade import Engine
from prefixkv.errors import OutOfBlocksError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest
from prefixkv.text.tokenizers import ByteTokenizer
from tests.engine_support import random_prompt

BLOCK = 4
VOCAB = ByteTokenizer().vocab_size
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=3)


class _Driver:
    """One request through the step API, computing exactly what the cache hands out."""

    def __init__(self, model: LlamaModel, cache: PrefixCache, kv: PagedKVCache) -> None:
        self.model, self.cache, self.kv = model, cache, kv

    def prefill(self, request_id: str, tokens: list[int], start: int, end: int, shared: bool):
        table = self.cache.block_table(request_id)
        batch = [
            PrefillRequest(
                tokens, table, num_cached_tokens=start, num_tokens=end, write_kv=not shared
            )
        ]
        return self.model.prefill(self.kv, batch, return_all_logits=True)[0]

    def serve_plainly(self, request_id: str, tokens: list[int]) -> None:
        """Prefill in one chunk, commit, finish: what warms the cache."""
        self.cache.add_request(request_id, tokens)
        slots = self.cache.allocate_slots(request_id, 0)
        start = slots.num_computed_tokens
        self.cache.allocate_slots(request_id, len(tokens) - start)
        self.prefill(request_id, tokens, start, len(tokens), slots.last_token_shared)
        self.cache.commit(request_id, len(tokens))
        self.cache.finish(request_id)


@settings(max_examples=15)
@given(data=st.data())
def test_any_schedule_equals_full_recompute(model: LlamaModel, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(FULL_HIT_MODES), label="full_hit")
    cache = PrefixCache(48, block_size=BLOCK, full_hit=mode, vocab_size=VOCAB)
    config = model.config
    kv = PagedKVCache(
        config.num_layers, 48, BLOCK, config.num_kv_heads, config.head_dim, dtype=model.dtype
    )
    driver = _Driver(model, cache, kv)
    prompt = random_prompt(data.draw(st.integers(1, 20), label="prompt length"), seed=5)
    warm = data.draw(st.integers(0, len(prompt)), label="cached prefix length")
    if warm:
        driver.serve_plainly("warm", prompt[:warm])
    num_new = data.draw(st.integers(1, 8), label="tokens to generate")
    reference = model.generate_greedy_full(prompt, num_new)
    # Row i: the logits that produced generated token i.
    full = model.forward_full(prompt + reference[:-1]).to(torch.float64)
    reference_logits = full[len(prompt) - 1 :]

    rid = "r"
    cache.add_request(rid, prompt)
    tokens = list(prompt)  # verified tokens, then pending drafts
    drafts: list[int] = []
    generated: list[int] = []
    computed = 0
    waiting = True
    shared_position: int | None = None
    while len(generated) < num_new:
        if not waiting and data.draw(st.booleans(), label="preempt"):
            cache.preempt(rid)
            del tokens[len(tokens) - len(drafts) :]
            drafts, waiting = [], True
            assert cache.block_table(rid) == []
        remaining = len(tokens) - computed if not waiting else None
        if waiting:
            probe = cache.lookup(tokens).num_cached_tokens
            chunk = data.draw(st.integers(1, len(tokens) - probe), label="chunk")
            lookahead = data.draw(st.integers(0, 3), label="lookahead")
            slots = cache.allocate_slots(rid, chunk, num_lookahead_tokens=lookahead)
            assert slots.num_computed_tokens == probe, "the match is what lookup promised"
            computed, waiting = slots.num_computed_tokens, False
            shared_position = computed if slots.last_token_shared else None
        else:
            assert remaining is not None
            # Drafts are verified in one pass; a prompt may go in any chunks.
            chunk = remaining if drafts else data.draw(st.integers(1, remaining), label="chunk")
            cache.allocate_slots(rid, chunk)
        end = computed + chunk
        logits = driver.prefill(rid, tokens, computed, end, shared_position == computed)
        shared_position = None
        cache.commit(rid, end)
        computed = end
        if computed < len(tokens):
            continue  # a prompt chunk: nothing to sample yet
        # Verify: row i predicts the token after position len(tokens) - len(drafts) - 1 + i.
        rows = logits[-(len(drafts) + 1) :].to(torch.float64)
        predicted = rows.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and predicted[accepted] == drafts[accepted]:
            accepted += 1
        first_row = len(tokens) - len(drafts) - len(prompt)  # index into reference rows
        for i in range(accepted + 1):  # rows whose context holds only correct tokens
            diff = (rows[i] - reference_logits[first_row + i]).abs().max().item()
            assert diff < TOLERANCE, f"logits differ by {diff} at generated token {first_row + i}"
        right = [t == r for t, r in zip(drafts, reference[len(generated) :], strict=False)]
        assert accepted == [*right, False].index(False), "accepted exactly the right drafts"
        if drafts:
            cache.accept_drafts(rid, accepted)
            del tokens[len(tokens) - len(drafts) + accepted :]
            computed = len(tokens)
            assert cache.num_computed_tokens(rid) == computed
        new = [*drafts[:accepted], predicted[accepted]]
        drafts = []
        generated.extend(new)
        assert generated[: len(reference)] == reference[: len(generated)]
        if len(generated) >= num_new:
            break
        tokens.append(new[-1])
        cache.append_tokens(rid, [new[-1]])
        # Drafts for the next step: each right (the oracle's token) or wrong, at random.
        room = num_new - len(generated) - 1
        for i in range(data.draw(st.integers(0, min(3, room)), label="drafts")):
            truth = reference[len(generated) + i]
            good = data.draw(st.booleans(), label="draft right")
            drafts.append(truth if good else (truth + 1 + i) % VOCAB)
        if drafts:
            cache.append_tokens(rid, drafts, draft=True)
            tokens.extend(drafts)
        cache.check_invariants()
    note(f"stats: {cache.stats()}")
    cache.finish(rid)
    cache.check_invariants()
    assert cache.stats().blocks_in_use == 0


def _assert_exact_results(model: LlamaModel, results, max_new_tokens: int) -> None:
    for result in results:
        expected = model.generate_greedy_full(result.prompt_token_ids, max_new_tokens)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
        assert result.tokens_match


@settings(max_examples=6)
@given(
    budget=st.integers(2, 40),
    num_blocks=st.integers(12, 40),
    speculative=st.integers(0, 3),
    policy=st.sampled_from(["cache_aware", "fcfs"]),
    mode=st.sampled_from(FULL_HIT_MODES),
    seed=st.integers(0, 3),
)
def test_the_engine_is_exact_under_any_budget_pool_and_draft_setting(
    model: LlamaModel,
    budget: int,
    num_blocks: int,
    speculative: int,
    policy: str,
    mode: str,
    seed: int,
) -> None:
    system = random_prompt(13, seed=seed)
    prompts = [system + random_prompt(3 + 2 * i, seed=10 * seed + i) for i in range(3)]
    prompts.append(system[:8])  # a full hit of a block-aligned prefix once cached
    engine = Engine(
        model,
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        num_speculative_tokens=speculative,
        scheduling=policy,
        full_hit=mode,
    )
    for _ in range(2):  # the second round runs against a warm cache
        results = engine.generate(prompts, max_new_tokens=6, check_exactness=True)
        _assert_exact_results(model, results, 6)
        note(f"{engine.last_stats}")
    engine.cache.check_invariants()
    assert engine.cache.stats().blocks_in_use == 0


def test_a_small_pool_preempts_and_resumes_exactly(model: LlamaModel) -> None:
    prompts = [random_prompt(14, seed=40 + i) for i in range(4)]
    # Room for about two requests at once: the running ones outgrow it while decoding.
    engine = Engine(model, num_blocks=10, block_size=BLOCK, watermark_blocks=0)
    results = engine.generate(prompts, max_new_tokens=12, check_exactness=True)
    _assert_exact_results(model, results, 12)
    assert engine.last_stats.preemptions > 0
    assert sum(r.preemptions for r in results) == engine.last_stats.preemptions
    engine.cache.check_invariants()


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget(model: LlamaModel) -> None:
    prompt = random_prompt(50, seed=7)
    engine = Engine(model, num_blocks=32, block_size=BLOCK, max_num_batched_tokens=16)
    (result,) = engine.generate([prompt], max_new_tokens=3, check_exactness=True)
    _assert_exact_results(model, [result], 3)
    stats = engine.last_stats
    assert stats.prefill_chunks == 4  # 16 + 16 + 16 + 2
    assert max(stats.tokens_per_step) <= 16


def test_drafts_speed_up_decode_of_repetitive_text_and_stay_exact(model: LlamaModel) -> None:
    # A prompt that repeats itself: its greedy continuation tends to repeat too, which is
    # what prompt-lookup drafts guess.
    phrase = random_prompt(6, seed=11)
    prompt = phrase * 5
    plain = Engine(model, num_blocks=64, block_size=BLOCK)
    drafted = Engine(model, num_blocks=64, block_size=BLOCK, num_speculative_tokens=4)
    (a,) = plain.generate([prompt], max_new_tokens=16)
    (b,) = drafted.generate([prompt], max_new_tokens=16, check_exactness=True)
    assert a.output_token_ids == b.output_token_ids
    _assert_exact_results(model, [b], 16)
    assert drafted.last_stats.draft_tokens > 0
    assert drafted.last_stats.steps <= plain.last_stats.steps


def test_a_pool_far_smaller_than_the_prompts_serves_everything_near_the_ideal_hit_rate(
    model: LlamaModel,
) -> None:
    """Sixteen 40-token requests sharing a 24-token system prompt through a pool holding
    under a fifth of them: all complete, none refused, and the shared prefix is computed
    about once."""
    system = random_prompt(24, seed=21)
    prompts = [system + random_prompt(16, seed=100 + i) for i in range(16)]
    hit_rates = {}
    for policy in ("cache_aware", "fcfs"):
        engine = Engine(
            model,
            num_blocks=32,
            block_size=BLOCK,
            max_num_batched_tokens=48,
            scheduling=policy,
        )
        assert engine.kv_cache.num_blocks * BLOCK < sum(map(len, prompts)) / 4
        results = engine.generate(prompts, max_new_tokens=4)
        assert len(results) == len(prompts)
        assert [r.prompt_token_ids for r in results] == prompts
        hit_rates[policy] = engine.last_stats.hit_rate
        engine.cache.check_invariants()
    # The ideal: every request but the first reads the 24 shared tokens (6 full blocks).
    ideal = 15 * 24 / sum(map(len, prompts))
    assert hit_rates["cache_aware"] >= 0.9 * ideal, hit_rates
    assert hit_rates["cache_aware"] >= hit_rates["fcfs"], hit_rates


def test_no_request_is_passed_over_more_than_the_bound(model: LlamaModel) -> None:
    """Cache-aware ordering favours cached prefixes, but a request passed over `max_passes`
    times goes first: a stream of hits cannot starve a miss."""
    system = random_prompt(16, seed=31)
    engine = Engine(model, num_blocks=64, block_size=BLOCK, max_batch_size=1, max_passes=2)
    engine.generate([[*system, 1]], max_new_tokens=1)  # warm the shared prefix
    loner = random_prompt(17, seed=32)
    prompts = [loner] + [[*system, 2 + i] for i in range(6)]
    finished: list[int] = []
    engine.generate(prompts, max_new_tokens=1, on_finish=lambda i, _: finished.append(i))
    assert finished.index(0) <= 2, finished


def test_a_request_that_fits_only_without_drafts_is_served(model: LlamaModel) -> None:
    """Issue 20.11: drafts are optional room. 37 prompt tokens plus 4 new fill a 10-block pool
    of 4-token blocks exactly; with 3 draft tokens on, the request is served (as with drafts
    off), alone or behind another such request, and drafts still run where there is room."""
    prompt = (random_prompt(6, seed=33) * 7)[:37]  # prompt-lookup proposes drafts for it (below)
    plain = Engine(model, num_blocks=10, block_size=BLOCK)
    drafted = Engine(model, num_blocks=10, block_size=BLOCK, num_speculative_tokens=3)
    (expected,) = plain.generate([prompt], max_new_tokens=4)
    (result,) = drafted.generate([prompt], max_new_tokens=4, check_exactness=True)
    assert result.output_token_ids == expected.output_token_ids
    _assert_exact_results(model, [result], 4)
    assert drafted.last_stats.preemptions == 0  # it gave up draft room, not its place
    # Admitted without draft room: 38 prompt tokens plus 3 drafts would not fit.
    (longer,) = drafted.generate([[*prompt, 7]], max_new_tokens=3, check_exactness=True)
    _assert_exact_results(model, [longer], 3)
    other = (random_prompt(5, seed=13) * 8)[:37]
    results = drafted.generate([other, prompt], max_new_tokens=4, check_exactness=True)
    _assert_exact_results(model, results, 4)
    assert results[1].output_token_ids == expected.output_token_ids
    drafted.cache.check_invariants()
    assert drafted.cache.stats().blocks_in_use == 0
    roomy = Engine(model, num_blocks=64, block_size=BLOCK, num_speculative_tokens=3)
    roomy.generate([prompt], max_new_tokens=4)
    assert roomy.last_stats.draft_tokens > 0  # the prompt does draw drafts


def test_a_request_too_big_without_drafts_is_refused_by_its_own_need(model: LlamaModel) -> None:
    engine = Engine(model, num_blocks=10, block_size=BLOCK, num_speculative_tokens=3)
    with pytest.raises(OutOfBlocksError, match=r"38 prompt tokens plus 4 new need 11 blocks"):
        engine.generate([random_prompt(38, seed=1)], max_new_tokens=4)
    assert engine.cache.stats().blocks_in_use == 0
