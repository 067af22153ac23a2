"""The batched decode path (`prefixkv.kv.decode`) against the reference backend of
`paged_prefill_attention`, on drawn batches, lengths, head groupings, windows and dtypes, with
stale pages full of NaN (a slot past a request's length must never reach its result); and the
decoder's use of it: one fused attention call per layer, its reads planned once per step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.kv import decode
from prefixkv.kv.decode import paged_decode_attention, plan_decode_reads
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv.prefill import paged_prefill_attention
from prefixkv.models.decoder import DecodeRequest, LlamaModel, ModelConfig, PrefillRequest


@given(
    seq_lens=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=5),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(min_value=1, max_value=12)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_decode_path_equals_the_reference(
    seq_lens: list[int],
    kv_heads: int,
    group: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    head_dim, heads = 8, kv_heads * group
    pages_per_request = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_request) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_pages = torch.randn(shape, generator=generator, dtype=dtype) * 3
    value_pages = torch.randn(shape, generator=generator, dtype=dtype)
    # Shuffled, non-contiguous tables, and NaN in every slot no request owns.
    order = torch.randperm(num_blocks, generator=generator)
    tables, start = [], 0
    for count in pages_per_request:
        tables.append(order[start : start + count])
        start += count
    width = max(pages_per_request)
    block_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    owned = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    for row, (table, n) in enumerate(zip(tables, seq_lens, strict=True)):
        block_tables[row, : table.numel()] = table.to(torch.int32)
        for position in range(n):
            owned[table[position // block_size], position % block_size] = True
    key_pages[~owned] = float("nan")
    value_pages[~owned] = float("nan")
    query = torch.randn((len(seq_lens), heads, head_dim), generator=generator, dtype=dtype)

    ours = paged_decode_attention(
        query, key_pages, value_pages, block_tables, seq_lens, scale=0.7, sliding_window=window
    )
    reference = paged_prefill_attention(
        query, key_pages, value_pages, block_tables, [1] * len(seq_lens), seq_lens,
        scale=0.7, sliding_window=window, backend="reference",
    )  # fmt: skip
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, reference)
    # The same reads planned ahead (as the decoder does, once for every layer) read the same.
    planned = plan_decode_reads(block_tables, seq_lens, block_size, sliding_window=window)
    again = paged_decode_attention(
        query, key_pages, value_pages, block_tables, seq_lens, scale=0.7,
        sliding_window=window, reads=planned,
    )  # fmt: skip
    assert torch.equal(again, ours)


def test_a_decode_step_plans_its_reads_once_and_attends_in_one_fused_call_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of three requests of different lengths: one plan for the whole step (not one per
    layer: that was per-layer Python the step paid 30 times on SmolLM2) and one SDPA call per
    layer over gathered slots (not a padded copy of every page and two einsums), with the
    greedy logits of the step still those of a full recompute."""
    config = ModelConfig(num_layers=3)
    model = LlamaModel.random(config, seed=3)
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4, 6], [11, 2, 13, 5, 6, 1, 9, 10, 12, 3, 2]]
    kv = PagedKVCache(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim)
    tables = [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    model.prefill(kv, [PrefillRequest(p, t) for p, t in zip(prompts, tables, strict=True)])
    plans: list[int] = []
    fused: list[tuple[int, ...]] = []
    plan, sdpa = decode.plan_decode_reads, decode.F.scaled_dot_product_attention

    def counting_plan(*args: Any, **kwargs: Any) -> decode.DecodeReads:
        plans.append(len(args[1]))
        return plan(*args, **kwargs)

    def counting_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        fused.append(tuple(args[1].shape))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr("prefixkv.models.decoder.plan_decode_reads", counting_plan)
    monkeypatch.setattr(decode.F, "scaled_dot_product_attention", counting_sdpa)
    sequences = [[*p, 17] for p in prompts]
    logits = model.decode_step(
        kv, [DecodeRequest(s, t) for s, t in zip(sequences, tables, strict=True)]
    )
    assert plans == [3]
    # [batch, kv_heads, keys up to the longest request, head_dim], once per layer.
    assert fused == [(3, config.num_kv_heads, 12, config.head_dim)] * config.num_layers
    for row, sequence in enumerate(sequences):
        torch.testing.assert_close(logits[row], model.forward_full(sequence)[-1])
