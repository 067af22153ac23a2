"""KV storage and attention over it (torch; Triton on CUDA): the layer that moves tensors.

- `pages` (`PagedKVCache`): the pages of every layer in one allocation, slots, page copies.
- `grouped` (`GroupedKVCache`): one set of pages per KV group of a hybrid model.
- `prefill` (`paged_prefill_attention`): new tokens attending to keys read from pages, tiled
  FlashAttention-style; `_triton_prefill` is its CUDA kernel.
- `decode` (`paged_decode_attention`): one query per request (decode steps).

This layer imports the block-manager layer (`prefixkv.errors`, `prefixkv.kv_groups`) and
nothing above it: no model, no engine. `prefixkv.kv.pages` keeps the names the module of that name
had (the pages' API).
"""

from prefixkv.kv.pages import (
    BlockIds,
    KVDeviceError,
    KVDtypeError,
    KVIndexError,
    KVShapeError,
    PagedKVCache,
    PagedKVError,
    gather_pages,
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
