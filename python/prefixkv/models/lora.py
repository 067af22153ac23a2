"""LoRA adapters of a `LlamaModel`: loading, the active one, and what names it in a cache key.

An adapter adds ``(lora_alpha / lora_rank) * B @ A`` to some of the q/k/v/o projections. It
changes K and V, so a cached block computed under one adapter must never be reused under
another, or under the same name reloaded with other weights. `AdapterSet.digest` is what the
engine puts in every block key: the name *and* a SHA-256 of the weights, not the name alone.
`AdapterSet.version` is the cheap change token the engine checks every step (see
`LlamaModel.weights_version`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixkv.errors import InvalidInputError
from prefixkv.models.config import ModelConfig

__all__ = ["AdapterSet", "LoraPair", "random_adapter"]

_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn\.)?([qkvo]_proj)\.lora_([AB])(?:\.weight)?$")


@dataclass(frozen=True)
class LoraPair:
    down: torch.Tensor  # lora_A: [rank, in_features]
    up: torch.Tensor  # lora_B: [out_features, rank]


Adapter = dict[tuple[int, str], LoraPair]


def random_adapter(config: ModelConfig, seed: int = 0, std: float = 0.5) -> dict[str, torch.Tensor]:
    """Seeded LoRA weights for every q/k/v/o projection, named as `AdapterSet.load` expects.

    Unlike a freshly initialised LoRA (B = 0, a no-op), both factors are non-zero, so the
    adapter visibly changes K and V.
    """
    if config.lora_rank is None:
        raise InvalidInputError("config.lora_rank is None: this model takes no adapters")
    generator = torch.Generator().manual_seed(seed)
    rank = config.lora_rank
    sizes = {
        "q_proj": (config.hidden_size, config.num_heads * config.head_dim),
        "k_proj": (config.hidden_size, config.num_kv_heads * config.head_dim),
        "v_proj": (config.hidden_size, config.num_kv_heads * config.head_dim),
        "o_proj": (config.num_heads * config.head_dim, config.hidden_size),
    }
    weights: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for projection, (in_features, out_features) in sizes.items():
            prefix = f"model.layers.{layer}.self_attn.{projection}"
            weights[f"{prefix}.lora_A.weight"] = (
                torch.randn((rank, in_features), generator=generator) * in_features**-0.5
            )
            weights[f"{prefix}.lora_B.weight"] = (
                torch.randn((out_features, rank), generator=generator) * std * rank**-0.5
            )
    return weights


class AdapterSet:
    """The adapters a model has loaded and the one in use.

    `base_weight(layer, projection)` returns the base projection weight an adapter is checked
    against (shape) and converted to (dtype, device).
    """

    def __init__(self, base_weight: Callable[[int, str], torch.Tensor]) -> None:
        self._base_weight = base_weight
        self._adapters: dict[str, Adapter] = {}
        self._active: str | None = None
        # Bumped by every `load`, so `version` sees a reload under a known name even if the new
        # tensors happen to reuse the old ones' ids.
        self._generation = 0

    def load(self, config: ModelConfig, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Register an adapter (not activated). Keys name a layer and projection and end in
        ``lora_A`` / ``lora_B`` (optionally ``.weight``); PEFT names such as
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` work. A projection
        may be left out (PEFT often adapts only q and v)."""
        if config.lora_rank is None:
            raise InvalidInputError("config.lora_rank is None: this model takes no adapters")
        if not isinstance(name, str) or not name:
            raise InvalidInputError("adapter name must be a non-empty string")
        halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            match = _LORA_KEY.search(key)
            if match is None:
                raise InvalidInputError(
                    f"adapter key {key!r} is not a q/k/v/o lora_A/lora_B weight"
                )
            layer, projection, half = int(match[1]), match[2], match[3]
            if layer >= config.num_layers:
                raise InvalidInputError(
                    f"adapter key {key!r} names layer {layer} of {config.num_layers}"
                )
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise InvalidInputError(f"adapter weight {key!r} must be a floating-point tensor")
            halves.setdefault((layer, projection), {})[half] = tensor
        adapter: Adapter = {}
        for (layer, projection), pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise InvalidInputError(f"layer {layer} {projection}: need both lora_A and lora_B")
            base = self._base_weight(layer, projection)
            out_features, in_features = base.shape
            expected_down = (config.lora_rank, in_features)
            expected_up = (out_features, config.lora_rank)
            if tuple(pair["A"].shape) != expected_down or tuple(pair["B"].shape) != expected_up:
                raise InvalidInputError(
                    f"layer {layer} {projection}: lora_A {tuple(pair['A'].shape)} / lora_B "
                    f"{tuple(pair['B'].shape)}, expected {expected_down} / {expected_up}"
                )
            adapter[(layer, projection)] = LoraPair(
                down=pair["A"].detach().to(base), up=pair["B"].detach().to(base)
            )
        self._adapters[name] = adapter
        self._generation += 1

    def activate(self, name: str | None) -> None:
        if name is not None and name not in self._adapters:
            raise InvalidInputError(f"no adapter named {name!r}; loaded: {sorted(self._adapters)}")
        self._active = name

    @property
    def active(self) -> str | None:
        return self._active

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    def copy_into(self, other: AdapterSet) -> None:
        """Give `other` the same adapters (tensors shared, they are never written) and the
        same active one."""
        for name, adapter in self._adapters.items():
            other._adapters[name] = dict(adapter)
        other._active = self._active
        other._generation += 1

    def delta(
        self, config: ModelConfig, layer: int, projection: str, hidden: torch.Tensor
    ) -> torch.Tensor | None:
        """The active adapter's update to one projection's output, or None."""
        if self._active is None:
            return None
        pair = self._adapters[self._active].get((layer, projection))
        if pair is None:
            return None
        assert config.lora_rank is not None and config.lora_alpha is not None
        scaling = config.lora_alpha / config.lora_rank
        down, up = pair.down.to(hidden), pair.up.to(hidden)
        return scaling * F.linear(F.linear(hidden, down), up)

    def digest(self) -> str | None:
        """The active adapter as a per-block cache key, ``name@<sha256 of its weights>``, so
        that reloading a name with other weights misses; None without an active adapter."""
        name = self._active
        if name is None:
            return None
        digest = hashlib.sha256()
        for (layer, projection), pair in sorted(self._adapters[name].items()):
            digest.update(f"{layer}.{projection}".encode())
            for tensor in (pair.down, pair.up):
                flat = tensor.detach().to("cpu").contiguous().reshape(-1)
                digest.update(flat.view(torch.uint8).numpy().data)
        return f"{name}@{digest.hexdigest()[:32]}"

    def version(self) -> Hashable | None:
        """A cheap token that changes when the active adapter or its weights may have: its
        name, the load generation, and the identity and version counter of its tensors."""
        name = self._active
        if name is None:
            return None
        try:
            return (
                name,
                self._generation,
                tuple(
                    (key, id(tensor), tensor._version)
                    for key, pair in sorted(self._adapters[name].items())
                    for tensor in (pair.down, pair.up)
                ),
            )
        except RuntimeError:  # inference tensors have no version counter
            return (name, self._generation, None)
