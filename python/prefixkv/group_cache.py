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
  (under the core's lock), so the answers still hold. A refusal changes nothing in any group.
- **Keys per group.** Each group's cache runs under the engine's context plus the group's index
  and window, so the same tokens in two groups are two different blocks everywhere: in the
  table, in KV events and in any tier.

Only ``full_hit="recompute_last_block"`` is served: with ``reuse_last_block`` the groups could
disagree on whether the last token's KV is to be written.

Each request-keyed method is one call into the Rust core's `KvGroups` (``rust/core/src/groups/``,
which states these rules as invariants), over the very caches in `groups`: a decode step costs
about what it costs in one `PrefixCache`, not one wrapper call per group.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from prefixkv import _core
from prefixkv._core import CacheStats, GroupSlots
from prefixkv.cache import PrefixCache, RequestRef, as_token_ids, key_extras
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError
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


def _specs(specs: Sequence[KVGroupSpec]) -> tuple[KVGroupSpec, ...]:
    """`specs` as a tuple, refused by name unless it is a non-empty sequence of `KVGroupSpec`
    with distinct group indices (a group's index joins its block keys: two groups under one
    index would share keys)."""
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
        raise InvalidInputError(
            f"specs must be a sequence of KVGroupSpec, not {type(specs).__name__}"
        )
    if not specs:
        raise InvalidInputError("specs must name at least one KV group")
    seen: dict[int, int] = {}
    for position, spec in enumerate(specs):
        if not isinstance(spec, KVGroupSpec):
            raise InvalidInputError(
                f"specs[{position}] must be a KVGroupSpec, not {type(spec).__name__}"
            )
        if spec.index in seen:
            raise InvalidInputError(
                f"specs[{position}] has group index {spec.index}, as specs[{seen[spec.index]}]: "
                "each KV group needs its own index (it joins the group's block keys)"
            )
        seen[spec.index] = position
    return tuple(specs)


def _per_group(values: Sequence[int], name: str, num_groups: int) -> list[int]:
    """One value per KV group, refused by name unless it is a sequence of that length (each
    value is checked by the group's `PrefixCache`)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInputError(
            f"{name} must be a sequence with one value per KV group, not {type(values).__name__}"
        )
    if len(values) != num_groups:
        raise InvalidInputError(
            f"{name} needs one value per KV group: {len(values)} for {num_groups} groups"
        )
    return list(values)


# `GroupSlots` is the native module's frozen class (`rust/py/src/groups.rs`): what
# `GroupedPrefixCache.allocate_slots` hands the engine (as `Slots`, per group), with
# group_block_ids (one list per group), num_computed_tokens, num_cached_tokens, full_hit and
# last_token_shared (always False: only ``recompute_last_block`` full hits are served).


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
        window_release: when the sliding groups release what a request's window passed
            (`PrefixCache`'s setting; full groups release nothing before `finish`). With
            ``"explicit"``, the engine calls `release_out_of_window`.

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
        window_release: str = "on_commit",
    ) -> None:
        specs = _specs(specs)
        num_blocks = _per_group(num_blocks, "num_blocks", len(specs))
        if block_sizes is None:
            block_sizes = [context.block_size] * len(specs)
        else:
            block_sizes = _per_group(block_sizes, "block_sizes", len(specs))
        self.specs = specs
        self._context = context
        self.groups = tuple(
            PrefixCache(
                count,
                context=group_context(context, spec, size),
                vocab_size=vocab_size,
                sliding_window=spec.sliding_window,
                window_release="on_commit" if spec.sliding_window is None else window_release,
                core="blocks",  # only the block core serves KV groups
            )
            for spec, count, size in zip(specs, num_blocks, block_sizes, strict=True)
        )
        # One hit length, all or nothing, the scheduled requests: all in the core, over the
        # same caches Python keeps using for lookups, events and stats.
        self._core = _core.CoreGroups([cache._block_core("KV groups") for cache in self.groups])
        #: Hit lengths are multiples of this: every group's blocks end there.
        self.hit_granularity = self._core.hit_granularity
        self.full_hit = "recompute_last_block"
        # Serialises the resets (`set_context`) with each other; the core serialises the rest.
        self._lock = threading.RLock()

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
        self._core.add_request(request_id, as_token_ids(tokens), key_extras(salt, adapter))

    def start_position(self, request: RequestRef) -> int:
        """Where the next `allocate_slots` starts computing: for a waiting request the hit
        every group agrees on, for a scheduled one its computed tokens."""
        return self._core.start_position(request)

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
        return self._core.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens, watermark_blocks
        )

    def can_allocate_slots(
        self,
        request: RequestRef,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> bool:
        return self._core.can_allocate_slots(
            request, num_new_tokens, num_lookahead_tokens, watermark_blocks
        )

    def append_tokens(
        self, request: RequestRef, tokens: Sequence[int], *, draft: bool = False
    ) -> None:
        self._core.append_tokens(request, as_token_ids(tokens), bool(draft))

    def commit(self, request: RequestRef, num_computed_tokens: int) -> int:
        """Record written KV in every group (a sliding group then releases what its window
        passed); returns the committed positions of the group with fewest."""
        return self._core.commit(request, num_computed_tokens)

    def release_out_of_window(self, request: RequestRef, processed_tokens: int) -> int:
        """`PrefixCache.release_out_of_window` in every sliding group (built with
        ``window_release="explicit"``); returns the blocks released, all groups together.
        Refused before any group changes."""
        return self._core.release_out_of_window(request, processed_tokens)

    def accept_drafts(self, request: RequestRef, num_accepted: int) -> int:
        return self._core.accept_drafts(request, num_accepted)

    def truncate(self, request: RequestRef, num_tokens: int) -> None:
        self._core.truncate(request, num_tokens)

    def preempt(self, request: RequestRef) -> None:
        self._core.preempt(request)

    def finish(self, request: RequestRef) -> None:
        self._core.finish(request)

    # -- observation ---------------------------------------------------------------------
    def block_tables(self, request: RequestRef) -> tuple[list[int], ...]:
        """The request's block table in each group (a sliding group's starts with its null
        block at every released position)."""
        return self._core.block_tables(request)

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
            for spec, cache in zip(self.specs, self.groups, strict=True):
                cache.set_context(group_context(context, spec, cache.block_size))
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
