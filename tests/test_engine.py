"""Engine tests: cached serving gives exactly what a full recompute gives.

Every comparison is against `LlamaModel.generate_greedy_full` / `forward_full`, the cache-free
oracle, on a tiny random model whose attention is sharp (`LlamaModel.random`), so a position,
page or mask mistake moves the logits. `test_exactness_check_detects_a_corrupted_page` plants
such a bug and checks that the comparison notices.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv import InvalidInputError, OutOfBlocksError
from prefixkv.engine.facade import Engine, RequestResult, weights_digest
from prefixkv.models.decoder import LlamaModel, ModelConfig, RopeScaling
from prefixkv.text.tokenizers import ByteTokenizer
from tests.engine_support import assert_exact, random_prompt

BLOCK = 4
VOCAB = ByteTokenizer().vocab_size
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=3)


def _engine(model: LlamaModel, num_blocks: int = 64, **options: object) -> Engine:
    return Engine(model, num_blocks=num_blocks, block_size=BLOCK, **options)  # type: ignore[arg-type]


def _assert_exact(model: LlamaModel, result: RequestResult, max_new_tokens: int) -> None:
    assert_exact(model, result, max_new_tokens)
    assert result.tokens_match


def test_batch_with_shared_prefix_matches_full_recompute(model: LlamaModel) -> None:
    engine = _engine(model)
    system = random_prompt(21, seed=1)
    prompts = [system + random_prompt(5 + i, seed=10 + i) for i in range(3)] + [
        random_prompt(9, seed=20)
    ]
    results = engine.generate(prompts, max_new_tokens=5, check_exactness=True)
    assert [r.prompt_token_ids for r in results] == prompts
    for result in results:
        _assert_exact(model, result, 5)
    # Requests running together compute the shared prefix once: the first computes it, the
    # other two wait one step and read its 5 full blocks.
    assert results[0].cached_tokens == 0
    assert [r.cached_tokens for r in results[1:3]] == [20, 20]
    assert results[3].cached_tokens == 0
    assert all(r.computed_tokens == r.prompt_tokens - r.cached_tokens for r in results)
    assert all(r.time_to_first_token > 0 for r in results)
    engine.cache.check_invariants()
    assert engine.cache.stats().requests_live == 0


@pytest.mark.parametrize("mode", ["recompute_last_block", "reuse_last_block"])
def test_a_full_hit_never_writes_into_a_shared_block(model: LlamaModel, mode: str) -> None:
    engine = _engine(model, full_hit=mode)
    prompt = random_prompt(4 * BLOCK, seed=2)
    (first,) = engine.generate([prompt], max_new_tokens=3)
    before = engine.kv_cache.storage.clone()
    prompt_blocks = engine.cache.lookup([*prompt, 0]).block_ids
    assert len(prompt_blocks) == 4
    (hit,) = engine.generate([prompt], max_new_tokens=3, check_exactness=True)
    assert hit.full_hit
    if mode == "reuse_last_block":
        # Every block shared; the last token computed without writing its KV.
        assert (hit.cached_tokens, hit.computed_tokens) == (len(prompt) - 1, 1)
    else:
        # vLLM's way: the last block recomputed into a private copy.
        assert (hit.cached_tokens, hit.computed_tokens) == (len(prompt) - BLOCK, BLOCK)
    _assert_exact(model, hit, 3)
    assert hit.output_token_ids == first.output_token_ids
    # The prompt's blocks are shared and read-only: not one element of them changed.
    after = engine.kv_cache.storage
    assert torch.equal(before[:, :, prompt_blocks], after[:, :, prompt_blocks])
    assert engine.cache.lookup([*prompt, 0]).block_ids == prompt_blocks


def test_result_docs_describe_both_full_hit_modes(model: LlamaModel) -> None:
    """Issue 20.15: `RequestResult`'s docs described only the reuse-last-block full hit, not
    the default; they now say what each mode caches, and the figures they give hold."""
    doc = RequestResult.__doc__ or ""
    for phrase in (
        '"recompute_last_block"`` (the default)',
        "``prompt_tokens - block_size``",
        '"reuse_last_block"',
        "``prompt_tokens - 1``",
    ):
        assert phrase in doc
    prompt = random_prompt(3 * BLOCK, seed=4)
    for mode, cached in (("recompute_last_block", 2 * BLOCK), ("reuse_last_block", 3 * BLOCK - 1)):
        engine = _engine(model, full_hit=mode)
        engine.generate([prompt], max_new_tokens=1)
        (hit,) = engine.generate([prompt], max_new_tokens=1)
        assert hit.full_hit and hit.cached_tokens == cached
        assert hit.computed_tokens == len(prompt) - cached


def test_next_turn_reuses_the_previous_answer(model: LlamaModel) -> None:
    engine = _engine(model)
    turn_one = random_prompt(10, seed=3)
    (first,) = engine.generate([turn_one], max_new_tokens=7, check_exactness=True)
    # What a chat engine sends next: the whole conversation, the answer included.
    turn_two = turn_one + first.output_token_ids + random_prompt(6, seed=4)
    (second,) = engine.generate([turn_two], max_new_tokens=4, check_exactness=True)
    _assert_exact(model, second, 4)
    # KV exists for prompt + answer[:-1] (16 tokens): four full blocks, the generated ones too.
    written = len(turn_one) + len(first.output_token_ids) - 1
    assert second.cached_tokens == written // BLOCK * BLOCK == 16


def test_chat_and_text_requests(model: LlamaModel) -> None:
    engine = _engine(model)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    tools = [{"name": "lookup", "parameters": {"q": "string"}}]
    chat, with_tools, text = engine.generate(
        [messages, {"messages": messages, "tools": tools}, "plain text prompt"],
        max_new_tokens=3,
        check_exactness=True,
    )
    rendered = engine.chat_template.render(messages)
    assert chat.prompt_token_ids == ByteTokenizer().encode(rendered)
    assert len(with_tools.prompt_token_ids) > len(chat.prompt_token_ids)
    # Both chat requests start with the same system message: the second reuses its blocks.
    assert with_tools.cached_tokens > 0
    assert text.prompt_token_ids == list(b"plain text prompt")
    for result in (chat, with_tools, text):
        _assert_exact(model, result, 3)
        assert result.output_text == ByteTokenizer().decode(result.output_token_ids)


def test_inputs_as_arrays_and_tensors(model: LlamaModel) -> None:
    import numpy as np

    engine = _engine(model)
    prompt = random_prompt(9, seed=5)
    results = engine.generate(
        [np.array(prompt, dtype=np.int32), torch.tensor(prompt), tuple(prompt)], max_new_tokens=2
    )
    assert {tuple(r.output_token_ids) for r in results} == {
        tuple(model.generate_greedy_full(prompt, 2))
    }


def test_small_pool_serves_in_waves(model: LlamaModel) -> None:
    # 12 blocks hold about two requests (3-4 blocks each with their output) at a time.
    engine = _engine(model, num_blocks=12)
    prompts = [random_prompt(11, seed=30 + i) for i in range(6)]
    results = engine.generate(prompts, max_new_tokens=4, check_exactness=True)
    for result in results:
        _assert_exact(model, result, 4)
    engine.cache.check_invariants()
    assert engine.cache.stats().requests_live == 0


def test_request_larger_than_the_pool_is_refused_clearly(model: LlamaModel) -> None:
    engine = _engine(model, num_blocks=4)
    with pytest.raises(OutOfBlocksError, match=r"need 5 blocks .* the KV pool has 4"):
        engine.generate([random_prompt(17, seed=6)], max_new_tokens=2)
    assert engine.cache.stats().requests_live == 0


def test_stop_tokens(model: LlamaModel) -> None:
    engine = _engine(model)
    prompt = random_prompt(7, seed=7)
    expected = model.generate_greedy_full(prompt, 6)
    (result,) = engine.generate([prompt], max_new_tokens=6, stop_token_ids=[expected[2]])
    assert result.output_token_ids == expected[: expected.index(expected[2]) + 1]


def test_exactness_check_detects_a_corrupted_page(model: LlamaModel) -> None:
    """A planted bug (one cached page overwritten) must show up in max_logit_diff."""
    engine = _engine(model)
    prompt = random_prompt(13, seed=8)
    engine.generate([prompt], max_new_tokens=2)
    block = engine.cache.lookup(prompt).block_ids[1]
    engine.kv_cache.storage[:, :, block] += 1.0
    (result,) = engine.generate([prompt], max_new_tokens=2, check_exactness=True)
    assert result.cached_tokens == 12
    assert result.max_logit_diff is not None and result.max_logit_diff > 1e-2


def test_context_covers_what_changes_kv(model: LlamaModel) -> None:
    base = _engine(model).context
    variants = [
        model.with_config(rope_theta=50_000.0),
        model.with_config(position_offset=3),
        model.with_config(sliding_window=8),
        model.with_config(rope_scaling=RopeScaling("linear", 2.0)),
        model.with_config(dtype=torch.float64),
        LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=4),  # other weights
    ]
    fingerprints = {base.fingerprint()}
    for variant in variants:
        fingerprints.add(_engine(variant).context.fingerprint())
    fingerprints.add(Engine(model, num_blocks=8, block_size=8).context.fingerprint())
    assert len(fingerprints) == len(variants) + 2
    assert base.weights_digest and base.tokenizer_digest and base.chat_template_version


def test_length_dependent_rope_is_served_without_prefix_reuse(
    model: LlamaModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 8.5: dynamic NTK made `Engine` impossible to build, though the model is exact.
    It is served with prefix reuse off: every request computes its whole prompt."""
    dynamic = model.with_config(
        rope_scaling=RopeScaling("dynamic_ntk", 2.0), max_position_embeddings=16
    )
    prompt = random_prompt(5 * BLOCK + 2, seed=11)  # 22 tokens > 16: the RoPE base moves
    with caplog.at_level(logging.WARNING, logger="prefixkv.engine.facade"):
        engine = _engine(dynamic)
        (first,) = engine.generate([prompt], max_new_tokens=1, check_exactness=True)
        results = engine.generate(
            [prompt, prompt + random_prompt(3, seed=12)], max_new_tokens=1, check_exactness=True
        )
    assert not engine.prefix_reuse
    assert engine.prefix_reuse_off_reason is not None
    assert "dynamic_ntk" in engine.prefix_reuse_off_reason
    assert engine.context.position_encoding.rope_scaling == "dynamic_ntk"
    for result in (first, *results):
        assert (result.cached_tokens, result.full_hit) == (0, False)
        assert result.computed_tokens == result.prompt_tokens
        assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
        assert result.tokens_match
    said = [r for r in caplog.records if "prefix reuse is off" in r.getMessage()]
    assert len(said) == 1, "said once, at construction"
    stats = engine.cache.stats()
    assert stats.requests_live == 0
    # What it committed is keyed under each request's own salt: the repeated prompt missed.
    assert stats.hit_tokens == 0


@pytest.mark.parametrize("layer_types", [None, ("sliding_attention", "full_attention")])
def test_without_prefix_reuse_chunked_prefill_and_long_decodes_get_their_slots(
    model: LlamaModel, layer_types: tuple[str, ...] | None
) -> None:
    """With reuse off the engine still commits (under a salt per request), so the cache knows
    how far each request got: chunks and decode steps past the first blocks get slots, and a
    sliding group releases what its window passed."""
    dynamic = model.with_config(
        rope_scaling=RopeScaling("dynamic_ntk", 2.0),
        max_position_embeddings=64,
        sliding_window=6 if layer_types else None,
        layer_types=layer_types,
    )
    prompts = [random_prompt(30, seed=20 + i) for i in range(3)]
    engine = _engine(dynamic, num_blocks=30, max_num_batched_tokens=8)
    results = engine.generate([*prompts, prompts[0]], max_new_tokens=20, check_exactness=True)
    assert not engine.prefix_reuse
    for result in results:
        assert result.cached_tokens == 0
        assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
        assert result.tokens_match
    stats = engine.cache.stats()
    assert stats.requests_live == 0 and stats.blocks_in_use == 0
    if layer_types:
        assert stats.blocks_released > 0


def test_switching_weights_into_a_length_dependent_rope_turns_reuse_off(
    model: LlamaModel,
) -> None:
    engine = _engine(model.with_config())
    assert engine.prefix_reuse and engine.prefix_reuse_off_reason is None
    engine.model.config = engine.model.config.replace(
        rope_scaling=RopeScaling("dynamic_ntk", 2.0), max_position_embeddings=16
    )
    prompt = random_prompt(22, seed=13)
    engine.generate([prompt], max_new_tokens=1)
    (again,) = engine.generate([prompt], max_new_tokens=1, check_exactness=True)
    assert not engine.prefix_reuse
    assert again.cached_tokens == 0
    assert again.max_logit_diff is not None and again.max_logit_diff < TOLERANCE


def test_switching_adapters_never_reuses_kv() -> None:
    config = ModelConfig(vocab_size=VOCAB, lora_rank=4, lora_alpha=8.0)
    model = LlamaModel.random(config, seed=5)
    model.load_adapter("a", LlamaModel.random_adapter(config, seed=1))
    model.load_adapter("b", LlamaModel.random_adapter(config, seed=2))
    engine = _engine(model)
    prompt = random_prompt(12, seed=9)
    model.set_adapter("a")
    engine.generate([prompt], max_new_tokens=2)
    model.set_adapter("b")
    (other,) = engine.generate([prompt], max_new_tokens=2, check_exactness=True)
    assert other.cached_tokens == 0
    _assert_exact(model, other, 2)
    # Reloading "b" with other weights must miss too: the key holds a digest of the weights.
    model.load_adapter("b", LlamaModel.random_adapter(config, seed=3))
    (reloaded,) = engine.generate([prompt], max_new_tokens=2, check_exactness=True)
    assert reloaded.cached_tokens == 0
    _assert_exact(model, reloaded, 2)


def test_from_pretrained(model: LlamaModel, tmp_path: object) -> None:
    from pathlib import Path

    directory = Path(str(tmp_path)) / "tiny-llama"
    model.save_pretrained(directory)
    engine = Engine.from_pretrained(directory, num_blocks=16, block_size=BLOCK)
    assert engine.context.model_id == "tiny-llama"
    assert engine.context.weights_digest == _engine(model).context.weights_digest
    prompt = random_prompt(9, seed=10)
    (result,) = engine.generate([prompt], max_new_tokens=3, check_exactness=True)
    _assert_exact(model, result, 3)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        ([], "at least one token"),
        ([1, 2, VOCAB], "outside the vocabulary"),
        ([1.5, 2.0], "token ids, text, chat messages"),
        ({"text": "no messages"}, "needs a 'messages' list"),
        (42, "not int"),
    ],
)
def test_bad_requests_are_refused(model: LlamaModel, request_: object, message: str) -> None:
    engine = _engine(model)
    with pytest.raises(InvalidInputError, match=message):
        engine.generate([request_], max_new_tokens=1)
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        engine.generate([[1, 2]], max_new_tokens=0)
    assert engine.cache.stats().requests_live == 0


def test_a_raising_callback_propagates_and_leaks_no_request() -> None:
    """Found in review: the cleanup once finished a request twice and masked the error."""
    engine = Engine(num_blocks=64, block_size=4)

    def explode(index: int, result: object) -> None:
        raise ValueError("callback failed")

    with pytest.raises(ValueError, match="callback failed"):
        engine.generate([[1, 2, 3, 4, 5], [1, 2, 3, 6]], max_new_tokens=2, on_finish=explode)
    stats = engine.cache.stats()
    assert stats.requests_live == 0
    assert stats.blocks_in_use == 0


# --------------------------------------------------------------------------------------------
# Issue 8: defects
# --------------------------------------------------------------------------------------------


def test_in_place_weight_edit_is_detected_and_never_serves_stale_kv() -> None:
    """Issue 8.1: the weights digest was taken once; an in-place edit served the old KV."""
    model = LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=6)
    engine = _engine(model)
    prompt = random_prompt(4 * BLOCK + 3, seed=40)
    engine.generate([prompt], max_new_tokens=3)
    before = engine.context.fingerprint()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    (again,) = engine.generate([prompt], max_new_tokens=3, check_exactness=True)
    assert again.cached_tokens == 0
    _assert_exact(model, again, 3)
    assert engine.context.fingerprint() != before
    assert engine.context.weights_digest == weights_digest(model)


def test_weights_changed_covers_edits_torch_cannot_see() -> None:
    """An edit under `torch.inference_mode` bumps no version counter: `weights_changed()` is
    the documented way to say so, and it makes the next request miss."""
    model = LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=6)
    engine = _engine(model)
    prompt = random_prompt(3 * BLOCK + 1, seed=41)
    engine.generate([prompt], max_new_tokens=2)
    weight = model.model.layers[1].self_attn.v_proj.weight
    # Swap the bytes without any torch op on the parameter: its version counter stays put.
    weight.detach().numpy()[:] *= 2.0
    engine.weights_changed()
    (again,) = engine.generate([prompt], max_new_tokens=2, check_exactness=True)
    assert again.cached_tokens == 0
    _assert_exact(model, again, 2)
    engine.cache.check_invariants()


def test_weight_edit_between_steps_restarts_running_requests() -> None:
    """An edit made while a batch is in flight (here by a callback) restarts the requests
    still running under the new weights rather than finishing them on stale KV."""
    model = LlamaModel.random(ModelConfig(vocab_size=VOCAB), seed=6)
    engine = _engine(model)
    short, long = random_prompt(5, seed=42), random_prompt(9, seed=43)
    edited = False

    def edit(index: int, result: RequestResult) -> None:
        nonlocal edited
        if not edited:
            edited = True
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight.mul_(-1.0)

    # The first request ends after one token (its stop token); the second then restarts.
    first_token = model.generate_greedy_full(short, 1)[0]
    results = engine.generate(
        [short, long],
        max_new_tokens=4,
        stop_token_ids=[first_token],
        on_finish=edit,
        check_exactness=True,
    )
    assert edited
    assert (
        results[1].output_token_ids
        == model.generate_greedy_full(long, 4)[: len(results[1].output_token_ids)]
    )
    assert results[1].max_logit_diff is not None and results[1].max_logit_diff < TOLERANCE
    assert engine.cache.stats().requests_live == 0


def test_admission_counts_every_block_eviction_can_reach() -> None:
    """Issue 8.13: admission compared against free + evictable *leaves*, so a cached chain of
    six blocks counted as one and a request the pool could serve was refused."""
    engine = Engine(num_blocks=8, block_size=4)
    engine.generate([list(range(24))], max_new_tokens=1)
    assert engine.cache.stats().blocks_cached == 6
    (result,) = engine.generate([list(range(100, 108))], max_new_tokens=8, check_exactness=True)
    _assert_exact(engine.model, result, 8)
    engine.cache.check_invariants()
    assert engine.cache.stats().requests_live == 0


def test_admission_still_waits_for_blocks_held_by_running_requests(model: LlamaModel) -> None:
    """The probe that replaced the leaf count must not over-admit: with room for one request
    and its output at a time, every request is still served exactly, in waves."""
    engine = _engine(model, num_blocks=5)
    prompts = [random_prompt(9, seed=50 + i) for i in range(4)]  # 3 blocks + 2 of output each
    results = engine.generate(prompts, max_new_tokens=8, check_exactness=True)
    for result in results:
        _assert_exact(model, result, 8)
    engine.cache.check_invariants()
    assert engine.cache.stats().requests_live == 0


def test_pinned_blocks_are_not_counted_as_obtainable() -> None:
    engine = Engine(num_blocks=8, block_size=4)
    engine.generate([list(range(24))], max_new_tokens=1)
    engine.cache.pin(list(range(24)))
    with pytest.raises(OutOfBlocksError, match=r"cannot schedule request 0: .* 6 pinned"):
        engine.generate([list(range(100, 108))], max_new_tokens=8)
    stats = engine.cache.stats()
    # It ran until decode needed a third block: its two prompt blocks stay cached.
    assert (stats.requests_live, stats.blocks_cached, stats.blocks_in_use) == (0, 8, 0)
    engine.cache.check_invariants()


# -- hostile chat requests (issue 20.14) ----------------------------------------------------------

_OK_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": [None]}, "messages"),
        ({"messages": ["hello"]}, "messages"),
        ({"messages": _OK_MESSAGES, "tools": 5}, "tools"),
        ({"messages": _OK_MESSAGES, "tools": "search"}, "tools"),
        ({"messages": _OK_MESSAGES, "tools": [5]}, "tools"),
        ({"messages": _OK_MESSAGES, "tools": [{"name": object()}]}, "tools"),
        ({"messages": _OK_MESSAGES, "salt": "tenant"}, "salt"),  # silently unsalted otherwise
    ],
)
def test_malformed_chat_requests_are_refused_by_field(
    model: LlamaModel, request_: object, field: str
) -> None:
    engine = _engine(model)
    with pytest.raises(InvalidInputError, match=field):
        engine.generate([request_], max_new_tokens=1)
    assert engine.cache.stats().requests_live == 0
    assert engine.cache.stats().blocks_in_use == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_hostile_chat = st.one_of(
    st.fixed_dictionaries({"messages": _json}),
    st.fixed_dictionaries({"messages": st.just(_OK_MESSAGES), "tools": _json}),
    st.lists(st.dictionaries(st.sampled_from(["role", "content"]), _json, max_size=2), max_size=3),
)


@given(request_=_hostile_chat)
def test_any_chat_payload_is_served_or_refused_with_a_typed_error(request_: object) -> None:
    engine = _HOSTILE_ENGINE
    with contextlib.suppress(InvalidInputError):  # served, or refused with a typed error
        engine.generate([request_], max_new_tokens=1)
    stats = engine.cache.stats()
    assert stats.requests_live == 0 and stats.blocks_in_use == 0


_HOSTILE_ENGINE = Engine(num_blocks=256, block_size=16)
