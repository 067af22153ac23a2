"""What a `LlamaModel` is: its shape and position-encoding settings, read from and written to
Hugging Face ``config.json``, and the `CacheContext` they imply.

`ModelConfig` is validated on construction, so a model is never built from settings the
decoder does not implement; `from_hf_config` reads Llama, Mistral, Ministral, Qwen2, Qwen3,
SmolLM3, Starcoder2 (and the types `prefixkv.models.hf_config` lists) configs as transformers
reads them, or refuses them by name (`prefixkv.models.hf_config` holds
the reader and its rules; `to_hf_config` writes no Ministral config: a per-layer pattern is
written as Qwen2 or Qwen3). `weight_bytes` and `check_fits_in_memory` size a model before a loader builds it.
`model_context` is the one place that says which settings change the KV a model writes (the
essay of `prefixkv.models.decoder` says why each does).

size: `ModelConfig`'s fields are the decoder's whole vocabulary, each with its check and its
place in the cache context; reading `config.json` is in `prefixkv.models.hf_config`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prefixkv.context import AttentionMask, CacheContext, PositionEncoding
from prefixkv.errors import InvalidInputError, ModelTooLargeError
from prefixkv.models.gemma import GemmaSettings
from prefixkv.models.hf_config import KNOWN_HF_CONFIG_FIELDS, read_hf_config
from prefixkv.models.moe import MoESettings
from prefixkv.models.rope import RopeScaling, rope_attention_factor, rope_base
from prefixkv.models.starcoder2 import PLAIN_MLP_ACTIVATIONS

if TYPE_CHECKING:
    from prefixkv.text.tokenizers import ChatTemplate, Tokenizer

__all__ = [
    "KNOWN_HF_CONFIG_FIELDS",
    "ModelConfig",
    "RopeScaling",
    "check_fits_in_memory",
    "model_context",
    "physical_memory_bytes",
]


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
    #: Qwen3's per-head RMSNorm of queries and keys (``q_norm`` / ``k_norm``, weights of
    #: ``head_dim``), applied after the projections and before RoPE.
    qk_norm: bool = False
    #: Per layer, whether it applies RoPE (SmolLM3's NoPE layers do not: their queries and keys
    #: carry no position). None: every layer does (a tuple of all True is normalized to None).
    rope_layers: tuple[bool, ...] | None = None
    #: Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, gpt-oss: `prefixkv.models.moe`); None: dense.
    moe: MoESettings | None = None
    #: gpt-oss's attention sinks: a learned logit per query head that joins every softmax's
    #: denominator (a key no value is attached to), so a head may attend to nothing.
    attention_sinks: bool = False
    #: Gemma 2 / Gemma 3 text (`prefixkv.models.gemma`): scaled embedding, ``(1 + weight)``
    #: sandwich norms, GELU MLP, query pre-scaling, soft caps, Gemma 3's local RoPE base.
    gemma: GemmaSettings | None = None
    #: Starcoder2 (`prefixkv.models.starcoder2`): every norm a LayerNorm with a bias (the mean
    #: subtracted; `rms_norm_eps` is its epsilon) instead of an RMSNorm.
    layer_norm: bool = False
    #: Starcoder2: a plain MLP ``c_proj(act(c_fc(x)))`` (biased with `mlp_bias`) instead of the
    #: gated one; the value names ``act`` as transformers does (``PLAIN_MLP_ACTIVATIONS``).
    #: None: the gated MLP (SwiGLU, or Gemma's GELU gate).
    plain_mlp_activation: str | None = None
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
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidInputError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidInputError(f"{name} must be finite, got {value!r}")
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
        if not isinstance(self.qk_norm, bool):
            raise InvalidInputError(f"qk_norm must be a bool, got {self.qk_norm!r}")
        if self.rope_layers is not None:
            if isinstance(self.rope_layers, str) or not isinstance(self.rope_layers, Sequence):
                raise InvalidInputError(
                    f"rope_layers must be a sequence of bool or None, got {self.rope_layers!r}"
                )
            rope_layers = tuple(self.rope_layers)
            if len(rope_layers) != self.num_layers or not all(
                isinstance(rope, bool) for rope in rope_layers
            ):
                raise InvalidInputError(
                    f"rope_layers must hold one bool per layer ({self.num_layers}), "
                    f"got {self.rope_layers!r}"
                )
            object.__setattr__(self, "rope_layers", None if all(rope_layers) else rope_layers)
        if self.moe is not None and not isinstance(self.moe, MoESettings):
            raise InvalidInputError(f"moe must be a MoESettings or None, got {self.moe!r}")
        sparse_layers = None if self.moe is None else self.moe.sparse_layers
        if sparse_layers is not None and len(sparse_layers) != self.num_layers:
            raise InvalidInputError(
                f"moe.sparse_layers has {len(sparse_layers)} entries for {self.num_layers} layers"
            )
        if not isinstance(self.attention_sinks, bool):
            raise InvalidInputError(f"attention_sinks must be a bool, got {self.attention_sinks!r}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise InvalidInputError(f"unsupported model dtype {self.dtype}")
        if self.attention_output_bias and not self.attention_qkv_bias:
            # Not an architecture transformers has (Llama biases all four, Qwen2 only q/k/v).
            raise InvalidInputError("attention_output_bias needs attention_qkv_bias")
        if self.gemma is not None and not isinstance(self.gemma, GemmaSettings):
            raise InvalidInputError(f"gemma must be a GemmaSettings or None, got {self.gemma!r}")
        self._check_starcoder2_parts()

    def _check_starcoder2_parts(self) -> None:
        if not isinstance(self.layer_norm, bool):
            raise InvalidInputError(f"layer_norm must be a bool, got {self.layer_norm!r}")
        activation = self.plain_mlp_activation
        if activation is not None and activation not in PLAIN_MLP_ACTIVATIONS:
            raise InvalidInputError(
                f"plain_mlp_activation must be None or one of {sorted(PLAIN_MLP_ACTIVATIONS)}, "
                f"got {activation!r}"
            )
        if (self.layer_norm or activation is not None) and (
            self.gemma is not None or self.moe is not None
        ):
            # Gemma's norms and MLP, and the experts, are their own modules: no architecture
            # transformers has mixes them with Starcoder2's.
            raise InvalidInputError(
                "layer_norm and plain_mlp_activation (Starcoder2's) do not combine with gemma "
                "or moe"
            )

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

    def layer_applies_rope(self, layer_index: int) -> bool:
        """Whether a layer rotates its queries and keys (False for a NoPE layer)."""
        return self.rope_layers is None or self.rope_layers[layer_index]

    def layer_uses_local_rope(self, layer_index: int) -> bool:
        """Whether a layer rotates with Gemma 3's local base (`local_rope`): its sliding
        layers do, its full-attention layers use `rope_theta` and `rope_scaling`."""
        return (
            self.gemma is not None
            and self.gemma.local_rope_theta is not None
            and self.layer_sliding_window(layer_index) is not None
        )

    @property
    def local_rope(self) -> ModelConfig | None:
        """The RoPE settings of Gemma 3's sliding layers (its local base, no scaling), as a
        config the RoPE formulas read; None for a model whose layers all rotate alike."""
        if self.gemma is None or self.gemma.local_rope_theta is None:
            return None
        return replace(self, rope_theta=self.gemma.local_rope_theta, rope_scaling=None, gemma=None)

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: ``head_dim ** -0.5``, or Gemma's
        ``query_pre_attn_scalar ** -0.5``."""
        return self.head_dim**-0.5 if self.gemma is None else self.gemma.attention_scale

    @property
    def attention_softcap(self) -> float | None:
        """Gemma 2's cap of attention scores (``tanh(s / cap) * cap``), else None."""
        return None if self.gemma is None else self.gemma.attn_logit_softcapping

    @property
    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """`layer_sliding_window` of every layer, in order."""
        return tuple(self.layer_sliding_window(index) for index in range(self.num_layers))

    @property
    def position_encoding_is_length_dependent(self) -> bool:
        """True if the RoPE of a position depends on the total sequence length (dynamic NTK,
        LongRoPE).

        Then KV computed while the sequence was shorter is not what a full recompute of the
        current sequence gives, so a prefix cache must not reuse it (it may still reuse KV while
        every length involved stays within `max_position_embeddings`, where the base is fixed).
        """
        return self.rope_scaling is not None and self.rope_scaling.kind in (
            "dynamic_ntk",
            "longrope",  # short factors up to the original context, long ones beyond
        )

    @property
    def prefix_reuse_limit(self) -> int | None:
        """Under a length-dependent RoPE, the longest sequence (in tokens, from position
        `position_offset`) whose RoPE is the one setting every shorter sequence has too, or
        None: LongRoPE's short factors hold while ``position_offset + length`` stays within
        ``original_max_position_embeddings`` (transformers switches at ``max(position_ids) + 1
        > original``). KV computed within it is what a full recompute of any sequence within
        it gives; a sequence that may pass it must share nothing with those that do not."""
        scaling = self.rope_scaling
        if scaling is None or scaling.kind != "longrope":
            return None
        limit = scaling.original_max_position_embeddings - self.position_offset
        return limit if limit > 0 else None

    @property
    def num_query_groups(self) -> int:
        """How many query heads share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def parameter_count(self) -> int:
        """How many weights the model has (embedding, head unless tied, layers, norms, biases)."""
        hidden, q_width = self.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
        if self.attention_qkv_bias:
            attention += q_width + 2 * kv_width
        if self.attention_output_bias:
            attention += hidden
        plain_mlp = self.plain_mlp_activation is not None  # c_fc and c_proj, no gate
        mlp = (2 if plain_mlp else 3) * hidden * self.intermediate_size
        if self.mlp_bias:
            mlp += (1 if plain_mlp else 2) * self.intermediate_size + hidden
        norm = 2 * hidden if self.layer_norm else hidden  # a LayerNorm has a bias too
        layer = attention + 2 * norm
        if self.gemma is not None:
            layer += 2 * hidden  # the sandwich's pre/post feed-forward norms
        if self.qk_norm:
            layer += 2 * self.head_dim
        if self.attention_sinks:
            layer += self.num_heads
        mlps = sum(
            mlp if self.moe is None or not self.moe.layer_is_sparse(index)
            else self.moe.parameter_count(hidden)
            for index in range(self.num_layers)
        )  # fmt: skip
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * hidden + self.num_layers * layer + mlps + norm

    def weight_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the weights take in `dtype` (loaders build in float32, then cast)."""
        return self.parameter_count * torch.empty((), dtype=dtype).element_size()

    def rope_base(self, sequence_length: int) -> float:
        """The RoPE base for a sequence whose positions end at ``sequence_length - 1``
        (`prefixkv.models.rope.rope_base`; only dynamic NTK scaling reads the length)."""
        return rope_base(self, sequence_length)

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | str | Path, **overrides: Any
    ) -> ModelConfig:
        """Read a Hugging Face Llama/Mistral-style ``config.json`` (a dict, file or directory).

        Every field is read as transformers' config class for the ``model_type`` reads it,
        defaults included (`prefixkv.models.hf_config.read_hf_config`): the projection biases
        (Llama's ``attention_bias`` / ``mlp_bias``, Qwen2's q/k/v biases), Qwen3's q/k norms and
        its own ``head_dim`` (128 when absent), the sliding window per layer
        (every layer for Mistral, none for Llama, Qwen2's and Qwen3's ``use_sliding_window`` with
        ``layer_types`` or ``max_window_layers``; docs/hybrid.md), RoPE. Metadata no forward
        pass reads is accepted; a value of the wrong type, a setting this decoder does not
        implement, or a field transformers does not declare for the type is refused with an
        `InvalidInputError` naming it. Keyword `overrides` replace fields after reading, e.g.
        ``dtype=torch.float32``.
        """
        values = read_hf_config(config)
        values.update(overrides)
        return cls(**values)

    def to_hf_config(self) -> dict[str, Any]:
        """This config as a Hugging Face ``config.json`` dict that transformers reads as the
        same model: Llama, Mistral when every layer has a window (transformers' Llama ignores
        ``sliding_window``), Qwen2 for q/k/v biases without an output bias or a per-layer pattern,
        Qwen3 for q/k norms, Starcoder2 for LayerNorms and a plain MLP.

        Fields HF has no name for (position offset, LoRA shape) are written with a
        ``prefixkv_`` prefix, which HF ignores and `from_hf_config` reads back.
        """
        if self.gemma is not None:
            # Read only, as Phi-3 and Ministral: written as Llama it would load as another model.
            raise InvalidInputError(
                f"a {self.gemma.model_type} config is read only: to_hf_config does not write it"
            )
        if self.moe is not None or self.attention_sinks:
            # Their checkpoints are read (`from_hf_config`), not written: transformers' own
            # save_pretrained writes them, which is what the tests compare against.
            raise InvalidInputError(
                "a mixture-of-experts model or one with attention sinks (moe, attention_sinks) "
                "is not written as a Hugging Face config"
            )
        if self.rope_scaling is not None and self.rope_scaling.kind == "longrope":
            raise InvalidInputError(
                "longrope rope scaling is read from a Phi-3 config, not written (to_hf_config)"
            )
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
        if self.layer_norm or self.plain_mlp_activation is not None:
            return self._starcoder2_hf_config(rope_scaling)
        # SmolLM3 is the only type with NoPE layers; its attention_bias biases all four
        # projections (or none), and it reads mlp_bias and a per-layer window pattern.
        smollm3 = self.rope_layers is not None
        if smollm3 and (self.qk_norm or self.attention_qkv_bias != self.attention_output_bias):
            raise InvalidInputError(
                "NoPE layers are written as a SmolLM3 config, which has no q/k norms and "
                "biases all four attention projections or none"
            )
        # Qwen3 is the only type with q/k norms; its attention_bias biases all four projections
        # (or none), and it has no MLP biases.
        qwen3 = self.qk_norm
        if qwen3 and (self.mlp_bias or self.attention_qkv_bias != self.attention_output_bias):
            raise InvalidInputError(
                "q/k norms are written as a Qwen3 config, which biases all four attention "
                "projections or none, and no MLP projection"
            )
        # Qwen2 is Llama with q/k/v biases and no output bias: written as a Qwen2 config, the
        # only one transformers reads that way.
        qwen2 = (
            not (qwen3 or smollm3) and self.attention_qkv_bias and not self.attention_output_bias
        )
        if qwen2 and self.mlp_bias:
            raise InvalidInputError(
                "no Hugging Face config has q/k/v biases without an output bias together with "
                "MLP biases"
            )
        windows = self.layer_sliding_windows
        hybrid = len(set(windows)) > 1
        if hybrid and not (qwen2 or qwen3 or smollm3):
            # Of the architectures this decoder writes, only Qwen2/3 read a per-layer pattern.
            raise InvalidInputError(
                "a per-layer attention pattern (layer_types) is written only as a Qwen2 config "
                "(attention_qkv_bias without attention_output_bias) or a Qwen3 one (qk_norm)"
            )
        # A window on every layer is written as Mistral: transformers' Llama reads no window.
        mistral = not (qwen2 or qwen3 or smollm3) and windows[0] is not None
        if mistral and (self.attention_qkv_bias or self.mlp_bias):
            raise InvalidInputError(
                "a sliding window is written as a Mistral config, which has no projection "
                "biases: transformers' Llama would load this config with full attention"
            )
        model_type = (
            "smollm3" if smollm3
            else "qwen3" if qwen3
            else "qwen2" if qwen2
            else "mistral" if mistral
            else "llama"
        )  # fmt: skip
        architecture = {
            "smollm3": "SmolLM3", "qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral",
            "llama": "Llama",
        }[model_type]  # fmt: skip
        hf: dict[str, Any] = {
            "architectures": [f"{architecture}ForCausalLM"],
            "model_type": model_type,
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
        if qwen2 or mistral:
            del hf["attention_bias"], hf["mlp_bias"]
        if qwen3:
            del hf["mlp_bias"]
        if smollm3:
            assert self.rope_layers is not None
            hf["no_rope_layers"] = [int(rope) for rope in self.rope_layers]
            # SmolLM3Config's default pad id (128004) is out of a small vocabulary, where
            # transformers' embedding refuses it; no forward pass reads it.
            hf["pad_token_id"] = None
        if qwen2 or qwen3 or smollm3:
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

    def _starcoder2_hf_config(self, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
        """A LayerNorm or plain-MLP model written as the one type that has them, Starcoder2,
        or refused naming what Starcoder2Config cannot say."""
        biases = {self.attention_qkv_bias, self.attention_output_bias, self.mlp_bias}
        windows = set(self.layer_sliding_windows)
        unsaid = [
            name
            for name, unsayable in (
                ("layer_norm", not self.layer_norm),
                ("plain_mlp_activation", self.plain_mlp_activation is None),
                ("attention_qkv_bias, attention_output_bias and mlp_bias", len(biases) > 1),
                ("qk_norm", self.qk_norm),
                ("rope_layers", self.rope_layers is not None),
                ("layer_types", len(windows) > 1),
            )
            if unsayable
        ]
        if unsaid:
            raise InvalidInputError(
                "LayerNorms and a plain MLP are written as a Starcoder2 config, which has both, "
                "one use_bias for all six projections, no q/k norms, NoPE layers or per-layer "
                f"pattern; refusing to write {', '.join(unsaid)}"
            )
        hf: dict[str, Any] = {
            "architectures": ["Starcoder2ForCausalLM"],
            "model_type": "starcoder2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.plain_mlp_activation,
            "norm_epsilon": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": windows.pop(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_bias": self.mlp_bias,
            # Starcoder2Config's defaults (50256) are outside a small vocabulary, which
            # transformers warns about; no forward pass reads them.
            "bos_token_id": None,
            "eos_token_id": None,
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


def physical_memory_bytes() -> int:
    """This machine's physical memory (``os.sysconf``), the most a loader lets a model take.
    Tests lower it by patching this function."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits_in_memory(config: ModelConfig, source: object) -> None:
    """Refuse, before anything is allocated, a model whose float32 weights (what a loader builds
    first) exceed the machine's memory: a config or GGUF header is untrusted, and a few bytes
    of it can ask torch for terabytes. `source` names the file in the error."""
    needed, limit = config.weight_bytes(torch.float32), physical_memory_bytes()
    if needed > limit:
        raise ModelTooLargeError(
            f"{source}: the model needs {needed:,} bytes of weights in float32 "
            f"({config.parameter_count:,} parameters), more than this machine's {limit:,} bytes"
        )


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
        if scaling.kind == "longrope":
            params += (
                ("attention_factor", float(rope_attention_factor(config))),
                *((f"long_factor.{i:04d}", float(v)) for i, v in enumerate(scaling.long_factor)),
                (
                    "original_max_position_embeddings",
                    float(scaling.original_max_position_embeddings),
                ),
                *((f"short_factor.{i:04d}", float(v)) for i, v in enumerate(scaling.short_factor)),
            )
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
        extra=_architecture_extra(config),
    )


def _architecture_extra(config: ModelConfig) -> dict[str, str]:
    """What of the architecture changes KV beyond the fields above: Qwen3's q/k norms, the
    layers that apply no RoPE. Named here as well as in the weights digest, so that a digest
    given by the caller (not computed from the model) still keeps such KV apart from Llama KV
    of equal shapes; absent for a plain Llama, so existing contexts keep their fingerprints."""
    extra = {}
    if config.qk_norm:
        extra["qk_norm"] = "rms_per_head_before_rope"
    if config.rope_layers is not None:
        extra["nope_layers"] = ",".join(
            str(index) for index, rope in enumerate(config.rope_layers) if not rope
        )
    if config.moe is not None:
        extra["moe"] = json.dumps(asdict(config.moe), sort_keys=True)
    if config.attention_sinks:
        extra["attention_sinks"] = "per_head_logit"
    if config.layer_norm:
        extra["norm"] = "layer_norm_with_bias"
    if config.plain_mlp_activation is not None:
        extra["mlp"] = f"plain:{config.plain_mlp_activation}"
    if config.gemma is not None:
        # Every Gemma setting changes the KV (the embedding scale and norms feed the keys) or
        # the attention over it; the local RoPE base is the sliding layers' position encoding.
        gemma = config.gemma
        extra["gemma"] = (
            f"{gemma.model_type};query_pre_attn_scalar={gemma.query_pre_attn_scalar!r};"
            f"attn_softcap={gemma.attn_logit_softcapping!r};"
            f"final_softcap={gemma.final_logit_softcapping!r};"
            f"local_rope_theta={gemma.local_rope_theta!r}"
        )
    return extra
