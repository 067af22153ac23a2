"""Qwen3 dense (issue 23): Llama plus a per-head RMSNorm of queries and keys before RoPE, a
``head_dim`` of its own, and Qwen2's sliding-window fields.

The reference is transformers itself (a test-only dependency): its ``Qwen3Config`` for how the
config is read, and checkpoints its ``Qwen3ForCausalLM.save_pretrained`` writes, served by our
`Engine` and compared token for token with its ``generate``. Weights are redrawn so attention
is sharp and the norm weights differ per dimension: with transformers' init (q/k norm weights
all 1) a norm applied after RoPE computes the same thing, and `test_a_misplaced_norm_is_caught`
checks that the comparison fails on such a planted bug.
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
from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models import decoder as decoder_module
from prefixkv.models import hf_config
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest
from prefixkv.models.layers import SelfAttention
from tests.test_config_reading import NULLABLE, READ_FIELDS, WRONG_VALUES
from tests.test_model_hf import TOKENS, assert_close_to_scale, load_with_transformers
from tests.test_model_paged import Scenario, build_model, check_cached_matches_full, scenarios

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Not hidden / heads (16): Qwen3 reads its own.
    "head_dim": 32,
    "max_position_embeddings": 256,
}
#: Each layer's query and key norm weights set the typical attention score (their product).
SHARPNESS = 8.0


def sharpen(model: Any, seed: int) -> None:
    """Redraw a transformers Qwen3 model's weights (its init makes attention near uniform and
    every norm weight 1): unit-variance embeddings, fan-in-scaled projections, norm weights
    away from 1, q/k norm weights of about ``sqrt(SHARPNESS)`` that differ per dimension."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                spread = 1.0 + 0.6 * noise.abs()
                parameter.copy_(SHARPNESS**0.5 * spread / spread.mean())
            elif name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif name == "lm_head.weight":
                parameter.copy_(2.0 * noise / math.sqrt(parameter.shape[1]))
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))


def qwen3_checkpoint(directory: Path, seed: int = 3, **changes: Any) -> Any:
    """A tiny random Qwen3 checkpoint written by transformers; returns transformers' model
    loaded back from it (float32, eager attention)."""
    torch.manual_seed(seed)
    theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, **changes}))
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


def transformers_greedy(model: Any, tokens: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([tokens]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    result: list[int] = output[0, len(tokens) :].tolist()
    return result


# -- the config, read as Qwen3Config reads it ----------------------------------------------------


def test_the_type_table_is_transformers_qwen3_config() -> None:
    declared = {field.name: field for field in dataclasses.fields(transformers.Qwen3Config)}
    defaults = hf_config.TYPE_DEFAULTS["qwen3"]
    assert set(declared) - set(hf_config.KNOWN_HF_CONFIG_FIELDS) <= set(defaults)
    for name, field in declared.items():
        if name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[name] == field.default, (name, defaults[name], field.default)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        # head_dim absent (...): Qwen3Config's default (128), not hidden / heads.
        {"head_dim": ...},
        {"attention_bias": True, "tie_word_embeddings": True},
        # null: as many KV heads as query heads (absent would be Qwen3Config's 32).
        {"num_key_value_heads": None},
        # Sliding from layer 1 on (max_window_layers), and an explicit pattern.
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 5,
            "layer_types": ["full_attention", "sliding_attention"] * 2,
        },
        # A window without use_sliding_window is ignored, as Qwen3Config ignores it.
        {"sliding_window": 8},
    ],
    ids=[
        "plain",
        "default_head_dim",
        "bias_tied",
        "mha",
        "max_window_layers",
        "layer_types",
        "window_off",
    ],
)
def test_configs_transformers_saves_are_read_as_it_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    arguments = {key: value for key, value in {**TINY, **changes}.items() if value is not ...}
    theirs = transformers.Qwen3Config(**arguments)
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.qk_norm is True
    assert ours.head_dim == theirs.head_dim
    assert (ours.num_heads, ours.num_kv_heads) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
    )
    assert ours.attention_qkv_bias is ours.attention_output_bias is theirs.attention_bias
    assert ours.mlp_bias is False
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    expected_windows = [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]
    assert list(ours.layer_sliding_windows) == expected_windows


def test_qwen3_0_6b_s_published_config_loads(tmp_path: Path) -> None:
    """Qwen3-0.6B's config.json as published (transformers 4.51 wrote it): every field known
    to Qwen3Config, read as transformers reads it."""
    raw = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert (ours.head_dim, ours.num_heads, ours.num_kv_heads) == (128, 16, 8)
    assert ours.qk_norm and ours.tie_word_embeddings and ours.dtype == torch.bfloat16
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 1e6
    assert ours.layer_sliding_windows == (None,) * 28


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        # Qwen3Config types head_dim as int (strict): null is an error there too.
        ({"head_dim": None}, "head_dim"),
        ({"head_dim": 32.0}, "head_dim"),
        ({"attention_bias": 1}, "attention_bias"),
        # Not Qwen3Config fields: Llama's, accepted only at the value Qwen3 computes with.
        ({"mlp_bias": True}, "mlp_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        # Qwen3-MoE's and others' fields are not Qwen3's.
        ({"num_experts": 8}, "num_experts"),
        ({"use_qk_norm": False}, "use_qk_norm"),
    ],
)
def test_fields_qwen3_does_not_compute_with_are_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, "model_type": "qwen3", **changes})


@given(field=st.sampled_from(READ_FIELDS), value=WRONG_VALUES)
@example(field="model_type", value=[])  # was a TypeError (an unhashable model_type)
def test_any_wrong_value_is_a_typed_error_naming_the_field(field: str, value: Any) -> None:
    raw = {**TINY, "model_type": "qwen3", field: value}
    try:
        ModelConfig.from_hf_config(raw)
    except InvalidInputError as exc:
        names = {field, "rope parameters"} if field.startswith("rope") else {field}
        if field in ("rope_theta", "partial_rotary_factor"):
            names |= {"rope_scaling", "rope_parameters"}
        assert any(name in str(exc) for name in names), (field, value, str(exc))
    else:
        nullable = NULLABLE - {"head_dim"}  # an int for Qwen3Config
        harmless = (
            (value is None and field in nullable)
            or (field in ("rope_scaling", "rope_parameters", "layer_types") and not value)
            or (
                field in ("rms_norm_eps", "rope_theta")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
            or (field == "partial_rotary_factor" and value == 1)
            or (
                field in ("tie_word_embeddings", "attention_bias", "use_sliding_window")
                and isinstance(value, bool)
            )
            or (field == "mlp_bias" and value is False)
        )
        assert harmless, (field, value)


# -- our checkpoints in transformers, and transformers' in our engine ---------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"head_dim": 32, "num_kv_heads": 1},
        {"attention_qkv_bias": True, "attention_output_bias": True, "tie_word_embeddings": True},
        {
            "num_layers": 4,
            "sliding_window": 5,
            "layer_types": ("sliding_attention", "full_attention") * 2,
        },
        {"sliding_window": 6},
        {"dtype": torch.bfloat16},
    ],
    ids=["plain", "head_dim_mqa", "biases_tied", "hybrid", "window_every_layer", "bf16"],
)
def test_our_qwen3_checkpoint_in_transformers_gives_our_logits(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    ours = LlamaModel.random(ModelConfig(qk_norm=True, **changes), seed=4)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    assert LlamaModel.from_pretrained(tmp_path).config == ours.config
    with torch.no_grad():
        expected = load_with_transformers(tmp_path)(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.with_config(dtype=torch.float32).forward_full(TOKENS), expected)


def test_a_qwen3_config_with_an_architecture_transformers_lacks_is_not_written(
    tmp_path: Path,
) -> None:
    for changes in ({"attention_qkv_bias": True}, {"mlp_bias": True}):
        with pytest.raises(InvalidInputError, match="Qwen3"):
            LlamaModel.random(ModelConfig(qk_norm=True, **changes)).save_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_transformers_qwen3_checkpoint_served_by_the_engine_is_transformers_own(
    tmp_path: Path, kind: str
) -> None:
    """Greedy output token for token equal to transformers' `generate`, from scratch, after a
    cached prefix, in prefill chunks of 8 tokens and with prompt-lookup drafts; the paged
    logits after a cached prefix within float32 rounding of transformers'."""
    changes: dict[str, Any] = {}
    if kind == "hybrid":
        changes = {
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 7,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        }
    theirs = qwen3_checkpoint(tmp_path, **changes)
    engine = Engine.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=8,
        num_speculative_tokens=3,
    )
    assert engine.model.config.qk_norm and engine.model.config.head_dim == 32
    assert engine.grouped is (kind == "hybrid")
    prompt = TOKENS.tolist()
    repetitive = prompt[:6] * 5  # prompt-lookup drafts guess repeats
    drafted = 0
    for tokens in (prompt, [*prompt[:32], 5, 6, 7], repetitive):
        expected = transformers_greedy(theirs, tokens, 16)
        (result,) = engine.generate([tokens], max_new_tokens=16, check_exactness=True)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
        if tokens is prompt:
            assert engine.last_stats.prefill_chunks == 5  # 40 tokens, 8 a step
        drafted += result.draft_tokens
        assert len(set(expected)) > 3  # a continuation that tells models apart
    assert result.cached_tokens >= 4 and drafted > 0  # drafts proposed and verified

    # The paged path's logits after a prefix another call cached, against transformers'.
    model, config = engine.model, engine.model.config
    with torch.no_grad():
        expected_logits = theirs(TOKENS[None]).logits[0]
    for cached in (0, 9, 24):
        kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
        table = list(range(10))
        if cached:
            model.prefill(kv, [PrefillRequest(TOKENS[:cached], table)])
        (logits,) = model.prefill(
            kv, [PrefillRequest(TOKENS, table, num_cached_tokens=cached)], return_all_logits=True
        )
        assert_close_to_scale(logits, expected_logits[cached:])


def test_a_misplaced_norm_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above is sensitive to where the q/k norms sit: with them applied after
    RoPE (a planted bug on the paged path), or not at all, the logits move far past the bound."""
    theirs = qwen3_checkpoint(tmp_path)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    config = ours.config

    def paged_logits() -> torch.Tensor:
        kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
        (logits,) = ours.prefill(
            kv, [PrefillRequest(TOKENS, list(range(10)))], return_all_logits=True
        )
        return logits

    assert_close_to_scale(paged_logits(), expected)
    scale = expected.abs().max().item()
    monkeypatch.setattr(SelfAttention, "normalize_heads", lambda self, q, k: (q, k))
    assert (paged_logits() - expected).abs().max().item() > 1e-2 * scale  # no norm

    # RoPE then the norm: the decoder rotates queries then keys, layer by layer.
    rotate = decoder_module._apply_rotate_half_rope
    calls = iter(range(10**6))

    def rotate_then_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        call = next(calls)
        attention = ours.model.layers[call // 2 % config.num_layers].self_attn
        norm = attention.q_norm if call % 2 == 0 else attention.k_norm
        return norm(rotate(x, cos, sin))

    monkeypatch.setattr(decoder_module, "_apply_rotate_half_rope", rotate_then_norm)
    assert (paged_logits() - expected).abs().max().item() > 1e-2 * scale


def test_a_qwen3_model_s_cache_context_differs_from_llama_s_of_the_same_shapes() -> None:
    qwen3 = LlamaModel.random(ModelConfig(qk_norm=True), seed=4)
    llama = LlamaModel.random(ModelConfig(), seed=4)
    assert qwen3.cache_context(4) != llama.cache_context(4)
    # Even under a weights digest the caller names (not computed from the weights).
    assert qwen3.cache_context(4, weights_digest="w") != llama.cache_context(4, weights_digest="w")
    # And a Llama context is what it was before Qwen3 existed (no new entry).
    assert dict(llama.cache_context(4).extra) == {}
    assert ModelConfig(qk_norm=True).parameter_count == sum(
        t.numel() for t in qwen3.state_dict().values()
    )


# Qwen3-MoE and Mixtral, refused here until their expert MLPs were implemented, are served
# exactly now: tests/test_moe.py.


@given(scenario=scenarios(), data=st.data())
def test_cached_prefix_matches_full_recompute_with_qk_norms(
    scenario: Scenario, data: st.DataObject
) -> None:
    """tests/test_model_paged.py's property (drawn shapes, dtypes, windows, adapters, cached
    splits and shuffled block tables: the paged KV and logits equal full recompute within the
    dtype's bound) on Qwen3-style models."""
    config = scenario.config.replace(qk_norm=True)
    if data.draw(st.booleans(), label="no rope on some layers"):
        pattern = data.draw(st.lists(st.booleans(), min_size=config.num_layers,
                                     max_size=config.num_layers), label="rope_layers")  # fmt: skip
        config = config.replace(rope_layers=tuple(pattern))
    scenario = dataclasses.replace(scenario, config=config)
    check_cached_matches_full(build_model(scenario), scenario)
