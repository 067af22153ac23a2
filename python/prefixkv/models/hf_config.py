"""Reading a Hugging Face ``config.json`` exactly as transformers' config class for its
``model_type`` reads it (`read_hf_config`), for the types this decoder implements: ``llama``,
``mistral``, ``ministral``, ``phi3``, ``qwen2``, ``qwen3``, ``smollm3``, ``gemma2``,
``gemma3_text``, ``starcoder2``, and the mixture-of-experts ``mixtral``, ``qwen3_moe`` and
``gpt_oss`` (`_moe_from_hf`).

The tables below are data taken from transformers 5.24 (`TRANSFORMERS_VERSION`), which is not a
runtime dependency: `PreTrainedConfig`'s own fields and the keys its ``__post_init__`` consumes,
and each type's config class fields with their defaults. ``tests/test_config_reading.py`` checks
them against the installed transformers, on configs its ``save_pretrained`` wrote.

How a field is judged (do the same for a new one):

* It changes what the model computes (a shape, the RoPE, the window, a bias, the dtype): it is
  **read**, as that type's config class and modeling code read it, default included, with its
  type checked as transformers' strict dataclass checks it (a bool is not an int, a float is not
  an int, no NaN or infinity), or the file is **refused** naming the field when the decoder does
  not implement the value.
* The reference never reads it in a forward pass (token ids for generation, training settings,
  bookkeeping such as ``transformers_version``, another runtime's settings): it is **accepted**
  (`INERT_FIELDS`) and ignored, whatever its value.
* Anything else is **refused by name**: a field transformers does not declare for the type may
  be a setting of an architecture this decoder does not implement.

Where a type's modeling code ignores a field another type reads (Llama ignores ``sliding_window``
and ``layer_types``), the field is read as that type reads it: ignored (`_IGNORED_BY_TYPE`).

size: about 200 of these lines are the tables (data copied from transformers, one per type),
kept beside the reader whose every branch they drive, so that a field is judged in one file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.models.gemma import GEMMA_MODEL_TYPES, GemmaSettings
from prefixkv.models.moe import MoESettings
from prefixkv.models.rope import RopeScaling
from prefixkv.models.starcoder2 import PLAIN_MLP_ACTIVATIONS

__all__ = [
    "FUSED_PROJECTION_TYPES",
    "INERT_FIELDS",
    "KNOWN_HF_CONFIG_FIELDS",
    "TRANSFORMERS_VERSION",
    "checkpoint_model_type",
    "read_hf_config",
]

#: The transformers release the tables below were read from.
TRANSFORMERS_VERSION = "5.24.0"

#: Per model_type, the fields its config class declares (beyond PreTrainedConfig's) and their
#: defaults, as in ``configuration_<type>.py``. ``None`` for a head count or head dim means
#: "derived" (``__post_init__``): KV heads = attention heads, head dim = hidden / heads.
TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "hidden_act": "silu", "max_position_embeddings": 2048, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "head_dim": None,
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "rope_parameters": None, "sliding_window": 4096,
        "attention_dropout": 0.0,
    },
    # Mistral with a per-layer pattern (layer_types); transformers' Ministral cannot build a
    # model without a head_dim (its attention reads the None), so none is derived here either.
    "ministral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "rope_parameters": None, "sliding_window": 4096,
        "attention_dropout": 0.0, "layer_types": None,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None, "attention_dropout": 0.0,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
        # Not a Qwen2Config field: its modeling code reads it with getattr (hidden / heads).
        "head_dim": None,
    },
    # Qwen2 plus per-head q/k RMSNorm; head_dim is a plain int (128 by default, never derived),
    # and attention_bias biases all four projections, as Llama's does.
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None, "attention_dropout": 0.0, "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None,
    },
    # Llama with fused q/k/v and gate/up weights and Mistral's window on every layer; the
    # dropouts are training settings, original_max_position_embeddings is read by longrope only.
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "hidden_act": "silu",
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "bos_token_id": 1,
        "eos_token_id": 32000, "pad_token_id": 32000, "sliding_window": None,
        # Not a Phi3Config field: its modeling code reads it with getattr (hidden / heads).
        "head_dim": None,
    },
    # Llama with NoPE layers (no RoPE on every no_rope_layer_interval-th layer by default) and
    # a RoPE theta of 2e6 when none is given (SmolLM3Config.default_theta).
    "smollm3": {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": 128004,
        "bos_token_id": 128000, "eos_token_id": 128001, "rope_parameters": None,
        "use_sliding_window": False, "sliding_window": None, "no_rope_layers": None,
        "no_rope_layer_interval": 4, "layer_types": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": True,
        # Not a SmolLM3Config field: its modeling code reads it with getattr (hidden / heads).
        "head_dim": None,
    },
    # Mistral with expert MLPs (num_local_experts, top 2 renormalised); the router's training
    # settings (aux loss, jitter noise, router logits output) never enter a forward pass.
    "mixtral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "sliding_window": None, "attention_dropout": 0.0,
        "num_experts_per_tok": 2, "num_local_experts": 8, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "rope_parameters": None,
        # Not a MixtralConfig field: its attribute_map's alias of num_local_experts.
        "num_experts": None,
    },
    # Qwen3 attention (q/k norms) with expert MLPs; the window is on every layer or none.
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": 0.02,
        "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "attention_dropout": 0.0, "decoder_sparse_step": 1,
        "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
        "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None,
        # Not Qwen3MoeConfig fields: its modeling code reads head_dim with getattr (hidden /
        # heads); num_local_experts is what its attribute_map stores num_experts under.
        "head_dim": None, "num_local_experts": None,
    },
    # Sliding / full layers alternating, attention sinks, biased attention, a biased router
    # (softmax over the top k logits), clamped SwiGLU experts, YaRN by default (`_GPT_OSS_ROPE`).
    "gpt_oss": {
        "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
        "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_parameters": None,
        "attention_dropout": 0.0, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001, "output_router_logits": False,
        "use_cache": True, "layer_types": None, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None, "attention_bias": True,
        # Not a GptOssConfig field: its attribute_map's alias of num_local_experts.
        "num_experts": None,
    },
    # Gemma 2 (`prefixkv.models.gemma`): every other layer slides (layer_types, else the even
    # ones); head_dim a plain int; attention_bias on all four projections.
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "use_cache": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None,
    },
    # Gemma 3 text: Gemma 2's fields with q/k norms, no caps by default, a sliding layer pattern
    # of 5:1, RoPE per layer type. The last two are not fields but keys its __post_init__ reads
    # (`sliding_window_pattern`, `rope_local_base_freq`), as published configs write them.
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "use_cache": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False, "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    },
    # Starcoder2 (`prefixkv.models.starcoder2`): LayerNorms (norm_epsilon), a plain GELU MLP,
    # use_bias on all six projections, the window on every layer when set; the dropouts are
    # training settings (typed, never read by inference).
    "starcoder2": {
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
        "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
        "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
        "initializer_range": 0.018042, "norm_epsilon": 1e-5, "use_cache": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None,
        "rope_parameters": None, "sliding_window": None, "attention_dropout": 0.0,
        "residual_dropout": 0.0, "embedding_dropout": 0.0, "use_bias": True,
        "tie_word_embeddings": True,
        # Not a Starcoder2Config field: its modeling code reads it with getattr (hidden / heads).
        "head_dim": None,
    },
}  # fmt: skip

#: Types whose checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``
#: (split on loading: `prefixkv.models.hf_weights`).
FUSED_PROJECTION_TYPES = frozenset({"phi3"})

#: The RoPE theta a config without one computes with (``<Type>Config.default_theta``).
_DEFAULT_ROPE_THETA = {"smollm3": 2_000_000.0, "mixtral": 1_000_000.0, "gpt_oss": 150_000.0}

#: The RoPE ``GptOssConfig`` computes with when a config names none (neither
#: ``rope_parameters`` nor ``rope_scaling``): YaRN, its theta from ``rope_theta`` or the default.
_GPT_OSS_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip

#: PreTrainedConfig's fields, and the keys its ``__post_init__`` takes from a config.json.
_COMMON_FIELDS = frozenset(
    {
        "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
        "model_type", "torch_dtype", "rope_scaling", "rope_theta", "partial_rotary_factor",
        "name_or_path", "_name_or_path", "_commit_hash", "output_attentions",
        "attn_implementation", "experts_implementation", "num_labels",
    }
)  # fmt: skip

#: GenerationConfig's parameters, which PreTrainedConfig pops from a config.json (how to decode,
#: not what the model computes).
_GENERATION_FIELDS = frozenset(
    {
        "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids",
        "begin_suppress_tokens", "diversity_penalty", "do_sample", "early_stopping",
        "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "epsilon_cutoff",
        "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id",
        "forced_eos_token_id", "length_penalty", "max_length", "min_length",
        "no_repeat_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
        "num_beam_groups", "num_beams", "num_return_sequences", "output_scores",
        "remove_invalid_values", "repetition_penalty", "return_dict_in_generate",
        "suppress_tokens", "target_lookbehind", "temperature", "top_k", "top_p", "typical_p",
        "use_cache",
    }
)  # fmt: skip

#: Accepted whatever their value: a forward pass of the reference never reads them.
INERT_FIELDS = _GENERATION_FIELDS | frozenset(
    {
        # PreTrainedConfig's bookkeeping, output switches and fine-tuning heads
        "transformers_version", "architectures", "output_hidden_states", "return_dict",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
        "name_or_path", "_name_or_path", "_commit_hash", "output_attentions",
        "attn_implementation", "experts_implementation", "num_labels",
        # the per-type classes' token ids and training settings
        "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range", "attention_dropout",
        # written by transformers' GGUF conversion (`load_gguf_checkpoint`), never read
        "_model_name_or_path", "unk_token_id",
        # written by other tools: older transformers, nanotron (SmolLM2), transformers.js
        "sep_token_id", "decoder_start_token_id", "tokenizer_class",
        "use_bidirectional_attention", "is_llama_config", "transformers.js_config",
        # the remote-code classes for trust_remote_code (Phi-3's); the native class, which
        # these tables describe, is what transformers builds without it
        "auto_map",
    }
)  # fmt: skip

#: Fields a type's modeling code never reads though another type's does; read as it does
#: (ignored). A Llama ``layer_types`` mixing kinds is still refused (`_llama_layer_types`).
_IGNORED_BY_TYPE: dict[str, frozenset[str]] = {
    "llama": frozenset({"sliding_window", "layer_types"}),
    "mistral": frozenset({"layer_types"}),
    "ministral": frozenset(),
    "qwen2": frozenset(),
    "qwen3": frozenset(),
    # Published SmolLM3 configs carry both; its modeling code reads neither.
    "smollm3": frozenset({"max_window_layers", "pretraining_tp"}),
    "phi3": frozenset(),
    "mixtral": frozenset(),
    # Published Qwen3-MoE configs carry it (from Qwen2); its modeling code never reads it.
    "qwen3_moe": frozenset({"max_window_layers"}),
    # Published gpt-oss configs carry these (OpenAI's own names); transformers never reads them.
    "gpt_oss": frozenset({"experts_per_token", "initial_context_length"}),
    # Published Gemma configs carry hidden_act beside hidden_activation (only the latter is
    # read) and the generation setting cache_implementation; transformers writes Gemma 3's
    # `_sliding_window_pattern` (an attribute its __post_init__ sets; loading reads only
    # `sliding_window_pattern`, and the `layer_types` it writes beside it).
    "gemma2": frozenset({"hidden_act", "cache_implementation"}),
    "gemma3_text": frozenset({"hidden_act", "cache_implementation", "_sliding_window_pattern"}),
    # Starcoder2-15B's config.json carries rms_norm_eps beside norm_epsilon; only the latter is
    # read.
    "starcoder2": frozenset({"rms_norm_eps"}),
}

#: Fields a type's config class does not declare, accepted there only with the value that type
#: computes with: Llama's (no biases, unsliced weights), which configs copied from a Llama one
#: carry, Qwen2.5's ``use_mrope: false`` (transformers' Qwen2 never reads it; true would
#: claim Qwen2-VL's multimodal RoPE, which neither it nor this decoder computes) and
#: Starcoder2's ``mlp_type`` / ``norm_type``.
_LLAMA_FIELDS_AT_DEFAULT: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "ministral": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "qwen2": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "use_mrope": False},
    "qwen3": {"mlp_bias": False, "pretraining_tp": 1},
    "smollm3": {},
    "phi3": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "mixtral": {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
    "qwen3_moe": {"mlp_bias": False, "pretraining_tp": 1},
    "gpt_oss": {"mlp_bias": False, "pretraining_tp": 1},
    "gemma2": {},
    "gemma3_text": {},
    # Published Starcoder2 configs carry BigCode's training settings; transformers never reads
    # them and computes the plain MLP and LayerNorm these values name. Another value would
    # claim a gated MLP or an RMSNorm (other weights) that neither it nor this decoder computes.
    "starcoder2": {"mlp_type": "default", "norm_type": "layer_norm"},
}

#: prefixkv's own fields (`ModelConfig.to_hf_config`), which transformers ignores.
_PREFIXKV_FIELDS = frozenset(
    {"prefixkv_position_offset", "prefixkv_lora_rank", "prefixkv_lora_alpha"}
)

#: Read and refused unless transformers' model would compute as this decoder does.
_REFUSED_UNLESS_DEFAULT = frozenset({"rope_interleaved"})

#: Every key `read_hf_config` accepts for some model type.
KNOWN_HF_CONFIG_FIELDS = (
    _COMMON_FIELDS
    | INERT_FIELDS
    | _PREFIXKV_FIELDS
    | _REFUSED_UNLESS_DEFAULT
    | frozenset().union(*(set(fields) for fields in TYPE_DEFAULTS.values()))
    | frozenset().union(*_IGNORED_BY_TYPE.values())
    | frozenset().union(*(set(fields) for fields in _LLAMA_FIELDS_AT_DEFAULT.values()))
)

#: An int field above this is no real model's (and would overflow the sizes computed from it).
_MAX_INT = 2**31 - 1

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def read_hf_config(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    """The `ModelConfig` fields a Hugging Face config (a dict, file or directory) means, read as
    transformers reads it for its ``model_type`` (defaults included). Raises
    `InvalidInputError` naming the field for a value of the wrong type, a setting this decoder
    does not implement, or a field transformers does not declare for the type."""
    hf = _load(config)
    model_type = hf.get("model_type", "llama")
    if not isinstance(model_type, str) or model_type not in TYPE_DEFAULTS:
        raise InvalidInputError(
            f"unsupported model_type {_show(model_type)}: expected one of "
            f"{', '.join(map(repr, TYPE_DEFAULTS))}"
        )
    known = set(
        _COMMON_FIELDS
        | INERT_FIELDS
        | _PREFIXKV_FIELDS
        | _REFUSED_UNLESS_DEFAULT
        | set(TYPE_DEFAULTS[model_type])
        | _IGNORED_BY_TYPE[model_type]
    )
    for key, expected in _LLAMA_FIELDS_AT_DEFAULT[model_type].items():
        if key in hf and not (hf[key] == expected and type(hf[key]) is type(expected)):
            raise InvalidInputError(
                f"config.json field {key!r} = {_show(hf[key])} is not read by transformers' "
                f"{model_type} (it computes as {key} = {expected!r}); refusing it"
            )
        known.add(key)
    if "quantization_config" in hf:
        # gpt-oss ships MXFP4 experts; any quantized checkpoint would be read as plain weights.
        method = hf["quantization_config"]
        if isinstance(method, Mapping):
            method = method.get("quant_method")
        raise InvalidInputError(
            f"config.json field 'quantization_config' ({_show(method)}): quantized checkpoints "
            "(gpt-oss's MXFP4 experts among them) are not supported; use a dequantized "
            "(bf16 or float32) checkpoint"
        )
    unknown = sorted(key for key in hf if key not in known)
    if unknown:
        raise InvalidInputError(
            f"config.json has field(s) transformers' {model_type} config does not declare and "
            f"this decoder does not know to be inert: {', '.join(map(repr, unknown))}; "
            "refusing rather than ignoring them"
        )
    fields = _Fields(hf, TYPE_DEFAULTS[model_type])
    gemma_type = model_type in GEMMA_MODEL_TYPES
    starcoder2 = model_type == "starcoder2"
    activation_key, supported = (
        ("hidden_activation", ("gelu_pytorch_tanh",)) if gemma_type
        else ("hidden_act", tuple(PLAIN_MLP_ACTIVATIONS)) if starcoder2
        else ("hidden_act", ("silu",))
    )  # fmt: skip
    activation = fields.string(activation_key)
    # gpt-oss's experts apply their own clamped SwiGLU: its modeling never reads hidden_act.
    if activation not in supported and model_type != "gpt_oss":
        raise InvalidInputError(
            f"unsupported {activation_key} {activation!r}: only "
            f"{' or '.join(map(repr, supported))} for {model_type}"
        )
    if hf.get("rope_interleaved", False) is not False:
        # GPT-J-style adjacent pairs; this decoder (and HF Llama) rotates halves.
        raise InvalidInputError(f"rope_interleaved={hf['rope_interleaved']!r} is unsupported")
    if model_type == "llama" and fields.integer("pretraining_tp", nullable=True) not in (1, None):
        # transformers ignores it at inference; another value means weights sliced for tensor
        # parallelism, which would be loaded as if whole.
        raise InvalidInputError(f"pretraining_tp {hf['pretraining_tp']!r} is unsupported")
    if ("prefixkv_lora_rank" in hf) != ("prefixkv_lora_alpha" in hf):
        raise InvalidInputError("set both prefixkv_lora_rank and prefixkv_lora_alpha, or neither")
    num_layers = fields.integer("num_hidden_layers")
    num_heads = fields.integer("num_attention_heads")
    hidden_size = fields.integer("hidden_size")
    layer_types: list[str] | None = None
    rope_layers: list[bool] | None = None
    moe = _moe_from_hf(model_type, fields, num_layers)
    gemma: GemmaSettings | None = None
    if gemma_type:
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = False
        sliding_window, layer_types = _gemma_layer_types(fields, model_type, num_layers)
    elif starcoder2:
        # use_bias: all six projections or none; the window on every layer when set.
        qkv_bias = output_bias = mlp_bias = fields.boolean("use_bias")
        sliding_window = fields.integer("sliding_window", nullable=True)
        for key in ("residual_dropout", "embedding_dropout"):
            fields.number(key)  # inert, but typed as transformers types it
    elif model_type == "gpt_oss":
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = False
        sliding_window, layer_types = _gpt_oss_layer_types(fields, num_layers)
        if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_scaling": _GPT_OSS_ROPE}
    elif model_type == "qwen3_moe":
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = False
        # Qwen3MoeConfig: the window on every layer with use_sliding_window, else none.
        use_window = fields.boolean("use_sliding_window")
        window = fields.integer("sliding_window", nullable=True)
        sliding_window = window if use_window else None
    elif model_type == "mixtral":
        qkv_bias = output_bias = mlp_bias = False
        sliding_window = fields.integer("sliding_window", nullable=True)
    elif model_type == "smollm3":
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = fields.boolean("mlp_bias")
        rope_layers = _smollm3_rope_layers(fields, num_layers)
        sliding_window, layer_types = _smollm3_layer_types(fields, num_layers, rope_layers)
        if all(rope_layers):
            rope_layers = None
    elif model_type == "qwen3":
        # Qwen3: attention_bias on all four projections (Qwen3Attention), none on the MLP.
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = False
        sliding_window, layer_types = _qwen2_layer_types(fields, num_layers)
    elif model_type == "qwen2":
        # Qwen2: q/k/v biased, o not (transformers reads no bias field for it).
        qkv_bias, output_bias, mlp_bias = True, False, False
        sliding_window, layer_types = _qwen2_layer_types(fields, num_layers)
    elif model_type == "phi3":
        qkv_bias = output_bias = mlp_bias = False
        sliding_window = fields.integer("sliding_window", nullable=True)
        for key in ("resid_pdrop", "embd_pdrop"):
            fields.number(key)  # inert, but typed as transformers types it
        fields.integer("original_max_position_embeddings")
    elif model_type == "ministral":
        qkv_bias = output_bias = mlp_bias = False
        sliding_window, layer_types = _ministral_layer_types(fields, num_layers)
    elif model_type == "mistral":
        qkv_bias = output_bias = mlp_bias = False
        sliding_window = fields.integer("sliding_window", nullable=True)
        _check_single_kind(hf, "sliding_attention" if sliding_window else "full_attention")
    else:
        qkv_bias = output_bias = fields.boolean("attention_bias")
        mlp_bias = fields.boolean("mlp_bias")
        sliding_window = None  # transformers' Llama reads no window
        _check_single_kind(hf, None)
    local_theta: float | None = None  # Gemma 3's sliding layers' RoPE base
    if model_type == "gemma3_text":
        rope_theta, rope_scaling, local_theta = _gemma3_rope(hf, fields)
    elif model_type == "phi3":
        rope_theta, rope_scaling = _phi3_rope(hf, fields, hidden_size // num_heads)
    else:
        rope_theta, rope_scaling = _rope_from_hf(
            hf, fields, _DEFAULT_ROPE_THETA.get(model_type, 10000.0)
        )
    if gemma_type:
        gemma = _gemma_settings(fields, model_type, local_theta)
    # Qwen3Config, GptOssConfig and the Gemma configs declare head_dim a plain int (strict:
    # null is refused, but GptOssConfig derives a missing one); Ministral's modeling reads a
    # null one as None and fails; the others derive it (hidden / heads).
    head_dim = fields.integer(
        "head_dim",
        nullable=model_type not in ("qwen3", "ministral", "gpt_oss") and not gemma_type,
    )
    num_kv_heads = fields.integer("num_key_value_heads", nullable=True)
    epsilon_key = "norm_epsilon" if starcoder2 else "rms_norm_eps"
    epsilon = fields.number(epsilon_key)
    if not epsilon > 0:  # named as the file names it (ModelConfig's name is rms_norm_eps)
        raise InvalidInputError(f"config.json field {epsilon_key!r} must be > 0, got {epsilon}")
    return {
        "vocab_size": fields.integer("vocab_size"),
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_heads if num_kv_heads is None else num_kv_heads,
        "head_dim": hidden_size // num_heads if head_dim is None else head_dim,
        "intermediate_size": fields.integer("intermediate_size"),
        "rms_norm_eps": epsilon,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": fields.integer("max_position_embeddings"),
        "position_offset": fields.integer("prefixkv_position_offset", default=0, minimum=0),
        "sliding_window": sliding_window,
        "layer_types": layer_types,
        "lora_rank": fields.integer("prefixkv_lora_rank", default=None, nullable=True),
        "lora_alpha": fields.number("prefixkv_lora_alpha", default=None, nullable=True),
        "tie_word_embeddings": fields.boolean("tie_word_embeddings"),
        "attention_qkv_bias": qkv_bias,
        "attention_output_bias": output_bias,
        "mlp_bias": mlp_bias,
        "qk_norm": model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        "rope_layers": rope_layers,
        "moe": moe,
        "attention_sinks": model_type == "gpt_oss",
        "gemma": gemma,
        "layer_norm": starcoder2,
        "plain_mlp_activation": activation if starcoder2 else None,
        "dtype": _dtype(hf),
    }


def checkpoint_model_type(config: Mapping[str, Any] | str | Path) -> str:
    """The ``model_type`` of a config (``llama`` when absent, as `read_hf_config` reads it)."""
    model_type = _load(config).get("model_type", "llama")
    return model_type if isinstance(model_type, str) else ""


def _load(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            hf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise InvalidInputError(f"cannot read model config {path}: {exc}") from exc
    elif isinstance(config, Mapping):
        hf = dict(config)
    else:
        hf = config
    if not isinstance(hf, dict) or not all(isinstance(key, str) for key in hf):
        raise InvalidInputError("a Hugging Face config must be a JSON object")
    return hf


class _Fields:
    """Typed reads of a config's fields, each with the type's default when absent, checked as
    transformers' strict dataclasses check them; an error names the field."""

    def __init__(self, hf: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.hf, self.defaults = hf, defaults

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.hf:
            return self.hf[key]
        return self.defaults.get(key) if default is ... else default

    def integer(
        self, key: str, *, default: Any = ..., nullable: bool = False, minimum: int = 1
    ) -> Any:
        value = self.get(key, default)
        if value is None and nullable:
            return None
        return _integer(key, value, minimum=minimum)

    def number(self, key: str, *, default: Any = ..., nullable: bool = False) -> Any:
        value = self.get(key, default)
        if value is None and nullable:
            return None
        return _number(key, value)

    def boolean(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise InvalidInputError(
                f"config.json field {key!r} must be true or false, got {_show(value)}"
            )
        return value

    def string(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str):
            raise InvalidInputError(
                f"config.json field {key!r} must be a string, got {_show(value)}"
            )
        return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(key: str, value: Any, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInputError(f"config.json field {key!r} must be an int, got {_show(value)}")
    if not minimum <= value <= _MAX_INT:
        raise InvalidInputError(
            f"config.json field {key!r} must be between {minimum} and {_MAX_INT}, got {_show(value)}"
        )
    return value


def _number(key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidInputError(f"config.json field {key!r} must be a number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidInputError(f"config.json field {key!r} must be finite, got {_show(value)}")
    return number


def _dtype(hf: Mapping[str, Any]) -> torch.dtype:
    # transformers: `dtype` wins when both are given (PreTrainedConfig.__post_init__).
    key = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    name = hf.get(key)
    if name is None:
        return torch.float32
    if not isinstance(name, str) or name not in _DTYPES:
        raise InvalidInputError(
            f"config.json field {key!r}: unsupported dtype {_show(name)} "
            f"(supported: {', '.join(_DTYPES)})"
        )
    return _DTYPES[name]


def _layer_type_list(hf: Mapping[str, Any]) -> list[str] | None:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or not all(isinstance(k, str) for k in layer_types):
        raise InvalidInputError(
            f"config.json field 'layer_types' must be a list of strings, got {_show(layer_types)}"
        )
    return layer_types


def _moe_from_hf(model_type: str, fields: _Fields, num_layers: int) -> MoESettings | None:
    """The expert mixture of a MoE type, read as its config class and modeling read it; None
    for a dense type. ``num_experts`` and ``num_local_experts`` name one field (each class's
    ``attribute_map``; transformers writes the second); both given and different is refused."""
    if model_type not in ("mixtral", "qwen3_moe", "gpt_oss"):
        return None
    given = [key for key in ("num_experts", "num_local_experts") if key in fields.hf]
    if len(given) == 2 and fields.hf["num_experts"] != fields.hf["num_local_experts"]:
        raise InvalidInputError(
            "config.json fields 'num_experts' and 'num_local_experts' (its alias) differ"
        )
    default_key = "num_experts" if model_type == "qwen3_moe" else "num_local_experts"
    experts_key = given[0] if given else default_key
    num_experts = fields.integer(experts_key)
    top_k = fields.integer("num_experts_per_tok")
    if top_k > num_experts:
        raise InvalidInputError(
            f"config.json field 'num_experts_per_tok' ({top_k}) exceeds {experts_key!r} "
            f"({num_experts})"
        )
    if model_type == "gpt_oss":
        return MoESettings(
            kind="gpt_oss",
            num_experts=num_experts,
            experts_per_token=top_k,
            expert_intermediate_size=fields.integer("intermediate_size"),
            swiglu_alpha=fields.number("swiglu_alpha"),
            swiglu_limit=fields.number("swiglu_limit"),
        )
    if model_type == "mixtral":
        return MoESettings(
            kind="mixtral",
            num_experts=num_experts,
            experts_per_token=top_k,
            expert_intermediate_size=fields.integer("intermediate_size"),
        )
    # Qwen3MoeDecoderLayer: experts where the layer is not in mlp_only_layers and
    # (index + 1) is a multiple of decoder_sparse_step.
    step = fields.integer("decoder_sparse_step")
    dense = fields.get("mlp_only_layers")
    dense = [] if dense is None else dense
    if not isinstance(dense, list) or not all(type(index) is int for index in dense):
        raise InvalidInputError(
            f"config.json field 'mlp_only_layers' must be a list of ints, got {_show(dense)}"
        )
    return MoESettings(
        kind="qwen3_moe",
        num_experts=num_experts,
        experts_per_token=top_k,
        expert_intermediate_size=fields.integer("moe_intermediate_size"),
        normalize_top_k=fields.boolean("norm_topk_prob"),
        sparse_layers=tuple(
            index not in dense and (index + 1) % step == 0 for index in range(num_layers)
        ),
    )


def _gpt_oss_layer_types(fields: _Fields, num_layers: int) -> tuple[int | None, list[str] | None]:
    """gpt-oss's window and per-layer pattern, read as ``GptOssConfig`` reads them:
    ``layer_types``, or, absent, sliding on even layers and full on odd ones. A sliding layer
    without a window is refused (transformers' attention would not slide it); one kind
    collapses to the plain fields."""
    window = fields.integer("sliding_window", nullable=True)
    layer_types = _layer_type_list(fields.hf)
    if layer_types is None:
        layer_types = [
            "sliding_attention" if index % 2 == 0 else "full_attention"
            for index in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise InvalidInputError(
            f"config.json field 'layer_types' has {len(layer_types)} entries for "
            f"{num_layers} layers"
        )
    if "sliding_attention" in layer_types and window is None:
        raise InvalidInputError(
            "config.json field 'layer_types' names sliding layers but 'sliding_window' is null"
        )
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


def _check_single_kind(hf: Mapping[str, Any], expected: str | None) -> None:
    """Llama and Mistral apply one kind to every layer (Mistral warns that a ``layer_types``
    is ignored): a list naming one kind is read as transformers reads it (ignored), a mixed
    one, or one contradicting Mistral's window, refused rather than guessed at."""
    layer_types = _layer_type_list(hf)
    if layer_types is None:
        return
    kinds = set(layer_types)
    if len(kinds) > 1 or (expected is not None and kinds - {expected}):
        raise InvalidInputError(
            f"config.json field 'layer_types' {sorted(kinds)} is unsupported for this "
            f"model_type: transformers applies one kind to every layer"
            + ("" if expected is None else f", here {expected!r}")
        )


def _qwen2_layer_types(fields: _Fields, num_layers: int) -> tuple[int | None, list[str] | None]:
    """Qwen2's window and per-layer pattern, read as transformers' ``Qwen2Config`` reads them
    (``Qwen3Config.__post_init__`` is the same code).

    ``sliding_window`` applies only with ``use_sliding_window``: off, it is ignored (every layer
    full). On, ``layer_types`` names each layer's kind, or, absent, layers from
    ``max_window_layers`` (default 28) on slide. A pattern of one kind collapses to the plain
    fields (no `layer_types`), so equal models get equal configs and cache contexts.
    """
    use_window = fields.boolean("use_sliding_window")
    window = fields.integer("sliding_window", nullable=True)
    first_sliding = fields.integer("max_window_layers", minimum=0)
    layer_types = _layer_type_list(fields.hf)
    if not use_window or window is None:
        if layer_types is not None and set(layer_types) - {"full_attention"}:
            raise InvalidInputError(
                f"config.json field 'layer_types' {sorted(set(layer_types))} needs "
                "use_sliding_window and a sliding_window"
            )
        return None, None
    if layer_types is None:
        layer_types = [
            "sliding_attention" if index >= first_sliding else "full_attention"
            for index in range(num_layers)
        ]
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


def _ministral_layer_types(fields: _Fields, num_layers: int) -> tuple[int | None, list[str] | None]:
    """Ministral's window and per-layer pattern, read as ``MinistralConfig`` reads them:
    ``layer_types`` names each layer's kind, or, absent, every layer slides when a
    ``sliding_window`` is set (as Mistral). A sliding layer without a window is refused
    (transformers' mask builder fails on it); one kind collapses to the plain fields."""
    window = fields.integer("sliding_window", nullable=True)
    layer_types = _layer_type_list(fields.hf)
    if layer_types is None:
        return window, None
    if len(layer_types) != num_layers:
        raise InvalidInputError(
            f"config.json field 'layer_types' has {len(layer_types)} entries for "
            f"{num_layers} layers"
        )
    if "sliding_attention" in layer_types and window is None:
        raise InvalidInputError(
            "config.json field 'layer_types' names sliding layers but 'sliding_window' is null"
        )
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


def _smollm3_rope_layers(fields: _Fields, num_layers: int) -> list[bool]:
    """Which layers apply RoPE, read as ``SmolLM3Config`` reads ``no_rope_layers`` (1: RoPE,
    0: NoPE; at least one entry per layer, the first ``num_layers`` used) or, absent, derives
    it: NoPE on every ``no_rope_layer_interval``-th layer. transformers tests an entry for
    truth; anything but 0 or 1 is refused rather than read that way."""
    raw = fields.hf.get("no_rope_layers")
    if raw is None:
        interval = fields.integer("no_rope_layer_interval")
        return [(index + 1) % interval != 0 for index in range(num_layers)]
    if not isinstance(raw, list) or not all(
        type(entry) is int and entry in (0, 1) for entry in raw
    ):
        raise InvalidInputError(
            f"config.json field 'no_rope_layers' must be a list of 0 and 1, got {_show(raw)}"
        )
    if len(raw) < num_layers:
        raise InvalidInputError(
            f"config.json field 'no_rope_layers' has {len(raw)} entries for {num_layers} layers"
        )
    fields.integer("no_rope_layer_interval")  # still type-checked, as transformers does
    return [entry == 1 for entry in raw[:num_layers]]


def _smollm3_layer_types(
    fields: _Fields, num_layers: int, rope_layers: list[bool]
) -> tuple[int | None, list[str] | None]:
    """SmolLM3's window: ``layer_types``, or, absent, a window on the NoPE layers when
    ``use_sliding_window`` and a ``sliding_window`` are set. A sliding layer without both is
    refused: transformers' eager mask would slide where its flash path would not."""
    use_window = fields.boolean("use_sliding_window")
    window = fields.integer("sliding_window", nullable=True)
    layer_types = _layer_type_list(fields.hf)
    if layer_types is None:
        layer_types = [
            "sliding_attention" if use_window and window is not None and not rope else
            "full_attention"
            for rope in rope_layers
        ]  # fmt: skip
    if len(layer_types) != num_layers:
        raise InvalidInputError(
            f"config.json field 'layer_types' has {len(layer_types)} entries for "
            f"{num_layers} layers"
        )
    if "sliding_attention" in layer_types and not (use_window and window is not None):
        raise InvalidInputError(
            "config.json field 'layer_types' names sliding layers without use_sliding_window "
            "and a sliding_window; transformers' attention backends disagree on it"
        )
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


def _gemma_layer_types(
    fields: _Fields, model_type: str, num_layers: int
) -> tuple[int | None, list[str] | None]:
    """Gemma's window and per-layer pattern, read as ``Gemma2Config`` / ``Gemma3TextConfig``
    read them: ``layer_types``, or, absent, every layer but each ``pattern``-th slides (Gemma 2:
    2, alternating from a sliding layer 0; Gemma 3: ``sliding_window_pattern``, 6 by default).
    Bidirectional attention (an encoder use of the weights) is refused; a sliding layer
    without a window too (transformers' mask builder fails on it). One kind collapses to the
    plain fields, as for the other types."""
    bidirectional = fields.get("use_bidirectional_attention")
    if bidirectional is not None and not isinstance(bidirectional, bool):
        raise InvalidInputError(
            f"config.json field 'use_bidirectional_attention' must be true, false or null, "
            f"got {_show(bidirectional)}"
        )
    if bidirectional:
        raise InvalidInputError(
            "config.json field 'use_bidirectional_attention' is true: this decoder is causal only"
        )
    window = fields.integer("sliding_window", nullable=True)
    pattern = 2 if model_type == "gemma2" else fields.integer("sliding_window_pattern")
    layer_types = _layer_type_list(fields.hf)
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (index + 1) % pattern else "full_attention"
            for index in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise InvalidInputError(
            f"config.json field 'layer_types' has {len(layer_types)} entries for "
            f"{num_layers} layers"
        )
    if "sliding_attention" in layer_types and window is None:
        raise InvalidInputError(
            "config.json field 'layer_types' names sliding layers but 'sliding_window' is null"
        )
    if all(kind == "full_attention" for kind in layer_types):
        return None, None
    if all(kind == "sliding_attention" for kind in layer_types):
        return window, None
    return window, layer_types


def _gemma_settings(fields: _Fields, model_type: str, local_theta: float | None) -> GemmaSettings:
    """What Gemma computes beyond Llama (`prefixkv.models.gemma`). Gemma 3's attention never
    passes ``attn_logit_softcapping`` on: type-checked, then ignored as there."""
    attention_cap = fields.number("attn_logit_softcapping", nullable=True)
    return GemmaSettings(
        model_type=model_type,
        query_pre_attn_scalar=fields.integer("query_pre_attn_scalar"),
        attn_logit_softcapping=attention_cap if model_type == "gemma2" else None,
        final_logit_softcapping=fields.number("final_logit_softcapping", nullable=True),
        local_rope_theta=local_theta,
    )


def _gemma3_rope(hf: Mapping[str, Any], fields: _Fields) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's RoPE per layer type, read as ``Gemma3TextConfig.convert_rope_params_to_dict``
    reads it: ``rope_parameters`` ``{"full_attention": {...}, "sliding_attention": {...}}``
    (transformers 5), or the older top-level keys: ``rope_scaling`` and ``rope_theta`` (default
    1e6) for the full layers, ``rope_local_base_freq`` (default 1e4) for the sliding ones.
    Returns the full layers' theta and scaling and the sliding layers' theta; scaling on the
    sliding layers is refused (no published Gemma 3 has it)."""
    key = "rope_parameters"
    parameters = hf.get(key)
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, Mapping) or set(parameters) - {
        "full_attention", "sliding_attention"
    }:  # fmt: skip
        raise InvalidInputError(
            f"config.json field {key!r} must map 'full_attention' and 'sliding_attention' to "
            f"RoPE parameters for gemma3_text, got {_show(parameters)}"
        )
    per_type = {}
    for layer_type in ("full_attention", "sliding_attention"):
        raw = parameters.get(layer_type)
        if raw is None:
            raw = {"rope_type": "default"}
        if not isinstance(raw, Mapping):
            raise InvalidInputError(
                f"config.json field '{key}.{layer_type}' must be an object, got {_show(raw)}"
            )
        per_type[layer_type] = dict(raw)
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise InvalidInputError(
                f"config.json field 'rope_scaling' must be an object or null, got {_show(scaling)}"
            )
        per_type["full_attention"].update(scaling)
    per_type["full_attention"].setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    per_type["sliding_attention"].setdefault("rope_theta", fields.get("rope_local_base_freq"))
    fraction = hf.get("partial_rotary_factor", 1.0)
    if _number("partial_rotary_factor", fraction) != 1.0:
        raise InvalidInputError(f"partial_rotary_factor {fraction} is unsupported")
    max_positions = fields.integer("max_position_embeddings")
    full, local = per_type["full_attention"], per_type["sliding_attention"]
    full_scaling = _rope_scaling_from_hf(full, f"{key}.full_attention", max_positions)
    if _rope_scaling_from_hf(local, f"{key}.sliding_attention", max_positions) is not None:
        raise InvalidInputError(
            f"config.json field '{key}.sliding_attention': RoPE scaling on the sliding layers "
            "is unsupported"
        )
    theta = _number(f"{key}.full_attention.rope_theta", full["rope_theta"])
    local_key = f"{key}.sliding_attention.rope_theta"
    if "rope_local_base_freq" in hf and "rope_theta" not in (
        parameters.get("sliding_attention") or {}
    ):
        local_key = "rope_local_base_freq"  # where the value came from, for the error
    local_theta = _number(local_key, local["rope_theta"])
    if not local_theta > 1:
        raise InvalidInputError(f"config.json field {local_key!r} must be > 1, got {local_theta}")
    return theta, full_scaling, local_theta


#: What a LongRoPE parameter object may hold besides its type, theta and rotary fraction:
#: transformers' required and optional keys for ``longrope``.
_LONGROPE_KEYS = frozenset(
    {
        "short_factor",
        "long_factor",
        "factor",
        "attention_factor",
        "original_max_position_embeddings",
    }
)


def _phi3_rope(
    hf: Mapping[str, Any], fields: _Fields, rotary_dim: int
) -> tuple[float, RopeScaling | None]:
    """Phi-3's RoPE, read as ``Phi3Config.convert_rope_params_to_dict`` and transformers'
    ``_compute_longrope_parameters`` read it.

    ``rope_scaling`` wins over ``rope_parameters``; its type is "default" or "longrope", the
    older "su" and "yarn" meaning longrope too (anything else Phi3Config refuses). The original
    context is always the top-level ``original_max_position_embeddings`` (default 4096): it
    overrides the object's own whenever transformers normalises a longrope object, which the
    model's rotary embedding does on construction even for "su" (whose object must hold one
    all the same, or the config is refused). The theta inside the object wins over the
    top-level one. ``factor`` defaults to ``max_position_embeddings / original``, and the
    attention factor to ``sqrt(1 + ln(factor) / ln(original))`` (1 when factor <= 1).
    """
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    raw = hf.get(key)
    if raw is None:
        return _rope_from_hf(hf, fields, 10000.0)
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"config.json field {key!r} must be an object, got {_show(raw)}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return _rope_from_hf(hf, fields, 10000.0)
    if kind not in ("longrope", "su", "yarn"):
        raise InvalidInputError(
            f"config.json field {key!r}: phi3 reads rope type 'default' or 'longrope' "
            f"(older 'su' and 'yarn' mean longrope), got {_show(kind)}"
        )
    unknown = sorted(
        set(raw) - _LONGROPE_KEYS - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    if unknown:
        raise InvalidInputError(
            f"config.json field {key!r}: longrope has parameter(s) this decoder does not "
            f"implement: {', '.join(map(repr, unknown))}"
        )
    fraction_key = "partial_rotary_factor"
    rotary_fraction = raw.get(fraction_key, hf.get(fraction_key, 1.0))
    if _number(fraction_key, rotary_fraction) != 1.0:
        raise InvalidInputError(f"{fraction_key} {rotary_fraction} is unsupported")
    theta = _number(f"{key}.rope_theta", raw.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "su" and raw.get("original_max_position_embeddings") is None:
        raise InvalidInputError(
            f"config.json field {key!r}: rope type 'su' needs its own "
            "'original_max_position_embeddings' (transformers refuses it without)"
        )
    original = fields.integer("original_max_position_embeddings")
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = raw.get(name)
        if not isinstance(values, list) or len(values) != rotary_dim // 2:
            raise InvalidInputError(
                f"config.json field '{key}.{name}' must be a list of {rotary_dim // 2} numbers "
                f"(one per rotated pair), got {_show(values)}"
            )
        factors[name] = tuple(_number(f"{key}.{name}", value) for value in values)
    factor = raw.get("factor")
    if factor is None:
        factor = fields.integer("max_position_embeddings") / original
    factor = _number(f"{key}.factor", factor)
    attention_factor = raw.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    attention_factor = _number(f"{key}.attention_factor", attention_factor)
    return theta, RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=attention_factor,
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
    )


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


def _rope_from_hf(
    hf: Mapping[str, Any], fields: _Fields, default_theta: float
) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either config style.

    transformers 5 writes ``rope_parameters: {rope_type, rope_theta, factor, ...}``; earlier
    versions wrote ``rope_theta`` and ``rope_scaling`` at the top level. Reading only the old
    keys from a new config would silently fall back to theta 10000, so both are understood.
    """
    key = "rope_parameters"
    parameters = hf.get("rope_parameters")
    if parameters is None:
        key = "rope_scaling"
        scaling = hf.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise InvalidInputError(
                f"config.json field 'rope_scaling' must be an object or null, got {_show(scaling)}"
            )
        parameters = dict(scaling or {})
        if "rope_theta" in hf:
            parameters["rope_theta"] = hf["rope_theta"]
    if not isinstance(parameters, Mapping):
        raise InvalidInputError(
            f"config.json field {key!r} must be an object, got {_show(parameters)}"
        )
    if parameters and all(isinstance(value, Mapping) for value in parameters.values()):
        raise InvalidInputError(f"config.json field {key!r}: per-layer-type RoPE is unsupported")
    fraction_key = "partial_rotary_factor"
    rotary_fraction = parameters.get(fraction_key, hf.get(fraction_key, 1.0))
    if _number(fraction_key, rotary_fraction) != 1.0:
        raise InvalidInputError(f"{fraction_key} {rotary_fraction} is unsupported")
    theta = _number("rope_theta", parameters.get("rope_theta", default_theta))
    max_positions = fields.integer("max_position_embeddings")
    return theta, _rope_scaling_from_hf(parameters, key, max_positions)


def _rope_scaling_from_hf(
    raw: Mapping[str, Any], key: str, max_position_embeddings: int
) -> RopeScaling | None:
    # No type is the default RoPE (whose parameters are checked all the same).
    kind = raw.get("rope_type", raw.get("type", "default"))
    kinds = {
        "linear": "linear",
        "ntk": "ntk",
        "dynamic": "dynamic_ntk",
        "llama3": "llama3",
        "yarn": "yarn",
        "default": None,
    }
    if not isinstance(kind, str) or kind not in kinds:
        raise InvalidInputError(
            f"config.json field {key!r}: unsupported rope type {_show(kind)}: this model "
            "implements 'linear', 'ntk' (static NTK-aware), 'dynamic' (dynamic NTK), 'llama3' "
            "and 'yarn'"
        )
    unknown = sorted(
        set(raw) - _ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    if unknown:
        raise InvalidInputError(
            f"config.json field {key!r}: rope type {kind!r} has parameter(s) this decoder does not implement: "
            f"{', '.join(map(repr, unknown))}"
        )
    if kinds[kind] is None:
        return None

    def number(name: str, default: float | None = None) -> float:
        value = raw.get(name, default)
        if value is None:
            raise InvalidInputError(f"{kind} rope scaling ({key}) needs {name!r}")
        return _number(f"{key}.{name}", value)

    def integer(name: str, default: int | None = None) -> int:
        value = raw.get(name, default)
        if value is None:
            raise InvalidInputError(f"{kind} rope scaling ({key}) needs {name!r}")
        return _integer(f"{key}.{name}", value)

    factor = number("factor")
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=factor,
            low_freq_factor=number("low_freq_factor"),
            high_freq_factor=number("high_freq_factor"),
            original_max_position_embeddings=integer("original_max_position_embeddings"),
        )
    if kind == "yarn":
        # transformers' `_compute_yarn_parameters`, read once: `mscale` / `mscale_all_dim`
        # resolve to the attention factor here, so the model sees only `attention_factor`.
        # A null or 0 falls back to the default, as transformers' `or` does.
        original = raw.get("original_max_position_embeddings") or max_position_embeddings
        attention_factor = raw.get("attention_factor")
        mscale, mscale_all_dim = raw.get("mscale"), raw.get("mscale_all_dim")
        if attention_factor is None and mscale and mscale_all_dim:

            def scale(value: float) -> float:
                return 1.0 if factor <= 1 else 0.1 * value * math.log(factor) + 1.0

            attention_factor = scale(_number(f"{key}.mscale", mscale)) / scale(
                _number(f"{key}.mscale_all_dim", mscale_all_dim)
            )
        truncate = raw.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidInputError(f"config.json field '{key}.truncate' must be true or false")
        return RopeScaling(
            kind="yarn",
            factor=factor,
            original_max_position_embeddings=_integer(
                f"{key}.original_max_position_embeddings", original
            ),
            beta_fast=_number(f"{key}.beta_fast", raw.get("beta_fast") or 32.0),
            beta_slow=_number(f"{key}.beta_slow", raw.get("beta_slow") or 1.0),
            attention_factor=(
                None
                if attention_factor is None
                else _number(f"{key}.attention_factor", attention_factor)
            ),
            truncate=truncate,
        )
    return RopeScaling(kind=kinds[kind], factor=factor)  # type: ignore[arg-type]
