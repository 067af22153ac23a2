"""prefixkv: exact, safe, fast prefix caching for LLM inference engines.

- `PrefixCache` (cache.py): which KV blocks a request may reuse, refcounts, eviction.
- `CacheContext` (context.py): every setting that must match for reuse to be safe.
- `PagedKVCache` (kv.py), `paged_prefill_attention` (attention.py): KV pages and prefill over them.
- `GroupedPrefixCache` (group_cache.py), `GroupedKVCache` (grouped_kv.py): a hybrid model's KV
  groups (kv_groups.py), one block manager and one set of pages per attention kind.
- `LlamaModel`, `ModelConfig` (model.py): the reference decoder; `Engine` (engine.py) serves it.

The block manager needs only numpy (`pip install prefixkv`). The torch-based names are
imported on first use, so `import prefixkv` stays cheap for an engine that only needs the
block manager and works where torch is not installed; using one of them then raises
`MissingDependencyError` naming the extra to install (`pip install 'prefixkv[torch]'`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefixkv import _compat
from prefixkv._core import __version__
from prefixkv.cache import (
    CacheStats,
    KeyExtras,
    Pin,
    PrefixCache,
    PrefixMatch,
    Request,
    Slots,
    as_token_ids,
    key_extras,
)
from prefixkv.context import AttentionMask, CacheContext, PositionEncoding
from prefixkv.errors import (
    BackendUnavailableError,
    BlockStateError,
    DuplicateRequestError,
    InvalidBlockError,
    InvalidInputError,
    KVAllocationError,
    MissingDependencyError,
    OutOfBlocksError,
    PagedKVError,
    PrefixKVError,
    UnknownRequestError,
    missing_dependency,
)
from prefixkv.group_cache import GroupedCacheStats, GroupedPrefixCache
from prefixkv.kv_groups import KVGroupSpec, kv_group_specs

_compat.install()  # the flat package's old module paths, as deprecated aliases

if TYPE_CHECKING:
    from prefixkv.engine.facade import Engine, EngineRequest, RequestResult
    from prefixkv.kv.grouped import GroupedKVCache
    from prefixkv.kv.pages import PagedKVCache
    from prefixkv.kv.prefill import paged_prefill_attention
    from prefixkv.models.decoder import (
        DecodeRequest,
        LlamaModel,
        ModelConfig,
        PrefillRequest,
        RopeScaling,
    )

_LAZY = {
    "PagedKVCache": "prefixkv.kv.pages",
    "paged_prefill_attention": "prefixkv.kv.prefill",
    "LlamaModel": "prefixkv.models.decoder",
    "ModelConfig": "prefixkv.models.decoder",
    "RopeScaling": "prefixkv.models.decoder",
    "PrefillRequest": "prefixkv.models.decoder",
    "DecodeRequest": "prefixkv.models.decoder",
    "GroupedKVCache": "prefixkv.kv.grouped",
    "Engine": "prefixkv.engine.facade",
    "EngineRequest": "prefixkv.engine.facade",
    "RequestResult": "prefixkv.engine.facade",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixkv' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        missing = missing_dependency(exc, f"prefixkv.{name}")
        if missing is None:  # not a missing optional dependency: a real error, shown as it is
            raise
        raise missing from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AttentionMask",
    "BackendUnavailableError",
    "BlockStateError",
    "CacheContext",
    "CacheStats",
    "DecodeRequest",
    "DuplicateRequestError",
    "Engine",
    "EngineRequest",
    "GroupedCacheStats",
    "GroupedKVCache",
    "GroupedPrefixCache",
    "InvalidBlockError",
    "InvalidInputError",
    "KVAllocationError",
    "KVGroupSpec",
    "KeyExtras",
    "LlamaModel",
    "MissingDependencyError",
    "ModelConfig",
    "OutOfBlocksError",
    "PagedKVCache",
    "PagedKVError",
    "Pin",
    "PositionEncoding",
    "PrefillRequest",
    "PrefixCache",
    "PrefixKVError",
    "PrefixMatch",
    "Request",
    "RequestResult",
    "RopeScaling",
    "Slots",
    "UnknownRequestError",
    "__version__",
    "as_token_ids",
    "key_extras",
    "kv_group_specs",
    "paged_prefill_attention",
]
