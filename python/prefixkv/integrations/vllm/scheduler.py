"""vLLM's own schedulers with prefixkv's block manager installed.

``scheduler_cls="prefixkv.integrations.vllm.Scheduler"`` (offline ``LLM(...)``) or
``vllm serve --scheduler-cls prefixkv.integrations.vllm.Scheduler``: vLLM builds its scheduler
as usual, then the block manager it made is replaced by prefixkv's over the same
`KVCacheConfig` and settings (`make_block_manager`: a `PrefixKVCacheManager` for one KV cache
group, a `HybridPrefixKVCacheManager` for several), before any request arrives. Scheduling policy, chunked prefill,
preemption and output processing stay vLLM's code.

Async scheduling (vLLM's default where the platform supports it) needs vLLM's `AsyncScheduler`;
a custom ``scheduler_cls`` that is not one runs synchronously and vLLM warns of it. So
`Scheduler` builds an `AsyncScheduler` (also exported) whenever the config asks for async
scheduling: one setting serves both.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from prefixkv.errors import (
    InvalidInputError,
    UnsupportedEngineVersionError,
    UnsupportedFeatureError,
)
from prefixkv.integrations.vllm.block_manager import VLLM_CORES, PrefixKVCacheManager
from prefixkv.integrations.vllm.context import vllm_cache_context
from prefixkv.integrations.vllm.hybrid import HybridPrefixKVCacheManager
from prefixkv.integrations.vllm.signatures import missing_attributes

__all__ = [
    "AsyncScheduler",
    "Scheduler",
    "install_block_manager",
    "make_block_manager",
    "prefixkv_settings",
]


def make_block_manager(kv_cache_config: Any, *args: Any, **kwargs: Any) -> PrefixKVCacheManager:
    """prefixkv's block manager for `kv_cache_config`, with `KVCacheManager`'s constructor
    arguments: `HybridPrefixKVCacheManager` (one lane per group in one cache) when the config
    has several KV cache groups (full attention beside sliding windows), else
    `PrefixKVCacheManager`."""
    several = len(kv_cache_config.kv_cache_groups) > 1
    cls = HybridPrefixKVCacheManager if several else PrefixKVCacheManager
    return cls(kv_cache_config, *args, **kwargs)


#: prefixkv's settings in vLLM's ``additional_config`` (``--additional-config
#: '{"prefixkv": {"core": "blocks"}}'``), with their defaults.
SETTINGS = {"core": "auto"}


def prefixkv_settings(vllm_config: Any) -> dict[str, str]:
    """prefixkv's settings from ``vllm_config.additional_config["prefixkv"]``: ``core``, the
    cache's core: "auto" (the default: the run core for one full-attention group, the block
    core for a sliding window or several groups), "runs" (the cache on runs of blocks, refused
    where it does not serve the layout) or "blocks". An unknown setting, or one of another
    type, is refused by name."""
    extra = getattr(vllm_config, "additional_config", None)
    ours = extra.get("prefixkv", {}) if isinstance(extra, dict) else {}
    if not isinstance(ours, dict):
        raise InvalidInputError(
            f'additional_config["prefixkv"] must be a dict, not {type(ours).__name__}'
        )
    unknown = sorted(set(ours) - set(SETTINGS))
    if unknown:
        raise InvalidInputError(
            f'unknown prefixkv setting(s) in additional_config["prefixkv"]: {", ".join(unknown)} '
            f"(known: {', '.join(SETTINGS)})"
        )
    settings = {**SETTINGS, **ours}
    if settings["core"] not in VLLM_CORES:
        raise InvalidInputError(
            'additional_config["prefixkv"]["core"] must be one of '
            f"{', '.join(map(repr, VLLM_CORES))}, "
            f"not {settings['core']!r}"
        )
    return settings


def install_block_manager(scheduler: _VllmScheduler) -> PrefixKVCacheManager:
    """Replace `scheduler`'s freshly built `KVCacheManager` with prefixkv's, built from the
    same settings. Call it before the scheduler has seen a request."""
    stock = scheduler.kv_cache_manager
    if scheduler.requests:
        raise UnsupportedFeatureError(
            "install_block_manager on a scheduler that already holds requests"
        )
    if scheduler.connector is not None:
        raise UnsupportedFeatureError(
            "a KV connector (kv_transfer_config) with prefixkv's scheduler: the connector "
            "drives vLLM's block pool directly; use the stock scheduler with it"
        )
    context = vllm_cache_context(scheduler.vllm_config, scheduler.block_size)
    settings = prefixkv_settings(scheduler.vllm_config)
    manager = make_block_manager(
        kv_cache_config=scheduler.kv_cache_config,
        max_model_len=scheduler.max_model_len,
        scheduler_block_size=scheduler.block_size,
        hash_block_size=scheduler.hash_block_size,
        max_in_flight_tokens=scheduler.vllm_config.max_in_flight_tokens,
        enable_caching=stock.enable_caching,
        use_eagle=stock.use_eagle,
        num_prefill_lookahead=scheduler.num_prefill_lookahead,
        log_stats=scheduler.log_stats,
        enable_kv_cache_events=stock.enable_kv_cache_events,
        dcp_world_size=scheduler.dcp_world_size,
        pcp_world_size=1,
        metrics_collector=stock.metrics_collector,
        watermark=scheduler.scheduler_config.watermark,
        enable_mamba_shared_prefix_checkpoint=(
            scheduler.cache_config.enable_mamba_shared_prefix_checkpoint
        ),
        context=context,
        core=settings["core"],
    )
    missing = missing_attributes(KVCacheManager, manager)
    if missing:
        raise UnsupportedEngineVersionError(
            "vLLM's KVCacheManager sets attributes prefixkv's block manager lacks: "
            + ", ".join(missing)
        )
    if manager.watermark_blocks != stock.watermark_blocks:
        raise UnsupportedEngineVersionError(
            f"watermark blocks differ from vLLM's ({manager.watermark_blocks} vs "
            f"{stock.watermark_blocks})"
        )
    scheduler.kv_cache_manager = manager  # type: ignore[assignment]
    return manager


class Scheduler(_VllmScheduler):
    """vLLM's `Scheduler` over prefixkv's block manager; an `AsyncScheduler` when the config
    asks for async scheduling."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Scheduler:
            vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
            if vllm_config.scheduler_config.async_scheduling:
                return super().__new__(AsyncScheduler)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_block_manager(self)


class AsyncScheduler(_VllmAsyncScheduler, Scheduler):
    """vLLM's `AsyncScheduler` over prefixkv's block manager."""
