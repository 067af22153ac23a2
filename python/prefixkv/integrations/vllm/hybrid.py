"""`HybridPrefixKVCacheManager`: vLLM's `KVCacheManager` for a layout of several KV cache groups
(full attention beside sliding windows: Gemma 2/3, gpt-oss), over one prefixkv cache.

vLLM's groups draw from one `BlockPool`: one id space, one free queue (LRU across groups), one
free count. So does this manager: one explicit-release sliding-window `PrefixCache` holds one
core request per (vLLM request, group), a *lane*, with the group's window
(`set_request_window`; a full-attention group, or a window covering the context, is a lane whose
window exceeds `max_model_len`) and its own salt (the group index folded into the request's
salt, so lanes never share entries, as vLLM keys cached blocks by hash and group). What vLLM's
`HybridKVCacheCoordinator` does across groups, and where this module does it:

- *The hit* (`get_computed_blocks`): the fixed point of `find_longest_cache_hit`. Full lanes
  first, then every other lane looked up under the current cap, the cap falling to each answer
  until a whole pass keeps it; full lanes are then cut to it. vLLM looks groups of one spec up
  together (a block counts only if every group caches it); each lane answering the longest
  valid hit below the cap reaches the same length.
- *Admission* (`allocate_slots`): the *sum* of the lanes' needs, as vLLM's single-type managers
  count them (`_lane_need`), against the one free count, before anything changes.
- *Hits before new blocks*: every lane first references its hit (an allocation of no tokens
  takes the match), then the lanes allocate in group order, so one lane's new blocks cannot
  evict another's hit (vLLM's `allocate_new_computed_blocks`, then `allocate_new_blocks`).
- *Release* (`free`, and the out-of-window release before each allocation): lane by lane in
  group order, each tail first, as `coordinator.free` frees its managers.

The rest (drafts, async placeholders, publishing at allocation, preemption) is lane by lane what
`PrefixKVCacheManager` does for one group. Refused by name: groups of different block sizes,
specs other than `FullAttentionSpec` / `SlidingWindowSpec`, KV events (their per-group metadata
is not checked yet) and what the one-group manager refuses.
"""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from prefixkv.cache import KeyExtras, PrefixCache, key_extras
from prefixkv.context import CacheContext
from prefixkv.errors import BlockStateError, OutOfBlocksError, UnsupportedFeatureError
from prefixkv.integrations.vllm.block_manager import (
    PrefixKVCacheManager,
    check_core,
    refuse_unsupported_settings,
    refuse_unsupported_window,
)
from prefixkv.integrations.vllm.pool_view import BlockPoolView, CoordinatorView

__all__ = ["HybridPrefixKVCacheManager"]

#: KV cache specs a hybrid layout may hold, by exact type (as `SUPPORTED_SPECS`).
HYBRID_SPECS = (FullAttentionSpec, SlidingWindowSpec)


class _Lane:
    """One KV cache group: its window in the core and vLLM's admission cap for it."""

    __slots__ = ("admission_cap", "full", "group_id", "window")

    def __init__(self, group_id: int, window: int, full: bool, admission_cap: int | None) -> None:
        self.group_id = group_id
        #: The lane's window in the core (past `max_model_len` for a full-attention group).
        self.window = window
        #: Downward-closed hits (full attention, or a window covering the context).
        self.full = full
        #: `max_admission_blocks_per_request` of a sliding group; None for full attention.
        self.admission_cap = admission_cap


class _HybridTracked:
    """What the manager remembers of one vLLM request between calls (all lanes)."""

    __slots__ = ("cached_blocks", "committed", "known", "lane_ids", "tables")

    def __init__(self, known: int, lane_ids: list[str]) -> None:
        #: Tokens every lane holds (vLLM's verified tokens, never drafts).
        self.known = known
        #: The core request of each lane.
        self.lane_ids = lane_ids
        #: vLLM's block table per group; None while the request waits.
        self.tables: list[list[KVCacheBlock]] | None = None
        #: Leading cached blocks per lane (from the last commit).
        self.cached_blocks = [0] * len(lane_ids)
        #: Tokens committed to every lane.
        self.committed = 0


def _lane_request_id(request_id: str, group_id: int) -> str:
    # The group index after the last separator: unambiguous whatever the request id holds.
    return f"{request_id}\x1f{group_id}"


def _lane_extras(request: Request, group_id: int) -> KeyExtras:
    # vLLM's block-hash extras (`_request_extras`), with the group folded into the salt so a
    # lane's entries are its own: "prefixkv-lane:<g>" then ":<salt>" when the request has one.
    salt = request.cache_salt
    lane_salt = f"prefixkv-lane:{group_id}" + ("" if salt is None else f":{salt}")
    lora = request.lora_request
    adapter = None if lora is None else str(lora.lora_name)
    multimodal = [
        (int(f.mm_position.offset), int(f.mm_position.length), str(f.identifier))
        for f in (request.mm_features or ())
    ]
    return key_extras(lane_salt, adapter, multimodal or None)


class HybridPrefixKVCacheManager(PrefixKVCacheManager):
    """`PrefixKVCacheManager` for several KV cache groups: one lane per group in one cache.
    `make_block_manager` (`scheduler.py`) builds it when the config has more than one group."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: KVCacheMetricsCollector | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        context: CacheContext | None = None,
        core: str = "auto",
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        # Several groups share one block-core cache: "auto" picks it, "runs" is refused.
        core = check_core(core, (f"a layout of {len(groups)} KV cache groups", True))
        specs = tuple(g.kv_cache_spec for g in groups)
        kinds = ", ".join(type(s).__name__ for s in specs)
        for spec in specs:
            if type(spec) not in HYBRID_SPECS:
                raise UnsupportedFeatureError(
                    f"hybrid KV cache layout ({kinds}): {type(spec).__name__} is not supported "
                    "by prefixkv's block manager (supported: FullAttentionSpec, "
                    "SlidingWindowSpec)"
                )
        block_size = specs[0].block_size
        if any(s.block_size != block_size for s in specs):
            raise UnsupportedFeatureError(
                f"hybrid KV cache layout with block sizes {[s.block_size for s in specs]} "
                "(different per group) is not supported by prefixkv's block manager"
            )
        if enable_kv_cache_events:
            raise UnsupportedFeatureError(
                "enable_kv_cache_events with a hybrid KV cache layout is not supported by "
                "prefixkv's block manager (per-group event metadata is not checked yet)"
            )
        refuse_unsupported_settings(
            kv_cache_config,
            block_size,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            metrics_collector=metrics_collector,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
        )
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        #: A window no request reaches: the lane never releases, its hits are a leading run.
        full_window = max_model_len + 1
        self._lanes: list[_Lane] = []
        for group_id, spec in enumerate(specs):
            if type(spec) is SlidingWindowSpec:
                refuse_unsupported_window(spec)
                covering = spec.sliding_window >= max_model_len
                cap = spec.max_admission_blocks_per_request(in_flight, max_model_len)
                window = full_window if covering else spec.sliding_window
                self._lanes.append(_Lane(group_id, window, covering, cap))
            else:
                self._lanes.append(_Lane(group_id, full_window, True, None))

        self._set_vllm_members(
            kv_cache_config,
            specs,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            use_eagle=use_eagle,
            log_stats=log_stats,
            metrics_collector=metrics_collector,
            watermark=watermark,
        )
        if context is None:
            context = CacheContext(block_size=block_size, extra={"engine": "vllm"})
        self._window = None
        self._admission_cap = 0
        # One pool for every group; each lane sets its own window.
        self._cache = PrefixCache(
            kv_cache_config.num_blocks - 1,
            context=context,
            sliding_window=full_window,
            window_release="explicit",
            core=core,
        )
        self._requests = {}
        self._hybrid: dict[str, _HybridTracked] = {}
        self.block_pool = BlockPoolView(self._cache, self._ids, self)
        self.coordinator = CoordinatorView(self, specs, block_size, self.block_pool)

    # -- what the views and tests read ---------------------------------------------------
    def table(self, request_id: str) -> list[KVCacheBlock]:
        """The first group's block table (`lane_tables` has every group's)."""
        return self.lane_tables(request_id)[0]

    def lane_tables(self, request_id: str) -> list[list[KVCacheBlock]]:
        tracked = self._hybrid.get(request_id)
        if tracked is None or tracked.tables is None:
            return [[] for _ in self._lanes]
        return tracked.tables

    def blocks_to_allocate(self, request_id: str, num_tokens: int, admission_cap: bool) -> int:
        tables = self.lane_tables(request_id)
        return sum(
            self._held_need(lane, num_tokens, len(table), admission_cap)
            for lane, table in zip(self._lanes, tables, strict=True)
        )

    def _held_need(self, lane: _Lane, num_tokens: int, held: int, admission_cap: bool) -> int:
        required = -(-num_tokens // self.block_size)
        if admission_cap and lane.admission_cap is not None:
            required = min(required, lane.admission_cap)
        return max(required - held, 0)

    # -- the request's tokens in the core ------------------------------------------------
    def _track_lanes(self, request: Request) -> _HybridTracked:
        rid = request.request_id
        tracked = self._hybrid.get(rid)
        num_tokens = request.num_tokens
        if tracked is None:
            tokens = list(request.all_token_ids)
            lane_ids = []
            for lane in self._lanes:
                lane_id = _lane_request_id(rid, lane.group_id)
                self._cache.add_request(
                    lane_id, tokens, extras=_lane_extras(request, lane.group_id)
                )
                self._cache.set_request_window(lane_id, lane.window)
                lane_ids.append(lane_id)
            tracked = _HybridTracked(num_tokens, lane_ids)
            self._hybrid[rid] = tracked
        elif num_tokens > tracked.known:
            new = list(request.all_token_ids[tracked.known :])
            for lane_id in tracked.lane_ids:
                self._cache.append_tokens(lane_id, new)
            tracked.known = num_tokens
        elif num_tokens < tracked.known:
            raise BlockStateError(
                f"request {rid!r} has {num_tokens} tokens but {tracked.known} were appended: "
                "vLLM dropped verified tokens, which prefixkv's block manager does not expect"
            )
        return tracked

    # -- lookups ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's hit across groups (`find_longest_cache_hit`'s fixed point), its length and
        its shared-prefix boundary. References nothing."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        self._track_lanes(request)
        tokens = list(request.all_token_ids)
        bs = self.block_size
        found: list[list[int] | None] = [None] * len(self._lanes)
        found_length = [0] * len(self._lanes)
        order = [lane for lane in self._lanes if lane.full] + [
            lane for lane in self._lanes if not lane.full
        ]
        hit = request.num_tokens - 1
        longest = 0
        while True:
            cap = hit
            for lane in order:
                g = lane.group_id
                if lane.full and found[g] is not None:
                    cap = min(cap, found_length[g])
                    continue
                # A hit of at most `cap` tokens: the lookup of `cap + 1` tokens (never a full
                # hit, so its last block is never counted), as vLLM's `max_length`.
                probe = tokens if cap + 1 >= len(tokens) else tokens[: cap + 1]
                match = self._cache.lookup_in_window(
                    probe, lane.window, extras=_lane_extras(request, g)
                )
                length = min(match.num_cached_tokens, cap)
                found[g] = list(match.block_ids[: length // bs])
                found_length[g] = length
                cap = length
                longest = max(longest, cap)
            if cap >= hit:
                break
            hit = cap
        if hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        blocks = tuple(self._ids.to_vllm((ids or [])[: hit // bs]) for ids in found)
        boundary = longest if longest > hit else 0
        return KVCacheBlocks(blocks), hit, boundary

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Room for `num_new_tokens` (+ `num_lookahead_tokens`) in every group, as vLLM's
        `allocate_slots`; None when the pool cannot supply the groups' sum (nothing changed,
        but for the out-of-window release vLLM also makes first)."""
        if num_external_computed_tokens or delay_cache_blocks or skip_zeroing_group_ids:
            raise UnsupportedFeatureError(
                "allocate_slots with external computed tokens / delay_cache_blocks / "
                "skip_zeroing_group_ids (a KV connector's asynchronous load) is not supported "
                "by prefixkv's block manager"
            )
        if num_encoder_tokens:
            raise UnsupportedFeatureError(
                "num_encoder_tokens (encoder-decoder cross-attention blocks) is not supported by "
                "prefixkv's block manager"
            )
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        rid = request.request_id
        tracked = self._track_lanes(request)
        waiting = tracked.tables is None
        bs = self.block_size
        num_tokens = request.num_tokens
        hit_blocks: list[list[KVCacheBlock]] = [[] for _ in self._lanes]
        if waiting:
            if request.num_computed_tokens:
                raise UnsupportedFeatureError(
                    f"request {rid!r} arrives with {request.num_computed_tokens} computed tokens "
                    "and no blocks (a KV connector's load): not supported by prefixkv's block "
                    "manager"
                )
            if new_computed_blocks is not None:
                hit_blocks = [list(group) for group in new_computed_blocks.blocks]
            if num_new_computed_tokens % bs or any(
                hit_blocks[lane.group_id]
                and len(hit_blocks[lane.group_id]) * bs != num_new_computed_tokens
                for lane in self._lanes
            ):
                raise UnsupportedFeatureError(
                    f"a hit of {num_new_computed_tokens} tokens that is not whole blocks of "
                    f"{bs} in every group (partial-block hits) is not supported by prefixkv's "
                    "block manager"
                )
            for lane_id in tracked.lane_ids:
                self._cache.limit_cached_prefix(lane_id, num_new_computed_tokens)
            start = num_new_computed_tokens
        else:
            if num_new_computed_tokens:
                raise UnsupportedFeatureError(
                    f"new computed blocks for running request {rid!r} (a late prefix hit) are "
                    "not supported by prefixkv's block manager"
                )
            start = tracked.committed
        total_computed = min(start if waiting else request.num_computed_tokens, self.max_model_len)
        end_known = min(total_computed + num_new_tokens, num_tokens)
        slot_end = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_known = max(end_known - start, 0)
        lookahead = max(slot_end - start - num_known, 0)

        watermark = 0
        if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            full = min(num_tokens, self.max_model_len)
            need = self._need(tracked, full, start, hit_blocks, admission_cap=True)
            if need + watermark > free:
                return None
        if not waiting:
            self._release_passed_lanes(request, tracked)
            free = self.block_pool.get_num_free_blocks()
        if self._need(tracked, slot_end, start, hit_blocks) + watermark > free - reserved_blocks:
            return None
        try:
            new = self._allocate_lanes(tracked, waiting, start, num_known, lookahead)
        except OutOfBlocksError as exc:
            raise BlockStateError(
                f"request {rid!r}: a group ran out of blocks after the groups' sum fitted "
                "(prefixkv's free count disagrees with the lanes' needs)"
            ) from exc
        if end_known > start or waiting:
            for i, lane_id in enumerate(tracked.lane_ids):
                tracked.cached_blocks[i] = self._cache.commit(lane_id, end_known)
            tracked.committed = max(tracked.committed, end_known)
        return self.create_kv_cache_blocks(tuple(new))

    def _need(
        self,
        tracked: _HybridTracked,
        num_slots: int,
        num_hit: int,
        hit_blocks: list[list[KVCacheBlock]],
        admission_cap: bool = False,
    ) -> int:
        """The blocks the groups would take for `num_slots` slots, summed, as vLLM's single-type
        managers count them (`get_num_blocks_to_allocate`): a scheduled lane's missing blocks
        (null positions count as held); a waiting lane's blocks past its hit (or past the
        positions its window skips, if more), plus the hit blocks in its window that no request
        references (touching them takes them from the free count)."""
        if tracked.tables is not None:
            return sum(
                self._held_need(lane, num_slots, len(table), admission_cap)
                for lane, table in zip(self._lanes, tracked.tables, strict=True)
            )
        bs = self.block_size
        total = 0
        for lane in self._lanes:
            hit = hit_blocks[lane.group_id]
            skipped = 0 if lane.full else max(0, num_hit - lane.window + 1) // bs
            total += self._held_need(lane, num_slots, max(skipped, len(hit)), admission_cap)
            total += sum(
                1 for block in hit[skipped:] if not block.is_null and self._ref_count(block) == 0
            )
        return total

    def _allocate_lanes(
        self,
        tracked: _HybridTracked,
        waiting: bool,
        start: int,
        num_known: int,
        lookahead: int,
    ) -> list[list[KVCacheBlock]]:
        """Every lane's hit referenced first, then each lane's new blocks in group order."""
        if waiting:
            tables: list[list[KVCacheBlock]] = []
            for lane_id in tracked.lane_ids:
                if start:
                    slots = self._cache.allocate_slots(lane_id, 0)
                    if slots.num_computed_tokens != start:
                        raise BlockStateError(
                            f"lane {lane_id!r}: prefixkv matched {slots.num_computed_tokens} "
                            f"cached tokens where vLLM's lookup found {start}"
                        )
                    tables.append(self._ids.to_vllm(slots.block_ids))
                else:
                    tables.append([])
            tracked.tables = tables
        assert tracked.tables is not None
        new: list[list[KVCacheBlock]] = []
        for lane_id, table in zip(tracked.lane_ids, tracked.tables, strict=True):
            slots = self._cache.allocate_slots(lane_id, num_known, num_lookahead_tokens=lookahead)
            blocks = self._ids.to_vllm(slots.block_ids)
            table.extend(blocks)
            new.append(blocks)
        return new

    def _release_passed_lanes(self, request: Request, tracked: _HybridTracked) -> None:
        """vLLM's `remove_skipped_blocks` for every group (`_release_passed`, lane by lane)."""
        processed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        processed = min(processed, tracked.known, self.max_model_len)
        assert tracked.tables is not None
        for i, (lane, lane_id) in enumerate(zip(self._lanes, tracked.lane_ids, strict=True)):
            if lane.full:
                continue
            if self._cache.release_out_of_window(lane_id, processed):
                tracked.tables[i] = self._ids.to_vllm(self._cache.block_table(lane_id))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        tracked = self._hybrid.get(request.request_id)
        if tracked is None or tracked.tables is None:
            return
        self._track_lanes(request)
        upto = min(num_computed_tokens, request.num_tokens)
        for i, lane_id in enumerate(tracked.lane_ids):
            tracked.cached_blocks[i] = self._cache.commit(lane_id, upto)
        tracked.committed = max(tracked.committed, upto)

    # -- release ---------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """Finish (or preempt) every lane in group order, each tail first, as vLLM's
        `coordinator.free` frees its managers."""
        rid = request.request_id
        tracked = self._hybrid.get(rid)
        if tracked is None:
            return
        if request.is_finished():
            for lane_id in tracked.lane_ids:
                self._cache.finish(lane_id)
            del self._hybrid[rid]
        elif tracked.tables is not None:
            for lane_id in tracked.lane_ids:
                self._cache.preempt(lane_id)
            tracked.tables = None
            tracked.cached_blocks = [0] * len(self._lanes)
            tracked.committed = 0

    # -- block tables ----------------------------------------------------------------------
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * len(self._lanes)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        tables = self.lane_tables(request_id)
        return self.create_kv_cache_blocks(tuple(list(t) for t in tables))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in t] for t in self.lane_tables(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        count = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:count] for ids in self.get_block_ids(request_id))

    def estimate_cached_tokens(self, request: Request) -> int:
        """The minimum over groups of the tokens in cached blocks each still holds."""
        tracked = self._hybrid.get(request.request_id)
        if tracked is None or tracked.tables is None:
            return 0
        cached = None
        for table, count in zip(tracked.tables, tracked.cached_blocks, strict=True):
            tokens = 0 if not count or table[count - 1].is_null else count * self.block_size
            cached = tokens if cached is None else min(cached, tokens)
        return cached or 0

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        if num_computed_tokens % self.block_size:
            raise UnsupportedFeatureError(
                f"truncating a hit to {num_computed_tokens} tokens, not whole blocks of "
                f"{self.block_size} (partial-block hits), is not supported"
            )
        count = num_computed_tokens // self.block_size
        return self.create_kv_cache_blocks(tuple(list(g[:count]) for g in blocks.blocks))
