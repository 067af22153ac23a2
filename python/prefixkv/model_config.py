"""What a `LlamaModel` is: its shape and position-encoding settings, read from and written to
Hugging Face ``config.json``, and the `CacheContext` they imply.

`ModelConfig` is validated on construction, so a model is never built from settings the
decoder does not implement; `from_hf_config` refuses architectures it would compute wrongly
(biases, other activations, unknown RoPE scalings) rather than load them. `model_context` is
the one place that says which settings change the KV a model writes (the essay of
`prefixkv.model` says why each does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from prefixkv.context import AttentionMask, CacheContext, PositionEncoding
from prefixkv.errors import InvalidInputError
from prefixkv.rope import rope_base

if TYPE_CHECKING:
    from prefixkv.text import ChatTemplate, Tokenizer

__all__ = ["ModelConfig", "RopeScaling", "model_context"]


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
        """The RoPE base for a sequence whose positions end at ``sequence_length - 1``
        (`prefixkv.rope.rope_base`; only dynamic NTK scaling reads the length)."""
        return rope_base(self, sequence_length)

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


def model_context(
    config: ModelConfig,
    *,
    weights: str,
    block_size: int,
    model_id: str = "",
    tokenizer: Tokenizer | None = None,
    chat_template: ChatTemplate | None = None,
) -> CacheContext:
    """The `CacheContext` of a model: every setting that changes the KV it writes.

    `weights` is a digest of the weights (`LlamaModel.weights_digest`); the tokenizer and chat
    template are named by their digests. Adapters are not here: they are per-block keys
    (`LlamaModel.adapter_digest`), so switching one does not clear the cache.
    """
    scaling = config.rope_scaling
    params: tuple[tuple[str, float], ...] = ()
    if scaling is not None:
        params = (("factor", float(scaling.factor)),)
        if scaling.kind == "llama3":
            params += (
                ("high_freq_factor", float(scaling.high_freq_factor)),
                ("low_freq_factor", float(scaling.low_freq_factor)),
                (
                    "original_max_position_embeddings",
                    float(scaling.original_max_position_embeddings),
                ),
            )
        if scaling.kind == "dynamic_ntk":
            params += (("max_position_embeddings", float(config.max_position_embeddings)),)
    window = config.sliding_window
    return CacheContext(
        model_id=model_id,
        weights_digest=weights,
        tokenizer_id="" if tokenizer is None else tokenizer.name,
        tokenizer_digest="" if tokenizer is None else tokenizer.digest(),
        chat_template_version="" if chat_template is None else chat_template.digest(),
        position_encoding=PositionEncoding(
            kind="rope",
            rope_theta=float(config.rope_theta),
            rope_scaling=None if scaling is None else scaling.kind,
            rope_scaling_params=params,
            position_offset=config.position_offset,
        ),
        attention_mask=AttentionMask(
            kind="causal" if window is None else "sliding_window", sliding_window=window
        ),
        kv_dtype=str(config.dtype).removeprefix("torch."),
        block_size=block_size,
    )
