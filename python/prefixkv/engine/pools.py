"""The KV pools an `Engine` serves from, and what one request needs of them.

A model without sliding-window layers has one pool (`PagedKVCache`) for all its layers. A model
with sliding-window layers forms KV groups (`prefixkv.kv_groups`, docs/hybrid.md), one pool per
group (`GroupedKVCache`); by default each group gets as many blocks as one pool for all layers
would have, the same memory, since each group's block holds only its own layers.

A full-attention group holds every block of a request; a sliding-window group releases what
its window passed, so it holds at most the window, the largest step and a block of slack on
each side (`blocks_held`). `check_fits` refuses, before anything is scheduled, a request that
no amount of waiting or preemption could fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixkv.engine.inputs import positive_int
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import KVGroupSpec
from prefixkv.models.decoder import ModelConfig

__all__ = ["DEFAULT_NUM_BLOCKS", "blocks_held", "build_kv_cache", "check_fits", "pool_sizes"]

#: Blocks of the pool (of each group's pool) when neither a count nor a memory budget is given.
DEFAULT_NUM_BLOCKS = 1024


def build_kv_cache(
    config: ModelConfig,
    kv_groups: Sequence[KVGroupSpec],
    *,
    grouped: bool,
    num_blocks: int | None,
    kv_memory_bytes: int | None,
    kv_group_blocks: Sequence[int] | None,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedKVCache | GroupedKVCache:
    """The engine's KV storage: one pool, or one per KV group when `grouped` (the caller has
    refused num_blocks together with kv_memory_bytes)."""
    geometry = (config.num_layers, block_size, config.num_kv_heads, config.head_dim)
    if grouped:
        return GroupedKVCache(
            kv_groups,
            _group_blocks(kv_groups, kv_group_blocks, num_blocks, kv_memory_bytes, geometry, dtype),
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
    if kv_group_blocks is not None:
        raise InvalidInputError(
            "kv_group_blocks applies to models with sliding-window layers; this one has "
            "one KV group (give num_blocks or kv_memory_bytes)"
        )
    if kv_memory_bytes is not None:
        return PagedKVCache.from_memory_budget(
            kv_memory_bytes, *geometry, dtype=dtype, device=device
        )
    return PagedKVCache(
        config.num_layers,
        DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )


def _group_blocks(
    kv_groups: Sequence[KVGroupSpec],
    kv_group_blocks: Sequence[int] | None,
    num_blocks: int | None,
    kv_memory_bytes: int | None,
    geometry: tuple[int, int, int, int],
    dtype: torch.dtype,
) -> tuple[int, ...]:
    """Blocks of each KV group's pool: as given, or every group the blocks the whole
    pool would have for all layers (the same memory: each group's block holds only its
    own layers)."""
    if kv_group_blocks is not None:
        if num_blocks is not None or kv_memory_bytes is not None:
            raise InvalidInputError(
                "give kv_group_blocks, or num_blocks / kv_memory_bytes, not both"
            )
        if isinstance(kv_group_blocks, (str, bytes)) or len(kv_group_blocks) != len(kv_groups):
            raise InvalidInputError(
                f"kv_group_blocks must give one count per KV group ({len(kv_groups)}: "
                f"{', '.join(spec.kind for spec in kv_groups)}), got {kv_group_blocks!r}"
            )
        return tuple(
            positive_int(count, f"kv_group_blocks[{index}]")
            for index, count in enumerate(kv_group_blocks)
        )
    if kv_memory_bytes is not None:
        count = PagedKVCache.blocks_in_budget(kv_memory_bytes, *geometry, dtype=dtype)
    else:
        count = DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks
    return (count,) * len(kv_groups)


def pool_sizes(kv_cache: PagedKVCache | GroupedKVCache) -> tuple[int, ...]:
    """Blocks of each KV group's pool (one pool for a model without KV groups)."""
    if isinstance(kv_cache, GroupedKVCache):
        return kv_cache.num_blocks
    return (kv_cache.num_blocks,)


def blocks_held(
    num_tokens: int, block_size: int, sliding_window: int | None, step_tokens: int
) -> int:
    """Blocks one request of `num_tokens` holds at most: all of them, or for a sliding
    group (which releases what its window passed) the window, the largest step's tokens
    (`step_tokens`) and a block of slack on each side."""
    blocks = -(-num_tokens // block_size)
    if sliding_window is None:
        return blocks
    return min(blocks, -(-(sliding_window - 1 + step_tokens) // block_size) + 2)


def check_fits(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    kv_cache: PagedKVCache | GroupedKVCache,
    kv_groups: Sequence[KVGroupSpec],
    grouped: bool,
    max_num_batched_tokens: int,
) -> None:
    """Raises `OutOfBlocksError` for the first request that could never fit the pool.

    Draft tokens are not counted: their room is optional (a request the pool cannot give
    drafts room to is served without them), so they are never the reason for a refusal."""
    block_size = kv_cache.block_size
    for index, prompt in enumerate(prompts):
        total = len(prompt) + max_new_tokens - 1
        for spec, pool in zip(kv_groups, pool_sizes(kv_cache), strict=True):
            needed = blocks_held(total, block_size, spec.sliding_window, max_num_batched_tokens)
            if needed > pool:
                name = f"of KV group {spec.index} ({spec.kind}) " if grouped else ""
                raise OutOfBlocksError(
                    f"request {index}: {len(prompt)} prompt tokens plus {max_new_tokens} new "
                    f"need {needed} blocks of {block_size} tokens; the KV pool "
                    f"{name}has {pool} (raise num_blocks or kv_memory_bytes)"
                )
