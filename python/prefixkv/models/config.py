"""What a `LlamaModel` is: its shape and position-encoding settings, read from and written to
Hugging Face ``config.json``, and the `CacheContext` they imply.

`ModelConfig` is validated on construction, so a model is never built from settings the
decoder does not implement; `from_hf_config` reads Llama, Mistral and Qwen2 configs (with their
projection biases and any static RoPE scaling: linear, NTK, Llama 3, YaRN) and refuses the rest
by name (another activation, an unknown field or RoPE parameter) rather than load it. `model_context` is
the one place that says which settings change the KV a model writes (the essay of
`prefixkv.models.decoder` says why each does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from prefixkv.context import AttentionMask, CacheContext, PositionEncoding
from prefixkv.errors import InvalidInputError
from prefixkv.models.rope import rope_base

if TYPE_CHECKING:
    from prefixkv.text.tokenizers import ChatTemplate, Tokenizer

__all__ = ["KNOWN_HF_CONFIG_FIELDS", "ModelConfig", "RopeScaling", "model_context"]


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
    """

    kind: Literal["linear", "ntk", "dynamic_ntk", "llama3", "yarn"]
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

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "ntk", "dynamic_ntk", "llama3", "yarn"):
            raise InvalidInputError(
                f"unsupported rope scaling kind {self.kind!r}; "
                "expected 'linear', 'ntk', 'dynamic_ntk', 'llama3' or 'yarn'"
            )
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
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)):
            raise InvalidInputError(
                f"rope scaling factor must be a finite number, got {self.factor!r}"
            )
        if self.factor < 1.0:
            raise InvalidInputError(f"rope scaling factor must be >= 1, got {self.factor}")

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's multiplier of cos and sin (1 for every other kind): `attention_factor` when
        the config gives it, else the paper's ``0.1 * ln(factor) + 1``."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


#: The per-layer attention kinds `ModelConfig.layer_types` may name (transformers' spelling).
LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


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
        (Mistral's convention), in every layer unless `layer_types` says otherwise.
    layer_types:
        Hybrid models (Gemma 2/3, gpt-oss, Qwen2/3 with ``use_sliding_window``): one entry per
        layer, ``"sliding_attention"`` (the `sliding_window` applies) or ``"full_attention"``
        (it does not), transformers' names. ``None`` means every layer is alike. See
        docs/hybrid.md for what the cache keeps.
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
    layer_types: tuple[str, ...] | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    tie_word_embeddings: bool = False
    #: Biases on the q/k/v projections (Qwen2; Llama's ``attention_bias`` sets this and the
    #: next), on the output projection, and on the MLP's three projections (``mlp_bias``).
    attention_qkv_bias: bool = False
    attention_output_bias: bool = False
    mlp_bias: bool = False
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
        if self.layer_types is not None:
            self._check_layer_types()
        if (self.lora_rank is None) != (self.lora_alpha is None):
            raise InvalidInputError("set both lora_rank and lora_alpha, or neither")
        if self.lora_rank is not None and (
            not isinstance(self.lora_rank, int) or self.lora_rank <= 0
        ):
            raise InvalidInputError(f"lora_rank must be a positive int, got {self.lora_rank!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise InvalidInputError(f"unsupported model dtype {self.dtype}")
        if self.attention_output_bias and not self.attention_qkv_bias:
            # Not an architecture transformers has (Llama biases all four, Qwen2 only q/k/v).
            raise InvalidInputError("attention_output_bias needs attention_qkv_bias")

    def _check_layer_types(self) -> None:
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, Sequence):
            raise InvalidInputError(
                f"layer_types must be a sequence of str or None, got {self.layer_types!r}"
            )
        layer_types = tuple(self.layer_types)
        # Frozen: a list from a caller (or JSON) becomes a tuple, so the config stays hashable.
        object.__setattr__(self, "layer_types", layer_types)
        if len(layer_types) != self.num_layers:
            raise InvalidInputError(
                f"layer_types has {len(layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted({kind for kind in layer_types if kind not in LAYER_TYPES}, key=repr)
        if unknown:
            raise InvalidInputError(
                f"unsupported layer type(s) {unknown}: expected one of {sorted(LAYER_TYPES)}"
            )
        if "sliding_attention" in layer_types and self.sliding_window is None:
            raise InvalidInputError("a 'sliding_attention' layer needs sliding_window")

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of one layer: `sliding_window`, or None for a full-attention layer."""
        if self.layer_types is not None and self.layer_types[layer_index] == "full_attention":
            return None
        return self.sliding_window

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """`layer_sliding_window` of every layer, in order."""
        return tuple(self.layer_sliding_window(index) for index in range(self.num_layers))

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

        Llama, Mistral and Qwen2 configs, with the projection biases they name (Llama's
        ``attention_bias`` / ``mlp_bias``, Qwen2's q/k/v biases), and the sliding window per
        layer as transformers applies it (every layer for Mistral, Qwen2's
        ``use_sliding_window`` with ``layer_types`` or ``max_window_layers``; docs/hybrid.md).
        Refuses what this decoder does not implement (another activation or model type, a RoPE
        scaling it lacks, a mixed ``layer_types`` that transformers would not honour for the
        model type) and any field it does not know, naming it
        (`KNOWN_HF_CONFIG_FIELDS`): a setting it would silently ignore could change what the
        model computes. Keyword `overrides` replace fields after reading, e.g.
        ``dtype=torch.float32``.
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

        _refuse_unknown_fields(hf)
        activation = hf.get("hidden_act", "silu")
        if activation != "silu":
            raise InvalidInputError(f"unsupported hidden_act {activation!r}: only SwiGLU ('silu')")
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise InvalidInputError(
                f"unsupported model_type {model_type!r}: expected 'llama', 'mistral' or 'qwen2'"
            )
        if hf.get("rope_interleaved", False):
            # GPT-J-style adjacent pairs; this decoder (and HF Llama) rotates halves.
            raise InvalidInputError("rope_interleaved=true is unsupported")
        if hf.get("pretraining_tp", 1) != 1:
            # transformers itself ignores it at inference; a value other than 1 means weights
            # sliced for tensor parallelism, which we would load as if whole.
            raise InvalidInputError(f"pretraining_tp {hf['pretraining_tp']!r} is unsupported")
        layer_types: list[str] | None = None
        if model_type == "qwen2":
            # Qwen2: q/k/v biased, o not (its own attention_bias key is not read by transformers).
            qkv_bias, output_bias = True, False
            sliding_window, layer_types = _qwen2_layer_types(hf, int(require("num_hidden_layers")))
        else:
            qkv_bias = output_bias = bool(hf.get("attention_bias", False))
            sliding_window = hf.get("sliding_window")
            # transformers' Llama and Mistral apply one kind to every layer (Mistral warns that
            # a layer_types list is ignored), so a mixed list here is refused, not guessed at.
            _check_layer_types(hf, "sliding_attention" if sliding_window else "full_attention")
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
            "sliding_window": sliding_window,
            "layer_types": layer_types,
            "lora_rank": hf.get("prefixkv_lora_rank"),
            "lora_alpha": hf.get("prefixkv_lora_alpha"),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attention_qkv_bias": qkv_bias,
            "attention_output_bias": output_bias,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
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
                "yarn": "yarn",
            }
            rope_scaling = {
                "rope_type": hf_type[self.rope_scaling.kind],
                "factor": self.rope_scaling.factor,
            }
            if self.rope_scaling.kind == "llama3":
                rope_scaling["low_freq_factor"] = self.rope_scaling.low_freq_factor
                rope_scaling["high_freq_factor"] = self.rope_scaling.high_freq_factor
            if self.rope_scaling.kind in ("llama3", "yarn"):
                rope_scaling["original_max_position_embeddings"] = (
                    self.rope_scaling.original_max_position_embeddings
                )
            if self.rope_scaling.kind == "yarn":
                rope_scaling["beta_fast"] = self.rope_scaling.beta_fast
                rope_scaling["beta_slow"] = self.rope_scaling.beta_slow
                rope_scaling["truncate"] = self.rope_scaling.truncate
                if self.rope_scaling.attention_factor is not None:
                    rope_scaling["attention_factor"] = self.rope_scaling.attention_factor
        # Qwen2 is Llama with q/k/v biases and no output bias: written as a Qwen2 config, the
        # only one transformers reads that way.
        qwen2 = self.attention_qkv_bias and not self.attention_output_bias
        if qwen2 and self.mlp_bias:
            raise InvalidInputError(
                "no Hugging Face config has q/k/v biases without an output bias together with "
                "MLP biases"
            )
        windows = self.layer_sliding_windows
        hybrid = len(set(windows)) > 1
        if hybrid and not qwen2:
            # Of the architectures this decoder writes, only Qwen2 reads a per-layer pattern.
            raise InvalidInputError(
                "a per-layer attention pattern (layer_types) is written only as a Qwen2 config "
                "(attention_qkv_bias without attention_output_bias)"
            )
        hf: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen2 else "llama",
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
            # A pattern of one kind is written as the plain field (`layer_types` all full
            # with a window set must not come back as a window on every layer).
            "sliding_window": self.sliding_window if hybrid else windows[0],
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_qkv_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
        }
        if qwen2:
            del hf["attention_bias"], hf["mlp_bias"]
            hf["use_sliding_window"] = hf["sliding_window"] is not None
            if hf["sliding_window"] is None:
                del hf["sliding_window"]
            else:
                hf["layer_types"] = [
                    "full_attention" if window is None else "sliding_attention"
                    for window in windows
                ]
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


#: Every ``config.json`` key `ModelConfig.from_hf_config` accepts. Anything else is refused,
#: named, because a setting this decoder silently ignored could change what the model computes.
#: Most are read; the rest are known not to change a forward pass (token ids for generation,
#: training-only settings, transformers' bookkeeping).
KNOWN_HF_CONFIG_FIELDS = frozenset(
    {
        # read
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps",
        "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
        "max_position_embeddings", "sliding_window", "use_sliding_window", "max_window_layers",
        "layer_types", "tie_word_embeddings", "attention_bias", "mlp_bias", "pretraining_tp",
        "model_type", "torch_dtype", "dtype", "rope_interleaved",
        "prefixkv_position_offset", "prefixkv_lora_rank", "prefixkv_lora_alpha",
        # inert at inference
        "architectures", "_name_or_path", "transformers_version", "bos_token_id",
        "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "initializer_range", "use_cache", "attention_dropout", "output_attentions",
        "output_hidden_states", "return_dict", "is_encoder_decoder", "chunk_size_feed_forward",
        "id2label", "label2id", "problem_type", "tokenizer_class", "use_bidirectional_attention",
        # SmolLM2's (nanotron's) markers, and transformers.js runtime settings
        "is_llama_config", "transformers.js_config",
    }
)  # fmt: skip


def _refuse_unknown_fields(hf: Mapping[str, Any]) -> None:
    unknown = sorted(key for key in hf if key not in KNOWN_HF_CONFIG_FIELDS)
    if unknown:
        raise InvalidInputError(
            f"config.json has field(s) this decoder does not implement or know to be inert: "
            f"{', '.join(map(repr, unknown))}; refusing rather than ignoring them"
        )


def _check_layer_types(hf: Mapping[str, Any], expected: str) -> None:
    """transformers 5 writes ``layer_types``; only one kind for every layer is implemented."""
    layer_types = hf.get("layer_types")
    if layer_types is not None and any(kind != expected for kind in layer_types):
        raise InvalidInputError(
            f"layer_types {sorted(set(layer_types))} is unsupported: every layer must be "
            f"{expected!r} here"
        )


def _qwen2_layer_types(
    hf: Mapping[str, Any], num_layers: int
) -> tuple[int | None, list[str] | None]:
    """Qwen2's window and per-layer pattern, read as transformers' ``Qwen2Config`` reads them.

    ``sliding_window`` applies only with ``use_sliding_window``: off, it is ignored (every layer
    full). On, ``layer_types`` names each layer's kind, or, absent, layers from
    ``max_window_layers`` (default 28) on slide. A pattern of one kind collapses to the plain
    fields (no `layer_types`), so equal models get equal configs and cache contexts.
    """
    # transformers' default window when the key is absent.
    window = hf.get("sliding_window", 4096)
    if not hf.get("use_sliding_window", False) or window is None:
        _check_layer_types(hf, "full_attention")
        return None, None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first_sliding = hf.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if index >= first_sliding else "full_attention"
            for index in range(num_layers)
        ]
    if not isinstance(layer_types, list):
        raise InvalidInputError(f"layer_types must be a list, got {layer_types!r}")
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


#: The keys a RoPE parameter object may hold, per kind ("rope_type"/"type" and "rope_theta"
#: everywhere). Another key is refused by name, as in the config itself.
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "ntk": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "attention_factor", "mscale", "mscale_all_dim", "truncate",
        }
    ),
}  # fmt: skip


def _yarn_from_hf(raw: Mapping[str, Any], max_position_embeddings: int) -> RopeScaling:
    """transformers' ``_compute_yarn_parameters``, read once: `mscale` / `mscale_all_dim`
    resolve to the attention factor here, so the model sees only `attention_factor`."""
    factor = float(raw["factor"])
    original = int(raw.get("original_max_position_embeddings") or max_position_embeddings)
    attention_factor = raw.get("attention_factor")
    mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:

        def scale(value: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * value * math.log(factor) + 1.0

        attention_factor = scale(float(mscale)) / scale(float(mscale_all_dim))
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(raw.get("truncate", True)),
    )


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
    max_positions = int(hf.get("max_position_embeddings", 2048))
    return theta, _rope_scaling_from_hf(parameters, max_positions) if has_scaling else None


def _rope_scaling_from_hf(
    raw: Mapping[str, Any], max_position_embeddings: int
) -> RopeScaling | None:
    kind = raw.get("rope_type", raw.get("type"))
    kinds = {
        "linear": "linear",
        "ntk": "ntk",
        "dynamic": "dynamic_ntk",
        "llama3": "llama3",
        "yarn": "yarn",
        "default": None,
    }
    if kind not in kinds:
        raise InvalidInputError(
            f"unsupported rope_scaling type {kind!r}: this model implements "
            "'linear', 'ntk' (static NTK-aware), 'dynamic' (dynamic NTK), 'llama3' and 'yarn'"
        )
    unknown = sorted(
        set(raw) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    if unknown:
        raise InvalidInputError(
            f"rope scaling {kind!r} has parameter(s) this decoder does not implement: "
            f"{', '.join(map(repr, unknown))}"
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
    if kind == "yarn":
        return _yarn_from_hf(raw, max_position_embeddings)
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
        if scaling.kind == "yarn":
            params += (
                ("attention_factor", scaling.yarn_attention_factor),
                ("beta_fast", float(scaling.beta_fast)),
                ("beta_slow", float(scaling.beta_slow)),
                (
                    "original_max_position_embeddings",
                    float(scaling.original_max_position_embeddings),
                ),
                ("truncate", float(scaling.truncate)),
            )
        if scaling.kind == "dynamic_ntk":
            params += (("max_position_embeddings", float(config.max_position_embeddings)),)
    windows = set(config.layer_sliding_windows)
    if len(windows) == 1:
        window = windows.pop()
        attention_mask = AttentionMask(
            kind="causal" if window is None else "sliding_window", sliding_window=window
        )
    else:
        # The whole pattern, so a model with the same window on other layers never hits.
        attention_mask = AttentionMask(
            kind="per_layer",
            sliding_window=config.sliding_window,
            layer_windows=config.layer_sliding_windows,
        )
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
        attention_mask=attention_mask,
        kv_dtype=str(config.dtype).removeprefix("torch."),
        block_size=block_size,
    )
