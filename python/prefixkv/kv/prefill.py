"""Paged prefill attention: the new tokens of a batch of requests attend to keys read from pages.

size: three backends of one contract (the reference, torch's tiled walk, the CPU fused SDPA
path) and their shared checks; the Triton kernel is in `prefixkv.kv._triton_prefill`.

What is computed
----------------
Requests are concatenated along the token axis of `query`. Request ``b`` has ``n = seq_lens[b]``
tokens in total, of which the last ``query_lens[b]`` are new; the first ``m = n - query_lens[b]``
were cached. Its queries are positions ``m .. n-1`` and each attends causally to keys
``0 .. n-1``, every one of them read from the pages through row ``b`` of `block_tables`
(``block_tables[b, j]`` holds positions ``j * block_size .. (j + 1) * block_size - 1``; entries
past the ``ceil(n / block_size)`` the request needs are padding and never read).

As in vLLM, the caller writes the new tokens' K and V into their slots *before* calling, so
cached and new keys are read the same way. ``query_lens[b] == 1`` with a long ``n`` is the full
prefix hit: only the last token is computed, everything else comes from the cache.

Conventions:

- Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``,
  the grouping ``repeat_interleave`` of the KV heads gives.
- ``scale`` defaults to ``1 / sqrt(head_dim)``.
- ``sliding_window=w``: the query at position ``p`` sees keys ``p - w + 1 .. p`` (``w`` keys,
  itself included). That is FlashAttention's ``window_size=(w - 1, 0)`` and Mistral's
  ``sliding_window``.
- ``sinks`` (gpt-oss): one logit per query head added to every softmax's denominator, as a key
  with no value: ``softmax([scores, sink])`` with the sink's column dropped. The torch backend
  starts each row's online softmax from it (running max = sink, running sum = 1); the reference
  backend appends the column explicitly; the triton kernel has no sinks (``"auto"`` picks torch).
- ``softcap=c`` (Gemma 2): each scaled score ``s`` becomes ``tanh(s / c) * c`` before the mask
  and softmax (FlashAttention's ``softcap``). The torch and reference backends implement it;
  the triton kernel does not, so ``"auto"`` picks torch for it.

Backends
--------
- ``"torch"``: on CPU tensors, torch's fused SDPA kernel (``scaled_dot_product_attention``, its
  flash-attention CPU kernel: online softmax in float32 over blocks of keys, grouped-query
  heads read in place). Per request, one gather of the pages its queries read (positions
  ``0 .. n-1``, or from the first query's window on), then one call with ``is_causal`` when
  nothing is cached and there is no window, else one call per query tile of
  `_SDPA_QUERY_TILE` rows with an explicit mask over keys up to the tile's last position (so the
  mask stays ``[tile, keys]`` and at most half a tile of keys per row is computed and masked).
  Only the tokens that exist are gathered, so a stale page slot is never read. This is exact as
  an attention computation: it differs from the walk below only in the order of the float32
  sums. Elsewhere (CUDA tensors), or when `_fused_path_applies` says no, FlashAttention's
  algorithm in plain torch (`_torch_attention`): per request and per query tile it walks KV
  tiles of whole pages, keeping a running maximum and sum (online softmax), so the largest
  score matrix is ``[num_heads, query_tile, kv_tile]`` and never ``[q, n]``. Tiles entirely
  above the causal diagonal or before the window are skipped. Either way, half-precision
  inputs are upcast to float32, so products and sums accumulate in float32 and only the
  output is rounded.
- ``"triton"``: the same algorithm as a Triton kernel (`prefixkv.kv._triton_prefill`) that reads
  K and V through the block table in place, one program per (query tile, query head). CUDA
  tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
  first imported), which is how it is tested without a GPU.
- ``"reference"``: gathers each request's K and V into contiguous tensors and calls
  ``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask. Simple
  and slow; the oracle in tests.
- ``"auto"``: triton for CUDA tensors when triton imports, torch otherwise.

Validation
----------
Shapes, dtypes and devices are always checked. The lengths are needed on the host to plan the
work, so CUDA tensors of lengths are read back once per call (pass lists to avoid it). Block
table entries are range-checked under the `prefixkv.kv.pages` rule: when the table is on the CPU (or
``check_bounds=True``), not when reading it would stall on the GPU. Errors are the
`prefixkv.kv.pages` exception classes (`PrefixKVError` and `ValueError`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch import Tensor

from prefixkv.errors import BackendUnavailableError, InvalidInputError
from prefixkv.kv.pages import KVDeviceError, KVDtypeError, KVIndexError, KVShapeError, gather_pages

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "paged_prefill_attention",
    "triton_available",
]

AttentionBackend: TypeAlias = Literal["auto", "torch", "triton", "reference"]
Lengths: TypeAlias = Sequence[int] | Tensor

_BACKENDS = ("auto", "torch", "triton", "reference")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Torch backend tiling. A query tile of 64 and a KV tile of ~256 tokens keep the score tensor at
# num_heads * 64 * 256 floats (2 MiB for 32 heads) while each matmul is still large enough that
# the Python loop is not the bottleneck.
_TORCH_QUERY_TILE = 64
_TORCH_KV_TILE_TOKENS = 256

# Fused (SDPA) path: query rows per call when a mask is needed (a cached prefix or a window). The
# float mask SDPA builds is [tile, keys]: 512 rows of an 8,192-token context are 16 MiB.
_SDPA_QUERY_TILE = 512


def triton_available() -> bool:
    """True when the triton package can be imported (it may still lack a GPU to run on)."""
    return importlib.util.find_spec("triton") is not None


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class _Batch:
    """Host-side plan of a call: per request lengths and where its queries start in `query`."""

    query_lens: list[int]
    seq_lens: list[int]
    query_starts: list[int]  # offset of request b's first query row in `query`

    @property
    def size(self) -> int:
        return len(self.seq_lens)


def paged_prefill_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    query_lens: Lengths,
    seq_lens: Lengths,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
    backend: AttentionBackend = "auto",
    check_bounds: bool | None = None,
) -> Tensor:
    """Attention of each request's new tokens over all its tokens, K and V read from pages.

    Shapes: `query` ``[total_query_tokens, num_heads, head_dim]`` (requests concatenated);
    `key_pages` and `value_pages` one layer's ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; `block_tables` int32/int64 ``[batch, max_blocks_per_request]``, padded;
    `query_lens` and `seq_lens` one int per request. Returns ``[total_query_tokens, num_heads,
    head_dim]`` in the query's dtype. See the module docstring for the exact semantics.
    `check_bounds` chooses whether used block table entries are range-checked (``None``: only
    when that costs no device sync, see `prefixkv.kv.pages`).
    """
    if backend not in _BACKENDS:
        raise InvalidInputError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    batch = _check_inputs(
        query, key_pages, value_pages, block_tables, query_lens, seq_lens, check_bounds
    )
    head_dim = int(query.shape[2])
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif (
        not isinstance(scale, (int, float))
        or isinstance(scale, bool)
        or not math.isfinite(scale)
        or not scale > 0
    ):
        raise InvalidInputError(f"scale must be a positive finite float, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise InvalidInputError(f"sliding_window must be a positive int, got {sliding_window!r}")
    if sinks is not None and (
        not isinstance(sinks, Tensor)
        or tuple(sinks.shape) != (int(query.shape[1]),)
        or sinks.device != query.device
    ):
        raise InvalidInputError(
            f"sinks must be a [num_heads] tensor on the query's device, got {sinks!r:.80}"
        )
    if softcap is not None and (
        not isinstance(softcap, (int, float))
        or isinstance(softcap, bool)
        or not math.isfinite(softcap)
        or not softcap > 0
    ):
        raise InvalidInputError(f"softcap must be None or a positive finite float, got {softcap!r}")

    if backend == "auto":
        manual = sinks is not None or softcap is not None
        backend = "torch" if manual else _auto_backend(query)
    if backend == "reference":
        return _reference_attention(
            query, key_pages, value_pages, block_tables, batch, float(scale), sliding_window,
            sinks, softcap,
        )  # fmt: skip
    if backend == "triton":
        if sinks is not None:
            raise BackendUnavailableError("backend='triton' does not implement attention sinks")
        if softcap is not None:
            raise BackendUnavailableError("backend='triton' does not implement softcap")
        return _triton_attention(
            query, key_pages, value_pages, block_tables, batch, float(scale), sliding_window
        )
    if _fused_path_applies(query, sinks=sinks, softcap=softcap):
        return _sdpa_attention(
            query, key_pages, value_pages, block_tables, batch, float(scale), sliding_window
        )
    return _torch_attention(
        query, key_pages, value_pages, block_tables, batch, float(scale), sliding_window, sinks,
        softcap=softcap,
    )  # fmt: skip


def _fused_path_applies(
    query: Tensor, *, sinks: Tensor | None = None, softcap: float | None = None
) -> bool:
    """Whether the torch backend hands the attention to torch's fused SDPA kernel: on CPU
    tensors (what the speed comparison with transformers measures; CUDA has the Triton kernel).
    An option SDPA cannot express (a score soft-cap, attention sinks) takes the tiled walk
    instead, which implements both."""
    return query.device.type == "cpu" and sinks is None and softcap is None


def _auto_backend(query: Tensor) -> AttentionBackend:
    if query.device.type == "cuda" and query.dtype in _TRITON_DTYPES and triton_available():
        return "triton"
    return "torch"


# -- validation ------------------------------------------------------------------------------


def _lengths(values: Lengths, name: str) -> list[int]:
    if isinstance(values, Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dim() != 1:
            raise KVDtypeError(f"{name} must be a 1-D integer tensor or a list of ints")
        result = [int(v) for v in values.tolist()]
    else:
        result = list(values)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in result):
            raise KVDtypeError(f"{name} must hold ints, got {result!r}")
    if any(v < 0 for v in result):
        raise KVShapeError(f"{name} must be non-negative, got {result}")
    return result


def _check_inputs(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    query_lens: Lengths,
    seq_lens: Lengths,
    check_bounds: bool | None,
) -> _Batch:
    for tensor, name in (
        (query, "query"),
        (key_pages, "key_pages"),
        (value_pages, "value_pages"),
        (block_tables, "block_tables"),
    ):
        if not isinstance(tensor, Tensor):
            raise KVDtypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if query.dim() != 3:
        raise KVShapeError(
            f"query must be [total_query_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if key_pages.dim() != 4:
        raise KVShapeError(
            "key_pages must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_pages.shape)}"
        )
    if value_pages.shape != key_pages.shape:
        raise KVShapeError(
            f"value_pages {tuple(value_pages.shape)} differs from key_pages "
            f"{tuple(key_pages.shape)}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = (int(d) for d in key_pages.shape)
    num_heads = int(query.shape[1])
    if int(query.shape[2]) != head_dim:
        raise KVShapeError(f"query head_dim {query.shape[2]} differs from the pages' {head_dim}")
    if num_heads == 0 or num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise KVShapeError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    if not query.dtype.is_floating_point:
        raise KVDtypeError(f"query must be floating point, got {query.dtype}")
    if key_pages.dtype != query.dtype or value_pages.dtype != query.dtype:
        raise KVDtypeError(
            f"query, key_pages and value_pages must share a dtype, got {query.dtype}, "
            f"{key_pages.dtype}, {value_pages.dtype}"
        )
    if key_pages.device != query.device or value_pages.device != query.device:
        raise KVDeviceError(
            f"query, key_pages and value_pages must share a device, got {query.device}, "
            f"{key_pages.device}, {value_pages.device}"
        )
    if block_tables.device != query.device and block_tables.device.type != "cpu":
        raise KVDeviceError(
            f"block_tables is on {block_tables.device}, the query on {query.device}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise KVDtypeError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    if block_tables.dim() != 2:
        raise KVShapeError(
            f"block_tables must be [batch, max_blocks_per_request], got {tuple(block_tables.shape)}"
        )

    batch_size, max_blocks = (int(d) for d in block_tables.shape)
    q_lens = _lengths(query_lens, "query_lens")
    s_lens = _lengths(seq_lens, "seq_lens")
    if len(q_lens) != batch_size or len(s_lens) != batch_size:
        raise KVShapeError(
            f"block_tables has {batch_size} rows, query_lens {len(q_lens)}, seq_lens {len(s_lens)}"
        )
    for b, (q_len, s_len) in enumerate(zip(q_lens, s_lens, strict=True)):
        if q_len > s_len:
            raise KVShapeError(
                f"request {b}: query_len {q_len} exceeds seq_len {s_len}; the new tokens' K and "
                "V must be written into the pages (and counted in seq_len) before attention"
            )
        if -(-s_len // block_size) > max_blocks:
            raise KVShapeError(
                f"request {b}: {s_len} tokens need {-(-s_len // block_size)} blocks of "
                f"{block_size}, block_tables has {max_blocks} columns"
            )
    if sum(q_lens) != int(query.shape[0]):
        raise KVShapeError(f"query has {query.shape[0]} tokens but query_lens sum to {sum(q_lens)}")

    free = block_tables.device.type == "cpu"
    if check_bounds or (check_bounds is None and free):
        # Only the columns a request uses: padding may hold anything (vLLM pads with 0, others -1).
        blocks_used = torch.tensor([-(-s // block_size) for s in s_lens], dtype=torch.int64)
        used = torch.arange(max_blocks)[None, :] < blocks_used[:, None]
        used_ids = block_tables.cpu()[used]
        if used_ids.numel() > 0:
            low, high = (int(x) for x in torch.aminmax(used_ids))
            if low < 0 or high >= num_blocks:
                bad = low if low < 0 else high
                raise KVIndexError(
                    f"block_tables references block {bad}, outside [0, {num_blocks})"
                )

    starts = [0]
    for q_len in q_lens[:-1]:
        starts.append(starts[-1] + q_len)
    return _Batch(query_lens=q_lens, seq_lens=s_lens, query_starts=starts)


def _allowed_keys(
    query_positions: Tensor, key_positions: Tensor, sliding_window: int | None
) -> Tensor:
    """Boolean ``[num_queries, num_keys]``: may the query at each position see each key."""
    delta = query_positions[:, None] - key_positions[None, :]
    allowed = delta >= 0
    if sliding_window is not None:
        allowed &= delta < sliding_window
    return allowed


# -- reference backend -----------------------------------------------------------------------


def _reference_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    batch: _Batch,
    scale: float,
    sliding_window: int | None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    num_heads, num_kv_heads = int(query.shape[1]), int(key_pages.shape[2])
    group = num_heads // num_kv_heads
    # float32 at least, so the oracle is not limited by half-precision arithmetic in SDPA.
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    output = torch.empty_like(query)
    for b in range(batch.size):
        q_len, n = batch.query_lens[b], batch.seq_lens[b]
        if q_len == 0:
            continue
        keys, values = gather_pages(key_pages, value_pages, block_tables[b], n, check_bounds=False)
        keys = keys.repeat_interleave(group, dim=1).to(compute_dtype).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).to(compute_dtype).transpose(0, 1)
        start = batch.query_starts[b]
        queries = query[start : start + q_len].to(compute_dtype).transpose(0, 1)
        mask = _reference_mask(q_len, n, sliding_window, query.device)
        if sinks is None and softcap is None:
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale
            )
        else:  # SDPA has neither: the softmax written out, capped, the sink's column appended
            scores = queries @ keys.transpose(-1, -2) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, -math.inf)
            if sinks is not None:
                sink_column = sinks.to(compute_dtype)[:, None, None].expand(-1, q_len, 1)
                scores = torch.cat((scores, sink_column), dim=-1)
            weights = torch.softmax(scores, dim=-1)
            attended = (weights[..., :-1] if sinks is not None else weights) @ values
        output[start : start + q_len] = attended.transpose(0, 1).to(query.dtype)
    return output


def _reference_mask(
    query_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> Tensor:
    """The mask of the module docstring, built independently of `_allowed_keys` on purpose.

    Row i is the query at position ``p = m + i`` (``m = seq_len - query_len``); ``tril`` with
    diagonal ``m`` keeps keys ``<= p``, and removing ``tril`` with diagonal ``m - w`` drops keys
    ``<= p - w``. A mistake shared with the fast backends' mask could not show in a comparison.
    """
    cached = seq_len - query_len
    ones = torch.ones(query_len, seq_len, dtype=torch.bool, device=device)
    mask = ones.tril(diagonal=cached)
    if sliding_window is not None:
        mask &= ~ones.tril(diagonal=cached - sliding_window)
    return mask


# -- torch backend ---------------------------------------------------------------------------


def _torch_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    batch: _Batch,
    scale: float,
    sliding_window: int | None,
    sinks: Tensor | None = None,
    *,
    softcap: float | None = None,
    query_tile: int = _TORCH_QUERY_TILE,
    kv_tile_tokens: int = _TORCH_KV_TILE_TOKENS,
) -> Tensor:
    """Online-softmax attention over KV tiles of whole pages (see the module docstring)."""
    num_heads, head_dim = int(query.shape[1]), int(query.shape[2])
    block_size, num_kv_heads = int(key_pages.shape[1]), int(key_pages.shape[2])
    group = num_heads // num_kv_heads
    pages_per_tile = max(1, kv_tile_tokens // block_size)
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    tables = block_tables.to(device=query.device, dtype=torch.int64)
    output = torch.empty_like(query)

    for b in range(batch.size):
        q_len, n = batch.query_lens[b], batch.seq_lens[b]
        cached = n - q_len
        for tile_start in range(0, q_len, query_tile):
            tile_len = min(query_tile, q_len - tile_start)
            first_pos = cached + tile_start  # absolute position of the tile's first query
            last_pos = first_pos + tile_len - 1
            rows = slice(
                batch.query_starts[b] + tile_start, batch.query_starts[b] + tile_start + tile_len
            )
            # [tile, heads, dim] -> [kv_heads, group * tile, dim]: query head kv*group + g reads
            # KV head kv, so each KV head's tile is used by one batched matmul, never repeated.
            queries = (
                query[rows]
                .to(compute_dtype)
                .mul(scale)
                .view(tile_len, num_kv_heads, group, head_dim)
                .permute(1, 2, 0, 3)
                .reshape(num_kv_heads, group * tile_len, head_dim)
            )
            query_positions = torch.arange(first_pos, last_pos + 1, device=query.device)
            running_max = torch.full(
                (num_kv_heads, group * tile_len),
                -math.inf,
                dtype=compute_dtype,
                device=query.device,
            )
            running_sum = torch.zeros_like(running_max)
            if sinks is not None:
                # The sink as the first key seen: its score starts the running max, its
                # exp(0) = 1 the running sum, its (absent) value adds nothing.
                running_max = (
                    sinks.to(compute_dtype)
                    .view(num_kv_heads, group, 1)
                    .expand(-1, -1, tile_len)
                    .reshape(num_kv_heads, group * tile_len)
                )
                running_sum = torch.ones_like(running_max)
            accumulator = torch.zeros(
                (num_kv_heads, group * tile_len, head_dim), dtype=compute_dtype, device=query.device
            )
            lowest_key = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
            first_page = lowest_key // block_size
            last_page = last_pos // block_size  # keys after last_pos are masked for every row
            for page in range(first_page, last_page + 1, pages_per_tile):
                pages = tables[b, page : min(page + pages_per_tile, last_page + 1)]
                key_start = page * block_size
                # Only keys that exist: past position n-1 a partial page holds stale data.
                tile_keys = min(pages.numel() * block_size, last_pos + 1 - key_start)
                keys = key_pages.index_select(0, pages).view(-1, num_kv_heads, head_dim)
                values = value_pages.index_select(0, pages).view(-1, num_kv_heads, head_dim)
                keys = keys[:tile_keys].to(compute_dtype).permute(1, 2, 0)  # [kv, dim, keys]
                values = values[:tile_keys].to(compute_dtype).transpose(0, 1)  # [kv, keys, dim]

                scores = torch.bmm(queries, keys).view(num_kv_heads, group, tile_len, tile_keys)
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                key_positions = torch.arange(key_start, key_start + tile_keys, device=query.device)
                allowed = _allowed_keys(query_positions, key_positions, sliding_window)
                scores = scores.masked_fill(~allowed, -math.inf).view(
                    num_kv_heads, group * tile_len, tile_keys
                )

                new_max = torch.maximum(running_max, scores.amax(dim=-1))
                # A row with every key masked so far has max -inf; shift by 0 instead so that
                # exp(-inf - (-inf)) does not turn into NaN. Its weights are all exp(-inf) = 0.
                shift = new_max.masked_fill(new_max == -math.inf, 0.0)
                weights = torch.exp(scores - shift[..., None])
                rescale = torch.exp(running_max - shift)
                running_sum = running_sum * rescale + weights.sum(dim=-1)
                accumulator = accumulator * rescale[..., None] + torch.bmm(weights, values)
                running_max = new_max

            # Every query sees at least itself, so running_sum > 0.
            attended = accumulator / running_sum[..., None]
            output[rows] = (
                attended.view(num_kv_heads, group, tile_len, head_dim)
                .permute(2, 0, 1, 3)
                .reshape(tile_len, num_heads, head_dim)
                .to(query.dtype)
            )
    return output


def _sdpa_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    batch: _Batch,
    scale: float,
    sliding_window: int | None,
    *,
    query_tile: int = _SDPA_QUERY_TILE,
) -> Tensor:
    """The torch backend through torch's fused SDPA kernel (see the module docstring)."""
    block_size, num_kv_heads = int(key_pages.shape[1]), int(key_pages.shape[2])
    head_dim = int(query.shape[2])
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    tables = block_tables.to(device=query.device, dtype=torch.int64)
    output = torch.empty_like(query)
    for b in range(batch.size):
        q_len, n = batch.query_lens[b], batch.seq_lens[b]
        if q_len == 0:
            continue
        cached = n - q_len
        # The lowest key any of this request's queries reads, and the pages from its page on.
        lowest = 0 if sliding_window is None else max(0, cached - sliding_window + 1)
        first_page = lowest // block_size
        pages = tables[b, first_page : -(-n // block_size)]
        skip = lowest - first_page * block_size
        keys = key_pages.index_select(0, pages).view(-1, num_kv_heads, head_dim)
        values = value_pages.index_select(0, pages).view(-1, num_kv_heads, head_dim)
        # [1, kv_heads, keys, dim] for positions lowest .. n-1: the slots past n-1 of the last
        # page (stale, possibly NaN) are cut here, never read.
        keys = keys[skip : skip + n - lowest].to(compute_dtype).transpose(0, 1)[None]
        values = values[skip : skip + n - lowest].to(compute_dtype).transpose(0, 1)[None]
        start = batch.query_starts[b]
        queries = query[start : start + q_len].to(compute_dtype).transpose(0, 1)[None]
        if cached == 0 and sliding_window is None:
            # Top-left causal alignment is the right one when queries and keys both start at 0.
            attended = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            tiles = []
            for tile_start in range(0, q_len, query_tile):
                tile_len = min(query_tile, q_len - tile_start)
                first_pos = cached + tile_start
                last_pos = first_pos + tile_len - 1
                key_low = (
                    lowest if sliding_window is None else max(0, first_pos - sliding_window + 1)
                )
                allowed = _allowed_keys(
                    torch.arange(first_pos, last_pos + 1, device=query.device),
                    torch.arange(key_low, last_pos + 1, device=query.device),
                    sliding_window,
                )
                tiles.append(
                    F.scaled_dot_product_attention(
                        queries[:, :, tile_start : tile_start + tile_len],
                        keys[:, :, key_low - lowest : last_pos + 1 - lowest],
                        values[:, :, key_low - lowest : last_pos + 1 - lowest],
                        attn_mask=allowed,
                        scale=scale,
                        enable_gqa=True,
                    )
                )
            attended = tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=2)
        output[start : start + q_len] = attended[0].transpose(0, 1).to(query.dtype)
    return output


# -- triton backend --------------------------------------------------------------------------


def _triton_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    batch: _Batch,
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    if query.dtype not in _TRITON_DTYPES:
        raise KVDtypeError(f"backend='triton' supports {_TRITON_DTYPES}, got {query.dtype}")
    if not triton_available():
        raise BackendUnavailableError("backend='triton' needs the triton package")
    if query.device.type != "cuda" and not _triton_interpreting():
        raise BackendUnavailableError(
            f"backend='triton' runs on CUDA tensors (got {query.device}); on the CPU only under "
            "Triton's interpreter, TRITON_INTERPRET=1"
        )
    from prefixkv.kv import _triton_prefill as kernel

    return kernel.paged_prefill(
        query,
        key_pages,
        value_pages,
        block_tables.to(query.device),
        query_lens=batch.query_lens,
        seq_lens=batch.seq_lens,
        query_starts=batch.query_starts,
        scale=scale,
        sliding_window=sliding_window,
    )
