"""RoPE math: the base, the per-pair frequencies, and the rotation, for every scaling
`RopeScaling` names.

One home for the formulas both forward paths use: `rope_inverse_frequencies` feeds the paged
path (`LlamaModel.prefill`, which rotates with `apply_rotate_half_rope`) and the full recompute
(`LlamaModel.forward_full`, which writes its own rotation on purpose, so a rotation bug shows
up as a difference). `tests/test_model_rope.py` checks these against the published formulas
and transformers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prefixkv.model_config import ModelConfig, RopeScaling

__all__ = [
    "apply_rotate_half_rope",
    "rope_attention_factor",
    "rope_base",
    "rope_inverse_frequencies",
]


def rope_base(config: ModelConfig, sequence_length: int) -> float:
    """The RoPE base used for a sequence whose positions end at ``sequence_length - 1``.

    Only dynamic NTK scaling reads `sequence_length`; the formula is HF's
    ``_compute_dynamic_ntk_parameters``.
    """
    scaling = config.rope_scaling
    if scaling is None or scaling.kind in ("linear", "llama3", "yarn"):
        return config.rope_theta
    exponent = config.head_dim / (config.head_dim - 2)
    if scaling.kind == "ntk":
        return config.rope_theta * scaling.factor**exponent
    length = max(sequence_length, config.max_position_embeddings)
    stretch = scaling.factor * length / config.max_position_embeddings - (scaling.factor - 1)
    return config.rope_theta * stretch**exponent


def rope_inverse_frequencies(config: ModelConfig, sequence_length: int) -> torch.Tensor:
    """Angle per position of each rotated pair, ``[head_dim // 2]`` float64 on the CPU.

    Position p rotates pair i by ``(p + position_offset) * result[i]``. Linear scaling is folded
    in here (dividing the frequencies is dividing the positions) so both forward paths get it
    from one place; `tests/test_model_rope.py` checks this table against the formulas directly.
    Float64 so that large positions do not lose angle precision before the cos/sin.
    """
    base = rope_base(config, sequence_length)
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    inverse = 1.0 / (base**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        inverse = inverse / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        inverse = _llama3_frequencies(inverse, scaling)
    elif scaling is not None and scaling.kind == "yarn":
        inverse = _yarn_frequencies(inverse, scaling, config.head_dim, base)
    return inverse


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1. Both forward paths
    fold it into the float64 tables before rounding them to the model dtype, as transformers
    does; scaling the rotated queries and keys instead would round them a second time."""
    return 1.0 if config.rope_scaling is None else config.rope_scaling.yarn_attention_factor


def _yarn_frequencies(
    inverse: torch.Tensor, scaling: RopeScaling, head_dim: int, base: float
) -> torch.Tensor:
    """YaRN (the published formula, as transformers' ``_compute_yarn_parameters``): pairs that
    turn more than `beta_fast` times over the original context keep their frequency, those
    turning fewer than `beta_slow` times are divided by `factor`, a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inverse / scaling.factor * (1 - keep) + inverse * keep


def _llama3_frequencies(inverse: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling (the published formula): long wavelengths are interpolated by
    `factor`, short ones kept, the band between blended linearly in 1 / wavelength."""
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inverse
    low_freq_wavelength = original / scaling.low_freq_factor
    high_freq_wavelength = original / scaling.high_freq_factor
    smooth = (original / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inverse / scaling.factor + smooth * inverse
    scaled = torch.where(wavelength > low_freq_wavelength, inverse / scaling.factor, inverse)
    in_band = (wavelength <= low_freq_wavelength) & (wavelength >= high_freq_wavelength)
    return torch.where(in_band, blended, scaled)


def apply_rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama RoPE on ``[tokens, heads, dim]``: ``x * cos + rotate_half(x) * sin``, the angle
    table repeated over both halves (pair i is dimensions i and i + dim/2)."""
    cos_full = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin_full = torch.cat((sin, sin), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_full + rotated * sin_full
