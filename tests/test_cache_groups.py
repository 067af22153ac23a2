"""`GroupedPrefixCache` refusals (issue 20, items 1, 13 and 14): all or nothing across groups,
hits that grew meanwhile, and constructor arguments refused by name.

The step API over groups is exercised in test_hybrid_groups.py; here, the defects.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixkv import CacheContext
from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv_groups import KVGroupSpec

FULL = KVGroupSpec(0, None, (0,))
SLIDING = KVGroupSpec(1, 8, (1,))


def two_sizes() -> GroupedPrefixCache:
    """Two full-attention groups with blocks of 8 and 4 tokens."""
    specs = (FULL, KVGroupSpec(1, None, (1,)))
    return GroupedPrefixCache(
        specs, (16, 16), context=CacheContext(block_size=8), block_sizes=(8, 4)
    )


def state(cache: GroupedPrefixCache, names) -> tuple:
    stats = cache.stats()
    return (
        tuple((s.blocks_free, s.blocks_cached, s.blocks_in_use) for s in stats.groups),
        tuple(cache.block_tables(n) for n in names),
        tuple(g.num_computed_tokens(n) for g in cache.groups for n in names),
    )


def test_a_refused_commit_publishes_in_no_group() -> None:
    """Item 1: group 0 (8-token blocks) holds 8 slots after 4 tokens were allocated, group 1
    (4-token blocks) four; `commit(8)` used to publish group 0's block 0, half of it never
    written, before group 1 refused. C would then have read positions 4-7 nobody wrote."""
    cache = two_sizes()
    tokens = list(range(100, 116))
    cache.add_request("A", tokens)
    cache.allocate_slots("A", 4)
    before = state(cache, ["A"])
    with pytest.raises(InvalidInputError, match="num_computed_tokens 8"):
        cache.commit("A", 8)
    assert state(cache, ["A"]) == before
    assert all(s.blocks_cached == 0 for s in cache.stats().groups)
    cache.add_request("C", tokens[:9])
    assert cache.start_position("C") == 0
    assert cache.commit("A", 4) == 0
    cache.check_invariants()


@given(num_new=st.integers(1, 16), committed=st.sampled_from([8, 16]))
def test_a_hit_that_grew_since_start_position_leaves_room_for_the_tokens(
    num_new: int, committed: int
) -> None:
    """Item 13: a waiting request's hit grew after the scheduler asked `start_position` (another
    request committed the prefix); `allocate_slots` with the count the scheduler took from the
    old start cuts the hit back so the tokens fit, in every group alike, instead of refusing."""
    specs = (FULL, SLIDING)
    cache = GroupedPrefixCache(specs, (32, 32), context=CacheContext(block_size=4))
    tokens = list(range(200, 216))
    cache.add_request("late", tokens)
    assert cache.start_position("late") == 0
    cache.add_request("first", tokens[:committed] + [999] * (16 - committed))
    cache.allocate_slots("first", 16)
    cache.commit("first", 16)
    grown = cache.start_position("late")
    assert grown > 0
    slots = cache.allocate_slots("late", num_new)
    start = slots.num_computed_tokens
    assert start + num_new <= len(tokens)
    assert start % cache.hit_granularity == 0
    # Not cut further than the room needs.
    assert start == min(grown, (len(tokens) - num_new) // 4 * 4)
    assert slots.num_cached_tokens == start
    cache.check_invariants()


def test_more_new_tokens_than_the_request_has_is_refused_by_name() -> None:
    cache = GroupedPrefixCache((FULL,), (8,), context=CacheContext(block_size=4))
    cache.add_request("r", [1, 2, 3])
    with pytest.raises(InvalidInputError, match="num_new_tokens 4 is more than"):
        cache.allocate_slots("r", 4)
    assert cache.block_tables("r") == ([],)


def test_constructor_arguments_are_refused_by_name() -> None:
    """Item 14: a bare int for a per-group sequence, non-specs, and two specs under one group
    index (both groups would then share block keys)."""
    context = CacheContext(block_size=4)
    with pytest.raises(InvalidInputError, match="num_blocks must be a sequence"):
        GroupedPrefixCache((FULL, SLIDING), 16, context=context)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="block_sizes must be a sequence"):
        GroupedPrefixCache((FULL,), (8,), context=context, block_sizes=4)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="num_blocks needs one value per KV group"):
        GroupedPrefixCache((FULL, SLIDING), (16,), context=context)
    with pytest.raises(InvalidInputError, match="specs must name at least one"):
        GroupedPrefixCache((), (), context=context)
    with pytest.raises(InvalidInputError, match=r"specs\[0\] must be a KVGroupSpec"):
        GroupedPrefixCache(("full",), (8,), context=context)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="specs must be a sequence"):
        GroupedPrefixCache(FULL, (8,), context=context)  # type: ignore[arg-type]


def test_two_specs_under_one_group_index_are_refused() -> None:
    """Both groups would run under one context, so share every block key."""
    twin = KVGroupSpec(0, 8, (1,))
    with pytest.raises(InvalidInputError, match=r"specs\[1\] has group index 0, as specs\[0\]"):
        GroupedPrefixCache((FULL, twin), (16, 16), context=CacheContext(block_size=4))


def test_a_request_id_with_a_lone_surrogate_is_invalid_input() -> None:
    cache = GroupedPrefixCache((FULL,), (8,), context=CacheContext(block_size=4))
    with pytest.raises(InvalidInputError, match="request id must be valid Unicode"):
        cache.add_request("a\ud800", [1, 2])
    assert cache.stats().requests_live == 0


def test_explicit_window_release_waits_for_the_call_in_every_sliding_group() -> None:
    """Issue 22 (hybrid layouts in vLLM): with ``window_release="explicit"`` a commit publishes
    and releases nothing; `release_out_of_window` releases what vLLM's `remove_skipped_blocks`
    frees (blocks of 4, window 8: settled at 20, the three blocks before 13), and a processed
    count above what the request computed is refused with every group unchanged."""
    cache = GroupedPrefixCache(
        (FULL, SLIDING), (16, 16), context=CacheContext(block_size=4), window_release="explicit"
    )
    assert [g.window_release for g in cache.groups] == ["on_commit", "explicit"]
    cache.add_request("r", list(range(20)))
    cache.allocate_slots("r", 20)
    cache.commit("r", 20)
    null = cache.null_blocks[1]
    before = state(cache, ["r"])
    assert null not in cache.block_tables("r")[1]
    with pytest.raises(InvalidInputError, match="processed_tokens 21"):
        cache.release_out_of_window("r", 21)
    assert state(cache, ["r"]) == before
    assert cache.release_out_of_window("r", 20) == 3
    full, sliding = cache.block_tables("r")
    assert sliding[:3] == [null] * 3 and null not in sliding[3:]
    assert len(full) == 5 and null not in full
    cache.finish("r")
    cache.check_invariants()


def test_window_release_is_refused_by_name() -> None:
    from prefixkv import PrefixCache

    with pytest.raises(InvalidInputError, match="window_release"):
        PrefixCache(8, block_size=4, sliding_window=8, window_release="later")
    with pytest.raises(InvalidInputError, match="window_release"):
        PrefixCache(8, block_size=4, window_release="explicit")
    on_commit = PrefixCache(8, block_size=4, sliding_window=8)
    on_commit.add_request("r", list(range(12)))
    on_commit.allocate_slots("r", 12)
    with pytest.raises(InvalidInputError, match="releases on commit"):
        on_commit.release_out_of_window("r", 0)


# -- lanes: a request's own window in one explicit-release cache (issue 22, hybrid in vLLM) --
@given(
    window=st.integers(1, 40),
    steps=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    ),
)
def test_a_request_window_serves_as_a_cache_of_that_window(
    window: int, steps: list[tuple[int, int, int]]
) -> None:
    """A request given its own window (`set_request_window`) in a cache built for another
    window behaves, call for call, as the same request in a cache built for its window: the
    same block tables, releases, commits, hits and counts, so one cache can hold one lane per
    KV group of a hybrid model. Each step: request `i` releases its window `back` tokens behind
    what it computed, then its next `n` tokens are allocated and committed; `n == 9` finishes it.
    """
    from prefixkv import PrefixCache

    lanes = PrefixCache(24, block_size=4, sliding_window=8, window_release="explicit")
    alone = PrefixCache(24, block_size=4, sliding_window=window, window_release="explicit")

    def run(cache: PrefixCache, lane: bool) -> list[object]:
        seen: list[object] = []
        computed: dict[str, int] = {}
        for i, n, back in steps:
            rid = f"r{i}"
            try:
                if n == 9:
                    if computed.pop(rid, None) is not None:
                        cache.finish(rid)
                    seen.append("finished")
                    continue
                if rid not in computed:
                    cache.add_request(rid, [i % 2] * 30)
                    if lane:
                        cache.set_request_window(rid, window)
                    computed[rid] = 0
                else:
                    seen.append(cache.release_out_of_window(rid, max(computed[rid] - back, 0)))
                slots = cache.allocate_slots(rid, n)
                computed[rid] = slots.num_computed_tokens + n
                seen.append((slots.block_ids, slots.num_cached_tokens))
                seen.append(cache.commit(rid, computed[rid]))
                seen.append(cache.block_table(rid))
            except PrefixKVError as error:
                seen.append(type(error).__name__)
            seen.append(cache.stats().blocks_in_use)
            seen.append(cache.lookup_in_window([i % 2] * 30, window).num_cached_tokens)
        cache.check_invariants()
        return seen

    assert run(lanes, lane=True) == run(alone, lane=False)


def test_request_windows_refused_by_name_and_change_nothing() -> None:
    from prefixkv import PrefixCache

    cache = PrefixCache(16, block_size=4, sliding_window=8, window_release="explicit")
    cache.add_request("r", list(range(12)))
    with pytest.raises(InvalidInputError, match="at least 1 token"):
        cache.set_request_window("r", 0)
    with pytest.raises(InvalidInputError, match="window"):
        cache.set_request_window("r", -1)
    cache.allocate_slots("r", 12)
    with pytest.raises(InvalidInputError, match="already scheduled"):
        cache.set_request_window("r", 100)
    assert cache.release_out_of_window("r", 12) == 1, "the cache's window, 8, still applies"
    with pytest.raises(InvalidInputError, match="full-attention"):
        PrefixCache(16, block_size=4).lookup_in_window([1, 2, 3], 8)
    full = PrefixCache(16, block_size=4)
    full.add_request("f", [1, 2, 3])
    with pytest.raises(InvalidInputError, match="window_release Explicit"):
        full.set_request_window("f", 8)
    cache.check_invariants()
