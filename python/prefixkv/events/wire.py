"""The wire format: vLLM's KV event batch, field for field (`docs/events.md`).

A payload is one msgpack value, encoded with msgspec exactly as vLLM's
`vllm/distributed/kv_events.py` encodes it:

- `KVEventBatch` is a positional array `[ts, events, data_parallel_rank]` (`array_like`; the
  rank is nil when unset: msgspec's `omit_defaults` leaves fields out of maps, not arrays);
- each event is a msgpack map tagged by class name under ``"type"`` (`tag=True`), with every
  field in declaration order and the fields that have a default left out while at it.

The field lists below follow vLLM's declarations (the newer optional fields included, so that a
batch decodes even when an engine sets them). Block hashes are ints (the 64-bit form,
`hash64`) or 32-byte keys, vLLM's `ExternalBlockHash = bytes | int`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

#: vLLM's medium for blocks in accelerator memory; prefixkv's engine on CPU reports "CPU".
MEDIUM_GPU = "GPU"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events at one instant."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the three events: a map tagged by class name."""


class BlockStored(KVCacheEvent):
    """Blocks now cached, in chain order: `block_hashes[0]` follows `parent_block_hash`."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer cached."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance is gone."""


class KVEventBatch(EventBatch):
    """The batch type on the wire."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch."""
    return _encoder.encode(batch)


def batch_payload(ts: float, events_msgpack: bytes, data_parallel_rank: int | None = None) -> bytes:
    """The payload of a batch whose events are already msgpack (`_core.encode_events`): the
    same bytes `encode_batch` writes for those events, without building the structs."""
    return (
        b"\x93\xcb" + struct.pack(">d", ts) + events_msgpack + _encoder.encode(data_parallel_rank)
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into a batch (prefixkv's or vLLM's); `InvalidInputError` if malformed."""
    from prefixkv.errors import InvalidInputError

    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise InvalidInputError(f"not a KV event batch: {exc}") from exc
    except RecursionError:
        # msgspec recurses per nesting level of an `Any` field (`extra_keys`).
        raise InvalidInputError("not a KV event batch: nested too deeply") from None


def hash64(block_hash: ExternalBlockHash) -> int:
    """The 64-bit form routers index: an int as it is, bytes as vLLM converts its own
    (`int.from_bytes(h, "big") & (2**64 - 1)`, the last 8 bytes big-endian)."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(block_hash[-8:], "big")
