"""Lower tiers of the KV cache: host memory and a shared remote store (docs/tiers.md).

Importing this package does not import redis; `RedisStore` does, and raises
`MissingDependencyError` without it.
"""

from __future__ import annotations

from prefixkv.tiers.format import FORMAT_VERSION, BlockFormatError, decode_block, encode_block
from prefixkv.tiers.host import BlockRecord, HostTier
from prefixkv.tiers.manager import WRITE_POLICIES, KVTiers, TierStats
from prefixkv.tiers.remote import RedisStore, RemoteStats, RemoteStore, RemoteTier, StoreError

__all__ = [
    "FORMAT_VERSION",
    "WRITE_POLICIES",
    "BlockFormatError",
    "BlockRecord",
    "HostTier",
    "KVTiers",
    "RedisStore",
    "RemoteStats",
    "RemoteStore",
    "RemoteTier",
    "StoreError",
    "TierStats",
    "decode_block",
    "encode_block",
]
