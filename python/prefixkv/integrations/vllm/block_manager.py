"""`PrefixKVCacheManager`: vLLM's `KVCacheManager` interface over prefixkv's `PrefixCache`.

size: one class, vLLM's `KVCacheManager` interface member for member (about 30 members, each a
short translation onto the core, plus the refusals that keep a vLLM upgrade loud); the hybrid
layouts' lanes live in `hybrid.py`.

vLLM's scheduler asks its block manager three things per request and step: what prefix is
cached (`get_computed_blocks`), room for the tokens it schedules (`allocate_slots`, which also
publishes the blocks those tokens fill) and, at the end, to let the blocks go (`free`, for a
finished request and for a preempted one alike). This class answers them from the Rust core, so
the refcounts, eviction, block keys and KV events are prefixkv's; vLLM sees the `KVCacheBlock`
objects of its own ids (`pool_view.BlockIds`) and the same free-block counts it would compute.

How vLLM's view maps onto prefixkv's request life (`docs/scheduling.md`):

- A request is registered (`add_request`) with its tokens at its first lookup, under vLLM's id,
  with its ``cache_salt`` as salt, its LoRA name as adapter and its multimodal features as
  per-block extras: the same inputs vLLM's block hashes take.
- *Publishing when vLLM does.* vLLM caches the blocks a step will fill at allocation, before the
  forward pass, so that a request scheduled later in the same step hits them. Here
  `allocate_slots` commits up to the same point (`min(computed + new, num_tokens)`): the core
  publishes exactly the full blocks of verified tokens below it.
- *Known tokens and lookahead.* prefixkv allocates room for tokens it knows plus lookahead
  slots. vLLM schedules draft tokens (spec decode) and, with async scheduling, positions whose
  token is not sampled yet; both are lookahead here, never tokens, so no draft can be published.
  vLLM's ``num_computed_tokens`` says how far KV is written after drafts were verified; the
  manager commits it before the next allocation, which is when vLLM caches those blocks too.
- A preempted request keeps its tokens in the core (`preempt`); its next lookup re-matches
  from the keys it kept.

Everything vLLM could ask that prefixkv does not do is refused by name
(`UnsupportedFeatureError`): a one-token sliding window, Mamba and
other non-attention specs, partial-block hits, EAGLE's dropped last block, copy-on-write, KV
connector loads and deferred frees.
Layouts of several KV cache groups (hybrid) are served by `hybrid.py`'s subclass, which
`scheduler.make_block_manager` builds for them (docs/vllm.md, "Hybrid and sliding-window
layouts").
`signatures.py` checks at import that every member and argument of the installed vLLM's
`KVCacheManager` exists here, so a vLLM upgrade fails loudly, not silently.

"""

from __future__ import annotations

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from prefixkv import _core
from prefixkv.cache import CORES, KeyExtras, PrefixCache, key_extras
from prefixkv.context import CacheContext
from prefixkv.errors import (
    BlockStateError,
    InvalidInputError,
    OutOfBlocksError,
    UnsupportedFeatureError,
)
from prefixkv.integrations.vllm.events import vllm_events
from prefixkv.integrations.vllm.pool_view import BlockIds, BlockPoolView, CoordinatorView

__all__ = ["PrefixKVCacheManager"]

#: KV cache specs served, by exact type: a subclass (sink tokens, RSWA, hidden-state caches)
#: changes what a block holds and is refused until it is tested. A `SlidingWindowSpec` whose
#: window covers the context is served as full attention (vLLM's `SlidingWindowManager` then
#: never frees, skips or masks a block); a shorter one with a sliding-window core cache that
#: releases where vLLM does (`window_release="explicit"`, docs/vllm.md).
SUPPORTED_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)

#: Blocks the core may queue between two `take_events` (one per engine step).
EVENT_CAPACITY = 1 << 16


def refuse_unsupported_settings(
    kv_cache_config: KVCacheConfig,
    block_size: int,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    enable_caching: bool,
    use_eagle: bool,
    num_prefill_lookahead: int,
    dcp_world_size: int,
    pcp_world_size: int,
    metrics_collector: KVCacheMetricsCollector | None,
    enable_mamba_shared_prefix_checkpoint: bool,
) -> None:
    """Refuse by name every manager setting prefixkv does not serve (any layout)."""
    refused = {
        "enable_caching=False (prefixkv's block manager is a prefix cache)": not enable_caching,
        "use_eagle (EAGLE's dropped last hit block)": use_eagle,
        "num_prefill_lookahead (multi-token-prediction re-prefill)": num_prefill_lookahead,
        "dcp_world_size > 1 (decode context parallelism)": dcp_world_size != 1,
        "pcp_world_size > 1 (prefill context parallelism)": pcp_world_size != 1,
        "metrics_collector (KV block residency metrics)": metrics_collector is not None,
        "enable_mamba_shared_prefix_checkpoint (Mamba)": enable_mamba_shared_prefix_checkpoint,
        "hash_block_size != block size (partial-block hits)": (
            hash_block_size != block_size or scheduler_block_size != block_size
        ),
        "needs_kv_cache_zeroing (new-block zeroing)": kv_cache_config.needs_kv_cache_zeroing,
    }
    for name, is_set in refused.items():
        if is_set:
            raise UnsupportedFeatureError(f"{name} is not supported by prefixkv's block manager")


#: The cores a vLLM block manager is built on: `PrefixCache`'s two, and ``"auto"`` (the
#: default): the run core where it serves the layout (one full-attention group, a window covering
#: the context included), else the block core.
VLLM_CORES = ("auto", *CORES)


def check_core(core: str, *settings: tuple[str, bool]) -> str:
    """The core to build on: `core`, with ``"auto"`` resolved to ``"runs"`` unless one of the
    settings asked for (`(name, asked)`) is one the run core does not serve yet, then to
    ``"blocks"``. Refuses, by name and before any cache is built, a core that is not one of
    `VLLM_CORES`, and ``"runs"`` asked for with such a setting."""
    if core not in VLLM_CORES:
        raise InvalidInputError(
            f"core must be one of {', '.join(map(repr, VLLM_CORES))}, not {core!r}"
        )
    unserved = [name for name, asked in settings if asked]
    if core == "auto":
        return "blocks" if unserved else "runs"
    if unserved and core == "runs":
        raise UnsupportedFeatureError(
            f'{", ".join(unserved)} with prefixkv\'s run core (core="runs") is not supported '
            'yet; use core="blocks" (or "auto", the default, which picks it)'
        )
    return core


def refuse_unsupported_window(spec: SlidingWindowSpec) -> None:
    """Refuses, by name, a sliding window vLLM treats in ways prefixkv does not: a one-token
    window (a hit then needs no block, `_contiguous_blocks_for_hit` is 0, and vLLM's
    `reachable_block_mask` caches none; prefixkv caches every full block) and retained tokens
    beyond the window (multi-module MTP)."""
    if spec.sliding_window < 2:
        raise UnsupportedFeatureError(
            "SlidingWindowSpec with sliding_window=1 (vLLM caches no block of it) is not "
            "supported by prefixkv's block manager"
        )
    if spec.extra_retained_tokens:
        raise UnsupportedFeatureError(
            f"SlidingWindowSpec with extra_retained_tokens={spec.extra_retained_tokens} "
            "(multi-module MTP) is not supported by prefixkv's block manager"
        )


class _Tracked:
    """What the manager remembers of one vLLM request between calls."""

    __slots__ = ("cached_blocks", "committed", "extras", "known", "table")

    def __init__(self, known: int, extras: KeyExtras) -> None:
        #: Tokens the core holds for the request (vLLM's verified tokens, never drafts).
        self.known = known
        self.extras = extras
        #: vLLM's view of the request's block table; None while it waits (holds no blocks).
        self.table: list[KVCacheBlock] | None = None
        #: Leading blocks of the request that are cached (from the last commit).
        self.cached_blocks = 0
        #: Tokens committed to the core (its num_computed_tokens; kept here to save a call).
        self.committed = 0


def _request_extras(request: Request) -> KeyExtras:
    # The inputs vLLM's own block hashes take besides tokens (kv_cache_utils'
    # generate_block_hash_extra_keys): the salt, the LoRA adapter's name and the multimodal
    # features' positions and identifiers.
    lora = request.lora_request
    adapter = None if lora is None else str(lora.lora_name)
    multimodal = [
        (int(f.mm_position.offset), int(f.mm_position.length), str(f.identifier))
        for f in (request.mm_features or ())
    ]
    return key_extras(request.cache_salt, adapter, multimodal or None)


class PrefixKVCacheManager:
    """A drop-in for vLLM's `KVCacheManager` (same constructor and members) backed by
    prefixkv's Rust block manager. `context` names the model the keys are made under
    (`context.vllm_cache_context`); the scheduler subclass passes it.

    A layout of several KV cache groups (full attention beside sliding windows: Gemma 2/3,
    gpt-oss) takes `HybridPrefixKVCacheManager` (`hybrid.py`), one lane per group;
    `make_block_manager` (`scheduler.py`) picks the class for a config."""

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
        if len(groups) != 1:
            # Several groups are `HybridPrefixKVCacheManager`'s (`make_block_manager` picks it).
            raise UnsupportedFeatureError(
                f"a KV cache config with {len(groups)} KV cache groups is not supported by "
                "PrefixKVCacheManager: build it with make_block_manager, which serves several "
                "groups with HybridPrefixKVCacheManager"
            )
        spec = groups[0].kv_cache_spec
        #: A sliding window shorter than the context: the core releases out-of-window blocks
        #: only when told, where vLLM's `remove_skipped_blocks` frees them (`_release_passed`).
        self._window: int | None = None
        #: vLLM's admission cap for such a window (`_fits_whole_sequence`).
        self._admission_cap = 0
        if type(spec) is SlidingWindowSpec and spec.sliding_window < max_model_len:
            refuse_unsupported_window(spec)
            self._window = spec.sliding_window
            in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
            self._admission_cap = spec.max_admission_blocks_per_request(in_flight, max_model_len)
        if type(spec) not in SUPPORTED_SPECS:
            raise UnsupportedFeatureError(
                f"KV cache spec {type(spec).__name__} is not supported by prefixkv's vLLM block "
                f"manager (supported: {', '.join(t.__name__ for t in SUPPORTED_SPECS)}, and "
                "SlidingWindowSpec whose window covers max_model_len)"
            )
        refuse_unsupported_settings(
            kv_cache_config,
            spec.block_size,
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

        self._set_vllm_members(
            kv_cache_config,
            (spec,),
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            use_eagle=use_eagle,
            log_stats=log_stats,
            metrics_collector=metrics_collector,
            watermark=watermark,
        )
        if context is None:
            context = CacheContext(block_size=self.block_size, extra={"engine": "vllm"})
        core = check_core(
            core, (f"a sliding window of {self._window} tokens", self._window is not None)
        )
        # vLLM's block 0 is its null block: prefixkv's pool is the other num_blocks - 1.
        self._cache = PrefixCache(
            kv_cache_config.num_blocks - 1,
            context=context,
            sliding_window=self._window,
            window_release="on_commit" if self._window is None else "explicit",
            core=core,
        )
        if enable_kv_cache_events:
            _core.enable_events(self._cache._core, EVENT_CAPACITY, "all")
        self._requests: dict[str, _Tracked] = {}
        self.block_pool = BlockPoolView(self._cache, self._ids, self)
        self.coordinator = CoordinatorView(self, (spec,), self.block_size, self.block_pool)

    def _set_vllm_members(
        self,
        kv_cache_config: KVCacheConfig,
        specs: tuple[KVCacheSpec, ...],
        *,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        use_eagle: bool,
        log_stats: bool,
        metrics_collector: KVCacheMetricsCollector | None,
        watermark: float,
    ) -> None:
        """The members vLLM's scheduler and `EngineCore` read off a `KVCacheManager`, alike for
        one KV cache group or several (`hybrid.py`); refuses a negative watermark."""
        if watermark < 0.0:
            raise UnsupportedFeatureError(f"watermark must be non-negative, got {watermark}")
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.mamba_shared_prefix_checkpoint = False
        self.num_kv_cache_groups = len(specs)
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.kv_cache_config = kv_cache_config
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.kv_cache_event_metadata: tuple[tuple[str, int | None], ...] = tuple(
            (get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s)) for s in specs
        )
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in specs))
        self.block_size = specs[0].block_size
        self._ids = BlockIds(kv_cache_config.num_blocks)

    # -- what the views and tests read ---------------------------------------------------
    @property
    def prefix_cache(self) -> PrefixCache:
        """The prefixkv cache behind this manager."""
        return self._cache

    def table(self, request_id: str) -> list[KVCacheBlock]:
        tracked = self._requests.get(request_id)
        return [] if tracked is None or tracked.table is None else tracked.table

    def blocks_to_allocate(self, request_id: str, num_tokens: int, admission_cap: bool) -> int:
        """Blocks a scheduled request would still take to hold `num_tokens` slots (what the
        scheduler asks of `coordinator.get_num_blocks_to_allocate`)."""
        held = len(self.table(request_id))
        return max(-(-num_tokens // self.block_size) - held, 0)

    # -- stats -----------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        # As vLLM: counted at admission, per request, preempted ones apart.
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    # -- the request's tokens in the core ------------------------------------------------
    def _track(self, request: Request) -> _Tracked:
        """The request's record, registering it or appending the tokens it sampled since."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        num_tokens = request.num_tokens
        if tracked is None:
            extras = _request_extras(request)
            self._cache.add_request(rid, list(request.all_token_ids), extras=extras)
            tracked = _Tracked(num_tokens, extras)
            self._requests[rid] = tracked
        elif num_tokens > tracked.known:
            self._cache.append_tokens(rid, list(request.all_token_ids[tracked.known :]))
            tracked.known = num_tokens
        elif num_tokens < tracked.known:
            raise BlockStateError(
                f"request {rid!r} has {num_tokens} tokens but {tracked.known} were appended: "
                "vLLM dropped verified tokens, which prefixkv's block manager does not expect"
            )
        return tracked

    # -- lookups ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix of a waiting request: its blocks, its length, and 0 (prefixkv has
        no sparse-retention group whose junction needs pinning). References nothing."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        tracked = self._track(request)
        # A full prompt hit still computes its last block (vLLM caps the hit at
        # num_tokens - 1, which for whole blocks is the same); `full_hit` mode
        # "recompute_last_block" gives exactly that.
        match = self._cache.lookup(list(request.all_token_ids), extras=tracked.extras)
        num_hit = match.num_cached_tokens
        if num_hit == 0:
            return self.empty_kv_cache_blocks, 0, 0
        ids = match.block_ids[: num_hit // self.block_size]
        return KVCacheBlocks((self._ids.to_vllm(ids),)), num_hit, 0

    def get_computed_blocks_for_connector(
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        # One group: the local hit never diverges between groups.
        return (*self.get_computed_blocks(request), False)

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
        """Room for `num_new_tokens` (+ `num_lookahead_tokens`) as vLLM's `allocate_slots`;
        None when the pool cannot supply it (nothing changed)."""
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
        tracked = self._track(request)
        waiting = tracked.table is None
        vllm_computed = request.num_computed_tokens
        num_tokens = request.num_tokens
        bs = self.block_size
        if waiting:
            if vllm_computed:
                raise UnsupportedFeatureError(
                    f"request {rid!r} arrives with {vllm_computed} computed tokens and no blocks "
                    "(a KV connector's load): not supported by prefixkv's block manager"
                )
            if num_new_computed_tokens % bs or (
                new_computed_blocks is not None
                and len(new_computed_blocks.blocks[0]) * bs != num_new_computed_tokens
            ):
                raise UnsupportedFeatureError(
                    f"a hit of {num_new_computed_tokens} tokens that is not whole blocks of "
                    f"{bs} (partial-block hits) is not supported by prefixkv's block manager"
                )
            # The hit the scheduler settled on, no longer: the match the core makes under
            # its lock then takes exactly these blocks.
            self._cache.limit_cached_prefix(rid, num_new_computed_tokens)
            start = num_new_computed_tokens
        else:
            if num_new_computed_tokens:
                raise UnsupportedFeatureError(
                    f"new computed blocks for running request {rid!r} (a late prefix hit) are "
                    "not supported by prefixkv's block manager"
                )
            # The core counts slots from what it has committed. Tokens vLLM computed since
            # (drafts verified last step) are committed below, only once the allocation
            # succeeded: vLLM caches them in the same call, and not at all when it fails (the
            # request may then be preempted with those blocks never published).
            start = tracked.committed
        total_computed = min(start if waiting else vllm_computed, self.max_model_len)
        # Tokens the core knows (verified) among those scheduled; the rest (drafts, and with
        # async scheduling tokens not sampled yet) and the lookahead are slots past them.
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
        if full_sequence_must_fit:
            if self._window is not None:
                if not self._fits_whole_sequence(request, start, new_computed_blocks, watermark):
                    return None
            else:
                full = min(num_tokens, self.max_model_len) - start
                if not self._cache.can_allocate_slots(rid, full, watermark_blocks=watermark):
                    return None
        if not waiting and self._window is not None:
            self._release_passed(request, tracked)
        try:
            slots = self._cache.allocate_slots(
                rid,
                num_known,
                num_lookahead_tokens=lookahead,
                watermark_blocks=watermark + reserved_blocks,
            )
        except OutOfBlocksError:
            return None
        if waiting and slots.num_computed_tokens != start:
            raise BlockStateError(
                f"request {rid!r}: prefixkv matched {slots.num_computed_tokens} cached tokens where "
                f"vLLM's lookup found {start} (the cache changed between lookup and allocation)"
            )
        new_ids = slots.block_ids
        if waiting:
            tracked.table = self._ids.to_vllm(new_ids)
            new_ids = new_ids[start // bs :]
        else:
            assert tracked.table is not None
            tracked.table.extend(self._ids.to_vllm(new_ids))
        # Publish what vLLM publishes now: the full blocks of verified tokens computed or
        # scheduled.
        if end_known > start or waiting:
            tracked.cached_blocks = self._cache.commit(rid, end_known)
            tracked.committed = max(tracked.committed, end_known)
        if not new_ids:
            return self.empty_kv_cache_blocks
        return KVCacheBlocks((self._ids.to_vllm(new_ids),))

    def _fits_whole_sequence(
        self,
        request: Request,
        num_hit: int,
        new_computed_blocks: KVCacheBlocks | None,
        watermark: int,
    ) -> bool:
        """vLLM's `full_sequence_must_fit` gate for a waiting request in a sliding-window group
        (`SlidingWindowManager.get_num_blocks_to_allocate` with the admission cap): the blocks
        of the whole sequence, capped at `max_admission_blocks_per_request`, less the hit's
        positions (or the positions the window skips, if more), plus the hit blocks no request
        references (touching them takes them from the free count)."""
        assert self._window is not None
        bs = self.block_size
        full = min(request.num_tokens, self.max_model_len)
        required = min(-(-full // bs), self._admission_cap)
        hit = [] if new_computed_blocks is None else list(new_computed_blocks.blocks[0])
        skipped = max(0, num_hit - self._window + 1) // bs
        needed = max(required - max(skipped, len(hit)), 0)
        evictable = sum(
            1 for block in hit[skipped:] if not block.is_null and self._ref_count(block) == 0
        )
        return needed + evictable + watermark <= self.block_pool.get_num_free_blocks()

    def _ref_count(self, block: KVCacheBlock) -> int:
        return self._cache.ref_count(block.block_id - 1)

    def _release_passed(self, request: Request, tracked: _Tracked) -> None:
        """vLLM's `remove_skipped_blocks` before an allocation for a running request: release
        the blocks wholly before the processed count's window (the in-flight steps' tokens
        not counted), even if the allocation then fails. The count includes drafts verified
        last step, which the manager commits only after a successful allocation (as vLLM
        caches them): blocks released before then are never published, as vLLM never caches
        them (the core skips them and publishes the positions after)."""
        processed = max(0, request.num_computed_tokens - request.num_in_flight_tokens)
        processed = min(processed, tracked.known, self.max_model_len)
        if self._cache.release_out_of_window(request.request_id, processed):
            tracked.table = self._ids.to_vllm(self._cache.block_table(request.request_id))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the full blocks of the request's verified tokens below `num_computed_tokens`
        (async scheduling calls this once the step's tokens are sampled)."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.table is None:
            return
        self._track(request)
        upto = min(num_computed_tokens, request.num_tokens)
        tracked.cached_blocks = self._cache.commit(request.request_id, upto)
        tracked.committed = max(tracked.committed, upto)

    # -- release ---------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        """A finished request is forgotten; a preempted one (the scheduler frees it while it is
        still running) keeps its tokens and waits. Either way its cached blocks stay cached,
        evictable, and its private blocks go back."""
        rid = request.request_id
        tracked = self._requests.get(rid)
        if tracked is None:
            return
        if request.is_finished():
            self._cache.finish(rid)
            del self._requests[rid]
        elif tracked.table is not None:
            self._cache.preempt(rid)
            tracked.table = None
            tracked.cached_blocks = 0
            tracked.committed = 0

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        raise UnsupportedFeatureError(
            "pop_blocks_for_free (deferred frees, used with asynchronous KV connectors) is not "
            "supported by prefixkv's block manager"
        )

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # vLLM calls this only on a KV connector's path (refused): the manager releases a short
        # window's blocks itself at each allocation (`_release_passed`).
        return None

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM does only when no request holds any."""
        if self._cache.stats().blocks_in_use:
            return False
        self._cache.clear()
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- block tables ----------------------------------------------------------------------
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        drain = _core.drain_events(self._cache._core)
        kind, window = self.kv_cache_event_metadata[0]
        return vllm_events(
            drain.events, block_size=self.block_size, kind=kind, sliding_window=window
        )

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        table = self.table(request_id)
        return KVCacheBlocks((list(table),)) if table else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([block.block_id for block in self.table(request_id)],)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        (ids,) = self.get_block_ids(request_id)
        return (ids[: -(-num_computed_tokens // self.block_size)],)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request in cached blocks (vLLM: the deepest hashed block's end)."""
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.table is None or not tracked.cached_blocks:
            return 0
        if tracked.table[tracked.cached_blocks - 1].is_null:
            # A sliding window released the deepest cached block: vLLM counts only the blocks
            # the request still holds, and the cached ones are a leading run (all released).
            return 0
        return tracked.cached_blocks * self.block_size

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        if num_computed_tokens % self.block_size:
            raise UnsupportedFeatureError(
                f"truncating a hit to {num_computed_tokens} tokens, not whole blocks of "
                f"{self.block_size} (partial-block hits), is not supported"
            )
        (group,) = blocks.blocks
        return self.create_kv_cache_blocks((list(group[: num_computed_tokens // self.block_size]),))

    # -- members for features prefixkv does not have: empty answers or refusals ---------------
    def take_new_block_ids(self) -> list[int]:
        # Only Mamba / kv-cache zeroing layouts record new blocks; those are refused above.
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        raise UnsupportedFeatureError(
            "record_blocks_for_zeroing (a failed KV connector load) is not supported by "
            "prefixkv's block manager"
        )

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        # prefixkv never copies on write: hits are whole blocks, shared read-only.
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        return None


# A vLLM whose KVCacheManager grew a member or an argument fails here, at import, by name.
def _check_against_installed_vllm() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from prefixkv.integrations.vllm.signatures import check_interface

    check_interface(KVCacheManager, PrefixKVCacheManager)


_check_against_installed_vllm()
