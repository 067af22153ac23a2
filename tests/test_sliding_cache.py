"""Sliding-window caches (`PrefixCache(sliding_window=W)`) through the binding.

A random step loop (add_request, allocate_slots in chunks, commit, decode, preempt, finish)
drives the real cache beside a tiny model of what each block's KV holds: the engine's writes,
recorded as the token prefix each block was computed under. After every step, every position
the window of a scheduled request's computed count reads is a block the request holds, never
the null block, whose recorded content is the request's own tokens (a released block is never
read); a hit's non-null blocks hold exactly the prompt's tokens; and the core's invariants hold.
Then the error cases.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import prefixkv
from prefixkv import CacheContext
from prefixkv.errors import InvalidInputError, OutOfBlocksError, UnknownRequestError

# A shared stem cut anywhere, with short tails: prompts share prefixes often.
STEM = list(range(100, 140))
prompts = st.builds(
    lambda cut, tail: STEM[:cut] + tail,
    st.integers(0, len(STEM)),
    st.lists(st.integers(1, 4), max_size=6),
).filter(bool)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts),
        st.tuples(st.just("step"), st.integers(0, 99), st.integers(1, 24)),
        st.tuples(st.just("step"), st.integers(0, 99), st.integers(1, 24)),
        st.tuples(st.just("decode"), st.integers(0, 99), st.integers(1, 4)),
        st.tuples(st.just("preempt"), st.integers(0, 99)),
        st.tuples(st.just("finish"), st.integers(0, 99)),
    ),
    min_size=1,
    max_size=60,
)


def make_cache(num_blocks: int, block_size: int, window: int, reuse: bool) -> prefixkv.PrefixCache:
    return prefixkv.PrefixCache(
        num_blocks,
        context=CacheContext(block_size=block_size),
        sliding_window=window,
        full_hit="reuse_last_block" if reuse else "recompute_last_block",
    )


class Model:
    """What each block's KV holds, and the live requests' tokens."""

    def __init__(self, cache: prefixkv.PrefixCache) -> None:
        self.cache = cache
        self.window = cache.sliding_window
        self.bs = cache.block_size
        self.null = cache.null_block
        self.content: dict[int, list[int]] = {}
        self.live: dict[int, list[int]] = {}
        self.next_id = 1

    def pick(self, index: int) -> int | None:
        ids = sorted(self.live)
        return ids[index % len(ids)] if ids else None

    def check_window(self, rid: int, settled: int) -> None:
        """The window of a query at `settled` reads only held, real blocks of its own tokens."""
        assert self.window is not None
        tokens = self.live[rid]
        table = self.cache.block_table(rid)
        first = max(0, settled + 1 - self.window) // self.bs
        for position in range(first, -(-settled // self.bs)):
            block = table[position]
            assert block != self.null, f"request {rid} reads released position {position}"
            assert self.cache.ref_count(block) > 0
            end = min((position + 1) * self.bs, settled)
            written = self.content.get(block, [])
            assert written[:end] == tokens[:end], (rid, position, block, written, tokens[:end])

    def add(self, prompt: list[int]) -> None:
        rid = self.next_id
        self.next_id += 1
        self.cache.add_request(rid, prompt)
        self.live[rid] = list(prompt)

    def step(self, index: int, chunk: int) -> None:
        rid = self.pick(index)
        if rid is None:
            return
        tokens = self.live[rid]
        start = self.cache.start_position(rid)
        n = min(chunk, len(tokens) - start)
        if n == 0:
            return
        waiting = not self.cache.block_table(rid)
        try:
            slots = self.cache.allocate_slots(rid, n)
        except OutOfBlocksError:
            return
        assert slots.num_computed_tokens == start, "start_position foretold it"
        hit_blocks = -(-slots.num_cached_tokens // self.bs) if waiting else 0
        if waiting:
            # The hit's non-null blocks hold exactly the prompt's tokens.
            for position, block in enumerate(slots.block_ids[:hit_blocks]):
                if block != self.null:
                    end = (position + 1) * self.bs
                    assert self.content.get(block, [])[:end] == tokens[:end]
        for block in slots.block_ids[hit_blocks:]:
            assert block != self.null and 0 <= block < self.cache.num_blocks
            self.content[block] = []
        self.check_window(rid, start)
        table = self.cache.block_table(rid)
        end = start + n
        for position in range(start // self.bs, -(-end // self.bs)):
            block = table[position]
            assert block != self.null, "a chunk writes into the null block"
            written = tokens[: min((position + 1) * self.bs, end)]
            kept = self.content.setdefault(block, [])
            # A shared block (a reuse-last-block hit) is read, not written.
            if kept[: len(written)] != written or len(kept) < len(written):
                self.content[block] = written
        self.cache.commit(rid, end)

    def decode(self, index: int, token: int) -> None:
        rid = self.pick(index)
        if rid is None or self.cache.num_computed_tokens(rid) < len(self.live[rid]):
            return
        self.cache.append_tokens(rid, [token])
        self.live[rid].append(token)

    def preempt(self, index: int) -> None:
        rid = self.pick(index)
        if rid is not None:
            self.cache.preempt(rid)

    def finish(self, index: int) -> None:
        rid = self.pick(index)
        if rid is not None:
            self.cache.finish(rid)
            del self.live[rid]

    def check(self) -> None:
        self.cache.check_invariants()
        for rid in self.live:
            if self.cache.block_table(rid):
                self.check_window(rid, self.cache.num_computed_tokens(rid))


@settings(max_examples=150, deadline=None)
@given(
    window=st.integers(1, 64),
    block_size=st.integers(1, 8),
    num_blocks=st.integers(4, 40),
    reuse=st.booleans(),
    ops=steps,
)
def test_released_blocks_are_never_read_and_hits_hold_the_prompt(
    window: int, block_size: int, num_blocks: int, reuse: bool, ops: list[tuple]
) -> None:
    model = Model(make_cache(num_blocks, block_size, window, reuse))
    for op in ops:
        getattr(model, op[0])(*op[1:])
        model.check()
    for rid in list(model.live):
        model.cache.finish(rid)
    stats = model.cache.stats()
    assert stats.blocks_in_use == 0
    assert stats.blocks_free + stats.blocks_cached == stats.blocks_total


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 64), block_size=st.integers(1, 8), prompt=prompts)
def test_lookup_after_commit_needs_only_the_window(
    window: int, block_size: int, prompt: list[int]
) -> None:
    cache = make_cache(64, block_size, window, False)
    cache.add_request("a", prompt)
    # Window 1 reads no earlier token: a fresh cache already serves a hit of nothing but nulls.
    start = cache.start_position("a")
    assert start == 0 or window == 1
    cache.allocate_slots("a", len(prompt) - start)
    cache.commit("a", len(prompt))
    probe = [*prompt, 0]
    hit = cache.lookup(probe)
    full = len(prompt) // block_size * block_size
    assert hit.num_cached_tokens == full
    first_needed = max(0, full + 1 - window) // block_size
    assert hit.block_ids[:first_needed] == [cache.null_block] * first_needed
    assert cache.null_block not in hit.block_ids[first_needed:]
    if start == 0:
        released = cache.stats().blocks_released
        assert released == max(0, len(prompt) + 1 - window) // block_size
    cache.finish("a")
    cache.check_invariants()


def test_properties_and_a_cap_that_makes_groups_agree() -> None:
    cache = make_cache(16, 2, 3, False)
    assert (cache.sliding_window, cache.null_block) == (3, 16)
    assert "sliding_window=3" in repr(cache)
    full = prefixkv.PrefixCache(16, context=CacheContext(block_size=2))
    assert (full.sliding_window, full.null_block) == (None, None)
    for c in (cache, full):
        c.add_request("a", list(range(1, 11)))
        c.allocate_slots("a", 10)
        c.commit("a", 10)
        c.add_request("b", list(range(1, 11)))
        assert c.start_position("b") == 8
        c.limit_cached_prefix("b", 5)
        assert c.start_position("b") == 4
        slots = c.allocate_slots("b", 6)
        assert slots.num_cached_tokens == 4 and not slots.full_hit
        c.limit_cached_prefix("b", None)
        with pytest.raises(UnknownRequestError):
            c.limit_cached_prefix("nobody", 3)
        with pytest.raises(InvalidInputError):
            c.limit_cached_prefix("b", -1)
        c.check_invariants()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_sliding_window_is_refused(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="sliding_window"):
        prefixkv.PrefixCache(8, sliding_window=bad)  # type: ignore[arg-type]


def test_truncate_into_the_released_window_is_refused() -> None:
    # Blocks of 4, window 2: settled at 7 the query reads 6..7, so block 0 is released.
    cache = make_cache(16, 4, 2, False)
    cache.add_request("a", list(range(1, 8)))
    cache.allocate_slots("a", 7)
    cache.commit("a", 7)
    assert cache.block_table("a")[0] == cache.null_block
    with pytest.raises(InvalidInputError, match="sliding window"):
        cache.truncate("a", 4)
    assert cache.num_tokens("a") == 7
    assert cache.truncate("a", 5) == []
    cache.check_invariants()


def test_low_level_publishing_is_refused_and_the_null_block_is_never_released() -> None:
    cache = make_cache(16, 2, 3, False)
    blocks = cache.allocate(2)
    with pytest.raises(InvalidInputError, match="sliding-window"):
        cache.commit_blocks([1, 2, 3, 4], blocks)
    with pytest.raises(InvalidInputError, match="sliding-window"):
        cache.pin([1, 2, 3, 4])
    cache.release(blocks)
    cache.add_request("a", list(range(1, 11)))
    cache.allocate_slots("a", 10)
    cache.commit("a", 10)
    cache.finish("a")
    held = cache.match_and_acquire(list(range(1, 12)))
    assert held.block_ids[:4] == [cache.null_block] * 4
    with pytest.raises(prefixkv.PrefixKVError):
        cache.release([cache.null_block])
    cache.release(held.block_ids[4:])
    cache.check_invariants()
