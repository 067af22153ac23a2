"""What a paged forward pass is asked to compute: the request types of `LlamaModel.prefill` and
`decode_step`, and the packing of a batch of them into the flat tensors one attention call per
layer reads.

A request says which positions to compute (``num_cached_tokens .. num_tokens - 1``) over which
pages (its block table); `pack_prefill_batch` checks all of that before anything is written,
so a rejected call leaves the pages as they were, and builds everything that depends only on
lengths (positions, RoPE tables, slot mapping) once per call, on the CPU, rather than once per
layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixkv.errors import (
    InvalidInputError,
    KVDeviceError,
    KVDtypeError,
    KVIndexError,
    KVShapeError,
)
from prefixkv.models.rope import rope_attention_factor, rope_inverse_frequencies

if TYPE_CHECKING:
    from prefixkv.kv.grouped import GroupedKVCache
    from prefixkv.kv.pages import PagedKVCache
    from prefixkv.models.config import ModelConfig

__all__ = [
    "BlockTable",
    "DecodeRequest",
    "PackedBatch",
    "PrefillRequest",
    "TokenIds",
    "check_kv_cache",
    "int_tensor",
    "pack_prefill_batch",
    "token_tensor",
]

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
BlockTable = Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class PrefillRequest:
    """One sequence in a `LlamaModel.prefill` batch.

    token_ids: every token of the sequence so far (n of them).
    block_table: block ids; block i holds positions ``i*block_size .. (i+1)*block_size - 1``.
        It must cover every position up to ``num_tokens - 1``.
    num_cached_tokens: m; the pages already hold the KV of positions ``0 .. m-1``.
    num_tokens: compute positions ``m .. num_tokens-1`` only (chunked prefill); default n.
    write_kv: False when the pages already hold the KV of the computed positions too, e.g. a
        full cache hit (m = n - 1, the last token's KV is in a shared block): only the queries
        are computed and the pages are not written, so a shared block is never modified.
    group_block_tables: for a `GroupedKVCache`, one block table per KV group (`block_table`
        is then ignored); a sliding group's table may hold its null block at positions outside
        the window of every computed position.
    """

    token_ids: TokenIds
    block_table: BlockTable
    num_cached_tokens: int = 0
    num_tokens: int | None = None
    write_kv: bool = True
    group_block_tables: Sequence[BlockTable] | None = None


@dataclass
class DecodeRequest:
    """One sequence in a `LlamaModel.decode_step` batch: its tokens including the new one
    (`group_block_tables` as in `PrefillRequest`, for a `GroupedKVCache`)."""

    token_ids: TokenIds
    block_table: BlockTable
    group_block_tables: Sequence[BlockTable] | None = None


@dataclass(frozen=True)
class PackedBatch:
    """A validated prefill batch, requests concatenated along the token axis."""

    tokens: torch.Tensor  # [total] token ids of the computed positions
    # [total, head_dim // 2] RoPE tables of those positions, YaRN's attention factor folded in
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # page slot of each written row
    written_rows: torch.Tensor | None  # rows whose K/V are written; None = all of them
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with block 0
    query_lens: list[int]  # Python ints: attention plans on the host, so no device read-back
    seq_lens: list[int]
    # One slot mapping and one padded table per KV group (a `GroupedKVCache`); for a plain
    # `PagedKVCache` the single group's are `slot_mapping` and `block_tables`.
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_block_tables: tuple[torch.Tensor, ...] = ()
    # The RoPE tables of Gemma 3's sliding layers (`ModelConfig.local_rope`), else None.
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None


def computed_range(request: PrefillRequest, n: int, where: str) -> tuple[int, int]:
    """``(m, end)``: the positions ``m .. end - 1`` this request computes."""
    start = request.num_cached_tokens
    end = n if request.num_tokens is None else request.num_tokens
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidInputError(f"{where}.num_cached_tokens must be an int >= 0, got {start!r}")
    if isinstance(end, bool) or not isinstance(end, int) or not 0 < end <= n:
        raise InvalidInputError(
            f"{where}.num_tokens must be an int in 1..{n} (len(token_ids)), got {end!r}"
        )
    if start >= end:
        raise InvalidInputError(
            f"{where}: num_cached_tokens ({start}) must be less than the number of tokens to "
            f"compute up to ({end}); at least one position must be computed"
        )
    return start, end


def check_kv_cache(
    config: ModelConfig,
    kv_cache: PagedKVCache | GroupedKVCache,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Refuse a KV cache the model with `config` (computing in `dtype` on `device`) cannot use:
    another layer layout, other sliding windows per layer, dtype or device."""
    from prefixkv.kv.grouped import GroupedKVCache
    from prefixkv.kv.pages import PagedKVCache

    if not isinstance(kv_cache, (PagedKVCache, GroupedKVCache)):
        raise InvalidInputError(
            f"expected a PagedKVCache or GroupedKVCache, got {type(kv_cache).__name__}"
        )
    if isinstance(kv_cache, GroupedKVCache):
        windows = tuple(
            kv_cache.specs[kv_cache.layer_location[layer][0]].sliding_window
            for layer in range(kv_cache.num_layers)
        )
        if windows != config.layer_sliding_windows:
            raise KVShapeError(
                f"the KV groups give the layers windows {windows}, the model "
                f"{config.layer_sliding_windows}"
            )
    model_shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    cache_shape = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)
    if cache_shape != model_shape:
        raise KVShapeError(
            f"KV cache (num_layers, num_kv_heads, head_dim) = {cache_shape}, "
            f"the model needs {model_shape}"
        )
    if kv_cache.dtype != dtype:
        raise KVDtypeError(f"KV cache holds {kv_cache.dtype}, the model computes {dtype}")
    if kv_cache.device != device:
        raise KVDeviceError(f"KV cache is on {kv_cache.device}, the model on {device}")


def pack_prefill_batch(
    config: ModelConfig,
    kv_cache: PagedKVCache | GroupedKVCache,
    batch: Sequence[PrefillRequest],
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> PackedBatch:
    """Validate every request against `config` and `kv_cache`, and lay the batch out as packed
    tensors on `device` (RoPE tables in `dtype`).

    Everything that depends only on lengths and block tables (positions, RoPE tables, slot
    mapping) is built here on the CPU, once per call rather than once per layer.
    """
    from prefixkv.kv.grouped import GroupedKVCache

    if isinstance(batch, PrefillRequest) or not isinstance(batch, Sequence) or not batch:
        raise InvalidInputError("batch must be a non-empty sequence of PrefillRequest")
    grouped = isinstance(kv_cache, GroupedKVCache)
    block_size = kv_cache.block_size
    # Per group: the pages a table may name, and the null block no computed position may use.
    # A sliding group's window: its queries read keys from ``position + 1 - window`` on.
    if isinstance(kv_cache, GroupedKVCache):
        limits = [pages.num_blocks for pages in kv_cache.groups]
        nulls = [kv_cache.null_block(g) for g in range(len(kv_cache.groups))]
        windows = [spec.sliding_window for spec in kv_cache.specs]
    else:
        limits, nulls, windows = [kv_cache.num_blocks], [None], [None]
    num_groups = len(limits)
    token_chunks: list[torch.Tensor] = []
    angle_chunks: list[torch.Tensor] = []
    local_rope = config.local_rope  # Gemma 3's sliding layers: no scaling, one table
    local_frequencies = None if local_rope is None else rope_inverse_frequencies(local_rope, 1)
    local_chunks: list[torch.Tensor] = []
    slot_chunks: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
    row_chunks: list[torch.Tensor] = []
    tables: list[list[torch.Tensor]] = [[] for _ in range(num_groups)]
    query_lens: list[int] = []
    seq_lens: list[int] = []
    row = 0
    for index, request in enumerate(batch):
        where = f"batch[{index}]"
        if not isinstance(request, PrefillRequest):
            raise InvalidInputError(f"{where} is not a PrefillRequest: {request!r}")
        tokens = token_tensor(request.token_ids, config.vocab_size, f"{where}.token_ids")
        start, end = computed_range(request, tokens.numel(), where)
        if grouped:
            if request.group_block_tables is None or len(request.group_block_tables) != num_groups:
                raise InvalidInputError(
                    f"{where}.group_block_tables must hold one block table per KV group "
                    f"({num_groups}) for a GroupedKVCache"
                )
            raw_tables = list(request.group_block_tables)
        else:
            raw_tables = [request.block_table]
        positions = torch.arange(start, end)
        needed = -(-end // block_size)
        for group, raw in enumerate(raw_tables):
            name = f"{where}.block_table" if not grouped else f"{where}.group_block_tables[{group}]"
            table = int_tensor(raw, name)
            if table.numel() < needed:
                raise KVShapeError(
                    f"{name} has {table.numel()} blocks; {end} tokens with "
                    f"block_size {block_size} need {needed}"
                )
            table = table[:needed]
            if bool(((table < 0) | (table >= limits[group])).any()):
                raise KVIndexError(
                    f"{name} has block ids outside [0, {limits[group]}): {table.tolist()}"
                )
            blocks = table[positions // block_size]
            null, window = nulls[group], windows[group]
            if null is not None and window is not None:
                # Every key a query of this call reads must be real KV: the null block may
                # stand only before the window of the first computed position.
                first_read = max(0, start + 1 - window) // block_size
                if bool((table[first_read:] == null).any()):
                    raise KVIndexError(
                        f"{name} has the null block {null} at a position the window of this "
                        f"call reads (from block {first_read} on, computing {start}..{end - 1} "
                        f"with a window of {window}): only blocks outside every window may be "
                        "released"
                    )
            if request.write_kv:
                slot_chunks[group].append(blocks * block_size + positions % block_size)
            tables[group].append(table)
        # RoPE angles in float64: positions in the hundreds of thousands times a frequency
        # near 1 lose the low bits of the angle in float32.
        absolute = positions.to(torch.float64) + config.position_offset
        # A length-dependent RoPE (dynamic NTK, LongRoPE) reads the length of the whole known
        # sequence, not of this chunk: a chunked prefill then rotates every chunk as the one
        # forward over the prompt does (transformers'), never early chunks under the short
        # length's setting and later ones under the long one's.
        frequencies = rope_inverse_frequencies(config, config.position_offset + tokens.numel())
        angle_chunks.append(torch.outer(absolute, frequencies))
        if local_frequencies is not None:
            local_chunks.append(torch.outer(absolute, local_frequencies))
        if request.write_kv:
            row_chunks.append(torch.arange(row, row + end - start))
        token_chunks.append(tokens[start:end])
        query_lens.append(end - start)
        seq_lens.append(end)
        row += end - start

    slot_mappings = []
    for group in range(num_groups):
        chunks = slot_chunks[group]
        slots = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
        if slots.unique().numel() != slots.numel():
            # Two requests writing one slot: the result would depend on write order.
            raise KVIndexError(
                "two requests in the batch write the same page slot; a block may be written by "
                "one request only (shared blocks must be read-only: write_kv=False)"
            )
        slot_mappings.append(slots.to(device))
    written_rows = torch.cat(row_chunks) if row_chunks else torch.empty(0, dtype=torch.int64)
    angles = torch.cat(angle_chunks)
    # YaRN's attention factor (1 otherwise) goes into the float64 tables before they are rounded
    # to the model dtype, as in the full path and transformers: scaling the rotated queries and
    # keys instead would round them twice, and the pages would not hold the full path's keys.
    attention_factor = rope_attention_factor(config)
    padded = tuple(_pad_block_tables(group_tables).to(device) for group_tables in tables)
    return PackedBatch(
        tokens=torch.cat(token_chunks).to(device),
        cos=(torch.cos(angles) * attention_factor).to(device, dtype),
        sin=(torch.sin(angles) * attention_factor).to(device, dtype),
        slot_mapping=slot_mappings[0],
        written_rows=None if written_rows.numel() == row else written_rows.to(device),
        block_tables=padded[0],
        query_lens=query_lens,
        seq_lens=seq_lens,
        group_slot_mappings=tuple(slot_mappings),
        group_block_tables=padded,
        **_local_rope_tables(local_chunks, device, dtype),
    )


def _local_rope_tables(
    chunks: list[torch.Tensor], device: torch.device | str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``local_cos`` / ``local_sin`` of a `PackedBatch` from the local angle chunks (none for
    a model without a local RoPE)."""
    if not chunks:
        return {}
    angles = torch.cat(chunks)
    return {"local_cos": torch.cos(angles).to(device, dtype),
            "local_sin": torch.sin(angles).to(device, dtype)}  # fmt: skip


def _pad_block_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    # Padding is never read (attention stops at each request's seq_len); 0 is a valid block id
    # all the same, so a kernel that did read it could not fault.
    width = max(table.numel() for table in tables)
    padded = torch.zeros((len(tables), width), dtype=torch.int32)
    for row, table in enumerate(tables):
        padded[row, : table.numel()] = table.to(torch.int32)
    return padded


def int_tensor(values: Any, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list, numpy array or tensor of integers."""
    if isinstance(values, torch.Tensor):
        tensor = values
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} must hold integers, got numpy dtype {values.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(values).astype(np.int64, copy=False))
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInputError(
            f"{what} must be a list, numpy array or tensor of ints, got {type(values).__name__}"
        )
    else:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise InvalidInputError(f"{what} must hold ints")
        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidInputError(f"{what} must hold integers, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.to("cpu", torch.int64)


def token_tensor(values: TokenIds, vocab_size: int, what: str) -> torch.Tensor:
    tokens = int_tensor(values, what)
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise InvalidInputError(f"{what} has ids outside [0, {vocab_size})")
    return tokens
