"""`GroupedPrefixCache`: one block manager per KV group, driven as one.

A hybrid model's layers form KV groups (`prefixkv.kv_groups`); each group has its own pages, so
each has its own `PrefixCache`: its own pool, block keys, verification, eviction and stats.
A full-attention group's cache keeps every block of a request; a sliding-window group's cache
(``sliding_window=W``) releases the blocks its window has passed and serves a hit from the
blocks covering the window before it (docs/hybrid.md).

This class gives an engine the step API of one `PrefixCache` over all groups:

- **One hit length.** A request's cached prefix is the longest one *every* group can serve: all
  its blocks for a full group, the window's blocks for a sliding one. The groups' answers are
  not monotone in each other (a sliding group may serve 48 tokens but not 32), so each group is
  asked for its longest hit under a cap, the cap is lowered to the smallest answer (rounded down
  to a multiple of every group's block size), and this repeats until all agree. Each answer
  is at most the cap, and the cap only falls, so it ends (at 0 at worst).
- **All or nothing.** An allocation first asks every group whether it can supply its blocks,
  then allocates in each; every group has its own pool, and only this object changes them
  (under its lock), so the answers still hold. A refusal changes nothing in any group.
- **Keys per group.** Each group's cache runs under the engine's context plus the group's index
  and window, so the same tokens in two groups are two different blocks everywhere: in the
  table, in KV events and in any tier.

Only ``full_hit="recompute_last_block"`` is served: with ``reuse_last_block`` the groups could
disagree on whether the last token's KV is to be written.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from prefixkv._core import CacheStats
from prefixkv.cache import PrefixCache, RequestRef
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.kv_groups import KVGroupSpec

__all__ = ["GroupSlots", "GroupedCacheStats", "GroupedPrefixCache", "group_context"]


def group_context(
    context: CacheContext, spec: KVGroupSpec, block_size: int | None = None
) -> CacheContext:
    """`context` for one KV group: its index and window join the key of every block (and its
    block size, when the group's differs)."""
    extra = dict(context.extra)
    extra["kv_group"] = spec.index
    extra["kv_group_window"] = spec.sliding_window
    size = context.block_size if block_size is None else block_size
    return dataclasses.replace(context, extra=extra, block_size=size)


@dataclass(frozen=True)
class GroupSlots:
    """What `GroupedPrefixCache.allocate_slots` hands the engine (as `Slots`, per group)."""

    #: Blocks appended to each group's table by this call.
    group_block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    num_cached_tokens: int
    full_hit: bool
    #: Always False: only ``recompute_last_block`` full hits are served.
    last_token_shared: bool = False


@dataclass(frozen=True)
class GroupedCacheStats:
    """Every group's `CacheStats` (`groups`), and the block counts summed over the groups."""

    groups: tuple[CacheStats, ...]

    def _sum(self, name: str) -> int:
        return sum(int(getattr(stats, name)) for stats in self.groups)

    @property
    def blocks_in_use(self) -> int:
        return self._sum("blocks_in_use")

    @property
    def blocks_free(self) -> int:
        return self._sum("blocks_free")

    @property
    def blocks_cached(self) -> int:
        return self._sum("blocks_cached")

    @property
    def blocks_pinned(self) -> int:
        return self._sum("blocks_pinned")

    @property
    def blocks_released(self) -> int:
        """Blocks the sliding groups released as their windows moved on."""
        return self._sum("blocks_released")

    @property
    def requests_live(self) -> int:
        return int(self.groups[0].requests_live)

    @property
    def hit_rate(self) -> float:
        """Group 0's: every group serves the same hit lengths."""
        return float(self.groups[0].hit_rate)


class GroupedPrefixCache:
    """Block managers for the KV groups of one model.

    Args:
        specs: the groups (`prefixkv.kv_groups.kv_group_specs`).
        num_blocks: blocks of each group's pool.
        context: the model's context; each group runs under `group_context` of it.
        vocab_size: when given, token ids at or above it are refused.
        block_sizes: tokens per block of each group (default: `context.block_size` for all);
            hit lengths are then multiples of their least common multiple.

    Request-keyed calls take the engine's request id, as `PrefixCache`'s do.
    """

    def __init__(
        self,
        specs: Sequence[KVGroupSpec],
        num_blocks: Sequence[int],
        *,
        context: CacheContext,
        vocab_size: int | None = None,
        block_sizes: Sequence[int] | None = None,
    ) -> None:
        specs = tuple(specs)
        if not specs or len(num_blocks) != len(specs):
            raise InvalidInputError(
                f"need one num_blocks per KV group: {len(num_blocks)} for {len(specs)} groups"
            )
        if block_sizes is None:
            block_sizes = [context.block_size] * len(specs)
        elif len(block_sizes) != len(specs):
            raise InvalidInputError(
                f"need one block size per KV group: {len(block_sizes)} for {len(specs)} groups"
            )
        self.specs = specs
        self._context = context
        self._block_sizes = tuple(block_sizes)
        self.groups = tuple(
            PrefixCache(
                count,
                context=group_context(context, spec, size),
                vocab_size=vocab_size,
                sliding_window=spec.sliding_window,
            )
            for spec, count, size in zip(specs, num_blocks, self._block_sizes, strict=True)
        )
        sizes = {cache.block_size for cache in self.groups}
        #: Hit lengths are multiples of this: every group's blocks end there.
        self.hit_granularity = math.lcm(*sizes)
        self.full_hit = "recompute_last_block"
        # Sliding groups first wherever a call can be refused after another group took it:
        # their refusals (a released position) are the ones a full group does not share.
        self._refusal_order = sorted(
            range(len(specs)), key=lambda g: specs[g].sliding_window is None
        )
        self._lock = threading.RLock()
        #: Requests holding blocks (matched their prefix); the others wait.
        self._scheduled: set[RequestRef] = set()

    # -- properties ----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Group 0's block size (`block_sizes` has every group's)."""
        return self.groups[0].block_size

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(cache.block_size for cache in self.groups)

    @property
    def num_blocks(self) -> tuple[int, ...]:
        return tuple(cache.num_blocks for cache in self.groups)

    @property
    def context(self) -> CacheContext:
        """The model's context (each group's adds its index and window)."""
        return self._context

    @property
    def null_blocks(self) -> tuple[int | None, ...]:
        return tuple(cache.null_block for cache in self.groups)

    # -- a request's life ----------------------------------------------------------------
    def add_request(
        self,
        request_id: int | str,
        tokens: Sequence[int],
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
    ) -> None:
        """Register a waiting request in every group (all or none)."""
        with self._lock:
            added: list[PrefixCache] = []
            try:
                for cache in self.groups:
                    cache.add_request(request_id, tokens, salt=salt, adapter=adapter)
                    added.append(cache)
            except BaseException:
                for cache in added:
                    cache.finish(request_id)
                raise

    def start_position(self, request: RequestRef) -> int:
        """Where the next `allocate_slots` starts computing: for a waiting request the hit
        every group agrees on, for a scheduled one its computed tokens."""
        with self._lock:
            if request in self._scheduled:
                return self.groups[0].start_position(request)
            return self._agree_on_hit(request)

    def _agree_on_hit(self, request: RequestRef) -> int:
        cap: int | None = None
        while True:
            starts = []
            for cache in self.groups:
                cache.limit_cached_prefix(request, cap)
                starts.append(cache.start_position(request))
            low = min(starts)
            low -= low % self.hit_granularity
            if all(start == low for start in starts):
                return low
            cap = low

    def allocate_slots(
        self,
        request: RequestRef,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> GroupSlots:
        """`PrefixCache.allocate_slots` in every group, or in none: raises `OutOfBlocksError`
        naming the group that cannot supply its blocks, with nothing changed."""
        with self._lock:
            waiting = request not in self._scheduled
            if waiting:
                self._agree_on_hit(request)
            for spec, cache in zip(self.specs, self.groups, strict=True):
                if not cache.can_allocate_slots(
                    request,
                    num_new_tokens,
                    num_lookahead_tokens=num_lookahead_tokens,
                    watermark_blocks=watermark_blocks,
                ):
                    raise OutOfBlocksError(
                        f"KV group {spec.index} ({spec.kind}, {len(spec.layers)} layers) cannot "
                        f"supply the blocks for {num_new_tokens} more tokens of request "
                        f"{request!r}"
                    )
            slots = [
                cache.allocate_slots(
                    request,
                    num_new_tokens,
                    num_lookahead_tokens=num_lookahead_tokens,
                    watermark_blocks=watermark_blocks,
                )
                for cache in self.groups
            ]
            starts = {s.num_computed_tokens for s in slots}
            # The caps make every group match the agreed hit; a mismatch would mean groups
            # computing from different positions, which must never reach the model.
            assert len(starts) == 1, f"KV groups disagree on where to compute: {starts}"
            self._scheduled.add(request)
            return GroupSlots(
                group_block_ids=tuple(s.block_ids for s in slots),
                num_computed_tokens=slots[0].num_computed_tokens,
                num_cached_tokens=min(s.num_cached_tokens for s in slots),
                full_hit=waiting and all(s.full_hit for s in slots),
            )

    def can_allocate_slots(
        self,
        request: RequestRef,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> bool:
        with self._lock:
            if request not in self._scheduled:
                self._agree_on_hit(request)
            return all(
                cache.can_allocate_slots(
                    request,
                    num_new_tokens,
                    num_lookahead_tokens=num_lookahead_tokens,
                    watermark_blocks=watermark_blocks,
                )
                for cache in self.groups
            )

    def append_tokens(
        self, request: RequestRef, tokens: Sequence[int], *, draft: bool = False
    ) -> None:
        with self._lock:
            for cache in self.groups:
                cache.append_tokens(request, tokens, draft=draft)

    def commit(self, request: RequestRef, num_computed_tokens: int) -> int:
        """Record written KV in every group (a sliding group then releases what its window
        passed); returns the committed positions of the group with fewest."""
        with self._lock:
            return min(cache.commit(request, num_computed_tokens) for cache in self.groups)

    def accept_drafts(self, request: RequestRef, num_accepted: int) -> int:
        with self._lock:
            return min(cache.accept_drafts(request, num_accepted) for cache in self.groups)

    def truncate(self, request: RequestRef, num_tokens: int) -> None:
        with self._lock:
            for group in self._refusal_order:
                self.groups[group].truncate(request, num_tokens)

    def preempt(self, request: RequestRef) -> None:
        with self._lock:
            for cache in self.groups:
                cache.preempt(request)
            self._scheduled.discard(request)

    def finish(self, request: RequestRef) -> None:
        with self._lock:
            error: BaseException | None = None
            for cache in self.groups:
                try:
                    cache.finish(request)
                except BaseException as exc:  # finish every group, then report
                    error = error or exc
            self._scheduled.discard(request)
            if error is not None:
                raise error

    # -- observation ---------------------------------------------------------------------
    def block_tables(self, request: RequestRef) -> tuple[list[int], ...]:
        """The request's block table in each group (a sliding group's starts with its null
        block at every released position)."""
        return tuple(cache.block_table(request) for cache in self.groups)

    def request_block_keys(self, request: RequestRef) -> list[bytes]:
        """The request's block keys in group 0 (the full-attention group when there is one):
        the keys routers and in-flight checks compare."""
        return self.groups[0].request_block_keys(request)

    def stats(self) -> GroupedCacheStats:
        """Each group's counters and block states, and their sums."""
        return GroupedCacheStats(tuple(cache.stats() for cache in self.groups))

    # -- reset ---------------------------------------------------------------------------
    def set_context(self, context: CacheContext) -> None:
        with self._lock:
            for spec, cache, size in zip(self.specs, self.groups, self._block_sizes, strict=True):
                cache.set_context(group_context(context, spec, size))
            self._context = context

    def clear(self) -> None:
        with self._lock:
            for cache in self.groups:
                cache.clear()

    def check_invariants(self) -> None:
        for cache in self.groups:
            cache.check_invariants()

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{spec.kind}(window={spec.sliding_window}, blocks={cache.num_blocks})"
            for spec, cache in zip(self.specs, self.groups, strict=True)
        )
        return f"GroupedPrefixCache([{parts}], block_size={self.block_size})"
