"""Attention for a batch where every request computes one query (a decode step, or a full
prefix hit recomputing its last token): `paged_decode_attention`.

`prefixkv.kv.prefill.paged_prefill_attention` handles any batch, one request and one KV tile at
a time, which is right for prefill (long query tiles amortise each loop iteration) and slow for
decode: there each request does a handful of tiny matmuls per layer, and with 8 requests the
Python loop and its small ops cost as much as the model's linear layers (a SmolLM2-135M decode
step at batch 8 was 1.5x slower than transformers'). Here the whole batch is one gather of its
pages (padded to the longest request) and two batched matmuls, with a mask per request.

Same contract as the torch backend: keys at positions ``0 .. seq_len - 1`` of each request,
grouped-query heads (query head ``h`` reads KV head ``h // group``), an optional sliding window
(a query at ``p`` sees keys ``k`` with ``p - window < k <= p``), softmax in at least float32.
Page slots past a request's `seq_len` are never read into a result: their scores are masked and
their values zeroed (a page may hold stale data, even NaN, from an earlier owner).
`tests/test_decode_attention.py` checks it against the reference backend on drawn shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["paged_decode_attention"]


def paged_decode_attention(
    query: Tensor,
    key_pages: Tensor,
    value_pages: Tensor,
    block_tables: Tensor,
    seq_lens: Sequence[int],
    *,
    scale: float,
    sliding_window: int | None = None,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``query [batch, heads, dim]`` (the query of request b at position ``seq_lens[b] - 1``)
    over ``key_pages`` / ``value_pages [blocks, block_size, kv_heads, dim]`` through
    ``block_tables [batch, >= pages]``; returns ``[batch, heads, dim]`` in the query's dtype.
    Arguments are trusted (validated by the caller, as `LlamaModel.prefill` does).
    `softcap` (Gemma 2) caps each scaled score, ``tanh(s / softcap) * softcap``, before the
    mask. `sinks` ``[heads]``: gpt-oss's per-head logit in each softmax's denominator (see
    `prefixkv.kv.prefill.paged_prefill_attention`)."""
    batch, num_heads, head_dim = (int(d) for d in query.shape)
    block_size, num_kv_heads = int(key_pages.shape[1]), int(key_pages.shape[2])
    group = num_heads // num_kv_heads
    longest = max(seq_lens)
    pages = -(-longest // block_size)
    tables = block_tables[:, :pages].to(device=query.device, dtype=torch.int64)
    compute_dtype = torch.promote_types(query.dtype, torch.float32)

    # [batch, pages * block_size, kv_heads, dim], cut at the longest request.
    keys = key_pages[tables].view(batch, pages * block_size, num_kv_heads, head_dim)[:, :longest]
    values = value_pages[tables].view(batch, pages * block_size, num_kv_heads, head_dim)
    values = values[:, :longest]
    positions = torch.arange(longest, device=query.device)
    ends = torch.tensor(list(seq_lens), device=query.device)[:, None]
    allowed = positions[None, :] < ends  # [batch, keys]
    if sliding_window is not None:
        allowed &= positions[None, :] > ends - 1 - sliding_window
    values = torch.where(allowed[:, :, None, None], values, 0).to(compute_dtype)

    queries = query.to(compute_dtype).mul(scale).view(batch, num_kv_heads, group, head_dim)
    # [batch, kv_heads, group, keys]
    scores = torch.einsum("bhgd,bnhd->bhgn", queries, keys.to(compute_dtype))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    if sinks is not None:  # one more column, the sink's logit, dropped after the softmax
        sink_column = sinks.to(compute_dtype).view(1, num_kv_heads, group, 1)
        scores = torch.cat((scores, sink_column.expand(batch, -1, -1, 1)), dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    attended = torch.einsum("bhgn,bnhd->bhgd", weights, values)
    return attended.reshape(batch, num_heads, head_dim).to(query.dtype)
