"""KV groups: the layers of a model split by attention kind.

A hybrid model (Gemma 2/3, gpt-oss, Qwen2/3 with ``use_sliding_window``) mixes sliding-window
layers, which read only the last W tokens, with full-attention layers, which read every token.
If one block held the KV of every layer, a block that fell out of the window would still hold
the full layers' KV and could never be freed. So the layers are split into *KV groups*, one
per attention kind (vLLM's ``KVCacheGroupSpec``): each group has its own pages
(`prefixkv.kv.grouped.GroupedKVCache`), its own block table per request and its own block
manager (`prefixkv.group_cache.GroupedPrefixCache`). A sliding group's manager releases the
blocks its window has passed, and a shared *null block* stands at their table positions.

This module only says which layers go together; it needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class _LayerWindows(Protocol):
    """What grouping reads of a model's config (`prefixkv.models.config.ModelConfig` has it):
    named structurally so this block-manager module does not import the model layer above it."""

    @property
    def layer_sliding_windows(self) -> Sequence[int | None]: ...


__all__ = ["KVGroupSpec", "kv_group_specs"]


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV group: the layers sharing an attention kind.

    index: the group's position (the ``group_idx`` of its KV events).
    sliding_window: W for a sliding-window group, None for full attention.
    layers: the model's layer indices in this group, ascending.
    """

    index: int
    sliding_window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        """``"full_attention"`` or ``"sliding_window"`` (vLLM's spec kinds)."""
        return "full_attention" if self.sliding_window is None else "sliding_window"


def kv_group_specs(config: _LayerWindows) -> tuple[KVGroupSpec, ...]:
    """The KV groups of a model: layers with the same window together, full attention first.

    A model whose layers are all alike has one group.
    """
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(config.layer_sliding_windows):
        by_window.setdefault(window, []).append(layer)
    # Full attention first (the group routers and tiers key on), then windows ascending.
    windows = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(
        KVGroupSpec(index, window, tuple(by_window[window])) for index, window in enumerate(windows)
    )
