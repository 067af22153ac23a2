"""`GroupedKVCache`: the KV pages of a model whose layers form KV groups (`prefixkv.kv_groups`).

One `PagedKVCache` per group, over that group's layers only, plus one extra page per sliding
group for its null block. The null page is never written (a written position is always inside
its request's window) and never read by attention (every key it stands for is outside the
window of every query), so its zeros are never seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import KVGroupSpec, kv_group_specs


class KVShape(Protocol):
    """What the pages of a model need from its config (`prefixkv.models.config.ModelConfig` has
    it): named structurally, so the KV layer does not import the model layer above it."""

    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def layer_sliding_windows(self) -> Sequence[int | None]: ...


__all__ = ["GroupedKVCache"]


class GroupedKVCache:
    """K and V pages of a model whose layers form several KV groups (or one sliding group).

    `groups[g]` holds group g's layers (in `specs[g].layers` order) in ``num_blocks[g]``
    blocks, plus the null page ``num_blocks[g]`` when the group slides. `layer_pages(layer)`
    gives the pages attention reads for one model layer.
    """

    def __init__(
        self,
        specs: Sequence[KVGroupSpec],
        num_blocks: Sequence[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        specs = tuple(specs)
        if not specs:
            raise InvalidInputError("a GroupedKVCache needs at least one KV group")
        if len(num_blocks) != len(specs):
            raise InvalidInputError(
                f"num_blocks has {len(num_blocks)} entries for {len(specs)} KV groups"
            )
        if any(spec.index != position for position, spec in enumerate(specs)):
            raise InvalidInputError("KV group specs must be given in index order 0, 1, ...")
        layers = sorted(layer for spec in specs for layer in spec.layers)
        if layers != list(range(len(layers))):
            raise InvalidInputError(
                "the KV groups must hold every layer exactly once, got "
                f"{[spec.layers for spec in specs]}"
            )
        self.specs = specs
        self.block_size = block_size
        self.num_layers = len(layers)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        #: Blocks each group's block manager may hand out (its null page not counted).
        self.num_blocks = tuple(int(n) for n in num_blocks)
        for spec, count in zip(specs, self.num_blocks, strict=True):
            if isinstance(count, bool) or count < 1:
                raise InvalidInputError(f"KV group {spec.index} needs at least one block")
        self.groups = tuple(
            PagedKVCache(
                len(spec.layers),
                count + (spec.sliding_window is not None),
                block_size,
                num_kv_heads,
                head_dim,
                dtype=dtype,
                device=device,
            )
            for spec, count in zip(specs, self.num_blocks, strict=True)
        )
        #: Each model layer's (group, index within the group's pages).
        location: dict[int, tuple[int, int]] = {}
        for spec in specs:
            for slot, layer in enumerate(spec.layers):
                location[layer] = (spec.index, slot)
        self.layer_location = tuple(location[layer] for layer in range(self.num_layers))

    @classmethod
    def for_model(
        cls,
        config: KVShape,
        num_blocks: Sequence[int],
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> GroupedKVCache:
        return cls(
            kv_group_specs(config),
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )

    def null_block(self, group: int) -> int | None:
        """The page standing for released blocks in a sliding group; None for a full one."""
        if self.specs[group].sliding_window is None:
            return None
        return self.num_blocks[group]

    def layer_pages(self, layer: int) -> tuple[PagedKVCache, int, int]:
        """(the group's pages, the layer's index in them, the group index) of a model layer."""
        group, slot = self.layer_location[layer]
        return self.groups[group], slot, group

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{spec.kind}(window={spec.sliding_window}, layers={len(spec.layers)}, blocks={count})"
            for spec, count in zip(self.specs, self.num_blocks, strict=True)
        )
        return f"GroupedKVCache([{parts}], block_size={self.block_size}, dtype={self.dtype})"
