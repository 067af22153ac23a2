"""The value format of one block in a remote store, and its verification.

A value is a header and the KV bytes of one block (K and V of every layer, laid out as the
engine's pages hold them: ``[2, num_layers, block_size, num_kv_heads, head_dim]``). One block
per value keeps a batched probe one pipelined round trip over consecutive keys, and lets the probe stop at
the first miss without fetching more than it serves.

Layout (little-endian)::

    magic b"PKVB" | version u16 | dtype code u8 | ndim u8 | shape u32 * ndim
    | block key 32 B | parent key 32 B (zeros for a first block) | context fingerprint 32 B
    | num_tokens u32 | tokens u32 * num_tokens | payload length u64
    | checksum 16 B (BLAKE2b-128 of everything before it and of the payload) | payload

`decode_block` checks every field against what the reader expects (the key it asked for, the
parent it holds, the request's tokens, its context, its dtype and shape), the exact length and
the checksum. Any difference raises `BlockFormatError`, which the tier counts as a miss. The
checksum catches corruption and truncation, not a store that forges values on purpose: the
store is trusted as much as the device memory is.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from prefixkv.errors import PrefixKVError

__all__ = ["FORMAT_VERSION", "BlockFormatError", "decode_block", "encode_block", "value_length"]

FORMAT_VERSION = 1
_MAGIC = b"PKVB"
_KEY_BYTES = 32
_CHECKSUM_BYTES = 16
_ROOT_PARENT = bytes(_KEY_BYTES)

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}


class BlockFormatError(PrefixKVError, ValueError):
    """A stored block value that is not the block asked for (or not a block at all)."""


def value_length(num_tokens: int, dtype: torch.dtype, shape: Sequence[int]) -> int:
    """The exact length of the value of a block of `num_tokens` tokens whose KV has `dtype` and
    `shape`: a reader never needs more bytes than this, so it never reads more (a store's value
    is untrusted; a longer one is refused like any other wrong length)."""
    # magic, version, dtype, ndim | shape | three keys | token count, tokens | payload length
    header = 8 + 4 * len(shape) + 3 * _KEY_BYTES + 4 + 4 * num_tokens + 8
    return header + _CHECKSUM_BYTES + _payload_length(dtype, shape)


def _payload_length(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of the KV of one block of `dtype` and `shape`."""
    length = torch.empty((), dtype=dtype).element_size()
    for size in shape:
        length *= size
    return length


def _checksum(header: bytes, payload: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(header, digest_size=_CHECKSUM_BYTES)
    digest.update(payload)
    return digest.digest()


def _header(
    key: bytes,
    parent: bytes | None,
    tokens: Sequence[int],
    context: bytes,
    dtype: torch.dtype,
    shape: Sequence[int],
    payload_len: int,
) -> bytes:
    if dtype not in _DTYPE_CODES:
        raise BlockFormatError(f"no format code for dtype {dtype}")
    for name, value in (("block key", key), ("context fingerprint", context)):
        if len(value) != _KEY_BYTES:
            raise BlockFormatError(f"the {name} must be {_KEY_BYTES} bytes, got {len(value)}")
    parent = _ROOT_PARENT if parent is None else parent
    if len(parent) != _KEY_BYTES:
        raise BlockFormatError(f"the parent key must be {_KEY_BYTES} bytes, got {len(parent)}")
    return b"".join(
        (
            struct.pack("<4sHBB", _MAGIC, FORMAT_VERSION, _DTYPE_CODES[dtype], len(shape)),
            struct.pack(f"<{len(shape)}I", *shape),
            key,
            parent,
            context,
            struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens),
            struct.pack("<Q", payload_len),
        )
    )


def encode_block(
    key: bytes,
    parent: bytes | None,
    tokens: Sequence[int],
    context: bytes,
    kv: torch.Tensor,
) -> bytes:
    """The value of one block whose KV is `kv` (any device; copied to the host)."""
    data = kv.detach().to("cpu").contiguous()
    payload = data.view(torch.uint8).numpy().tobytes()
    header = _header(key, parent, tokens, context, data.dtype, data.shape, len(payload))
    return header + _checksum(header, payload) + payload


def decode_block(
    value: bytes,
    *,
    key: bytes,
    parent: bytes | None,
    tokens: Sequence[int],
    context: bytes,
    dtype: torch.dtype,
    shape: Sequence[int],
) -> torch.Tensor:
    """The KV of the block `key`, read from `value` after checking every header field against
    what the caller expects; raises `BlockFormatError` on any difference."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise BlockFormatError(f"a block value is bytes, got {type(value).__name__}")
    payload_len = _payload_length(dtype, shape)
    expected = _header(key, parent, tokens, context, dtype, shape, payload_len)
    if len(value) != len(expected) + _CHECKSUM_BYTES + payload_len:
        if value[:4] != _MAGIC:
            raise BlockFormatError("not a prefixkv block value")
        raise BlockFormatError(f"a block value of {len(value)} bytes (truncated or extended)")
    view = memoryview(value)
    if view[: len(expected)] != expected:
        version = struct.unpack_from("<H", value, 4)[0] if len(value) >= 6 else None
        if value[:4] == _MAGIC and version != FORMAT_VERSION:
            raise BlockFormatError(
                f"block format version {version}, this reader has {FORMAT_VERSION}"
            )
        raise BlockFormatError("the header names another block, context, dtype or shape")
    start = len(expected) + _CHECKSUM_BYTES
    payload = view[start:]
    if _checksum(expected, payload) != view[len(expected) : start]:
        raise BlockFormatError("checksum mismatch: the KV bytes are corrupted")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(*shape)
