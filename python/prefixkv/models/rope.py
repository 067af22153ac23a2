"""RoPE: its scaling settings (`RopeScaling`) and math: the base, the per-pair frequencies, and
the rotation, for every scaling `RopeScaling` names.

Below the model config in the layers: the formulas read a config through the `RopeSettings`
protocol, and `prefixkv.models.config` imports `RopeScaling` from here.

One home for the formulas both forward paths use: `rope_inverse_frequencies` feeds the paged
path (`LlamaModel.prefill`, which rotates with `apply_rotate_half_rope`) and the full recompute
(`LlamaModel.forward_full`, which writes its own rotation on purpose, so a rotation bug shows
up as a difference). `tests/test_model_rope.py` checks these against the published formulas
and transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from prefixkv.errors import InvalidInputError

__all__ = [
    "RopeScaling",
    "RopeSettings",
    "apply_rotate_half_rope",
    "rope_attention_factor",
    "rope_base",
    "rope_inverse_frequencies",
    "rotate_half_tables",
]


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE is stretched beyond the context length the model was trained for.

    kind:
        ``"linear"``: positions are divided by `factor` (position interpolation).
        ``"ntk"``: static NTK-aware scaling, the base becomes
        ``theta * factor ** (d / (d - 2))`` for every length.
        ``"dynamic_ntk"``: the NTK base is recomputed from the sequence length L once L exceeds
        `max_position_embeddings` (HF's ``"dynamic"``). This makes RoPE depend on the total
        length: see `ModelConfig.position_encoding_is_length_dependent`.
        ``"llama3"``: Llama 3.1's static per-frequency scaling: wavelengths longer than
        ``original_max_position_embeddings / low_freq_factor`` are divided by `factor`, those
        shorter than ``... / high_freq_factor`` kept, the band between interpolated smoothly.
        ``"yarn"``: YaRN (Qwen2.5, DeepSeek): frequencies blended between kept and divided by
        `factor` along a ramp set by `beta_fast` / `beta_slow` rotations over
        ``original_max_position_embeddings``, and cos/sin multiplied by `attention_factor`.
        Static: no length enters, so cached KV stays exact.
        ``"longrope"``: Phi-3's LongRoPE (HF's ``"longrope"``, older ``"su"``): pair i's
        frequency divided by ``short_factor[i]`` while the sequence's length L is at most
        ``original_max_position_embeddings``, by ``long_factor[i]`` once L exceeds it, and
        cos/sin multiplied by `attention_factor` (resolved by the config reader, which knows
        ``max_position_embeddings``). Length-dependent at that one threshold: see
        `ModelConfig.position_encoding_is_length_dependent`. `factor` is kept for the record
        only; the attention factor already holds what it means.
    """

    kind: Literal["linear", "ntk", "dynamic_ntk", "llama3", "yarn", "longrope"]
    factor: float
    #: Llama 3 only (the defaults are Llama 3.1's).
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    #: Llama 3 and YaRN: the context length the model was pretrained with.
    original_max_position_embeddings: int = 8192
    #: YaRN only (the defaults are the paper's and transformers'). `attention_factor` None means
    #: ``0.1 * ln(factor) + 1`` (resolved by `yarn_attention_factor`).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    #: LongRoPE only: the divisor of each rotated pair's frequency, ``head_dim // 2`` each.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "ntk", "dynamic_ntk", "llama3", "yarn", "longrope"):
            raise InvalidInputError(
                f"unsupported rope scaling kind {self.kind!r}; "
                "expected 'linear', 'ntk', 'dynamic_ntk', 'llama3', 'yarn' or 'longrope'"
            )
        object.__setattr__(self, "short_factor", tuple(self.short_factor))
        object.__setattr__(self, "long_factor", tuple(self.long_factor))
        if self.kind == "longrope":
            self._check_longrope()
        if self.kind == "yarn" and not (
            self.beta_fast > 0 and self.beta_slow > 0 and self.original_max_position_embeddings > 0
        ):
            raise InvalidInputError(
                "yarn rope scaling needs positive beta_fast, beta_slow and "
                "original_max_position_embeddings"
            )
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor
            and self.original_max_position_embeddings > 0
        ):
            raise InvalidInputError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and a "
                "positive original_max_position_embeddings"
            )
        number = isinstance(self.factor, (int, float)) and not isinstance(self.factor, bool)
        if not (number and math.isfinite(self.factor)):
            raise InvalidInputError(
                f"rope scaling factor must be a finite number, got {self.factor!r}"
            )
        # LongRoPE's factor (max / original context) only sets its default attention factor,
        # which transformers makes 1 for a factor <= 1; every other kind divides by it.
        if self.factor < 1.0 and not (self.kind == "longrope" and self.factor > 0):
            raise InvalidInputError(f"rope scaling factor must be >= 1, got {self.factor}")

    def _check_longrope(self) -> None:
        if self.original_max_position_embeddings <= 0:
            raise InvalidInputError(
                "longrope rope scaling needs a positive original_max_position_embeddings"
            )
        if self.attention_factor is None or not (
            math.isfinite(self.attention_factor) and self.attention_factor > 0
        ):
            raise InvalidInputError(
                "longrope rope scaling needs a positive finite attention_factor, got "
                f"{self.attention_factor!r}"
            )
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if not values or not all(
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and v > 0
                for v in values
            ):
                raise InvalidInputError(
                    f"longrope rope scaling needs {name} as a non-empty list of positive numbers"
                )
        if len(self.short_factor) != len(self.long_factor):
            raise InvalidInputError(
                f"longrope short_factor has {len(self.short_factor)} entries, long_factor "
                f"{len(self.long_factor)}: both need one per rotated pair"
            )

    def longrope_factors(self, sequence_length: int) -> tuple[float, ...]:
        """LongRoPE's per-pair divisors for a sequence of `sequence_length` tokens: the long
        ones once it exceeds the original context, as transformers' ``longrope`` update picks
        them (``max(position_ids) + 1 > original_max_position_embeddings``)."""
        if sequence_length > self.original_max_position_embeddings:
            return self.long_factor
        return self.short_factor

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's multiplier of cos and sin (1 for every other kind): `attention_factor` when
        the config gives it, else the paper's ``0.1 * ln(factor) + 1``."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


class RopeSettings(Protocol):
    """What the formulas read of a model's settings (`prefixkv.models.config.ModelConfig` is one):
    a protocol, so this module sits below the config and imports nothing of it."""

    @property
    def head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> RopeScaling | None: ...
    @property
    def max_position_embeddings(self) -> int: ...


def rope_base(config: RopeSettings, sequence_length: int) -> float:
    """The RoPE base used for a sequence whose positions end at ``sequence_length - 1``.

    Only dynamic NTK scaling reads `sequence_length`; the formula is HF's
    ``_compute_dynamic_ntk_parameters``.
    """
    scaling = config.rope_scaling
    if scaling is None or scaling.kind in ("linear", "llama3", "yarn", "longrope"):
        return config.rope_theta
    exponent = config.head_dim / (config.head_dim - 2)
    if scaling.kind == "ntk":
        return config.rope_theta * scaling.factor**exponent
    length = max(sequence_length, config.max_position_embeddings)
    stretch = scaling.factor * length / config.max_position_embeddings - (scaling.factor - 1)
    return config.rope_theta * stretch**exponent


def rope_inverse_frequencies(config: RopeSettings, sequence_length: int) -> torch.Tensor:
    """Angle per position of each rotated pair, ``[head_dim // 2]`` float64 on the CPU.

    Position p rotates pair i by ``(p + position_offset) * result[i]``. `sequence_length` is read
    by dynamic NTK (the base) and LongRoPE (short or long factors) only. Linear scaling is folded
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
    elif scaling is not None and scaling.kind == "longrope":
        factors = scaling.longrope_factors(sequence_length)
        if len(factors) != len(inverse):
            raise InvalidInputError(
                f"longrope rope scaling has {len(factors)} factors for "
                f"{len(inverse)} rotated pairs (head_dim {config.head_dim})"
            )
        inverse = inverse / torch.tensor(factors, dtype=torch.float64)
    return inverse


def rope_attention_factor(config: RopeSettings) -> float:
    """What cos and sin are multiplied by: YaRN's or LongRoPE's attention factor, else 1. Both
    forward paths fold it into the float64 tables before rounding them to the model dtype, as
    transformers does; scaling the rotated queries and keys instead would round them a second
    time. LongRoPE applies its factor at every length, short factors included."""
    scaling = config.rope_scaling
    if scaling is None:
        return 1.0
    if scaling.kind == "longrope":
        assert scaling.attention_factor is not None  # checked at construction
        return scaling.attention_factor
    return scaling.yarn_attention_factor


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
    table repeated over both halves (pair i is dimensions i and i + dim/2). `cos` and `sin` are
    ``[tokens, dim/2]`` angle tables, or the ``[tokens, 1, dim]`` ones `rotate_half_tables`
    builds from them (once per forward pass, not once per layer and projection)."""
    if cos.dim() == 2:
        cos, sin = rotate_half_tables(cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_half_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, dim/2]`` angle tables repeated over both halves, ``[tokens, 1, dim]``."""
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]
