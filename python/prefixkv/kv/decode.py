"""Attention for a batch where every request computes one query (a decode step, or a full
prefix hit recomputing its last token): `paged_decode_attention`.

`prefixkv.kv.prefill.paged_prefill_attention` handles any batch, one request and one KV tile at
a time, which is right for prefill (long query tiles amortise each loop iteration) and slow for
decode: there each request does a handful of tiny matmuls per layer, and with 8 requests the
Python loop and its small ops cost as much as the model's linear layers (a SmolLM2-135M decode
step at batch 8 was 1.5x slower than transformers'). Here the whole batch is one gather of the
page slots its keys live in (padded to the longest request) and one call of torch's fused SDPA
kernel, with a mask per request. The gather reads slots, not whole pages: a position a
request does not attend to (past its length, before its window) reads the slot of its last
token instead, which holds real KV and is masked out, so a stale slot (an earlier owner's
data, even NaN, or a released block) never reaches the kernel, where a masked NaN value
would still poison the weighted sum.

Same contract as the torch backend: keys at positions ``0 .. seq_len - 1`` of each request,
grouped-query heads (query head ``h`` reads KV head ``h // group``), an optional sliding window
(a query at ``p`` sees keys ``k`` with ``p - window < k <= p``), softmax in at least float32.
Page slots past a request's `seq_len` are never read into a result: their scores are masked and
their values zeroed (a page may hold stale data, even NaN, from an earlier owner).
`tests/test_decode_attention.py` checks it against the reference backend on drawn shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DecodeReads", "paged_decode_attention", "plan_decode_reads"]


@dataclass(frozen=True)
class DecodeReads:
    """Where a decode batch's keys are read from: the page slot of each (request, key) pair and
    which of them each request attends to. It depends only on the block tables, the lengths
    and the window, so every layer sharing those reads the same one: `LlamaModel.prefill`
    plans it once per step instead of once per layer (`plan_decode_reads`)."""

    slots: Tensor  # [batch, keys] int64 slots of positions lowest .. longest - 1
    mask: Tensor | None  # [batch, 1, 1, keys] bool, None when every request reads every key


def plan_decode_reads(
    block_tables: Tensor,
    seq_lens: Sequence[int],
    block_size: int,
    *,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> DecodeReads:
    """The `DecodeReads` of a batch (arguments as `paged_decode_attention` takes them)."""
    device = block_tables.device if device is None else device
    longest = max(seq_lens)
    # Keys from the lowest position any request's window reaches to the longest request's end.
    lowest = 0 if sliding_window is None else max(0, min(seq_lens) - sliding_window)
    positions = torch.arange(lowest, longest, device=device)
    ends = torch.tensor(list(seq_lens), device=device)[:, None]
    allowed = positions[None, :] < ends  # [batch, keys]
    if sliding_window is not None:
        allowed &= positions[None, :] > ends - 1 - sliding_window
    read = torch.where(allowed, positions[None, :], ends - 1)
    tables = block_tables.to(device=device, dtype=torch.int64)
    slots = tables.gather(1, read // block_size) * block_size + read % block_size
    # Requests of one length read every gathered key (the window, if any, starts at `lowest`
    # for each): no mask, decided on the host so a CUDA batch does not sync here.
    mask = None if min(seq_lens) == longest else allowed[:, None, None, :]
    return DecodeReads(slots=slots, mask=mask)


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
    reads: DecodeReads | None = None,
) -> Tensor:
    """``query [batch, heads, dim]`` (the query of request b at position ``seq_lens[b] - 1``)
    over ``key_pages`` / ``value_pages [blocks, block_size, kv_heads, dim]`` through
    ``block_tables [batch, >= pages]``; returns ``[batch, heads, dim]`` in the query's dtype.
    `softcap` (Gemma 2) caps each scaled score, ``tanh(s / softcap) * softcap``, before the
    mask. `sinks` ``[heads]``: gpt-oss's per-head logit in each softmax's denominator (see
    `prefixkv.kv.prefill.paged_prefill_attention`). SDPA has neither, so with either the softmax
    is written out over the same gathered keys. `reads`, when given, is `plan_decode_reads` of
    these same arguments (planned once for many layers). Arguments are trusted (validated by the
    caller, as `LlamaModel.prefill` does)."""
    batch, num_heads, head_dim = (int(d) for d in query.shape)
    block_size, num_kv_heads = int(key_pages.shape[1]), int(key_pages.shape[2])
    if reads is None:
        reads = plan_decode_reads(
            block_tables, seq_lens, block_size, sliding_window=sliding_window, device=query.device
        )
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    flat = (-1, num_kv_heads, head_dim)
    slots = reads.slots.view(-1)
    # [batch, kv_heads, keys, dim]
    keys = key_pages.view(flat).index_select(0, slots)
    keys = keys.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(compute_dtype)
    values = value_pages.view(flat).index_select(0, slots)
    values = values.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(compute_dtype)
    if sinks is not None or softcap is not None:
        group = num_heads // num_kv_heads
        # [batch, kv_heads, group, dim] x [batch, kv_heads, dim, keys]
        queries = query.to(compute_dtype).mul(scale).view(batch, num_kv_heads, group, head_dim)
        scores = queries @ keys.transpose(-1, -2)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if reads.mask is not None:  # [batch, 1, 1, keys]
            scores = scores.masked_fill(~reads.mask, float("-inf"))
        if sinks is not None:  # one more column, the sink's logit, dropped after the softmax
            sink_column = sinks.to(compute_dtype).view(1, num_kv_heads, group, 1)
            scores = torch.cat((scores, sink_column.expand(batch, -1, -1, 1)), dim=-1)
        weights = torch.softmax(scores, dim=-1)
        if sinks is not None:
            weights = weights[..., :-1]
        return (weights @ values).reshape(batch, num_heads, head_dim).to(query.dtype)
    queries = query.to(compute_dtype)[:, :, None, :]  # [batch, heads, 1, dim]
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=reads.mask, scale=scale, enable_gqa=True
    )
    return attended.view(batch, num_heads, head_dim).to(query.dtype)
