"""The Triton kernel behind ``paged_prefill_attention(..., backend="triton")``.

Imported only when that backend runs, because importing triton is slow and triton is optional.
`prefixkv.kv.prefill` validates every input before calling in; this module trusts them.

Work split: the queries of each request are cut into tiles of ``BLOCK_M`` rows, and one program
handles one (query tile, query head). The host lists the tiles (request index and first row) so
the grid is exactly as large as the work, however unequal the requests. A program walks the keys
its tile may see in chunks of ``BLOCK_N`` tokens, finding each key's page through the block
table (token ``t`` lives at offset ``t % block_size`` of block ``block_table[t // block_size]``),
so any block size works, powers of two or not, and K and V are read in place, never gathered.

The arithmetic is FlashAttention's online softmax in base 2 (``exp2`` is the native instruction;
the scale is multiplied by ``log2(e)`` to compensate). Scores, the running max and sum, and the
accumulator are float32. For float32 inputs the matmuls ask for IEEE precision, because Triton
otherwise uses TF32 (10-bit mantissa) on recent GPUs. For half-precision inputs the probabilities
are rounded to the input dtype before the ``P @ V`` matmul, as FlashAttention does, which keeps
the tensor cores busy and costs at most one rounding of each weight (see the tests for bounds).

Under Triton's interpreter, bfloat16 operands of ``tl.dot`` are multiplied as raw bit patterns
(triton-lang/triton#11584; bfloat16 arithmetic is unsupported there, casts are fine), so in that
mode bfloat16 matmuls run on float32 copies, with the weights still rounded to bfloat16 first so
the numerics match the compiled kernel's.

Triton's interpreter (``TRITON_INTERPRET=1``) must be switched on before triton is first
imported in the process: triton.language's own helpers (``tl.max``, ``tl.sum``...) are jitted
when it is imported, and an interpreted kernel cannot call compiled ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

_LOG2_E = 1.0 / math.log(2.0)


@triton.jit
def _paged_prefill_kernel(
    Query,  # [total_query_tokens, num_heads, head_dim]
    KeyPages,  # [num_blocks, block_size, num_kv_heads, head_dim]
    ValuePages,
    Output,  # like Query
    BlockTables,  # [batch, max_blocks_per_request]
    TileRequest,  # [num_tiles]: request of each query tile
    TileFirstQuery,  # [num_tiles]: index of the tile's first query within its request
    QueryStarts,  # [batch]: row of the request's first query in Query
    QueryLens,  # [batch]
    SeqLens,  # [batch]
    scale_log2,  # softmax scale * log2(e)
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_k_dim,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_v_dim,
    stride_o_token,
    stride_o_head,
    stride_o_dim,
    stride_table_row,
    block_size,
    head_dim,
    group_size,  # query heads per KV head
    sliding_window,  # used only when HAS_WINDOW
    HAS_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # float32 inputs, or bfloat16 under the interpreter (see below)
    ROUND_WEIGHTS: tl.constexpr,  # half-precision inputs: P is rounded to their dtype for P @ V
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    request = tl.load(TileRequest + tile)
    first_query = tl.load(TileFirstQuery + tile)
    query_start = tl.load(QueryStarts + request)
    query_len = tl.load(QueryLens + request)
    seq_len = tl.load(SeqLens + request)
    cached = seq_len - query_len
    kv_head = head // group_size

    rows = first_query + tl.arange(0, BLOCK_M)  # query index within the request
    row_valid = rows < query_len
    positions = cached + rows  # absolute token positions of the queries
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim

    query_ptrs = (
        Query
        + (query_start + rows).to(tl.int64)[:, None] * stride_q_token
        + head * stride_q_head
        + dims[None, :] * stride_q_dim
    )
    queries = tl.load(query_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        queries = queries.to(tl.float32)

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    accumulator = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys the tile may see: causal up to its last query, the window back from its first one.
    key_end = tl.minimum(cached + first_query + BLOCK_M, seq_len)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(cached + first_query - sliding_window + 1, 0)

    table_row = BlockTables + request.to(tl.int64) * stride_table_row
    for chunk_start in range(key_begin, key_end, BLOCK_N):
        keys_at = chunk_start + tl.arange(0, BLOCK_N)
        key_valid = keys_at < key_end
        # Padding entries of the block table are never read: the load is masked.
        block_ids = tl.load(table_row + keys_at // block_size, mask=key_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        slots_in_block = keys_at % block_size
        load_mask = key_valid[:, None] & dim_valid[None, :]

        key_ptrs = (
            KeyPages
            + block_ids[:, None] * stride_k_block
            + slots_in_block[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dims[None, :] * stride_k_dim
        )
        keys = tl.load(key_ptrs, mask=load_mask, other=0.0)
        if DOT_IN_FP32:
            scores = tl.dot(queries, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(queries, tl.trans(keys))
        scores = scores * scale_log2

        allowed = (keys_at[None, :] <= positions[:, None]) & key_valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & (keys_at[None, :] > positions[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # Rows with no visible key yet keep max -inf; shift them by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.math.exp2(scores - shift[:, None])
        rescale = tl.math.exp2(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)

        value_ptrs = (
            ValuePages
            + block_ids[:, None] * stride_v_block
            + slots_in_block[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dims[None, :] * stride_v_dim
        )
        # other=0 matters: a partial page past the last token may hold anything, even NaN.
        values = tl.load(value_ptrs, mask=load_mask, other=0.0)
        if ROUND_WEIGHTS:
            weights = weights.to(values.dtype)
        if DOT_IN_FP32:
            update = tl.dot(weights.to(tl.float32), values.to(tl.float32), input_precision="ieee")
        else:
            update = tl.dot(weights, values)
        accumulator = accumulator * rescale[:, None] + update
        running_max = new_max

    # Rows past the request's last query never saw a key; keep them finite, they are not stored.
    running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    attended = accumulator / running_sum[:, None]
    output_ptrs = (
        Output
        + (query_start + rows).to(tl.int64)[:, None] * stride_o_token
        + head * stride_o_head
        + dims[None, :] * stride_o_dim
    )
    tl.store(
        output_ptrs,
        attended.to(Output.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def _tile_sizes(head_dim: int, dtype: torch.dtype, interpreting: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): rows per program, keys per chunk, padded head dim."""
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every side >= 16
    if interpreting:
        # The interpreter runs every lane in numpy: the smallest legal tiles are the fastest.
        return 16, 16, block_d
    element_bytes = torch.empty((), dtype=dtype).element_size()
    # Keep the Q, K and V tiles within shared memory on every GPU Triton supports.
    if block_d * element_bytes <= 256:
        return 64, 64, block_d
    return 32, 32, block_d


def paged_prefill(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    *,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    query_starts: Sequence[int],
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    """Launch the kernel; arguments as validated by `prefixkv.kv.prefill.paged_prefill_attention`."""
    output = torch.empty_like(query)
    num_heads, head_dim = int(query.shape[1]), int(query.shape[2])
    num_kv_heads = int(key_pages.shape[2])
    interpreting = bool(triton.knobs.runtime.interpret)
    block_m, block_n, block_d = _tile_sizes(head_dim, query.dtype, interpreting)

    tile_request: list[int] = []
    tile_first_query: list[int] = []
    for request, query_len in enumerate(query_lens):
        for first in range(0, query_len, block_m):
            tile_request.append(request)
            tile_first_query.append(first)
    if not tile_request:
        return output

    device = query.device

    def on_device(values: Sequence[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    grid = (len(tile_request), num_heads)
    _paged_prefill_kernel[grid](
        query,
        key_pages,
        value_pages,
        output,
        block_tables,
        on_device(tile_request),
        on_device(tile_first_query),
        on_device(query_starts),
        on_device(query_lens),
        on_device(seq_lens),
        scale * _LOG2_E,
        *query.stride(),
        *key_pages.stride(),
        *value_pages.stride(),
        *output.stride(),
        block_tables.stride(0),
        int(key_pages.shape[1]),
        head_dim,
        num_heads // num_kv_heads,
        sliding_window or 0,
        HAS_WINDOW=sliding_window is not None,
        # Triton's interpreter multiplies the raw bits of bfloat16 operands in tl.dot
        # (triton-lang/triton#11584, "not supported yet"); its casts are right, so under the
        # interpreter bfloat16 matmuls run on float32 copies, with P still rounded to bfloat16.
        DOT_IN_FP32=query.dtype == torch.float32
        or (interpreting and query.dtype == torch.bfloat16),
        ROUND_WEIGHTS=query.dtype != torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return output
