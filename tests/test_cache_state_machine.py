"""The real cache and the pure-Python model, side by side, through random request lives.

After every step: identical hit lengths and block tables, exact refcounts, the same blocks
cached and pinned, no referenced block evicted, capacity never exceeded, and the core's own
invariant check. At teardown every request finishes and nothing may stay referenced.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

import prefixkv
from prefixkv import CacheContext, OutOfBlocksError
from tests.reference_cache import ReferenceCache

# A few shared stems make prefixes collide often, as in real traffic.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5], []]
token_lists = st.builds(
    lambda stem, cut, tail: stem[:cut] + tail,
    st.sampled_from(STEMS),
    st.integers(0, 8),
    st.lists(st.integers(0, 3), max_size=10),
).filter(bool)


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    raw_blocks = Bundle("raw_blocks")
    pins = Bundle("pins")

    @initialize(
        num_blocks=st.integers(3, 16),
        block_size=st.sampled_from([1, 2, 3, 4]),
        full_hit=st.sampled_from(["recompute_last_block", "reuse_last_block"]),
    )
    def create(self, num_blocks: int, block_size: int, full_hit: str) -> None:
        self.contexts = [
            CacheContext(block_size=block_size),
            CacheContext(block_size=block_size, model_id="other"),
        ]
        self.cache = prefixkv.PrefixCache(
            num_blocks, context=self.contexts[0], full_hit=full_hit, core="blocks"
        )
        self.model = ReferenceCache(num_blocks, block_size, full_hit == "reuse_last_block")
        self.live: dict[int, int] = {}  # real request id -> model request id
        self.num_blocks = num_blocks
        self.raw_held: list[list[int]] = []

    def ready(self) -> bool:
        return hasattr(self, "cache")

    @rule(
        target=requests,
        tokens=token_lists,
        salt=st.sampled_from([None, "tenant"]),
        priority=st.sampled_from([0, 0, 1, -1]),
    )
    def begin(self, tokens: list[int], salt: str | None, priority: int):
        expected = self.model.begin(tokens, salt, priority)
        if expected is None:
            before = self.cache.stats()
            with pytest.raises(OutOfBlocksError):
                self.cache.begin(tokens, salt=salt, priority=priority)
            assert self.cache.stats() == before or _same_state(before, self.cache.stats())
            return None
        request = self.cache.begin(tokens, salt=salt, priority=priority)
        rid, table, cached, full = expected
        assert (request.block_table, request.num_cached_tokens, request.full_hit) == (
            table,
            cached,
            full,
        )
        assert request.num_cached_tokens < len(tokens), "at least one token is left to compute"
        self.live[request.id] = rid
        return request.id

    @rule(
        tokens=token_lists,
        salt=st.sampled_from([None, "tenant"]),
        priority=st.sampled_from([0, 0, 1, -1]),
        generated=st.lists(st.integers(0, 3), max_size=6),
    )
    def serve(
        self, tokens: list[int], salt: str | None, priority: int, generated: list[int]
    ) -> None:
        """A whole request life in one step: the common case, and what fills the cache."""
        request = self.begin(tokens, salt, priority)
        if request is None:
            return
        self.commit(request, 1.0)
        if generated:
            self.append(request, generated)
            self.commit(request, 1.0)
        self.finish(request)

    @rule(
        target=requests,
        tokens=token_lists,
        salt=st.sampled_from([None, "tenant"]),
        priority=st.sampled_from([0, 0, 1, -1]),
    )
    def begin_full_hit(self, tokens: list[int], salt: str | None, priority: int):
        """A prompt of whole blocks served, then begun again: a full hit, whose recomputed last
        block, committed, duplicates the cached one (issue 22: later blocks chain on it, and
        evicting the original moves its entry into it)."""
        whole = len(tokens) // self.model.bs * self.model.bs
        if whole == 0:
            return None
        self.serve(tokens[:whole], salt, priority, [])
        request = self.begin(tokens[:whole], salt, priority)
        self.commit(request, 1.0)
        return request

    @rule(
        target=requests,
        tokens=token_lists,
        salt=st.sampled_from([None, "tenant"]),
        priority=st.sampled_from([0, 0, 1, -1]),
        generated=st.lists(st.integers(0, 3), min_size=4, max_size=8),
        reader=st.booleans(),
    )
    def full_hit_decode_finish(
        self,
        tokens: list[int],
        salt: str | None,
        priority: int,
        generated: list[int],
        reader: bool,
    ):
        """A full hit that decodes at least one more whole block, then finishes: its recomputed
        last block is a duplicate parenting the decoded block, so at finish it stays a *spare
        with a child* (issue 22, `pool.rs`). With `reader`, a new request then reads through
        that child and stays live, which blocks it: the child is lent to the canonical copy
        until the reader finishes. Random rule order reaches either state seldom."""
        request = self.begin_full_hit(tokens, salt, priority)
        if request is None:
            return None
        self.append(request, generated)
        self.commit(request, 1.0)
        self.finish(request)
        if not reader:
            return None
        whole = len(tokens) // self.model.bs * self.model.bs
        return self.begin(tokens[:whole] + generated + [0], salt, priority)

    @rule(request=requests, fraction=st.floats(0, 1))
    def commit(self, request: int | None, fraction: float) -> None:
        if request is None or request not in self.live:
            return
        n = round(self.cache._core.num_tokens(request) * fraction)
        assert self.cache.commit(request, n) == self.model.commit(self.live[request], n)

    @rule(request=requests, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, request: int | None, tokens: list[int]) -> None:
        if request is None or request not in self.live:
            return
        expected = self.model.append(self.live[request], tokens)
        if expected is None:
            with pytest.raises(OutOfBlocksError):
                self.cache.append(request, tokens)
        else:
            assert self.cache.append(request, tokens) == expected

    @rule(request=consumes(requests))
    def finish(self, request: int | None) -> None:
        if request is None or request not in self.live:
            return
        self.cache.finish(request)
        self.model.finish(self.live.pop(request))

    @rule(target=raw_blocks, count=st.integers(0, 3))
    def allocate(self, count: int):
        expected = self.model.allocate(count)
        if expected is None:
            with pytest.raises(OutOfBlocksError):
                self.cache.allocate(count)
            return []
        got = self.cache.allocate(count)
        assert got == expected
        self.raw_held.append(got)
        return got

    @rule(blocks=consumes(raw_blocks))
    def release(self, blocks: list[int]) -> None:
        if blocks in self.raw_held:
            self.raw_held.remove(blocks)
        self.cache.release(blocks)
        self.model.release(blocks)

    @rule(target=pins, tokens=token_lists, salt=st.sampled_from([None, "tenant"]))
    def pin(self, tokens: list[int], salt: str | None):
        pin = self.cache.pin(tokens, salt=salt)
        pid, count = self.model.pin(tokens, salt)
        assert pin.num_blocks == count
        return (pin, pid)

    @rule(pin=consumes(pins))
    def unpin(self, pin) -> None:
        real, pid = pin
        if pid in self.model.pins:
            self.cache.unpin(real)
            self.model.unpin(pid)

    @rule(tokens=token_lists, salt=st.sampled_from([None, "tenant"]))
    def lookup(self, tokens: list[int], salt: str | None) -> None:
        got = self.cache.lookup(tokens, salt=salt)
        assert (got.block_ids, got.num_cached_tokens, got.full_hit) == self.model.lookup(
            tokens, salt
        )

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()

    @rule(which=st.integers(0, 1))
    def set_context(self, which: int) -> None:
        self.cache.set_context(self.contexts[which])
        self.model.set_context(which)

    @invariant()
    def states_agree(self) -> None:
        if not self.ready():
            return
        self.cache.check_invariants()
        stats = self.cache.stats()
        for name, value in self.model.counts().items():
            assert getattr(stats, name) == value, name
        for block, meta in enumerate(self.model.blocks):
            assert self.cache.ref_count(block) == meta.ref, f"refcount of block {block}"
            assert self.cache.is_cached(block) == meta.cached, f"cached state of block {block}"
        # Every block a live request reads is referenced: it cannot have been evicted.
        for rid in self.live:
            for block in self.cache.block_table(rid):
                assert self.cache.ref_count(block) >= 1
        assert stats.blocks_free + stats.blocks_cached <= self.num_blocks + stats.blocks_in_use
        assert stats.blocks_free <= self.num_blocks

    def teardown(self) -> None:
        if not self.ready():
            return
        for rid in list(self.live):
            self.cache.finish(rid)
        for blocks in self.raw_held:
            self.cache.release(blocks)
        stats = self.cache.stats()
        assert stats.blocks_in_use == 0, "a block is still referenced after every request finished"
        assert stats.blocks_free + stats.blocks_cached == self.num_blocks, "a block leaked"
        self.cache.check_invariants()
        # Released duplicates are spares (cached content, rust/core/src/pool.rs) until taken;
        # a clear frees them, and every other block.
        self.cache.clear()
        assert self.cache.stats().blocks_free == self.num_blocks, "a block leaked"
        self.cache.check_invariants()


def _same_state(before, after) -> bool:
    return all(
        getattr(before, f) == getattr(after, f)
        for f in ("blocks_free", "blocks_cached", "blocks_in_use", "evictions", "lookups")
    )


CacheMachine.TestCase.settings = settings(stateful_step_count=40)
TestCacheMachine = CacheMachine.TestCase
