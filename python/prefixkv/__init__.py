"""prefixkv: exact, safe, fast prefix caching for LLM inference engines.

- `PrefixCache` (cache.py): which KV blocks a request may reuse, refcounts, eviction.
- `CacheContext` (context.py): every setting that must match for reuse to be safe.
- `PagedKVCache` (kv.py), `paged_prefill_attention` (attention.py): KV pages and prefill over them.
- `LlamaModel`, `ModelConfig` (model.py): the reference decoder; `Engine` (engine.py) serves it.

The torch-based names are imported on first use, so `import prefixkv` stays cheap for an
engine that only needs the block manager.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefixkv._core import __version__
from prefixkv.cache import CacheStats, Pin, PrefixCache, PrefixMatch, Request, as_token_ids
from prefixkv.context import AttentionMask, CacheContext, PositionEncoding
from prefixkv.errors import (
    BlockStateError,
    InvalidBlockError,
    InvalidInputError,
    OutOfBlocksError,
    PrefixKVError,
    UnknownRequestError,
)

if TYPE_CHECKING:
    from prefixkv.attention import BackendUnavailableError, paged_prefill_attention
    from prefixkv.engine import Engine, RequestResult
    from prefixkv.kv import PagedKVCache, PagedKVError
    from prefixkv.model import DecodeRequest, LlamaModel, ModelConfig, PrefillRequest, RopeScaling

_LAZY = {
    "PagedKVCache": "prefixkv.kv",
    "PagedKVError": "prefixkv.kv",
    "paged_prefill_attention": "prefixkv.attention",
    "BackendUnavailableError": "prefixkv.attention",
    "LlamaModel": "prefixkv.model",
    "ModelConfig": "prefixkv.model",
    "RopeScaling": "prefixkv.model",
    "PrefillRequest": "prefixkv.model",
    "DecodeRequest": "prefixkv.model",
    "Engine": "prefixkv.engine",
    "RequestResult": "prefixkv.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AttentionMask",
    "BackendUnavailableError",
    "BlockStateError",
    "CacheContext",
    "CacheStats",
    "DecodeRequest",
    "Engine",
    "InvalidBlockError",
    "InvalidInputError",
    "LlamaModel",
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
    "UnknownRequestError",
    "__version__",
    "as_token_ids",
    "paged_prefill_attention",
]
