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
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from prefixkv import _core
from prefixkv._core import CacheStats, KeyExtras, Pin, PrefixMatch, Request
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError

__all__ = [
    "CacheStats",
    "KeyExtras",
    "Pin",
    "PrefixCache",
    "PrefixMatch",
    "Request",
    "as_token_ids",
]

#: What callers may pass as token ids.
TokenIds = Any  # Sequence[int] | np.ndarray | torch.Tensor (kept Any: torch is optional here)
#: A multimodal item: (first placeholder position, number of placeholders, content hash).
MultimodalItem = tuple[int, int, "bytes | str"]

# array("I") is 32 bits wide on every platform CPython supports today; checked, not assumed.
_PACK_LISTS = array.array("I").itemsize == 4

#: The extras of a request that has none: parsed once, shared by every such call.
_NO_EXTRAS = KeyExtras()

# The result types are the native module's frozen classes (`rust/py/src/results.rs`):
# `PrefixMatch` (num_cached_tokens, full_hit, block_ids, num_cached_blocks), `Request` (id,
# block_table, num_cached_tokens, full_hit, num_prompt_tokens, num_tokens_to_compute) and
# `Pin` (id, num_blocks).


def key_extras(
    salt: str | bytes | None = None,
    adapter: str | bytes | None = None,
    multimodal: Sequence[MultimodalItem] | None = None,
) -> KeyExtras:
    """Everything besides the token ids that goes into a request's block keys, parsed once."""
    if salt is None and adapter is None and not multimodal:
        return _NO_EXTRAS
    return KeyExtras(salt, adapter, multimodal)


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
        if tokens.is_floating_point() or tokens.is_complex() or str(tokens.dtype) == "torch.bool":
            raise InvalidInputError(f"token ids must have an integer dtype, got {tokens.dtype}")
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
    # array('I') takes True and False as 1 and 0; a bool among token ids is a caller's bug,
    # refused as the core refuses it. Only the positions holding 0 or 1 can be bools, so one
    # vectorised pass finds the few to look at (usually none, or the BOS token).
    values = np.frombuffer(packed, dtype=np.uint32)
    if len(values) and values.min() <= 1:  # ~2 µs for 4k tokens; the scan below is rarer
        for position in np.flatnonzero(values <= 1).tolist():
            if isinstance(tokens[position], bool):
                raise InvalidInputError(f"token at position {position} must be an int, not bool")
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _array_tokens(values: np.ndarray) -> tuple[bytes, int, bool]:
    # Only metadata is checked here; the core checks every value (negative, above 2**32 - 1)
    # and narrows to u32 with the GIL released. The one copy made with the GIL held is the
    # `tobytes` below: the stable ABI for CPython 3.10 has no buffer protocol to read in place.
    if values.ndim != 1:
        raise InvalidInputError(f"token ids must be one-dimensional, got shape {values.shape}")
    if values.dtype.kind not in "iu":  # bool is kind "b": refused here too
        raise InvalidInputError(f"token ids must have an integer dtype, got {values.dtype}")
    if values.dtype.byteorder == ">" or (values.dtype.byteorder == "=" and sys.byteorder == "big"):
        values = values.astype(values.dtype.newbyteorder("<"))
    return values.tobytes(), values.dtype.itemsize, values.dtype.kind == "i"


class PrefixCache:
    """Prefix-cache block manager: which KV blocks a request may reuse, and for how long.

    Args:
        num_blocks: blocks in the pool (the engine's KV pages).
        context: the execution context; defaults to `CacheContext()`. Changing it later with
            `set_context` (or calling `clear`) makes every cached block unreachable.
        block_size: tokens per block; defaults to `context.block_size` and must equal it.
        vocab_size: when given, token ids at or above it are refused.

    Every request-keyed call takes the `Request` that `begin` returned or its int id; an int
    follows `operator.index` (a float, str, bool or None is an `InvalidInputError`, never
    rounded to some other request). `salt`, `adapter` and `multimodal` may be given as keywords
    or, parsed once for several calls, as one `extras=key_extras(...)`.
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
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise InvalidInputError(f"block_size must be a positive int, got {block_size!r}")
        if context is None:
            context = CacheContext(block_size=16 if block_size is None else block_size)
        elif not isinstance(context, CacheContext):
            raise InvalidInputError(f"context must be a CacheContext, not {type(context).__name__}")
        if block_size is not None and block_size != context.block_size:
            raise InvalidInputError(
                f"block_size {block_size} differs from context.block_size {context.block_size}"
            )
        _check_reuse_safe(context)
        self._context = context
        # Guards the pair (core context, self._context) so that `context` never names a
        # context other than the one the core keys blocks under.
        self._context_lock = threading.Lock()
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
        with self._context_lock:
            return self._context

    # -- lookups -------------------------------------------------------------------------
    def lookup(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> PrefixMatch:
        """The cached prefix of `tokens`, without taking references (lock-free probe)."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.lookup(as_token_ids(tokens), keys)

    def block_keys(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> list[bytes]:
        """The 32-byte key of every full block of `tokens` (stable across processes)."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.block_keys(as_token_ids(tokens), keys)

    # -- a request's life ----------------------------------------------------------------
    def begin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> Request:
        """Match the cached prefix, reference it and allocate blocks for the rest.

        `salt` isolates tenants; `adapter` and `multimodal` become per-block extra keys;
        `priority` is the retention priority of the request's blocks (lower goes first).
        Raises `OutOfBlocksError` (nothing changed) when the pool cannot hold the prompt.
        """
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.begin(as_token_ids(tokens), keys, priority)

    def append(self, request: Request | int, tokens: TokenIds) -> list[int]:
        """Add generated tokens; returns the blocks newly allocated for them."""
        return self._core.append(request, as_token_ids(tokens))

    def commit(self, request: Request | int, num_computed_tokens: int) -> int:
        """KV of the first `num_computed_tokens` tokens is written: publish the full blocks.

        Returns how many leading blocks of the request are now cached.
        """
        return self._core.commit(request, num_computed_tokens)

    def finish(self, request: Request | int) -> None:
        """Drop the request's references; its cached blocks stay (evictable)."""
        self._core.finish(request)

    def block_table(self, request: Request | int) -> list[int]:
        """The request's current block table (prompt and generated tokens)."""
        return self._core.block_table(request)

    # -- low-level calls -----------------------------------------------------------------
    def match_and_acquire(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> PrefixMatch:
        """Match the cached prefix and take one reference per matched block, atomically."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.match_and_acquire(as_token_ids(tokens), keys, priority)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each, evicting cached blocks if needed."""
        return self._core.allocate(count)

    def blocks_obtainable(self, up_to: int | None = None) -> int:
        """How many blocks `allocate` could hand out right now, capped at `up_to` (default: the
        pool size), without changing anything: the free blocks plus every cached block that
        eviction can reach (unreferenced, unpinned, no held descendant). Cheap when the free
        list covers `up_to`; otherwise it plans the eviction, so ask for what you need.
        `stats().blocks_evictable` counts only the leaves evictable at once: a lower bound."""
        return self._core.blocks_obtainable(self.num_blocks if up_to is None else up_to)

    def commit_blocks(
        self,
        tokens: TokenIds,
        block_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> list[int]:
        """Publish blocks the caller filled: `block_ids[i]` holds tokens of block i.

        Returns the canonical block per cached position (an existing identical block where
        one was cached first; the caller's copy is then freed at its release).
        """
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.commit_blocks(as_token_ids(tokens), block_ids, keys, priority)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed block."""
        self._core.release(block_ids)

    # -- retention -----------------------------------------------------------------------
    def pin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> Pin:
        """Keep the cached prefix of `tokens` (e.g. a system prompt) safe from eviction."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.pin(as_token_ids(tokens), keys)

    def unpin(self, pin: Pin | int) -> None:
        """Release a pin. An unknown id (never taken, already unpinned, or dropped by `clear` /
        `set_context`, which release every pin) is an `UnknownRequestError` saying which."""
        self._core.unpin(pin)

    # -- reset and observation -----------------------------------------------------------
    def clear(self) -> None:
        """Forget every cached block (e.g. after a weights update). Live requests keep their
        blocks, but nothing they compute from now on is published."""
        self._core.clear()

    def set_context(self, context: CacheContext) -> None:
        """Switch to a new execution context; clears the cache as `clear` does."""
        if not isinstance(context, CacheContext):
            raise InvalidInputError(f"context must be a CacheContext, not {type(context).__name__}")
        if context.block_size != self.block_size:
            raise InvalidInputError(
                f"context.block_size {context.block_size} differs from the cache's {self.block_size}"
            )
        _check_reuse_safe(context)
        fingerprint = context.fingerprint()
        with self._context_lock:
            self._core.set_context(fingerprint)
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


def _extras(
    salt: str | bytes | None,
    adapter: str | bytes | None,
    multimodal: Sequence[MultimodalItem] | None,
    extras: KeyExtras | None,
) -> KeyExtras:
    if extras is None:
        return key_extras(salt, adapter, multimodal)
    if salt is not None or adapter is not None or multimodal is not None:
        raise InvalidInputError("pass either extras= or salt/adapter/multimodal, not both")
    if not isinstance(extras, KeyExtras):
        raise InvalidInputError(f"extras must be a KeyExtras, not {type(extras).__name__}")
    return extras


def _check_reuse_safe(context: CacheContext) -> None:
    if not context.reuse_is_safe:
        raise InvalidInputError(
            f"position encoding {context.position_encoding.rope_scaling!r} depends on the total "
            "sequence length: a prefix's KV differs from a full recompute, so prefix reuse is unsafe"
        )
