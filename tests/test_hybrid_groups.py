"""KV groups of hybrid models: per-group pages, released out-of-window blocks, one hit length.

The oracle is `LlamaModel.forward_full` (no cache, no pages). A released block goes back to
its group's pool and is rewritten by other requests, and the null page standing in for it is
filled with garbage here: if attention read either inside a window, the logits would move.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError, KVIndexError, OutOfBlocksError
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import KVGroupSpec, kv_group_specs
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest
from tests.test_hybrid import BLOCK, FULL, SLIDING, VOCAB, _prompt
from tests.test_hybrid import _hybrid as _model

# fp32 through 4 sharp layers, prefilled in chunks and decoded: the single-pool path itself
# is up to ~1.5e-4 from `forward_full` on some of these models (the grouped path is bitwise
# equal to it: `test_grouped_pages_compute_what_one_pool_computes`); a wrong block read moves
# logits by far more than this.
TOLERANCE = 5e-4


def _all_sliding(window: int, num_layers: int = 2) -> LlamaModel:
    return _model((SLIDING,) * num_layers, window)


# -- groups and pages ---------------------------------------------------------------------


def test_layers_are_grouped_by_window_full_attention_first() -> None:
    config = _model((SLIDING, FULL, SLIDING, FULL, SLIDING), window=8).config
    specs = kv_group_specs(config)
    assert specs == (
        KVGroupSpec(0, None, (1, 3)),
        KVGroupSpec(1, 8, (0, 2, 4)),
    )
    assert [s.kind for s in specs] == ["full_attention", "sliding_window"]
    assert kv_group_specs(_all_sliding(6, 3).config) == (KVGroupSpec(0, 6, (0, 1, 2)),)
    plain = ModelConfig(vocab_size=VOCAB, num_layers=2)
    assert kv_group_specs(plain) == (KVGroupSpec(0, None, (0, 1)),)


def test_paged_prefill_over_group_tables_never_reads_the_null_block() -> None:
    """Null blocks stand before the window; garbage in the null page changes nothing."""
    window = 6
    model = _model((SLIDING, FULL, SLIDING), window=window)
    tokens = _prompt(30, seed=2)
    expected = model.forward_full(tokens)
    kv = GroupedKVCache.for_model(model.config, (12, 12), BLOCK)
    full_table = list(range(8))
    null = kv.null_block(1)
    assert null == 12 and kv.null_block(0) is None
    # Prefill 0..19 first: the sliding group holds every block so far.
    first = PrefillRequest(
        tokens, (), num_tokens=20, group_block_tables=(full_table, list(range(8)))
    )
    logits = model.prefill(kv, [first], return_all_logits=True)[0]
    torch.testing.assert_close(logits, expected[:20], rtol=0, atol=TOLERANCE)
    # Positions 20..29 read keys from 15 on: blocks 0..2 (positions 0..11) are released, the
    # null block stands there, and the null page and a released page hold garbage.
    sliding_table = [null, null, null, *range(3, 8)]
    garbage = torch.randn_like(kv.groups[1].key_pages[:, null]) * 1e3
    kv.groups[1].key_pages[:, null] = garbage
    kv.groups[1].value_pages[:, null] = garbage
    kv.groups[1].key_pages[:, 0] = garbage
    second = PrefillRequest(
        tokens, (), num_cached_tokens=20, group_block_tables=(full_table, sliding_table)
    )
    logits = model.prefill(kv, [second], return_all_logits=True)[0]
    torch.testing.assert_close(logits, expected[20:], rtol=0, atol=TOLERANCE)


def test_grouped_pages_compute_what_one_pool_computes() -> None:
    """Same tables in every group: bit for bit the single-pool result, chunk and decode."""
    model = _model((FULL, SLIDING, FULL, SLIDING), window=7, seed=1)
    config = model.config
    sequence = _prompt(41, seed=4)
    table = list(range(11))
    single = PagedKVCache(config.num_layers, 16, BLOCK, config.num_kv_heads, config.head_dim)
    grouped = GroupedKVCache.for_model(config, (16, 16), BLOCK)
    start = 0
    while start < len(sequence):
        end = min(start + 5, len(sequence)) if start < 30 else start + 1
        a = model.prefill(
            single,
            [PrefillRequest(sequence, table, num_cached_tokens=start, num_tokens=end)],
            return_all_logits=True,
        )[0]
        b = model.prefill(
            grouped,
            [
                PrefillRequest(
                    sequence,
                    (),
                    num_cached_tokens=start,
                    num_tokens=end,
                    group_block_tables=(table, table),
                )
            ],
            return_all_logits=True,
        )[0]
        assert torch.equal(a, b)
        start = end


def test_a_computed_position_in_the_null_block_is_refused() -> None:
    model = _model((SLIDING, FULL), window=4)
    kv = GroupedKVCache.for_model(model.config, (8, 8), BLOCK)
    tokens = _prompt(8, seed=1)
    bad = PrefillRequest(tokens, (), num_cached_tokens=4, group_block_tables=([0, 1], [0, 8]))
    with pytest.raises(KVIndexError, match="null block"):
        model.prefill(kv, [bad])
    # Position 7 reads keys 4..7 (window 4): block 0 may be null, block 1 may not.
    last = PrefillRequest(tokens, (), num_cached_tokens=7, group_block_tables=([0, 1], [8, 1]))
    model.prefill(kv, [last])
    # Position 6 reads keys 3..6: block 0 holds position 3, so it must be real.
    early = PrefillRequest(tokens, (), num_cached_tokens=6, group_block_tables=([0, 1], [8, 1]))
    with pytest.raises(KVIndexError, match="window of this call reads"):
        model.prefill(kv, [early])
    with pytest.raises(Exception, match="one block table per KV group"):
        model.prefill(kv, [PrefillRequest(tokens, [0, 1])])


# -- the engine -----------------------------------------------------------------------------


@settings(max_examples=max(12, settings().max_examples // 2), deadline=None)
@given(
    layer_types=st.lists(st.sampled_from([FULL, SLIDING]), min_size=1, max_size=4)
    .filter(lambda types: SLIDING in types)
    .map(tuple),
    # Windows from one token to longer than every prompt plus its output (about 60).
    window=st.one_of(st.integers(1, 8), st.integers(9, 70)),
    budget=st.integers(3, 24),
    full_blocks=st.integers(18, 40),
    sliding_blocks=st.integers(6, 40),
    speculative=st.integers(0, 2),
    seed=st.integers(0, 3),
)
def test_kv_groups_through_the_engine_equal_full_recompute(
    layer_types: tuple[str, ...],
    window: int,
    budget: int,
    full_blocks: int,
    sliding_blocks: int,
    speculative: int,
    seed: int,
) -> None:
    model = _model(layer_types, window, seed=seed)
    specs = kv_group_specs(model.config)
    pools = tuple(full_blocks if s.sliding_window is None else sliding_blocks for s in specs)
    system = _prompt(21, seed=seed)
    prompts = [system + _prompt(3 + 7 * i, seed=10 * seed + i) for i in range(3)]
    prompts.append(system[:12])  # a full hit of a block-aligned prefix once cached
    engine = Engine(
        model,
        kv_group_blocks=pools,
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        num_speculative_tokens=speculative,
        watermark_blocks=0,
    )
    try:
        results = engine.generate(prompts, max_new_tokens=8, check_exactness=True)
    except OutOfBlocksError:
        # A sliding pool too small for one request's window plus a step: refused up front.
        assert sliding_blocks < 2 + (window - 1 + budget + speculative + BLOCK - 1) // BLOCK
        return
    for round_index in range(2):  # the second round runs against a warm cache
        if round_index:
            results = engine.generate(prompts, max_new_tokens=8, check_exactness=True)
        for result in results:
            assert result.output_token_ids == model.generate_greedy_full(result.prompt_token_ids, 8)
            assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
        note(f"round {round_index}: {engine.last_stats} {engine.cache.stats()}")
    stats = engine.cache.stats()
    assert stats.blocks_in_use == 0
    engine.cache.check_invariants()


def test_a_prompt_longer_than_the_sliding_pool_runs_by_releasing_blocks() -> None:
    """An all-sliding model: 200 prompt tokens need 50 blocks, the pool has 12."""
    model = _all_sliding(window=8)
    prompt = _prompt(200, seed=5)
    engine = Engine(
        model,
        kv_group_blocks=(12,),
        block_size=BLOCK,
        max_num_batched_tokens=16,
        watermark_blocks=0,
    )
    [result] = engine.generate([prompt], max_new_tokens=10, check_exactness=True)
    assert result.output_token_ids == model.generate_greedy_full(prompt, 10)
    assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
    stats = engine.cache.stats()
    assert stats.blocks_released >= 40
    # The same prompt again: the last window's blocks are still cached, so it hits far in.
    [again] = engine.generate([prompt], max_new_tokens=10, check_exactness=True)
    assert again.cached_tokens >= 200 - 2 * BLOCK
    assert again.output_token_ids == result.output_token_ids
    assert again.max_logit_diff is not None and again.max_logit_diff < TOLERANCE


def test_a_full_attention_model_of_the_same_shape_needs_the_whole_prompt() -> None:
    """The refusal the test above avoids, for the same pool without windows."""
    config = ModelConfig(vocab_size=VOCAB, num_layers=2)
    engine = Engine(LlamaModel.random(config, seed=3), num_blocks=12, block_size=BLOCK)
    with pytest.raises(OutOfBlocksError, match="need 53 blocks"):
        engine.generate([_prompt(200, seed=5)], max_new_tokens=10)


def test_the_sliding_group_holds_the_window_while_the_full_group_holds_everything() -> None:
    model = _model((SLIDING, FULL), window=8)
    engine = Engine(model, kv_group_blocks=(64, 64), block_size=BLOCK, max_num_batched_tokens=8)
    held: list[tuple[int, ...]] = []
    cache = engine.cache
    assert isinstance(cache, GroupedPrefixCache)

    original_commit = cache.commit

    def commit(request: int | str, num_computed_tokens: int) -> int:
        committed = original_commit(request, num_computed_tokens)
        held.append(tuple(stats.blocks_in_use for stats in cache.stats().groups))
        return committed

    cache.commit = commit  # type: ignore[method-assign]
    [result] = engine.generate([_prompt(120, seed=8)], max_new_tokens=4, check_exactness=True)
    assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE
    full_peak = max(full for full, _ in held)
    sliding_peak = max(sliding for _, sliding in held)
    assert full_peak == 31  # 123 tokens
    # The window (8) plus a step (8) and the partial blocks at both ends.
    assert sliding_peak <= 5


def test_one_hit_length_for_every_group() -> None:
    """The sliding group lost its early blocks, the full group its late ones: the hit is the
    longest both can serve."""
    model = _model((FULL, SLIDING), window=5)
    specs = kv_group_specs(model.config)
    cache = GroupedPrefixCache(specs, (32, 32), context=model.cache_context(BLOCK))
    prompt = _prompt(40, seed=9)
    cache.add_request("a", prompt)
    cache.allocate_slots("a", 40)
    cache.commit("a", 40)
    cache.finish("a")
    cache.add_request("b", prompt)
    # Every block of both groups is cached: a full hit recomputes the last block.
    assert cache.start_position("b") == 36
    # Evict the tail of the full group's chain, and most of the sliding group's blocks.
    full, sliding = cache.groups
    filler = _prompt(32 * BLOCK, seed=10)
    for group, count in ((full, 25), (sliding, 30)):
        group.add_request("f", filler[: count * BLOCK])
        group.allocate_slots("f", count * BLOCK)
        group.finish("f")  # never committed: its blocks go back free
    full_hit = full.lookup(prompt).num_cached_tokens
    sliding_hit = sliding.lookup(prompt).num_cached_tokens
    assert full_hit == 28
    position = cache.start_position("b")
    assert position <= min(full_hit, sliding_hit) and position % BLOCK == 0
    print(f"full {full_hit}, sliding {sliding_hit}, agreed {position}")
    slots = cache.allocate_slots("b", 40 - position)
    assert slots.num_computed_tokens == position
    assert [g.num_computed_tokens("b") for g in cache.groups] == [position, position]
    assert [len(table) for table in cache.block_tables("b")] == [10, 10]
    cache.finish("b")
    cache.check_invariants()


def test_an_allocation_one_group_cannot_supply_changes_no_group() -> None:
    model = _model((FULL, SLIDING), window=64)
    specs = kv_group_specs(model.config)
    cache = GroupedPrefixCache(specs, (32, 4), context=model.cache_context(BLOCK))
    cache.add_request("a", _prompt(40, seed=1))
    before = [(s.blocks_free, s.blocks_in_use) for s in cache.stats().groups]
    with pytest.raises(OutOfBlocksError, match="KV group 1"):
        cache.allocate_slots("a", 40)
    assert [(s.blocks_free, s.blocks_in_use) for s in cache.stats().groups] == before
    assert cache.block_tables("a") == ([], [])
    cache.finish("a")
    cache.check_invariants()


def test_groups_key_the_same_tokens_as_different_blocks() -> None:
    model = _model((FULL, SLIDING), window=8)
    cache = GroupedPrefixCache(
        kv_group_specs(model.config), (8, 8), context=model.cache_context(BLOCK)
    )
    tokens = _prompt(8, seed=1)
    keys = [group.block_keys(tokens) for group in cache.groups]
    assert keys[0] != keys[1]


def test_engine_arguments_for_kv_groups_are_checked() -> None:
    hybrid = _model((FULL, SLIDING), window=8)
    with pytest.raises(InvalidInputError, match="recompute_last_block"):
        Engine(hybrid, full_hit="reuse_last_block")
    with pytest.raises(InvalidInputError, match="one count per KV group"):
        Engine(hybrid, kv_group_blocks=(8,))
    with pytest.raises(InvalidInputError, match="not both"):
        Engine(hybrid, kv_group_blocks=(8, 8), num_blocks=8)
    with pytest.raises(InvalidInputError, match="tiers"):
        Engine(hybrid, host_tier_bytes=1 << 20)
    plain = LlamaModel.random(ModelConfig(vocab_size=VOCAB, num_layers=2), seed=1)
    with pytest.raises(InvalidInputError, match="one KV group"):
        Engine(plain, kv_group_blocks=(8,))
    engine = Engine(hybrid, num_blocks=16, block_size=BLOCK)
    assert isinstance(engine.cache, GroupedPrefixCache)
    assert engine.cache.num_blocks == (16, 16)
    assert "16, 16" in repr(engine)


def test_kv_events_of_a_hybrid_engine_name_their_group() -> None:
    from prefixkv.events.wire import BlockRemoved, BlockStored

    model = _model((FULL, SLIDING), window=8)
    engine = Engine(model, kv_group_blocks=(16, 6), block_size=BLOCK, max_num_batched_tokens=8)
    publisher = engine.publish_kv_events("tcp://127.0.0.1:*")
    sent: list[list[object]] = []
    # Captured where the batch leaves for the socket: the structs, before encoding.
    publisher.socket.publish = lambda events, ts=None: sent.append(list(events)) or 0  # type: ignore[method-assign]
    try:
        engine.generate([_prompt(40, seed=1), _prompt(40, seed=2)], max_new_tokens=2)
    finally:
        engine.close()
    events = [event for batch in sent for event in batch]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored
    } == {(0, "full_attention", None), (1, "sliding_window", 8)}
    keys = [{h for e in stored if e.group_idx == g for h in e.block_hashes} for g in (0, 1)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert any(e.group_idx == 1 for e in removed), "the small sliding pool evicts"
    assert all(e.group_idx in (0, 1) for e in removed)


def test_metrics_of_a_hybrid_engine_are_per_kv_group() -> None:
    import prometheus_client

    model = _model((FULL, SLIDING), window=8)
    engine = Engine(model, kv_group_blocks=(32, 12), block_size=BLOCK, max_num_batched_tokens=8)
    engine.generate([_prompt(60, seed=1)], max_new_tokens=2)
    registry = prometheus_client.CollectorRegistry()
    registry.register(engine.metrics_collector({"model_name": "m"}))

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert sample("prefixkv:kv_cache_blocks", kv_group="0", state="free") is not None
    released = [sample("prefixkv:prefix_cache_released_blocks_total", kv_group=g) for g in "01"]
    assert released[0] == 0 and released[1] is not None and released[1] >= 10
    stats = engine.cache.stats()
    assert sample("prefixkv:kv_cache_blocks", kv_group="1", state="cached") == (
        stats.groups[1].blocks_cached
    )
    assert sample("prefixkv:prefix_cache_queries_total") == stats.groups[0].lookup_tokens


def test_groups_with_different_block_sizes_agree_on_a_common_multiple() -> None:
    """A full group of 4-token blocks and a sliding group of 6-token blocks: every hit is a
    multiple of 12, the first length where both groups' blocks end."""
    model = _model((FULL, SLIDING), window=5)
    cache = GroupedPrefixCache(
        kv_group_specs(model.config),
        (32, 32),
        context=model.cache_context(BLOCK),
        block_sizes=(4, 6),
    )
    assert cache.block_sizes == (4, 6) and cache.hit_granularity == 12
    prompt = _prompt(40, seed=3)
    cache.add_request("a", prompt)
    cache.allocate_slots("a", 40)
    cache.commit("a", 40)
    cache.finish("a")
    for length in (40, 30, 26, 12, 11):
        cache.add_request("b", prompt[:length])
        position = cache.start_position("b")
        assert position % 12 == 0 and position < length
        # The longest multiple of 12 that both groups can serve, short of the full prompt.
        assert position == 12 * ((length - 1) // 12)
        slots = cache.allocate_slots("b", length - position)
        assert slots.num_computed_tokens == position
        assert [len(t) for t in cache.block_tables("b")] == [-(-length // 4), -(-length // 6)]
        cache.finish("b")
    cache.check_invariants()


def test_a_truncation_one_group_refuses_cuts_no_group() -> None:
    """After a reset a request publishes nothing more, but its window still moves on: the
    sliding group refuses a cut into positions it released, which the full group would make."""
    model = _model((FULL, SLIDING), window=8)
    cache = GroupedPrefixCache(
        kv_group_specs(model.config), (32, 32), context=model.cache_context(BLOCK)
    )
    tokens = _prompt(32, seed=4)
    cache.add_request("a", tokens[:12])
    cache.allocate_slots("a", 12)
    cache.commit("a", 12)
    cache.clear()
    cache.append_tokens("a", tokens[12:])
    cache.allocate_slots("a", 20)
    cache.commit("a", 32)
    tables = cache.block_tables("a")
    with pytest.raises(InvalidInputError, match=r"KV group 1: .*sliding window"):
        cache.truncate("a", 16)
    assert [group.num_tokens("a") for group in cache.groups] == [32, 32]
    assert cache.block_tables("a") == tables
    cache.truncate("a", 31)  # position 31 reads from 24 on: both groups accept
    assert [group.num_tokens("a") for group in cache.groups] == [31, 31]
    cache.finish("a")
    cache.check_invariants()


def test_group_slots_name_each_groups_new_blocks() -> None:
    model = _model((FULL, SLIDING), window=8)
    cache = GroupedPrefixCache(
        kv_group_specs(model.config), (16, 16), context=model.cache_context(BLOCK)
    )
    cache.add_request("a", _prompt(10, seed=2))
    slots = cache.allocate_slots("a", 10)
    assert isinstance(slots.group_block_ids, tuple)
    assert [len(blocks) for blocks in slots.group_block_ids] == [3, 3]
    assert (slots.num_computed_tokens, slots.num_cached_tokens) == (0, 0)
    assert not slots.full_hit and not slots.last_token_shared
    assert cache.block_tables("a") == tuple(slots.group_block_ids)
    cache.commit("a", 10)
    # A decode step inside the last block takes nothing; the one past it a block per group.
    for position, new_blocks in ((10, 0), (11, 0), (12, 1)):
        cache.append_tokens("a", [7])
        slots = cache.allocate_slots("a", 1)
        assert slots.num_computed_tokens == position
        assert [len(blocks) for blocks in slots.group_block_ids] == [new_blocks] * 2
        cache.commit("a", position + 1)
    cache.finish("a")
    assert all(stats.blocks_in_use == 0 for stats in cache.stats().groups)


def test_finish_reaches_every_group_when_one_refuses() -> None:
    from prefixkv.errors import DuplicateRequestError, UnknownRequestError

    model = _model((FULL, SLIDING), window=8)
    cache = GroupedPrefixCache(
        kv_group_specs(model.config), (16, 16), context=model.cache_context(BLOCK)
    )
    full, sliding = cache.groups
    sliding.add_request("a", _prompt(4, seed=1))
    # Live in one group already: refused, and the other group is left as it was.
    with pytest.raises(DuplicateRequestError):
        cache.add_request("a", _prompt(4, seed=1))
    with pytest.raises(UnknownRequestError):
        full.num_tokens("a")
    with pytest.raises(UnknownRequestError):
        cache.finish("a")
    with pytest.raises(UnknownRequestError):
        sliding.num_tokens("a")
