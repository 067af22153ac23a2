"""prefixkv: exact, safe, fast prefix caching for LLM inference engines.

- `PrefixCache` (cache.py): which KV blocks a request may reuse, refcounts, eviction.
- `CacheContext` (context.py): every setting that must match for reuse to be safe.
"""

from prefixkv._core import __version__
from prefixkv._errors import (
    BlockStateError,
    InvalidBlockError,
    InvalidInputError,
    OutOfBlocksError,
    PrefixKVError,
    UnknownRequestError,
)
from prefixkv.cache import CacheStats, Pin, PrefixCache, PrefixMatch, Request, as_token_ids
from prefixkv.context import AttentionMask, CacheContext, PositionEncoding

__all__ = [
    "AttentionMask",
    "BlockStateError",
    "CacheContext",
    "CacheStats",
    "InvalidBlockError",
    "InvalidInputError",
    "OutOfBlocksError",
    "Pin",
    "PositionEncoding",
    "PrefixCache",
    "PrefixKVError",
    "PrefixMatch",
    "Request",
    "UnknownRequestError",
    "__version__",
    "as_token_ids",
]
