"""Paged KV storage: where the keys and values of cached tokens live, and the copies between pages.

Layout
------
The cache owns one tensor, ``storage``, shaped
``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V, layer, block,
token-in-block, KV head, head dim), contiguous. ``key_pages`` and ``value_pages`` are its two
halves, so ``key_pages[layer]`` is a contiguous ``[num_blocks, block_size, num_kv_heads,
head_dim]`` tensor: one block of one layer is a single contiguous slab of
``block_size * num_kv_heads * head_dim`` elements, and a tile of whole pages is one gather. This
is the layout vLLM's paged attention reads (one layer's pages, indexed by block id) and the one
`prefixkv.kv.prefill` expects.

A token's *slot* is ``block_id * block_size + offset_in_block``: its row in the flattened
``[num_blocks * block_size, num_kv_heads, head_dim]`` view of one layer's pages.

Keeping K and V of every layer in one allocation means a whole-block copy (copy-on-write of a
partial block, compaction, moving blocks to a host tier) is a single indexed copy for all layers
at once, instead of ``2 * num_layers`` small ones.

What is checked, and when it costs a device sync
------------------------------------------------
Shapes, dtypes and devices are tensor metadata: they are always checked, for free. Range checks
on ids (slots, block ids) need their values. When the ids arrive as Python sequences or CPU
tensors that is cheap and always done (``check_bounds=None``, the default). When they arrive as
CUDA tensors, reading them back would stall the host on the GPU once per layer per step, so the
default skips the check there; pass ``check_bounds=True`` to pay for it (one reduction and one
sync), ``False`` to skip it everywhere. An unchecked out-of-range id on CUDA trips a device-side
assertion in torch, which is unrecoverable for the process: check during development.

Every failed check raises before any page is touched, so a rejected call leaves the cache as it
was.

Errors
------
All errors are subclasses of `PagedKVError`, itself an `prefixkv.errors.InvalidInputError`
(so both a `prefixkv.PrefixKVError` and a `ValueError`). An out-of-range block id or slot is a
`KVIndexError`; it is a `ValueError` rather than an `IndexError` because it is a bad argument
value like the others, and one ``except ValueError`` then covers every bad input.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeAlias

import torch
from torch import Tensor

from prefixkv.errors import (
    KVAllocationError,
    KVDeviceError,
    KVDtypeError,
    KVIndexError,
    KVShapeError,
    PagedKVError,
)

__all__ = [
    "BlockIds",
    "KVDeviceError",
    "KVDtypeError",
    "KVIndexError",
    "KVShapeError",
    "PagedKVCache",
    "PagedKVError",
    "gather_pages",
]

#: Block ids or slots as engines hold them: a list of ints or an integer tensor (any device).
BlockIds: TypeAlias = Sequence[int] | Tensor


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVShapeError(f"{name} must be a positive int, got {value!r}")
    return value


def _is_free_to_read(ids: BlockIds) -> bool:
    """True when reading the id values back costs no device synchronisation."""
    return not isinstance(ids, Tensor) or ids.device.type == "cpu"


def _as_index_tensor(
    ids: BlockIds,
    *,
    name: str,
    upper: int,
    device: torch.device,
    check_bounds: bool | None,
    require_unique: bool = False,
) -> Tensor:
    """Validate ids (values in ``[0, upper)``) and return them as a 1-D int64 tensor on `device`.

    Shared by every call that takes ids, so all of them follow the module's rule on when a range
    check is done (see the module docstring). Uniqueness is only checked where the check is free:
    a repeated destination makes an indexed copy nondeterministic, but proving there is none on
    CUDA would cost a sync, and the callers that pass CUDA ids are engines that already own
    distinct blocks.
    """
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise KVDtypeError(f"{name} must hold integers, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise KVShapeError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        tensor = ids
    else:
        values = list(ids)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise KVDtypeError(f"{name} must hold ints, got {values!r}")
        tensor = torch.tensor(values, dtype=torch.int64)
    free = _is_free_to_read(tensor)
    if tensor.numel() > 0 and (check_bounds or (check_bounds is None and free)):
        low, high = (int(x) for x in torch.aminmax(tensor))
        if low < 0 or high >= upper:
            bad = low if low < 0 else high
            raise KVIndexError(f"{name} contains {bad}, outside the valid range [0, {upper})")
    if require_unique and free and tensor.numel() > 1 and tensor.unique().numel() != tensor.numel():
        raise KVIndexError(f"{name} repeats an id; each destination may be written once per call")
    return tensor.to(device=device, dtype=torch.int64, non_blocking=True)


class PagedKVCache:
    """K and V pages for every layer of one model, with batched copies in and out of them.

    Parameters are the geometry of the cache; ``pin_memory=True`` allocates the storage in pinned
    host memory (CPU only), which a host tier needs for asynchronous copies to and from a CUDA
    cache.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> None:
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_size = _positive_int(block_size, "block_size")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        if dtype not in _FLOAT_DTYPES:
            raise KVDtypeError(f"dtype must be a floating point dtype, got {dtype}")
        self.dtype = dtype
        self.device = torch.device(device)
        if pin_memory and self.device.type != "cpu":
            raise KVDeviceError(f"pin_memory applies to host caches only, not {self.device}")
        # Zeros, not empty: attention reads whole pages, and garbage past the last token of a
        # partial block could be NaN, which a zero softmax weight does not cancel (0 * NaN = NaN).
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            self.storage = torch.zeros(
                shape, dtype=dtype, device=self.device, pin_memory=pin_memory
            )
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise KVAllocationError(
                f"cannot allocate {num_bytes:,} bytes of KV pages {list(shape)} ({dtype}) on "
                f"{self.device}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
        # Reused staging buffer for block copies on this cache's device (grown on demand): a
        # fresh buffer per call pays first-touch page faults that cost more than the copy.
        self._staging: Tensor | None = None

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> PagedKVCache:
        """The largest cache whose pages fit in `budget_bytes` (K and V of all layers)."""
        return cls(
            num_layers,
            cls.blocks_in_budget(
                budget_bytes, num_layers, block_size, num_kv_heads, head_dim, dtype=dtype
            ),
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            device=device,
            pin_memory=pin_memory,
        )

    @classmethod
    def blocks_in_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Blocks of this geometry whose pages fit in `budget_bytes`; `KVShapeError` if none."""
        if dtype not in _FLOAT_DTYPES:
            raise KVDtypeError(f"dtype must be a floating point dtype, got {dtype}")
        per_block = cls._bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            raise KVShapeError(
                f"a budget of {budget_bytes} bytes holds no block; one block takes {per_block}"
            )
        return num_blocks

    @staticmethod
    def _bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        for value, name in (
            (num_layers, "num_layers"),
            (block_size, "block_size"),
            (num_kv_heads, "num_kv_heads"),
            (head_dim, "head_dim"),
        ):
            _positive_int(value, name)
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: its K and V pages in every layer."""
        return self._bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def num_slots(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def key_pages(self) -> Tensor:
        """``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``; index by layer."""
        return self.storage[0]

    @property
    def value_pages(self) -> Tensor:
        """``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``; index by layer."""
        return self.storage[1]

    @property
    def is_pinned(self) -> bool:
        return self.device.type == "cpu" and self.storage.is_pinned()

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )

    # -- validation helpers -------------------------------------------------------------------

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise KVIndexError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise KVIndexError(f"layer {layer} is outside [0, {self.num_layers})")

    def _check_token_tensor(self, tensor: Tensor, name: str) -> int:
        """Check a ``[num_tokens, num_kv_heads, head_dim]`` K or V tensor; return num_tokens."""
        if not isinstance(tensor, Tensor):
            raise KVDtypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        expected_tail = (self.num_kv_heads, self.head_dim)
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected_tail:
            raise KVShapeError(
                f"{name} must be [num_tokens, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.dtype != self.dtype:
            raise KVDtypeError(f"{name} has dtype {tensor.dtype}, the cache holds {self.dtype}")
        if tensor.device != self.device:
            raise KVDeviceError(f"{name} is on {tensor.device}, the cache is on {self.device}")
        return int(tensor.shape[0])

    def _block_ids(
        self, ids: BlockIds, name: str, check_bounds: bool | None, *, unique: bool = False
    ) -> Tensor:
        return _as_index_tensor(
            ids,
            name=name,
            upper=self.num_blocks,
            device=self.device,
            check_bounds=check_bounds,
            require_unique=unique,
        )

    def _check_same_geometry(self, other: PagedKVCache) -> None:
        mine = (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)
        theirs = (other.num_layers, other.block_size, other.num_kv_heads, other.head_dim)
        if mine != theirs:
            raise KVShapeError(
                "caches differ in (num_layers, block_size, num_kv_heads, head_dim): "
                f"{mine} vs {theirs}"
            )
        if self.dtype != other.dtype:
            raise KVDtypeError(f"caches differ in dtype: {self.dtype} vs {other.dtype}")

    # -- page copies ------------------------------------------------------------------------

    # Page copies run without autograd: cached K and V are never differentiated through, and a
    # source that requires grad would otherwise hang its whole graph on the cache's storage,
    # keeping every step's activations alive for as long as the cache lives.

    @torch.no_grad()
    def write(
        self,
        layer: int,
        key: Tensor,
        value: Tensor,
        slot_mapping: BlockIds,
        *,
        check_bounds: bool | None = None,
    ) -> None:
        """Store the K and V of `num_tokens` tokens of one layer at their slots.

        `key` and `value` are ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype and
        on its device; ``slot_mapping[i]`` is token i's slot (``block_id * block_size +
        offset``). Slots must be distinct (checked when free, see the module docstring). One
        indexed copy each for K and V, whatever the number of tokens. ``check_bounds=False``
        skips the distinct-slots check too: the caller has validated the mapping (
        `LlamaModel.prefill` checks a batch's slots once per call, not once per layer).
        """
        self._check_layer(layer)
        num_keys = self._check_token_tensor(key, "key")
        num_values = self._check_token_tensor(value, "value")
        slots = _as_index_tensor(
            slot_mapping,
            name="slot_mapping",
            upper=self.num_slots,
            device=self.device,
            check_bounds=check_bounds,
            require_unique=check_bounds is not False,
        )
        if not num_keys == num_values == slots.numel():
            raise KVShapeError(
                f"key has {num_keys} tokens, value {num_values}, slot_mapping {slots.numel()}"
            )
        flat_shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        # A source that is a view of these pages (e.g. KV gathered without a copy) would be
        # read while written: torch refuses that. Copy such a source first.
        if _shares_memory(key, self.storage):
            key = key.clone()
        if _shares_memory(value, self.storage):
            value = value.clone()
        self.storage[0, layer].view(flat_shape).index_copy_(0, slots, key)
        self.storage[1, layer].view(flat_shape).index_copy_(0, slots, value)

    def copy_blocks(
        self,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        check_bounds: bool | None = None,
    ) -> None:
        """Copy whole blocks ``src[i] -> dst[i]``, K and V of every layer, in one indexed copy.

        For copy-on-write of a shared partial block and for compaction. All sources are read
        before any destination is written, so a chain like ``[a, b] -> [b, c]`` copies the old
        contents of ``b`` to ``c``. Destinations must be distinct.
        """
        self.copy_blocks_to(
            self, src_block_ids, dst_block_ids, non_blocking=False, check_bounds=check_bounds
        )

    @torch.no_grad()
    def copy_blocks_to(
        self,
        other: PagedKVCache,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        non_blocking: bool = True,
        check_bounds: bool | None = None,
    ) -> None:
        """Copy blocks ``self[src[i]] -> other[dst[i]]``, all layers, possibly across devices.

        `other` must have the same geometry and dtype; its device may differ, which is how
        blocks move between a CUDA cache and a host tier. The blocks are gathered on the source
        device into one contiguous buffer, moved in one transfer, and scattered on the
        destination device, so the cost is three operations whatever the number of blocks.

        With ``non_blocking=True``: host -> CUDA stages through pinned memory and returns
        without waiting for the transfer (the copy is ordered on the current stream, so kernels
        launched after it see the data). CUDA -> host cannot be fully asynchronous, because the
        host must see the bytes before it scatters them into its pages: it waits for this
        transfer (not for the whole device) before returning.
        """
        if not isinstance(other, PagedKVCache):
            raise KVDtypeError(f"other must be a PagedKVCache, got {type(other).__name__}")
        self._check_same_geometry(other)
        src = self._block_ids(src_block_ids, "src_block_ids", check_bounds)
        dst = other._block_ids(dst_block_ids, "dst_block_ids", check_bounds, unique=True)
        if src.numel() != dst.numel():
            raise KVShapeError(
                f"src_block_ids has {src.numel()} ids but dst_block_ids has {dst.numel()}"
            )
        if src.numel() == 0:
            return
        # Gather and scatter along dim 1 of a [K/V x layer, block, block elements] view of the
        # contiguous storage: the same bytes as indexing the block axis of the 6-D tensor, but
        # torch's CPU index_select on an inner dim of a 6-D tensor takes a slow generic path
        # (measured here: ~500x slower for 64 blocks).
        src_view = self._blocks_view()
        dst_view = other._blocks_view()
        if self.device.type == "cpu" and other.device.type == "cpu":
            src_list, dst_list = src.tolist(), dst.tolist()
            if other is not self or not set(src_list) & set(dst_list):
                # No block is both read and written, so order does not matter: copy each block
                # straight to its destination, one pass over the bytes (a gather into a staging
                # buffer and a scatter out of it is two passes: measured ~77% vs ~38% of a plain
                # copy of the same bytes on this CPU). The loop is over blocks, not tokens.
                for source, destination in zip(src_list, dst_list, strict=True):
                    dst_view[:, destination].copy_(src_view[:, source])
                return
        to_cuda_async = non_blocking and self.device.type == "cpu" and other.device.type == "cuda"
        if to_cuda_async and not self.is_pinned:
            # Gather straight into pinned memory: the DMA engine can only read pinned pages
            # without a hidden, synchronous staging copy. torch's caching host allocator keeps
            # this buffer alive until the transfer that reads it has finished.
            shape = (src_view.shape[0], src.numel(), src_view.shape[2])
            gathered = torch.empty(shape, dtype=self.dtype, pin_memory=True)
            torch.index_select(src_view, 1, src, out=gathered)
        else:
            gathered = self._staging_for(src.numel())
            torch.index_select(src_view, 1, src, out=gathered)
        if other.device != self.device:
            gathered = _transfer(gathered, other.device, non_blocking=non_blocking)
        dst_view.index_copy_(1, dst, gathered)

    def _staging_for(self, num_blocks: int) -> Tensor:
        """A contiguous ``[2 * num_layers, num_blocks, elements per block]`` scratch tensor,
        carved from a buffer kept between calls. Safe to reuse: every use on this device is
        ordered on the same stream (CPU: synchronous), and a copy to another device is made
        from it before the call returns."""
        per_block = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        needed = per_block * num_blocks
        if self._staging is None or self._staging.numel() < needed:
            self._staging = torch.empty(needed, dtype=self.dtype, device=self.device)
        return self._staging[:needed].view(2 * self.num_layers, num_blocks, -1)

    def _blocks_view(self) -> Tensor:
        """The storage as ``[2 * num_layers, num_blocks, elements per block]`` (no copy)."""
        return self.storage.view(2 * self.num_layers, self.num_blocks, -1)

    def swap_out(
        self,
        block_ids: BlockIds,
        host_cache: PagedKVCache,
        host_block_ids: BlockIds,
        *,
        check_bounds: bool | None = None,
    ) -> None:
        """Copy device blocks ``block_ids[i]`` to ``host_cache`` blocks ``host_block_ids[i]``."""
        self.copy_blocks_to(host_cache, block_ids, host_block_ids, check_bounds=check_bounds)

    def swap_in(
        self,
        host_cache: PagedKVCache,
        host_block_ids: BlockIds,
        block_ids: BlockIds,
        *,
        check_bounds: bool | None = None,
    ) -> None:
        """Copy ``host_cache`` blocks ``host_block_ids[i]`` into device blocks ``block_ids[i]``."""
        host_cache.copy_blocks_to(self, host_block_ids, block_ids, check_bounds=check_bounds)

    def gather(
        self,
        layer: int,
        block_table: BlockIds,
        num_tokens: int,
        *,
        check_bounds: bool | None = None,
    ) -> tuple[Tensor, Tensor]:
        """K and V of one request's first `num_tokens` tokens, as contiguous copies.

        ``block_table[j]`` is the block holding the request's tokens ``j * block_size`` to
        ``(j + 1) * block_size - 1``; entries past the blocks that `num_tokens` needs are
        ignored (engines pad tables). Returns two ``[num_tokens, num_kv_heads, head_dim]``
        tensors.
        """
        self._check_layer(layer)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise KVShapeError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        return gather_pages(
            self.storage[0, layer],
            self.storage[1, layer],
            block_table,
            num_tokens,
            check_bounds=check_bounds,
        )


def gather_pages(
    key_pages: Tensor,
    value_pages: Tensor,
    block_table: BlockIds,
    num_tokens: int,
    *,
    check_bounds: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Contiguous K and V of tokens ``0 .. num_tokens-1`` of one layer's pages via a block table.

    The module-level form of `PagedKVCache.gather`, for callers (the attention reference path)
    that hold a layer's page tensors rather than the cache object.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise KVShapeError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    num_blocks, block_size = int(key_pages.shape[0]), int(key_pages.shape[1])
    blocks_needed = -(-num_tokens // block_size)
    table_length = len(block_table)
    if blocks_needed > table_length:
        raise KVShapeError(
            f"{num_tokens} tokens need {blocks_needed} blocks of {block_size}, "
            f"the block table has {table_length}"
        )
    ids = _as_index_tensor(
        block_table[:blocks_needed],
        name="block_table",
        upper=num_blocks,
        device=key_pages.device,
        check_bounds=check_bounds,
    )
    tail = tuple(key_pages.shape[2:])
    keys = key_pages.index_select(0, ids).view(-1, *tail)[:num_tokens]
    values = value_pages.index_select(0, ids).view(-1, *tail)[:num_tokens]
    return keys, values


def _transfer(tensor: Tensor, device: torch.device, *, non_blocking: bool) -> Tensor:
    """Move a freshly gathered buffer to `device`, asynchronously where that is safe."""
    if non_blocking and tensor.device.type == "cuda" and device.type == "cpu":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        # The caller scatters `host` with a CPU op next, which would otherwise race the DMA.
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        done.synchronize()
        return host
    # Host -> CUDA from pinned memory (see copy_blocks_to) or CUDA -> CUDA: ordered on the
    # current stream, so later kernels see the data without the host waiting.
    return tensor.to(device, non_blocking=non_blocking)


def _shares_memory(tensor: Tensor, storage: Tensor) -> bool:
    """True when `tensor` is a view into `storage`'s memory (same untyped storage)."""
    return (
        tensor.device == storage.device
        and tensor.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    )
