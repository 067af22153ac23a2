"""The engine-facing prefix cache: `PrefixCache`.

A thin typed layer over the Rust block manager (`prefixkv._core`): it turns the token ids an
engine holds (lists, numpy arrays, CPU tensors) into what the core reads, and the core's
answers into small typed objects. All state lives in the core, behind its own lock, so one
`PrefixCache` may be shared by threads: lookups never block, even while another thread begins,
commits and finishes requests.

A request's life::

    request = cache.begin(prompt_ids)           # cached prefix referenced, rest allocated
    # compute positions request.num_cached_tokens .. len(prompt)-1 into request.block_table
    cache.commit(request, len(prompt_ids))      # publish the blocks that are now full
    new_blocks = cache.append(request, [next_token])   # decode: room for generated tokens
    cache.commit(request, num_tokens_with_kv)
    cache.finish(request)                       # blocks stay cached, evictable (LRU)
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixkv import _core
from prefixkv._core import CacheStats
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError

__all__ = ["CacheStats", "Pin", "PrefixCache", "PrefixMatch", "Request", "as_token_ids"]

#: What callers may pass as token ids.
TokenIds = Any  # Sequence[int] | np.ndarray | torch.Tensor (kept Any: torch is optional here)
#: A multimodal item: (first placeholder position, number of placeholders, content hash).
MultimodalItem = tuple[int, int, "bytes | str"]

# array("I") is 32 bits wide on every platform CPython supports today; checked, not assumed.
_PACK_LISTS = array.array("I").itemsize == 4


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a prompt."""

    #: Tokens whose KV is reused; the engine computes from this position on.
    num_cached_tokens: int
    #: Every block is cached: compute only the final token (for its logits), write nothing.
    full_hit: bool
    #: The matched block ids as packed little-endian u32 (see `block_ids`).
    packed_block_ids: bytes

    @property
    def block_ids(self) -> list[int]:
        """Cached blocks in prompt order. Unpacked on access: a probe that only wants the hit
        length never builds a list of Python ints (and holds the GIL less)."""
        return _unpack_u32(self.packed_block_ids)


@dataclass(frozen=True, slots=True)
class Request:
    """A live request, as `begin` returned it."""

    id: int
    #: Blocks covering every prompt token: the shared cached ones first, then private ones.
    block_table: list[int]
    num_cached_tokens: int
    full_hit: bool
    num_prompt_tokens: int

    @property
    def num_tokens_to_compute(self) -> int:
        """Prompt positions the engine must compute (at least one)."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(frozen=True, slots=True)
class Pin:
    """A pinned prefix; pass to `PrefixCache.unpin`."""

    id: int
    num_blocks: int


def as_token_ids(
    tokens: TokenIds,
) -> list[int] | tuple[int, ...] | bytes | tuple[bytes, int, bool]:
    """Token ids in a form the core reads (treat it as opaque).

    A list of ints is packed to little-endian u32 in C; numpy arrays of any integer dtype and
    CPU torch tensors are handed over as one buffer of their raw bytes, which the core checks
    and narrows with the GIL released. Nothing is converted element by element in Python.
    """
    if isinstance(tokens, (list, tuple)):
        return _list_tokens(tokens)
    if isinstance(tokens, np.ndarray):
        return _array_tokens(tokens)
    if type(tokens).__module__.startswith("torch"):
        if tokens.device.type != "cpu":
            raise InvalidInputError(
                f"token ids must be on the CPU, got a tensor on {tokens.device}; call .cpu() first"
            )
        return _array_tokens(tokens.detach().numpy())
    if isinstance(tokens, range):
        return list(tokens)
    raise InvalidInputError(
        f"token ids must be a list, tuple, numpy array or CPU tensor of ints, not {type(tokens).__name__}"
    )


def _list_tokens(tokens: list[int] | tuple[int, ...]) -> list[int] | tuple[int, ...] | bytes:
    # array('I') converts a list of ints in C, about three times faster than extracting each
    # int through the binding. Anything it refuses (a negative id, one above 2**32 - 1, a
    # non-int) goes to the core as is, whose error names the value and its position.
    if not _PACK_LISTS:
        return tokens
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError):
        return tokens
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _array_tokens(values: np.ndarray) -> tuple[bytes, int, bool]:
    # Only metadata is checked here; the core checks every value (negative, above 2**32 - 1)
    # and narrows to u32 with the GIL released. The one copy made with the GIL held is the
    # `tobytes` below: the stable ABI for CPython 3.10 has no buffer protocol to read in place.
    if values.ndim != 1:
        raise InvalidInputError(f"token ids must be one-dimensional, got shape {values.shape}")
    if values.dtype.kind not in "iu":
        raise InvalidInputError(f"token ids must have an integer dtype, got {values.dtype}")
    if values.dtype.byteorder == ">" or (values.dtype.byteorder == "=" and sys.byteorder == "big"):
        values = values.astype(values.dtype.newbyteorder("<"))
    return values.tobytes(), values.dtype.itemsize, values.dtype.kind == "i"


def _unpack_u32(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<u4").tolist()


def _request_id(request: Request | int) -> int:
    return request.id if isinstance(request, Request) else int(request)


class PrefixCache:
    """Prefix-cache block manager: which KV blocks a request may reuse, and for how long.

    Args:
        num_blocks: blocks in the pool (the engine's KV pages).
        context: the execution context; defaults to `CacheContext()`. Changing it later with
            `set_context` (or calling `clear`) makes every cached block unreachable.
        block_size: tokens per block; defaults to `context.block_size` and must equal it.
        vocab_size: when given, token ids at or above it are refused.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        context: CacheContext | None = None,
        block_size: int | None = None,
        vocab_size: int | None = None,
        _key_bits: int = 128,
    ) -> None:
        if context is None:
            context = CacheContext(block_size=block_size or 16)
        if block_size is not None and block_size != context.block_size:
            raise InvalidInputError(
                f"block_size {block_size} differs from context.block_size {context.block_size}"
            )
        _check_reuse_safe(context)
        self._context = context
        self._core = _core.CoreCache(
            num_blocks, context.block_size, context.fingerprint(), vocab_size, _key_bits
        )

    # -- properties ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def context(self) -> CacheContext:
        return self._context

    # -- lookups -------------------------------------------------------------------------
    def lookup(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> PrefixMatch:
        """The cached prefix of `tokens`, without taking references (lock-free probe)."""
        blocks, cached, full = self._core.lookup(as_token_ids(tokens), salt, adapter, multimodal)
        return PrefixMatch(cached, full, blocks)

    def block_keys(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> list[bytes]:
        """The 32-byte key of every full block of `tokens` (stable across processes)."""
        return self._core.block_keys(as_token_ids(tokens), salt, adapter, multimodal)

    # -- a request's life ----------------------------------------------------------------
    def begin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
    ) -> Request:
        """Match the cached prefix, reference it and allocate blocks for the rest.

        `salt` isolates tenants; `adapter` and `multimodal` become per-block extra keys;
        `priority` is the retention priority of the request's blocks (lower goes first).
        Raises `OutOfBlocksError` (nothing changed) when the pool cannot hold the prompt.
        """
        rid, table, cached, full, n = self._core.begin(
            as_token_ids(tokens), salt, adapter, multimodal, priority
        )
        return Request(rid, table, cached, full, n)

    def append(self, request: Request | int, tokens: TokenIds) -> list[int]:
        """Add generated tokens; returns the blocks newly allocated for them."""
        return self._core.append(_request_id(request), as_token_ids(tokens))

    def commit(self, request: Request | int, num_computed_tokens: int) -> int:
        """KV of the first `num_computed_tokens` tokens is written: publish the full blocks.

        Returns how many leading blocks of the request are now cached.
        """
        return self._core.commit(_request_id(request), num_computed_tokens)

    def finish(self, request: Request | int) -> None:
        """Drop the request's references; its cached blocks stay (evictable)."""
        self._core.finish(_request_id(request))

    def block_table(self, request: Request | int) -> list[int]:
        """The request's current block table (prompt and generated tokens)."""
        return self._core.block_table(_request_id(request))

    # -- low-level calls -----------------------------------------------------------------
    def match_and_acquire(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
    ) -> PrefixMatch:
        """Match the cached prefix and take one reference per matched block, atomically."""
        blocks, cached, full = self._core.match_and_acquire(
            as_token_ids(tokens), salt, adapter, multimodal, priority
        )
        return PrefixMatch(cached, full, blocks)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each, evicting cached blocks if needed."""
        return self._core.allocate(count)

    def commit_blocks(
        self,
        tokens: TokenIds,
        block_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
    ) -> list[int]:
        """Publish blocks the caller filled: `block_ids[i]` holds tokens of block i.

        Returns the canonical block per cached position (an existing identical block where
        one was cached first; the caller's copy is then freed at its release).
        """
        return self._core.commit_blocks(
            as_token_ids(tokens), list(block_ids), salt, adapter, multimodal, priority
        )

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed block."""
        self._core.release(list(block_ids))

    # -- retention -----------------------------------------------------------------------
    def pin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> Pin:
        """Keep the cached prefix of `tokens` (e.g. a system prompt) safe from eviction."""
        pin_id, count = self._core.pin(as_token_ids(tokens), salt, adapter, multimodal)
        return Pin(pin_id, count)

    def unpin(self, pin: Pin | int) -> None:
        self._core.unpin(pin.id if isinstance(pin, Pin) else int(pin))

    # -- reset and observation -----------------------------------------------------------
    def clear(self) -> None:
        """Forget every cached block (e.g. after a weights update). Live requests keep their
        blocks, but nothing they compute from now on is published."""
        self._core.clear()

    def set_context(self, context: CacheContext) -> None:
        """Switch to a new execution context; clears the cache as `clear` does."""
        if context.block_size != self.block_size:
            raise InvalidInputError(
                f"context.block_size {context.block_size} differs from the cache's {self.block_size}"
            )
        _check_reuse_safe(context)
        self._core.set_context(context.fingerprint())
        self._context = context

    def stats(self) -> CacheStats:
        return self._core.stats()

    def ref_count(self, block_id: int) -> int:
        return self._core.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self._core.is_cached(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant is broken (for tests)."""
        self._core.check_invariants()

    def __repr__(self) -> str:
        return f"PrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size})"


def _check_reuse_safe(context: CacheContext) -> None:
    if not context.reuse_is_safe:
        raise InvalidInputError(
            f"position encoding {context.position_encoding.rope_scaling!r} depends on the total "
            "sequence length: a prefix's KV differs from a full recompute, so prefix reuse is unsafe"
        )
