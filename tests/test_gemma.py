"""Gemma 2 and Gemma 3 text (issue 23): scaled embeddings, ``(1 + weight)`` sandwich norms, a
GELU MLP, query pre-scaling, soft caps (Gemma 2's on attention scores too), Gemma 3's q/k norms
and local RoPE base, and their sliding/full layer patterns on the KV groups.

The reference is transformers itself: its ``Gemma2Config`` / ``Gemma3TextConfig`` for how a
config is read, and checkpoints its ``save_pretrained`` writes at test time, compared with its
forward and ``generate``. Weights are redrawn so attention is sharp, the caps small enough to
bite, and the norm weights away from 0: with transformers' init (norm weights 0, attention
near uniform) most planted bugs would barely move the logits, and
`test_each_planted_bug_is_caught` checks that each one does here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import example, given
from hypothesis import strategies as st

from prefixkv.engine.facade import Engine
from prefixkv.errors import BackendUnavailableError, InvalidInputError
from prefixkv.kv.decode import paged_decode_attention
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv.prefill import paged_prefill_attention
from prefixkv.models import hf_config
from prefixkv.models import layers as layers_module
from prefixkv.models.config import ModelConfig
from prefixkv.models.decoder import DecodeRequest, LlamaModel, PrefillRequest
from prefixkv.models.gemma import GemmaSettings
from tests.demo_support import run_demo_model
from tests.test_config_reading import WRONG_VALUES
from tests.test_gguf import tokenizer as tokenizer
from tests.test_model_hf import TOKENS, assert_close_to_scale, load_with_transformers
from tests.test_model_paged import Scenario, build_model, check_cached_matches_full, scenarios
from tests.test_qwen3 import transformers_greedy

#: Tiny shapes; the window (7) is far shorter than the 40-token prompts, so sliding matters,
#: and query_pre_attn_scalar (24) is not head_dim (32), so the pre-scaling does.
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "sliding_window": 7,
    "query_pre_attn_scalar": 24,
}
#: Caps the sharpened scores and logits reach, so dropping one moves the result.
GEMMA2: dict[str, Any] = {**TINY, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}
#: Six layers of a 3:1 pattern (two full layers), a local RoPE base far from the global one,
#: linear scaling on the global layers only, a final cap.
GEMMA3: dict[str, Any] = {
    **TINY,
    "num_hidden_layers": 6,
    "sliding_window_pattern": 3,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "final_logit_softcapping": 5.0,
}
SHARPNESS = 8.0
#: transformers computes RoPE angles in float32 (``position * inv_freq``), this decoder in
#: float64 (`prefixkv.models.rope`); through Gemma 3's sharp q/k norms that alone moves its
#: logits by up to 2e-5 of their scale (with its angles in float64 the full path is bit for bit
#: equal: checked while writing this test). Gemma 2's bound is the usual 1e-5.
RTOL = {"gemma2": 1e-5, "gemma3_text": 1e-4}


def sharpen(model: Any, seed: int) -> None:
    """Redraw a transformers Gemma model's weights: embeddings small (they are scaled by
    sqrt(hidden)), projections of twice the fan-in scale (sharp scores), norm weights (used as
    ``1 + w``) away from 0, q/k norms of about ``sqrt(SHARPNESS)`` differing per dimension."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                spread = 1.0 + 0.6 * noise.abs()
                parameter.copy_(SHARPNESS**0.5 * spread / spread.mean() - 1.0)
            elif name.endswith("norm.weight"):
                parameter.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(0.1 * noise)
            else:
                parameter.copy_(2.0 * noise / math.sqrt(parameter.shape[1]))


def gemma_checkpoint(directory: Path, model_type: str, seed: int = 1, **changes: Any) -> Any:
    """A tiny random Gemma checkpoint written by transformers; returns transformers' model
    loaded back from it (float32, eager attention)."""
    torch.manual_seed(seed)
    if model_type == "gemma2":
        config: Any = transformers.Gemma2Config(**{**GEMMA2, **changes})
        theirs: Any = transformers.Gemma2ForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(**{**GEMMA3, **changes})
        theirs = transformers.Gemma3ForCausalLM(config)
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


def paged_logits(model: LlamaModel, tokens: torch.Tensor, cached: int) -> torch.Tensor:
    """Logits of positions ``cached ..`` on the paged path, the first `cached` positions
    prefilled (and cached in the pages) by an earlier call."""
    config = model.config
    kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
    table = list(range(11))
    if cached:
        model.prefill(kv, [PrefillRequest(tokens[:cached], table)])
    (logits,) = model.prefill(
        kv, [PrefillRequest(tokens, table, num_cached_tokens=cached)], return_all_logits=True
    )
    return logits


# -- the config, read as transformers reads it ---------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "config_class"),
    [("gemma2", transformers.Gemma2Config), ("gemma3_text", transformers.Gemma3TextConfig)],
)
def test_the_type_tables_are_transformers_configs(model_type: str, config_class: Any) -> None:
    declared = {field.name: field for field in dataclasses.fields(config_class)}
    defaults = hf_config.TYPE_DEFAULTS[model_type]
    assert set(declared) - set(hf_config.KNOWN_HF_CONFIG_FIELDS) <= set(defaults)
    for name, field in declared.items():
        if name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[name] == field.default, (name, defaults[name], field.default)


@pytest.mark.parametrize(
    ("model_type", "changes"),
    [
        ("gemma2", {}),
        ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),
        ("gemma2", {"layer_types": ["full_attention"] * 3 + ["sliding_attention"]}),
        ("gemma3_text", {}),
        # transformers' defaults: 5:1, theta 1e6 / 1e4, no scaling, no caps.
        (
            "gemma3_text",
            {
                "sliding_window_pattern": 6,
                "rope_local_base_freq": 10000.0,
                "rope_scaling": None,
                "final_logit_softcapping": None,
                "num_hidden_layers": 12,
            },
        ),
        ("gemma3_text", {"attn_logit_softcapping": 9.0, "rope_theta": 5e5}),
        ("gemma3_text", {"sliding_window": None, "layer_types": ["full_attention"] * 6}),
    ],
    ids=["g2", "g2_no_caps", "g2_layer_types", "g3", "g3_defaults", "g3_cap_theta", "g3_full"],
)
def test_configs_transformers_saves_are_read_as_it_reads_them(
    tmp_path: Path, model_type: str, changes: dict[str, Any]
) -> None:
    arguments = {**(GEMMA2 if model_type == "gemma2" else GEMMA3), **changes}
    if model_type == "gemma2":
        theirs: Any = transformers.Gemma2Config(**arguments)
    else:
        theirs = transformers.Gemma3TextConfig(**arguments)
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    gemma = ours.gemma
    assert gemma is not None and gemma.model_type == model_type
    assert ours.attention_scale == theirs.query_pre_attn_scalar**-0.5
    assert gemma.final_logit_softcapping == theirs.final_logit_softcapping
    # Gemma 3's attention never passes its cap on (Gemma3Attention.forward).
    expected_cap = theirs.attn_logit_softcapping if model_type == "gemma2" else None
    assert ours.attention_softcap == expected_cap
    assert ours.qk_norm is (model_type == "gemma3_text")
    assert ours.head_dim == theirs.head_dim and ours.tie_word_embeddings
    expected_windows = [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]
    assert list(ours.layer_sliding_windows) == expected_windows
    if model_type == "gemma2":
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
        assert gemma.local_rope_theta is None
    else:
        full = theirs.rope_parameters["full_attention"]
        assert ours.rope_theta == full["rope_theta"]
        assert (ours.rope_scaling and ours.rope_scaling.factor) == full.get("factor")
        assert gemma.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]


def test_published_configs_load(tmp_path: Path) -> None:
    """gemma-2-2b's and gemma-3-1b-it's config.json as published (older transformers wrote
    them: hidden_act beside hidden_activation, cache_implementation, top-level RoPE keys)."""
    gemma2 = {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True,
        "vocab_size": 256000,
    }  # fmt: skip
    gemma3 = {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
    }  # fmt: skip
    for raw in (gemma2, gemma3):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        theirs = transformers.AutoConfig.from_pretrained(tmp_path)
        ours = ModelConfig.from_hf_config(tmp_path)
        windows = [theirs.sliding_window if kind == "sliding_attention" else None
                   for kind in theirs.layer_types]  # fmt: skip
        assert list(ours.layer_sliding_windows) == windows
        assert ours.gemma is not None
        assert ours.gemma.query_pre_attn_scalar == theirs.query_pre_attn_scalar
    assert ours.gemma is not None and ours.gemma.local_rope_theta == 10000.0
    assert ours.rope_theta == 1e6 and ours.layer_sliding_windows.count(None) == 4  # 26 layers, 5:1


@pytest.mark.parametrize(
    ("model_type", "changes", "field"),
    [
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma3_text", {"hidden_activation": "silu"}, "hidden_activation"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"query_pre_attn_scalar": 24.5}, "query_pre_attn_scalar"),
        ("gemma2", {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        ("gemma2", {"sliding_window": None}, "sliding_window"),
        ("gemma3_text", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("gemma3_text", {"rope_parameters": {"rope_type": "default"}}, "rope_parameters"),
        (
            "gemma3_text",
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "sliding_attention",
        ),
        ("gemma3_text", {"rope_scaling": {"rope_type": "longrope"}}, "rope type"),
        # Not Gemma's fields: Llama's / Qwen's settings are refused by name.
        ("gemma2", {"mlp_bias": False}, "mlp_bias"),
        ("gemma3_text", {"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_what_this_decoder_does_not_compute_is_refused_by_name(
    model_type: str, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, "model_type": model_type, **changes})


GEMMA_FIELDS = [
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "sliding_window", "sliding_window_pattern",
    "rope_local_base_freq", "use_bidirectional_attention", "layer_types", "rope_parameters",
    "rope_scaling", "rope_theta", "head_dim", "attention_bias", "tie_word_embeddings",
]  # fmt: skip


@given(
    model_type=st.sampled_from(["gemma2", "gemma3_text"]),
    field=st.sampled_from(GEMMA_FIELDS),
    value=WRONG_VALUES,
)
@example(model_type="gemma3_text", field="rope_local_base_freq", value=-1)
@example(model_type="gemma3_text", field="sliding_window_pattern", value=0)
@example(model_type="gemma2", field="final_logit_softcapping", value=0.0)
def test_any_wrong_value_is_a_typed_error_naming_the_field(
    model_type: str, field: str, value: Any
) -> None:
    raw = {**TINY, "model_type": model_type, field: value}
    try:
        ModelConfig.from_hf_config(raw)
    except InvalidInputError as exc:
        names = {field, "rope_parameters", "rope_scaling"} if field.startswith("rope") else {field}
        assert any(name in str(exc) for name in names), (field, value, str(exc))
    else:
        harmless = (
            (
                value is None
                and field
                in (
                    "attn_logit_softcapping",
                    "final_logit_softcapping",
                    "rope_scaling",
                    "rope_parameters",
                    "layer_types",
                    "use_bidirectional_attention",
                )
            )
            or (field in ("rope_scaling", "rope_parameters") and value == {})
            or (field in ("attention_bias", "tie_word_embeddings") and isinstance(value, bool))
            or (field == "use_bidirectional_attention" and value is False)
            # read, then ignored: Gemma 3's attention never applies its cap
            or (
                model_type == "gemma3_text"
                and field == "attn_logit_softcapping"
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            or (field == "rope_theta" and isinstance(value, (int, float)) and value > 1)
            # a valid value after all: a positive cap, a local base above 1
            or (
                field in ("attn_logit_softcapping", "final_logit_softcapping")
                and isinstance(value, (int, float))
                and math.isfinite(value)
                and value > 0
            )
            or (field == "rope_local_base_freq" and isinstance(value, (int, float)) and value > 1)
        )
        assert harmless, (model_type, field, value)


def test_a_gemma_config_is_read_only(tmp_path: Path) -> None:
    """Written as Llama it would load as another model: refused, naming the type."""
    config = ModelConfig(gemma=GemmaSettings("gemma2", 16, 50.0, 30.0))
    with pytest.raises(InvalidInputError, match="gemma2"):
        config.to_hf_config()
    with pytest.raises(InvalidInputError, match="softcapping"):
        GemmaSettings("gemma2", 16, attn_logit_softcapping=-1.0)


# -- transformers' checkpoints in our decoder and engine -----------------------------------------


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_logits_equal_transformers_full_and_paged_after_a_cached_prefix(
    tmp_path: Path, model_type: str
) -> None:
    theirs = gemma_checkpoint(tmp_path, model_type)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.gemma is not None and ours.config.layer_types is not None
    rtol = RTOL[model_type]
    assert_close_to_scale(ours.forward_full(TOKENS), expected, rtol)
    for cached in (0, 9, 24):  # 24: the sliding layers' window lies wholly in the cache
        assert_close_to_scale(paged_logits(ours, TOKENS, cached), expected[cached:], rtol)
    # One decode step (the batched decode kernel) after the 39 cached tokens.
    config = ours.config
    kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
    ours.prefill(kv, [PrefillRequest(TOKENS[:-1], list(range(11)))])
    decoded = ours.decode_step(kv, [DecodeRequest(TOKENS, list(range(11)))])
    assert_close_to_scale(decoded[0], expected[-1], rtol)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_the_engine_serves_transformers_greedy_tokens(tmp_path: Path, model_type: str) -> None:
    """Greedy output token for token equal to transformers' `generate`, from scratch, after a
    cached prefix, in 8-token prefill chunks and with prompt-lookup drafts, on the KV groups
    (sliding blocks released). Untied head: over these small embeddings a tied one repeats
    one token."""
    theirs = gemma_checkpoint(tmp_path, model_type, tie_word_embeddings=False)
    engine = Engine.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=8,
        num_speculative_tokens=3,
    )
    assert engine.grouped and len(engine.kv_groups) == 2
    prompt = TOKENS.tolist()
    repetitive = prompt[:6] * 5  # prompt-lookup drafts guess repeats
    drafted = 0
    for tokens in (prompt, [*prompt[:32], 5, 6, 7], [*prompt[:32], 9], repetitive):
        expected = transformers_greedy(theirs, tokens, 12)
        (result,) = engine.generate([tokens], max_new_tokens=12, check_exactness=True)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < 1e-3
        assert len(set(expected)) > 3  # a continuation that tells models apart
        if tokens is prompt:
            assert engine.last_stats.prefill_chunks == 5  # 40 tokens, 8 a step
        else:  # a prefix an earlier request cached: 32 tokens, or the first 6
            assert result.cached_tokens >= (28 if tokens[:32] == prompt[:32] else 4)
        drafted += result.draft_tokens
    assert drafted > 0  # drafts proposed and verified
    assert engine.cache.stats().blocks_released > 0  # the sliding group let blocks go


#: Planted bugs: (what to patch, attribute, replacement, model type it shows on).
PLANTED: dict[str, tuple[Any, str, Any, str]] = {
    # The attention cap dropped (every path: the config hands the kernels None).
    "no_attention_softcap": (ModelConfig, "attention_softcap", property(lambda self: None),
                             "gemma2"),
    # Gemma 3's sliding layers rotated with rope_theta (and its scaling), not their own base.
    "global_rope_on_local_layers": (ModelConfig, "layer_uses_local_rope",
                                    lambda self, index: False, "gemma3_text"),
    # head_dim ** -0.5 instead of query_pre_attn_scalar ** -0.5.
    "head_dim_scale": (ModelConfig, "attention_scale", property(lambda self: self.head_dim**-0.5),
                       "gemma3_text"),
    # Llama's residual (post_attention_layernorm before the MLP, no sandwich).
    "no_sandwich": (layers_module.DecoderLayer, "add_attention_and_mlp",
                    lambda self, hidden, out: hidden + out + self.mlp(
                        self.post_attention_layernorm(hidden + out)), "gemma2"),
    # SiLU in the MLP.
    "silu_mlp": (layers_module, "gelu_tanh", torch.nn.functional.silu, "gemma3_text"),
}  # fmt: skip


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_bug_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: str
) -> None:
    target, attribute, replacement, model_type = PLANTED[bug]
    theirs = gemma_checkpoint(tmp_path, model_type)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    monkeypatch.setattr(target, attribute, replacement)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    scale = expected.abs().max().item()
    assert (ours.forward_full(TOKENS) - expected).abs().max().item() > 1e-2 * scale
    assert (paged_logits(ours, TOKENS, 24) - expected[24:]).abs().max().item() > 1e-2 * scale


def test_a_softcap_dropped_in_one_kernel_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged prefill and the batched decode each apply the cap: ignoring it in either
    moves Gemma 2's logits on that path alone."""
    from prefixkv.models import decoder as decoder_module

    theirs = gemma_checkpoint(tmp_path, "gemma2")
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    scale = expected.abs().max().item()
    for name in ("paged_prefill_attention", "paged_decode_attention"):
        original = getattr(decoder_module, name)

        def uncapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return _original(*args, **{**kwargs, "softcap": None})

        with monkeypatch.context() as patch:
            patch.setattr(decoder_module, name, uncapped)
            config = ours.config
            kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
            ours.prefill(kv, [PrefillRequest(TOKENS[:-1], list(range(11)))])
            decoded = ours.decode_step(kv, [DecodeRequest(TOKENS, list(range(11)))])
            assert (decoded[0] - expected[-1]).abs().max().item() > 1e-2 * scale, name


def test_cache_contexts_keep_gemma_kv_apart() -> None:
    llama = ModelConfig(num_layers=2, sliding_window=4, layer_types=("sliding_attention",
                        "full_attention"), qk_norm=True)  # fmt: skip
    gemma = llama.replace(gemma=GemmaSettings("gemma3_text", 16, None, 30.0, 100.0))
    other_local = llama.replace(gemma=GemmaSettings("gemma3_text", 16, None, 30.0, 1000.0))
    contexts = {
        LlamaModel.random(config, seed=1).cache_context(4, weights_digest="w")
        for config in (llama, gemma, other_local)
    }
    assert len(contexts) == 3  # even under one weights digest the caller names
    # The sandwich's two extra norms per layer are counted (sizing a model before loading).
    assert gemma.parameter_count == sum(
        t.numel() for t in LlamaModel.random(gemma).state_dict().values()
    )


# -- the kernels' cap, and drawn models ----------------------------------------------------------


@given(
    seed=st.integers(0, 2**16),
    cap=st.sampled_from([0.5, 2.0, 30.0]),
    window=st.sampled_from([None, 3]),
)
def test_softcap_kernels_equal_a_dense_softmax(seed: int, cap: float, window: int | None) -> None:
    generator = torch.Generator().manual_seed(seed)
    block_size, num_blocks, heads, kv_heads, dim = 4, 8, 4, 2, 8
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator) * 3
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[None, :]
    seq_len, query_len = 13, 5
    query = torch.randn(query_len, heads, dim, generator=generator) * 3
    dense_keys = keys[table[0]].reshape(-1, kv_heads, dim)[:seq_len].repeat_interleave(2, 1)
    dense_values = values[table[0]].reshape(-1, kv_heads, dim)[:seq_len].repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", query, dense_keys) * 0.3
    scores = torch.tanh(scores / cap) * cap
    positions = torch.arange(seq_len)
    query_positions = positions[-query_len:, None]
    allowed = positions[None, :] <= query_positions
    if window is not None:
        allowed &= positions[None, :] > query_positions - window
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    expected = torch.einsum("hqk,khd->qhd", weights, dense_values)
    for backend in ("torch", "reference"):
        attended = paged_prefill_attention(
            query, keys, values, table, [query_len], [seq_len], scale=0.3,
            sliding_window=window, softcap=cap, backend=backend,
        )  # fmt: skip
        torch.testing.assert_close(attended, expected, rtol=1e-5, atol=1e-5)
    decoded = paged_decode_attention(
        query[-1:], keys, values, table, [seq_len], scale=0.3, sliding_window=window, softcap=cap
    )
    torch.testing.assert_close(decoded, expected[-1:], rtol=1e-5, atol=1e-5)


def test_softcap_arguments_are_checked() -> None:
    query = torch.zeros(1, 2, 4)
    pages = torch.zeros(2, 4, 1, 4)
    table = torch.zeros(1, 1, dtype=torch.int32)
    for bad in (0.0, -1.0, math.inf, True):
        with pytest.raises(InvalidInputError, match="softcap"):
            paged_prefill_attention(query, pages, pages, table, [1], [1], softcap=bad)
    with pytest.raises(BackendUnavailableError, match="softcap"):
        paged_prefill_attention(query, pages, pages, table, [1], [1], softcap=2.0,
                                backend="triton")  # fmt: skip


@given(scenario=scenarios(), data=st.data())
def test_cached_prefix_matches_full_recompute_on_gemma_models(
    scenario: Scenario, data: st.DataObject
) -> None:
    """tests/test_model_paged.py's property (drawn shapes, dtypes, windows, adapters, cached
    splits and shuffled block tables) on Gemma-style models: caps, pre-scaling, sandwich norms,
    and, for drawn Gemma 3 ones, q/k norms and a local RoPE base on the sliding layers."""
    gemma3 = data.draw(st.booleans(), label="gemma3")
    settings = GemmaSettings(
        "gemma3_text" if gemma3 else "gemma2",
        data.draw(st.sampled_from([8, 24, 256]), label="query_pre_attn_scalar"),
        None if gemma3 else data.draw(st.sampled_from([None, 1.5, 50.0]), label="attn cap"),
        data.draw(st.sampled_from([None, 2.0]), label="final cap"),
        data.draw(st.sampled_from([50.0, 10000.0]), label="local theta") if gemma3 else None,
    )
    config = scenario.config.replace(gemma=settings, qk_norm=gemma3)
    scenario = dataclasses.replace(scenario, config=config)
    check_cached_matches_full(build_model(scenario), scenario)


def test_prefixkv_demo_serves_a_gemma3_checkpoint(
    tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prefixkv demo --model` on a Gemma 3 directory transformers wrote (with a tokenizer and
    a chat template beside it): served on the KV groups, its greedy tokens those of a full
    recompute, the stable-first layout hitting the cache."""
    from tests.test_engine_checkpoint import CHATML

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **{
            **GEMMA3,
            "vocab_size": tokenizer.get_vocab_size(),
            "sliding_window": 16,
            "max_position_embeddings": 4096,
        }
    )
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    eos = tokenizer.token_to_id("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    # Chunked: the sliding layers let blocks go.
    data = run_demo_model(tmp_path, capsys, "--max-num-batched-tokens", "64")
    stable = data["layouts"]["stable_first"]
    # The sliding layers let go of out-of-window blocks: the demo reports the KV the running
    # requests held against what every layer keeping every block would hold.
    assert stable["peak_kv_bytes_all_full"] > stable["peak_kv_bytes"] > 0
