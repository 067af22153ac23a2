"""A small Llama-style decoder that runs on paged KV storage: the reference model of prefixkv.

Why it exists: prefix caching is only correct if the KV of a cached prefix, read back from the
pages, gives the same logits as recomputing the whole prompt. This module supplies both sides of
that comparison:

* `LlamaModel.prefill` / `decode_step` compute only the tokens that are not cached yet, write
  their K/V into a `PagedKVCache` and attend over the pages through `paged_prefill_attention`.
* `LlamaModel.forward_full` recomputes everything with contiguous K/V and a plain causal
  softmax. It shares the weights and the RoPE frequency table (`rope_inverse_frequencies`,
  tested on its own against the published formulas) and nothing else: its RoPE rotation, mask,
  head grouping and attention are written independently, so a bug in the paged path shows up as
  a difference between the two.

What a cached KV block depends on, besides the tokens before it (the cache key must cover all of
these, and the negative tests in `tests/test_model_negative.py` show each one matters):

* the weights, including the active LoRA adapter (it changes the k/v projections);
* `rope_theta` and `rope_scaling`;
* `position_offset` (the absolute position of token 0);
* for dynamic NTK scaling only, the *total* length of the sequence being computed: the RoPE base
  grows with it once it exceeds `max_position_embeddings`, so KV computed for a shorter prompt is
  not the KV a full recompute of the longer prompt would give.
  `ModelConfig.position_encoding_is_length_dependent` says when this applies; a cache must then
  refuse reuse (or limit it to lengths within `max_position_embeddings`, where the base does not
  move).

The random weights (`LlamaModel.random`) make attention sharp on purpose: query and key
projections are scaled so that a typical attention row puts most of its mass on a few keys. With
the usual small init attention is close to uniform, and an off-by-one position or a wrong mask
then barely moves the logits, which would let a broken cache pass its tests.

Parameter names follow Hugging Face Llama (`model.layers.N.self_attn.q_proj.weight`, ...) and
RoPE follows HF's `rotate_half` convention, so `from_pretrained` loads a local HF checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.attention import AttentionBackend, paged_prefill_attention
from prefixkv.errors import InvalidInputError
from prefixkv.kv import KVDeviceError, KVDtypeError, KVIndexError, KVShapeError, PagedKVCache

__all__ = [
    "DecodeRequest",
    "LlamaModel",
    "ModelConfig",
    "PrefillRequest",
    "RopeScaling",
    "rope_inverse_frequencies",
]

_log = logging.getLogger(__name__)

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
BlockTable = Sequence[int] | np.ndarray | torch.Tensor

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


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
    """

    kind: Literal["linear", "ntk", "dynamic_ntk", "llama3"]
    factor: float
    #: Llama 3 only (the defaults are Llama 3.1's).
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "ntk", "dynamic_ntk", "llama3"):
            raise InvalidInputError(
                f"unsupported rope scaling kind {self.kind!r}; "
                "expected 'linear', 'ntk', 'dynamic_ntk' or 'llama3'"
            )
        if self.kind == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor
            and self.original_max_position_embeddings > 0
        ):
            raise InvalidInputError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and a "
                "positive original_max_position_embeddings"
            )
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)):
            raise InvalidInputError(
                f"rope scaling factor must be a finite number, got {self.factor!r}"
            )
        if self.factor < 1.0:
            raise InvalidInputError(f"rope scaling factor must be >= 1, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and position-encoding settings of a `LlamaModel`.

    The defaults describe a tiny model (2 layers, hidden size 64, grouped-query attention with 4
    query heads over 2 KV heads, a 256-token byte vocabulary) that runs a forward pass in
    milliseconds on a CPU.

    position_offset:
        Absolute position of token 0. Two requests with the same tokens but different offsets
        produce different KV, so the offset belongs in the cache key.
    sliding_window:
        If set, a query at position i attends only to keys j with ``i - window < j <= i``
        (Mistral's convention).
    lora_rank / lora_alpha:
        Shape and scale (``alpha / rank``) of the adapters `LlamaModel.load_adapter` accepts on
        the q/k/v/o projections. ``None`` means the model takes no adapters.
    max_position_embeddings:
        The trained context length; only dynamic NTK scaling reads it.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    position_offset: int = 0
    sliding_window: int | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    tie_word_embeddings: bool = False
    dtype: torch.dtype = field(default=torch.float32)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidInputError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0 or self.head_dim < 4:
            # RoPE rotates pairs of dimensions; NTK scaling divides by (d - 2).
            raise InvalidInputError(f"head_dim must be even and >= 4, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 1):
            raise InvalidInputError("rms_norm_eps must be > 0 and rope_theta > 1")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise InvalidInputError(
                "rope_scaling must be a RopeScaling or None; "
                "use ModelConfig.from_hf_config for Hugging Face dicts"
            )
        if not isinstance(self.position_offset, int) or self.position_offset < 0:
            raise InvalidInputError(
                f"position_offset must be an int >= 0, got {self.position_offset!r}"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise InvalidInputError(
                f"sliding_window must be None or a positive int, got {self.sliding_window!r}"
            )
        if (self.lora_rank is None) != (self.lora_alpha is None):
            raise InvalidInputError("set both lora_rank and lora_alpha, or neither")
        if self.lora_rank is not None and (
            not isinstance(self.lora_rank, int) or self.lora_rank <= 0
        ):
            raise InvalidInputError(f"lora_rank must be a positive int, got {self.lora_rank!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise InvalidInputError(f"unsupported model dtype {self.dtype}")

    @property
    def position_encoding_is_length_dependent(self) -> bool:
        """True if the RoPE of a position depends on the total sequence length (dynamic NTK).

        Then KV computed while the sequence was shorter is not what a full recompute of the
        current sequence gives, so a prefix cache must not reuse it (it may still reuse KV while
        every length involved stays within `max_position_embeddings`, where the base is fixed).
        """
        return self.rope_scaling is not None and self.rope_scaling.kind == "dynamic_ntk"

    @property
    def num_query_groups(self) -> int:
        """How many query heads share one KV head."""
        return self.num_heads // self.num_kv_heads

    def rope_base(self, sequence_length: int) -> float:
        """The RoPE base used for a sequence whose positions end at ``sequence_length - 1``.

        Only dynamic NTK scaling reads `sequence_length`; the formula is HF's
        ``_compute_dynamic_ntk_parameters``.
        """
        scaling = self.rope_scaling
        if scaling is None or scaling.kind in ("linear", "llama3"):
            return self.rope_theta
        exponent = self.head_dim / (self.head_dim - 2)
        if scaling.kind == "ntk":
            return self.rope_theta * scaling.factor**exponent
        length = max(sequence_length, self.max_position_embeddings)
        stretch = scaling.factor * length / self.max_position_embeddings - (scaling.factor - 1)
        return self.rope_theta * stretch**exponent

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | Path, **overrides: Any
    ) -> ModelConfig:
        """Read a Hugging Face Llama/Mistral-style ``config.json`` (a dict, file or directory).

        Refuses architectures this decoder does not implement (biases on the projections, an
        activation other than SiLU, RoPE scalings other than linear / NTK / dynamic NTK) rather
        than load them and compute something else. Keyword `overrides` replace fields after
        reading, e.g. ``dtype=torch.float32``.
        """
        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                hf = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise InvalidInputError(f"cannot read model config {path}: {exc}") from exc
        else:
            hf = dict(config)
        if not isinstance(hf, dict):
            raise InvalidInputError("a Hugging Face config must be a JSON object")

        def require(key: str) -> Any:
            if key not in hf:
                raise InvalidInputError(f"Hugging Face config is missing {key!r}")
            return hf[key]

        activation = hf.get("hidden_act", "silu")
        if activation != "silu":
            raise InvalidInputError(f"unsupported hidden_act {activation!r}: only SwiGLU ('silu')")
        if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
            raise InvalidInputError("projection biases (attention_bias / mlp_bias) are unsupported")
        if hf.get("model_type", "llama") not in ("llama", "mistral"):
            raise InvalidInputError(
                f"unsupported model_type {hf.get('model_type')!r}: expected 'llama' or 'mistral'"
            )
        rope_theta, rope_scaling = _rope_from_hf(hf)
        num_heads = int(require("num_attention_heads"))
        hidden_size = int(require("hidden_size"))
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        dtype_name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if dtype_name not in dtypes:
            raise InvalidInputError(f"unsupported torch_dtype {dtype_name!r}")
        values: dict[str, Any] = {
            "vocab_size": int(require("vocab_size")),
            "hidden_size": hidden_size,
            "num_layers": int(require("num_hidden_layers")),
            "num_heads": num_heads,
            "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
            "head_dim": int(head_dim),
            "intermediate_size": int(require("intermediate_size")),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
            "position_offset": int(hf.get("prefixkv_position_offset", 0)),
            "sliding_window": hf.get("sliding_window"),
            "lora_rank": hf.get("prefixkv_lora_rank"),
            "lora_alpha": hf.get("prefixkv_lora_alpha"),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "dtype": dtypes[dtype_name],
        }
        values.update(overrides)
        return cls(**values)

    def to_hf_config(self) -> dict[str, Any]:
        """This config as a Hugging Face ``LlamaForCausalLM`` ``config.json`` dict.

        Fields HF has no name for (position offset, LoRA shape) are written with a
        ``prefixkv_`` prefix, which HF ignores and `from_hf_config` reads back.
        """
        rope_scaling = None
        if self.rope_scaling is not None:
            hf_type = {
                "linear": "linear",
                "ntk": "ntk",
                "dynamic_ntk": "dynamic",
                "llama3": "llama3",
            }
            rope_scaling = {
                "rope_type": hf_type[self.rope_scaling.kind],
                "factor": self.rope_scaling.factor,
            }
            if self.rope_scaling.kind == "llama3":
                rope_scaling["low_freq_factor"] = self.rope_scaling.low_freq_factor
                rope_scaling["high_freq_factor"] = self.rope_scaling.high_freq_factor
                rope_scaling["original_max_position_embeddings"] = (
                    self.rope_scaling.original_max_position_embeddings
                )
        hf: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
        }
        if self.position_offset:
            hf["prefixkv_position_offset"] = self.position_offset
        if self.lora_rank is not None:
            hf["prefixkv_lora_rank"] = self.lora_rank
            hf["prefixkv_lora_alpha"] = self.lora_alpha
        return hf

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """Plain-data view, for logs and test failure messages."""
        data = asdict(self)
        data["dtype"] = str(self.dtype)
        return data


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either config style.

    transformers 5 writes ``rope_parameters: {rope_type, rope_theta, factor, ...}``; earlier
    versions wrote ``rope_theta`` and ``rope_scaling`` at the top level. Reading only the old
    keys from a new config would silently fall back to theta 10000, so both are understood.
    """
    parameters = hf.get("rope_parameters")
    if parameters is None:
        scaling = hf.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise InvalidInputError(f"rope_scaling must be an object or null, got {scaling!r}")
        parameters = dict(scaling or {})
        if "rope_theta" in hf:
            parameters["rope_theta"] = hf["rope_theta"]
    if not isinstance(parameters, Mapping):
        raise InvalidInputError(f"rope parameters must be an object, got {parameters!r}")
    if parameters and all(isinstance(value, Mapping) for value in parameters.values()):
        raise InvalidInputError("per-layer-type RoPE parameters are unsupported")
    rotary_fraction = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary_fraction != 1.0:
        raise InvalidInputError(f"partial_rotary_factor {rotary_fraction} is unsupported")
    theta = float(parameters.get("rope_theta", 10000.0))
    has_scaling = "rope_type" in parameters or "type" in parameters
    return theta, _rope_scaling_from_hf(parameters) if has_scaling else None


def _rope_scaling_from_hf(raw: Mapping[str, Any]) -> RopeScaling | None:
    kind = raw.get("rope_type", raw.get("type"))
    kinds = {
        "linear": "linear",
        "ntk": "ntk",
        "dynamic": "dynamic_ntk",
        "llama3": "llama3",
        "default": None,
    }
    if kind not in kinds:
        raise InvalidInputError(
            f"unsupported rope_scaling type {kind!r}: this model implements "
            "'linear', 'ntk' (static NTK-aware), 'dynamic' (dynamic NTK) and 'llama3'"
        )
    if kinds[kind] is None:
        return None
    if "factor" not in raw:
        raise InvalidInputError("rope_scaling needs a 'factor'")
    if kind == "llama3":
        try:
            return RopeScaling(
                kind="llama3",
                factor=float(raw["factor"]),
                low_freq_factor=float(raw["low_freq_factor"]),
                high_freq_factor=float(raw["high_freq_factor"]),
                original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
            )
        except KeyError as missing:
            raise InvalidInputError(f"llama3 rope_scaling needs {missing}") from None
    return RopeScaling(kind=kinds[kind], factor=float(raw["factor"]))  # type: ignore[arg-type]


def rope_inverse_frequencies(config: ModelConfig, sequence_length: int) -> torch.Tensor:
    """Angle per position of each rotated pair, ``[head_dim // 2]`` float64 on the CPU.

    Position p rotates pair i by ``(p + position_offset) * result[i]``. Linear scaling is folded
    in here (dividing the frequencies is dividing the positions) so both forward paths get it
    from one place; `tests/test_model_rope.py` checks this table against the formulas directly.
    Float64 so that large positions do not lose angle precision before the cos/sin.
    """
    base = config.rope_base(sequence_length)
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    inverse = 1.0 / (base**exponents)
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        inverse = inverse / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        inverse = _llama3_frequencies(inverse, scaling)
    return inverse


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


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass
class PrefillRequest:
    """One sequence in a `LlamaModel.prefill` batch.

    token_ids: every token of the sequence so far (n of them).
    block_table: block ids; block i holds positions ``i*block_size .. (i+1)*block_size - 1``.
        It must cover every position up to ``num_tokens - 1``.
    num_cached_tokens: m; the pages already hold the KV of positions ``0 .. m-1``.
    num_tokens: compute positions ``m .. num_tokens-1`` only (chunked prefill); default n.
    write_kv: False when the pages already hold the KV of the computed positions too, e.g. a
        full cache hit (m = n - 1, the last token's KV is in a shared block): only the queries
        are computed and the pages are not written, so a shared block is never modified.
    """

    token_ids: TokenIds
    block_table: BlockTable
    num_cached_tokens: int = 0
    num_tokens: int | None = None
    write_kv: bool = True


@dataclass
class DecodeRequest:
    """One sequence in a `LlamaModel.decode_step` batch: its tokens including the new one."""

    token_ids: TokenIds
    block_table: BlockTable


# --------------------------------------------------------------------------------------------
# Modules (attribute names mirror HF Llama so state_dict keys are HF parameter names)
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in (at least) float32 as HF Llama does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        wide = hidden.to(torch.promote_types(input_dtype, torch.float32))
        variance = wide.pow(2).mean(-1, keepdim=True)
        normalized = wide * torch.rsqrt(variance + self.eps)
        return self.weight * normalized.to(input_dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_kv_heads * config.head_dim, bias=False
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_kv_heads * config.head_dim, bias=False
        )
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass(frozen=True)
class _LoraPair:
    down: torch.Tensor  # lora_A: [rank, in_features]
    up: torch.Tensor  # lora_B: [out_features, rank]


_Adapter = dict[tuple[int, str], _LoraPair]
_LORA_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn\.)?([qkvo]_proj)\.lora_([AB])(?:\.weight)?$")


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class LlamaModel(nn.Module):
    """Llama-style decoder with a paged-KV forward (`prefill`, `decode_step`) and a cache-free
    oracle (`forward_full`). Build one with `random`, `from_pretrained` or the constructor
    (which leaves PyTorch's default init; `random` is what tests want)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._adapters: dict[str, _Adapter] = {}
        self._active_adapter: str | None = None
        # Bumped by every `load_adapter`, so `adapter_version` sees a reload under a known name.
        self._adapter_generation = 0
        self.to(dtype=config.dtype)
        self.requires_grad_(False)

    # ---------------------------------------------------------------- construction

    @classmethod
    def random(
        cls, config: ModelConfig | None = None, seed: int = 0, *, attention_sharpness: float = 8.0
    ) -> LlamaModel:
        """A model with seeded random weights, in `config.dtype` (drawn in float32 first, so the
        same seed gives the same weights, up to rounding, in every dtype).

        `attention_sharpness` is the typical standard deviation of a pre-softmax attention score:
        q/k projections are drawn with ``std = sqrt(sharpness / hidden_size)`` (a score is a sum
        of ``hidden_size``-scaled products, then divided by ``sqrt(head_dim)``), so rows of the
        attention matrix are far from uniform and mask or position bugs move the logits.
        Configs that differ only in position settings (theta, scaling, offset, window) get
        identical weights for the same seed.
        """
        config = config or ModelConfig()
        generator = torch.Generator().manual_seed(seed)

        def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
            return torch.randn(shape, generator=generator, dtype=torch.float32) * std

        model = cls(config.replace(dtype=torch.float32))
        hidden = config.hidden_size
        qk_std = math.sqrt(attention_sharpness / hidden)
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(normal((config.vocab_size, hidden), 1.0))
            for layer in model.model.layers:
                assert isinstance(layer, DecoderLayer)
                attention = layer.self_attn
                attention.q_proj.weight.copy_(normal(tuple(attention.q_proj.weight.shape), qk_std))
                attention.k_proj.weight.copy_(normal(tuple(attention.k_proj.weight.shape), qk_std))
                attention.v_proj.weight.copy_(
                    normal(tuple(attention.v_proj.weight.shape), hidden**-0.5)
                )
                out_features = config.num_heads * config.head_dim
                attention.o_proj.weight.copy_(
                    normal(tuple(attention.o_proj.weight.shape), out_features**-0.5)
                )
                for projection in (layer.mlp.gate_proj, layer.mlp.up_proj):
                    projection.weight.copy_(normal(tuple(projection.weight.shape), hidden**-0.5))
                layer.mlp.down_proj.weight.copy_(
                    normal(tuple(layer.mlp.down_proj.weight.shape), config.intermediate_size**-0.5)
                )
                # Norm weights away from 1, so a dropped or misapplied norm is visible.
                layer.input_layernorm.weight.copy_(1.0 + normal((hidden,), 0.2))
                layer.post_attention_layernorm.weight.copy_(1.0 + normal((hidden,), 0.2))
            model.model.norm.weight.copy_(1.0 + normal((hidden,), 0.2))
            if not config.tie_word_embeddings:
                # Logits of order a few units: a peaked but not one-hot next-token distribution.
                model.lm_head.weight.copy_(normal((config.vocab_size, hidden), 2.0 * hidden**-0.5))
        model.config = config
        return model.to(dtype=config.dtype)

    def with_config(self, **changes: Any) -> LlamaModel:
        """A model with these config changes and the same weights (copied) and adapters.

        Only settings that leave every weight shape alone may change (position encoding, offset,
        sliding window, dtype...). Tests use it to compute KV under one setting and reuse it
        under another.
        """
        config = self.config.replace(**changes)
        other = type(self)(config)
        try:
            other.load_state_dict(self.state_dict())  # copies, casting to config.dtype
        except RuntimeError as exc:
            raise InvalidInputError(f"config change alters weight shapes: {exc}") from exc
        other = other.to(device=self.device)
        for name, adapter in self._adapters.items():
            other._adapters[name] = dict(adapter)
        other._active_adapter = self._active_adapter
        return other

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---------------------------------------------------------------- HF checkpoints

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in Hugging Face Llama layout.

        Adapters are not saved (they are not part of the base checkpoint).
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.contiguous() for name, tensor in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            # safetensors refuses shared storage, and HF omits the tied head too.
            state.pop("lm_head.weight")
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        hf = self.config.to_hf_config()
        hf["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        **config_overrides: Any,
    ) -> LlamaModel:
        """Load a local Hugging Face Llama checkpoint: ``config.json`` plus ``*.safetensors``.

        Never touches the network. Every parameter the model has must be present exactly once,
        with the right shape; unknown tensors other than RoPE buffers are an error, so a
        checkpoint of a different architecture is refused instead of half-loaded. One
        exception, as in transformers: a tied-embedding checkpoint may store ``lm_head.weight``
        too (see `_untie_if_head_differs` for which value wins).
        """
        from safetensors import safe_open

        directory = Path(directory)
        overrides = dict(config_overrides)
        if dtype is not None:
            overrides["dtype"] = dtype
        config = ModelConfig.from_hf_config(directory, **overrides)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise InvalidInputError(f"no *.safetensors files in {directory}")
        loaded: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # derived from the config; old checkpoints store it
                    if name in loaded:
                        raise InvalidInputError(f"tensor {name!r} appears in two files")
                    loaded[name] = handle.get_tensor(name)
        if config.tie_word_embeddings and "lm_head.weight" in loaded:
            config = _untie_if_head_differs(config, loaded, directory)
        model = cls(config.replace(dtype=torch.float32))
        expected = dict(model.state_dict())
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight")
        unknown = sorted(set(loaded) - set(expected))
        missing = sorted(set(expected) - set(loaded))
        if unknown or missing:
            raise InvalidInputError(
                f"checkpoint in {directory} does not match the config: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}"
            )
        for name, tensor in loaded.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise InvalidInputError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(expected[name].shape)}"
                )
        model.load_state_dict(loaded, strict=False)
        model.config = config
        return model.to(device=device, dtype=config.dtype)

    # ---------------------------------------------------------------- adapters

    @staticmethod
    def random_adapter(
        config: ModelConfig, seed: int = 0, std: float = 0.5
    ) -> dict[str, torch.Tensor]:
        """Seeded LoRA weights for every q/k/v/o projection, named as `load_adapter` expects.

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

    def load_adapter(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Register a LoRA adapter under `name` (it is not activated; see `set_adapter`).

        Keys name a layer and projection and end in ``lora_A`` / ``lora_B`` (optionally
        ``.weight``); PEFT names such as
        ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` work. A projection
        may be left out (PEFT often adapts only q and v). The update is
        ``(lora_alpha / lora_rank) * B @ A``.
        """
        config = self.config
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
        adapter: _Adapter = {}
        for (layer, projection), pair in halves.items():
            if set(pair) != {"A", "B"}:
                raise InvalidInputError(f"layer {layer} {projection}: need both lora_A and lora_B")
            base = getattr(self.model.layers[layer].self_attn, projection).weight
            out_features, in_features = base.shape
            expected_down = (config.lora_rank, in_features)
            expected_up = (out_features, config.lora_rank)
            if tuple(pair["A"].shape) != expected_down or tuple(pair["B"].shape) != expected_up:
                raise InvalidInputError(
                    f"layer {layer} {projection}: lora_A {tuple(pair['A'].shape)} / lora_B "
                    f"{tuple(pair['B'].shape)}, expected {expected_down} / {expected_up}"
                )
            adapter[(layer, projection)] = _LoraPair(
                down=pair["A"].detach().to(base), up=pair["B"].detach().to(base)
            )
        self._adapters[name] = adapter
        self._adapter_generation += 1

    def set_adapter(self, name: str | None) -> None:
        """Activate a loaded adapter for every later forward call, or None for the base model."""
        if name is not None and name not in self._adapters:
            raise InvalidInputError(f"no adapter named {name!r}; loaded: {sorted(self._adapters)}")
        self._active_adapter = name

    @property
    def active_adapter(self) -> str | None:
        """Name of the adapter in use (part of what a cached KV block depends on)."""
        return self._active_adapter

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._adapters)

    # ---------------------------------------------------------------- change detection

    def weights_version(self) -> Hashable | None:
        """A cheap token that changes whenever a base weight or the config may have changed.

        Built from each parameter's identity, storage address and autograd version counter
        (every in-place op, ``copy_``, ``load_state_dict`` and optimiser step bumps the counter;
        ``.data =`` and ``.to()`` move the storage), plus the config. Costs a walk over the
        parameters, no reads of their values. Edits torch cannot see return an unchanged token:
        writes through ``.numpy()`` or another view of the storage, and parameters that are
        inference tensors (created under ``torch.inference_mode``), which have no version
        counter; then this returns None, meaning "cannot tell".
        """
        try:
            tensors = tuple(
                (id(parameter), parameter.data_ptr(), parameter._version)
                for parameter in self.parameters()
            )
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None
        return (self.config, tensors)

    def adapter_version(self) -> Hashable | None:
        """Like `weights_version`, for the active adapter: its name and the identity and
        version of its tensors (a reloaded or edited adapter changes it)."""
        name = self._active_adapter
        if name is None:
            return None
        try:
            return (
                name,
                self._adapter_generation,
                tuple(
                    (key, id(tensor), tensor._version)
                    for key, pair in sorted(self._adapters.get(name, {}).items())
                    for tensor in (pair.down, pair.up)
                ),
            )
        except RuntimeError:
            return (name, self._adapter_generation, None)

    def _project(self, layer_index: int, projection: str, hidden: torch.Tensor) -> torch.Tensor:
        """A q/k/v/o projection plus the active adapter's low-rank update, if any."""
        linear: nn.Linear = getattr(self.model.layers[layer_index].self_attn, projection)
        output = linear(hidden)
        if self._active_adapter is not None:
            pair = self._adapters[self._active_adapter].get((layer_index, projection))
            if pair is not None:
                assert self.config.lora_rank is not None and self.config.lora_alpha is not None
                scaling = self.config.lora_alpha / self.config.lora_rank
                down, up = pair.down.to(hidden), pair.up.to(hidden)
                output = output + scaling * F.linear(F.linear(hidden, down), up)
        return output

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Half-precision logits are returned in float32 (what sampling wants); float64 stays.
        logits = self.lm_head(self.model.norm(hidden))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    # ---------------------------------------------------------------- oracle: full recompute

    def forward(self, token_ids: TokenIds) -> torch.Tensor:
        """``model(token_ids)`` is `forward_full`: the module's plain, cache-free forward."""
        return self.forward_full(token_ids)

    def forward_full(self, token_ids: TokenIds) -> torch.Tensor:
        """Logits ``[n, vocab]`` for every position of one sequence, recomputed from scratch: no
        cache, no pages. The oracle the paged path is tested against. Float32 (float64 for a
        float64 model)."""
        logits, _, _ = self.forward_full_with_kv(token_ids)
        return logits

    @torch.no_grad()
    def forward_full_with_kv(
        self, token_ids: TokenIds
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """`forward_full` plus each layer's keys and values ``[n, num_kv_heads, head_dim]``
        (keys after RoPE): exactly what a correct paged prefill writes into the pages."""
        config = self.config
        tokens = _token_tensor(token_ids, config.vocab_size, "token_ids").to(self.device)
        n = tokens.numel()
        if n == 0:
            raise InvalidInputError("token_ids is empty")
        # Written independently of the paged path on purpose: [heads, n, dim] layout, rotation
        # by explicit halves, GQA by repeating KV heads, a dense boolean mask.
        positions = torch.arange(n, dtype=torch.float64) + config.position_offset
        angles = positions[:, None] * rope_inverse_frequencies(config, config.position_offset + n)
        cos = torch.cos(angles).to(self.device, self.dtype)  # [n, dim/2]
        sin = torch.sin(angles).to(self.device, self.dtype)
        query_index = torch.arange(n, device=self.device)[:, None]
        key_index = torch.arange(n, device=self.device)[None, :]
        allowed = key_index <= query_index
        if config.sliding_window is not None:
            allowed = allowed & (key_index > query_index - config.sliding_window)
        half = config.head_dim // 2
        softmax_dtype = torch.promote_types(self.dtype, torch.float32)

        def rotate(x: torch.Tensor) -> torch.Tensor:  # x: [heads, n, dim]
            first, second = x[..., :half], x[..., half:]
            return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

        hidden = self.model.embed_tokens(tokens)
        keys_per_layer: list[torch.Tensor] = []
        values_per_layer: list[torch.Tensor] = []
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            normed = layer.input_layernorm(hidden)
            query = self._project(index, "q_proj", normed).view(n, config.num_heads, -1)
            key = self._project(index, "k_proj", normed).view(n, config.num_kv_heads, -1)
            value = self._project(index, "v_proj", normed).view(n, config.num_kv_heads, -1)
            query = rotate(query.transpose(0, 1))
            key = rotate(key.transpose(0, 1))
            value = value.transpose(0, 1)
            keys_per_layer.append(key.transpose(0, 1).contiguous())
            values_per_layer.append(value.transpose(0, 1).contiguous())
            key = key.repeat_interleave(config.num_query_groups, dim=0)
            value = value.repeat_interleave(config.num_query_groups, dim=0)
            # HF "eager" attention: matmuls in the model dtype, softmax in float32.
            scores = torch.matmul(query, key.transpose(1, 2)) * config.head_dim**-0.5
            scores = scores.to(softmax_dtype).masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1).to(self.dtype)
            attended = torch.matmul(weights, value).transpose(0, 1).reshape(n, -1)
            hidden = hidden + self._project(index, "o_proj", attended)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self._logits(hidden), keys_per_layer, values_per_layer

    @torch.no_grad()
    def generate_greedy_full(self, token_ids: TokenIds, max_new_tokens: int) -> list[int]:
        """Greedy continuation by repeated full recompute (the oracle for `generate_greedy`)."""
        tokens = _token_tensor(token_ids, self.config.vocab_size, "token_ids").tolist()
        generated: list[int] = []
        for _ in range(max_new_tokens):
            next_token = int(self.forward_full(tokens + generated)[-1].argmax())
            generated.append(next_token)
        return generated

    # ---------------------------------------------------------------- paged path

    @overload
    def prefill(
        self,
        kv_cache: PagedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: Literal[False] = False,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor: ...

    @overload
    def prefill(
        self,
        kv_cache: PagedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: Literal[True],
        attention_backend: AttentionBackend = "auto",
    ) -> list[torch.Tensor]: ...

    @torch.no_grad()
    def prefill(
        self,
        kv_cache: PagedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: bool = False,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor | list[torch.Tensor]:
        """Compute the uncached positions of every request, reading the cached prefix from pages.

        For request b, positions ``m_b .. end_b - 1`` are computed (``m_b`` =
        `num_cached_tokens`, ``end_b`` = `num_tokens` or ``len(token_ids)``), all requests in
        one packed batch with one attention call per layer. Each layer writes the new K/V into
        the request's pages (unless ``write_kv`` is False) *before* attention, which then reads
        keys ``0 .. end_b - 1`` from the pages.

        Every request is validated before any page is written, so a rejected call leaves the
        cache as it was. Returns the logits of each request's last computed position,
        ``[len(batch), vocab]`` (float32, or float64 for a float64 model), or with
        ``return_all_logits=True`` a list of ``[end_b - m_b, vocab]`` tensors.
        """
        packed = self._pack(kv_cache, batch)
        config = self.config
        total = packed.tokens.numel()
        cos, sin = packed.cos, packed.sin

        hidden = self.model.embed_tokens(packed.tokens)
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            normed = layer.input_layernorm(hidden)
            query = self._project(index, "q_proj", normed).view(total, config.num_heads, -1)
            key = self._project(index, "k_proj", normed).view(total, config.num_kv_heads, -1)
            value = self._project(index, "v_proj", normed).view(total, config.num_kv_heads, -1)
            query = _apply_rotate_half_rope(query, cos, sin)
            key = _apply_rotate_half_rope(key, cos, sin)
            if packed.written_rows is None:
                kv_cache.write(index, key, value, packed.slot_mapping, check_bounds=False)
            elif packed.written_rows.numel() > 0:
                rows = packed.written_rows
                kv_cache.write(
                    index, key[rows], value[rows], packed.slot_mapping, check_bounds=False
                )
            attended = paged_prefill_attention(
                query,
                kv_cache.key_pages[index],
                kv_cache.value_pages[index],
                packed.block_tables,
                packed.query_lens,
                packed.seq_lens,
                scale=config.head_dim**-0.5,
                sliding_window=config.sliding_window,
                backend=attention_backend,
                check_bounds=False,
            )
            hidden = hidden + self._project(index, "o_proj", attended.reshape(total, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))

        if return_all_logits:
            return list(self._logits(hidden).split(packed.query_lens))
        last_rows = torch.tensor(packed.query_lens).cumsum(0).sub(1).to(hidden.device)
        return self._logits(hidden[last_rows])

    def decode_step(
        self,
        kv_cache: PagedKVCache,
        batch: Sequence[DecodeRequest],
        *,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor:
        """Append one token per request: its K/V goes into the pages, the result is next-token
        logits ``[len(batch), vocab]``. Every earlier token's KV must already be in the pages."""
        if isinstance(batch, DecodeRequest) or not isinstance(batch, Sequence):
            raise InvalidInputError("batch must be a sequence of DecodeRequest")
        requests = []
        for position, request in enumerate(batch):
            if not isinstance(request, DecodeRequest):
                raise InvalidInputError(f"batch[{position}] is not a DecodeRequest: {request!r}")
            tokens = _token_tensor(
                request.token_ids, self.config.vocab_size, f"batch[{position}].token_ids"
            )
            if tokens.numel() == 0:
                raise InvalidInputError(f"batch[{position}] needs at least one token")
            requests.append(
                PrefillRequest(tokens, request.block_table, num_cached_tokens=tokens.numel() - 1)
            )
        return self.prefill(kv_cache, requests, attention_backend=attention_backend)

    def generate_greedy(
        self,
        kv_cache: PagedKVCache,
        token_ids: TokenIds,
        block_table: BlockTable,
        max_new_tokens: int,
        *,
        num_cached_tokens: int = 0,
        attention_backend: AttentionBackend = "auto",
    ) -> list[int]:
        """Greedy continuation on the paged path: prefill from `num_cached_tokens`, then one
        `decode_step` per token. `block_table` must cover ``n + max_new_tokens - 1`` positions
        (the last generated token is returned, not written).
        """
        tokens = _token_tensor(token_ids, self.config.vocab_size, "token_ids").tolist()
        if max_new_tokens <= 0:
            return []
        logits = self.prefill(
            kv_cache,
            [PrefillRequest(tokens, block_table, num_cached_tokens=num_cached_tokens)],
            attention_backend=attention_backend,
        )
        generated = [int(logits[0].argmax())]
        while len(generated) < max_new_tokens:
            logits = self.decode_step(
                kv_cache,
                [DecodeRequest(tokens + generated, block_table)],
                attention_backend=attention_backend,
            )
            generated.append(int(logits[0].argmax()))
        return generated

    # ---------------------------------------------------------------- paged path helpers

    def _check_cache(self, kv_cache: PagedKVCache) -> None:
        config = self.config
        if not isinstance(kv_cache, PagedKVCache):
            raise InvalidInputError(f"expected a PagedKVCache, got {type(kv_cache).__name__}")
        model_shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        cache_shape = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)
        if cache_shape != model_shape:
            raise KVShapeError(
                f"KV cache (num_layers, num_kv_heads, head_dim) = {cache_shape}, "
                f"the model needs {model_shape}"
            )
        if kv_cache.dtype != self.dtype:
            raise KVDtypeError(f"KV cache holds {kv_cache.dtype}, the model computes {self.dtype}")
        if kv_cache.device != self.device:
            raise KVDeviceError(f"KV cache is on {kv_cache.device}, the model on {self.device}")

    def _pack(self, kv_cache: PagedKVCache, batch: Sequence[PrefillRequest]) -> _PackedBatch:
        """Validate the cache and every request, and lay the batch out as packed tensors.

        Everything that depends only on lengths and block tables (positions, RoPE tables, slot
        mapping) is built here on the CPU, once per call rather than once per layer.
        """
        config = self.config
        self._check_cache(kv_cache)
        if isinstance(batch, PrefillRequest) or not isinstance(batch, Sequence) or not batch:
            raise InvalidInputError("batch must be a non-empty sequence of PrefillRequest")
        block_size = kv_cache.block_size
        token_chunks: list[torch.Tensor] = []
        angle_chunks: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        row_chunks: list[torch.Tensor] = []
        tables: list[torch.Tensor] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        row = 0
        for index, request in enumerate(batch):
            where = f"batch[{index}]"
            if not isinstance(request, PrefillRequest):
                raise InvalidInputError(f"{where} is not a PrefillRequest: {request!r}")
            tokens = _token_tensor(request.token_ids, config.vocab_size, f"{where}.token_ids")
            start, end = _computed_range(request, tokens.numel(), where)
            table = _int_tensor(request.block_table, f"{where}.block_table")
            needed = -(-end // block_size)
            if table.numel() < needed:
                raise KVShapeError(
                    f"{where}.block_table has {table.numel()} blocks; {end} tokens with "
                    f"block_size {block_size} need {needed}"
                )
            table = table[:needed]
            if bool(((table < 0) | (table >= kv_cache.num_blocks)).any()):
                raise KVIndexError(
                    f"{where}.block_table has block ids outside [0, {kv_cache.num_blocks}): "
                    f"{table.tolist()}"
                )
            positions = torch.arange(start, end)
            # RoPE angles in float64: positions in the hundreds of thousands times a frequency
            # near 1 lose the low bits of the angle in float32.
            absolute = positions.to(torch.float64) + config.position_offset
            frequencies = rope_inverse_frequencies(config, config.position_offset + end)
            angle_chunks.append(torch.outer(absolute, frequencies))
            if request.write_kv:
                blocks = table[positions // block_size]
                slot_chunks.append(blocks * block_size + positions % block_size)
                row_chunks.append(torch.arange(row, row + end - start))
            token_chunks.append(tokens[start:end])
            tables.append(table)
            query_lens.append(end - start)
            seq_lens.append(end)
            row += end - start

        slots = torch.cat(slot_chunks) if slot_chunks else torch.empty(0, dtype=torch.int64)
        if slots.unique().numel() != slots.numel():
            # Two requests writing one slot: the result would depend on write order.
            raise KVIndexError(
                "two requests in the batch write the same page slot; a block may be written by "
                "one request only (shared blocks must be read-only: write_kv=False)"
            )
        written_rows = torch.cat(row_chunks) if row_chunks else torch.empty(0, dtype=torch.int64)
        device = self.device
        angles = torch.cat(angle_chunks)
        return _PackedBatch(
            tokens=torch.cat(token_chunks).to(device),
            cos=torch.cos(angles).to(device, self.dtype),
            sin=torch.sin(angles).to(device, self.dtype),
            slot_mapping=slots.to(device),
            written_rows=None if written_rows.numel() == row else written_rows.to(device),
            block_tables=_pad_block_tables(tables).to(device),
            query_lens=query_lens,
            seq_lens=seq_lens,
        )


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _untie_if_head_differs(
    config: ModelConfig, loaded: dict[str, torch.Tensor], directory: Path
) -> ModelConfig:
    """A tied-embedding checkpoint that stores ``lm_head.weight`` as well (many do).

    If the stored head equals the embedding, it is the same weight written twice: drop it and
    stay tied. If it differs, do what transformers 5 does: do not tie, each tensor keeps its
    stored value (transformers 4 overwrote the head with the embedding instead). The model then
    reports ``tie_word_embeddings=False``, which is what it computes.
    """
    head = loaded["lm_head.weight"]
    embedding = loaded.get("model.embed_tokens.weight")
    if embedding is not None and head.shape == embedding.shape and torch.equal(head, embedding):
        del loaded["lm_head.weight"]
        return config
    _log.warning(
        "%s: tie_word_embeddings is true but the checkpoint stores an lm_head.weight that "
        "differs from the embedding; loading them untied, as transformers does",
        directory,
    )
    return config.replace(tie_word_embeddings=False)


@dataclass(frozen=True)
class _PackedBatch:
    """A validated prefill batch, requests concatenated along the token axis."""

    tokens: torch.Tensor  # [total] token ids of the computed positions
    cos: torch.Tensor  # [total, head_dim // 2] RoPE tables of those positions
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # page slot of each written row
    written_rows: torch.Tensor | None  # rows whose K/V are written; None = all of them
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with block 0
    query_lens: list[int]  # Python ints: attention plans on the host, so no device read-back
    seq_lens: list[int]


def _computed_range(request: PrefillRequest, n: int, where: str) -> tuple[int, int]:
    """``(m, end)``: the positions ``m .. end - 1`` this request computes."""
    start = request.num_cached_tokens
    end = n if request.num_tokens is None else request.num_tokens
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidInputError(f"{where}.num_cached_tokens must be an int >= 0, got {start!r}")
    if isinstance(end, bool) or not isinstance(end, int) or not 0 < end <= n:
        raise InvalidInputError(
            f"{where}.num_tokens must be an int in 1..{n} (len(token_ids)), got {end!r}"
        )
    if start >= end:
        raise InvalidInputError(
            f"{where}: num_cached_tokens ({start}) must be less than the number of tokens to "
            f"compute up to ({end}); at least one position must be computed"
        )
    return start, end


def _apply_rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama RoPE on ``[tokens, heads, dim]``: ``x * cos + rotate_half(x) * sin``, the angle
    table repeated over both halves (pair i is dimensions i and i + dim/2)."""
    cos_full = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin_full = torch.cat((sin, sin), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos_full + rotated * sin_full


def _pad_block_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    # Padding is never read (attention stops at each request's seq_len); 0 is a valid block id
    # all the same, so a kernel that did read it could not fault.
    width = max(table.numel() for table in tables)
    padded = torch.zeros((len(tables), width), dtype=torch.int32)
    for row, table in enumerate(tables):
        padded[row, : table.numel()] = table.to(torch.int32)
    return padded


def _int_tensor(values: Any, what: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list, numpy array or tensor of integers."""
    if isinstance(values, torch.Tensor):
        tensor = values
    elif isinstance(values, np.ndarray):
        if values.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} must hold integers, got numpy dtype {values.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(values).astype(np.int64, copy=False))
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInputError(
            f"{what} must be a list, numpy array or tensor of ints, got {type(values).__name__}"
        )
    else:
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            raise InvalidInputError(f"{what} must hold ints")
        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise InvalidInputError(f"{what} must hold integers, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise InvalidInputError(f"{what} must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor.to("cpu", torch.int64)


def _token_tensor(values: TokenIds, vocab_size: int, what: str) -> torch.Tensor:
    tokens = _int_tensor(values, what)
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise InvalidInputError(f"{what} has ids outside [0, {vocab_size})")
    return tokens
