"""The batched decode path (`prefixkv.kv.decode`) against the reference backend of
`paged_prefill_attention`, on drawn batches, lengths, head groupings, windows and dtypes, with
stale pages full of NaN (a slot past a request's length must never reach its result)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.kv.decode import paged_decode_attention
from prefixkv.kv.prefill import paged_prefill_attention


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
