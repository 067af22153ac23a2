"""Cross-check against Hugging Face transformers (a test-only dependency).

`forward_full` is the oracle of every other model test; here it is checked in turn against
transformers' own Llama and Mistral implementations on the same checkpoint, in both directions:
a checkpoint we write, loaded by transformers, and one transformers writes, loaded by us.
Runs offline (local directories only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest, RopeScaling

TOKENS = torch.tensor([(29 * i + 3) % 256 for i in range(40)])


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * scale)


def load_with_transformers(directory: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"num_heads": 8, "num_kv_heads": 1, "head_dim": 8, "rope_theta": 500000.0},
        {"rope_scaling": RopeScaling("linear", 4.0)},
        # Beyond the trained length, so the length-dependent base is exercised.
        {"rope_scaling": RopeScaling("dynamic_ntk", 2.0), "max_position_embeddings": 16},
        # Llama 3.1-style scaling, with an original length short enough that all three bands
        # (kept, blended, interpolated) occur among the default head_dim's frequencies.
        {"rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 64)},
        # YaRN with a short original length, so the ramp spans several pairs, and a factor
        # large enough that the attention factor (1.23) is far from 1.
        {"rope_scaling": RopeScaling("yarn", 10.0, original_max_position_embeddings=64)},
        {
            "rope_scaling": RopeScaling(
                "yarn",
                4.0,
                original_max_position_embeddings=32,
                beta_fast=16.0,
                beta_slow=2.0,
                attention_factor=1.5,
                truncate=False,
            )
        },
        {"tie_word_embeddings": True},
        {"dtype": torch.bfloat16},
        {"sliding_window": 5},
        # Hybrid (Gemma 2 / gpt-oss alternation, written as Qwen2 layer_types): windows of 5
        # on layers 0, 2, full attention on 1, 3; and a window on the last layer only.
        {
            "num_layers": 4,
            "attention_qkv_bias": True,
            "sliding_window": 5,
            "layer_types": ("sliding_attention", "full_attention") * 2,
        },
        {
            "num_layers": 3,
            "attention_qkv_bias": True,
            "sliding_window": 3,
            "layer_types": ("full_attention", "full_attention", "sliding_attention"),
        },
        # Llama's attention_bias (q/k/v/o) and mlp_bias; Qwen2's q/k/v-only biases.
        {"attention_qkv_bias": True, "attention_output_bias": True, "mlp_bias": True},
        {"attention_qkv_bias": True, "rope_theta": 1000000.0},
    ],
    ids=[
        "plain",
        "gqa8to1",
        "linear",
        "dynamic_ntk",
        "llama3",
        "yarn",
        "yarn_explicit",
        "tied",
        "bf16",
        "mistral_window",
        "qwen2_alternating",
        "qwen2_last_layer_window",
        "llama_biases",
        "qwen2",
    ],
)
def test_our_checkpoint_in_transformers_gives_our_logits(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    ours = LlamaModel.random(ModelConfig(**changes), seed=4)
    # Written as the type transformers reads as this model, with no edit here: a window on
    # every layer as Mistral (transformers' Llama ignores sliding_window), Qwen2's pattern.
    ours.save_pretrained(tmp_path)
    theirs = load_with_transformers(tmp_path)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.with_config(dtype=torch.float32).forward_full(TOKENS), expected)


def test_transformers_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.rope_scaling == RopeScaling("linear", 2.0)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.forward_full(TOKENS), expected)


def _tied_checkpoint_with_head(directory: Path, head_equals_embedding: bool) -> LlamaModel:
    """A tied-embedding checkpoint that also stores `lm_head.weight`, as many real ones do."""
    from safetensors.torch import save_file

    ours = LlamaModel.random(ModelConfig(tie_word_embeddings=True), seed=7)
    ours.save_pretrained(directory)
    state = {name: tensor.clone().contiguous() for name, tensor in ours.state_dict().items()}
    if not head_equals_embedding:
        state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return ours


def test_tied_checkpoint_that_stores_the_head_too_loads(tmp_path: Path) -> None:
    """Issue 8.5: refused as an unexpected tensor, though transformers loads it."""
    ours = _tied_checkpoint_with_head(tmp_path, head_equals_embedding=True)
    loaded = LlamaModel.from_pretrained(tmp_path)
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(loaded.forward_full(TOKENS), ours.forward_full(TOKENS))
    with torch.no_grad():
        expected = load_with_transformers(tmp_path)(TOKENS[None]).logits[0]
    assert_close_to_scale(loaded.forward_full(TOKENS), expected)


def test_tied_checkpoint_with_a_different_head_unties_as_transformers_does(
    tmp_path: Path,
) -> None:
    """transformers 5 does not tie weights that the checkpoint stores with different values:
    each keeps its own. We do the same (logged), rather than silently pick one."""
    _tied_checkpoint_with_head(tmp_path, head_equals_embedding=False)
    loaded = LlamaModel.from_pretrained(tmp_path)
    assert not loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 ties the head to the embedding; we follow transformers 5")
    with torch.no_grad():
        expected = load_with_transformers(tmp_path)(TOKENS[None]).logits[0]
    assert_close_to_scale(loaded.forward_full(TOKENS), expected)


def test_hybrid_checkpoint_matches_transformers_after_a_cached_prefix(tmp_path: Path) -> None:
    """Alternating sliding/full layers (written as Qwen2 layer_types): the paged path, reading
    a prefix another call cached, gives transformers' logits for the rest of the prompt."""
    config = ModelConfig(
        num_layers=4,
        attention_qkv_bias=True,
        sliding_window=6,
        layer_types=("sliding_attention", "full_attention") * 2,
    )
    ours = LlamaModel.random(config, seed=9)
    ours.save_pretrained(tmp_path)
    assert (
        json.loads((tmp_path / "config.json").read_text())["layer_types"]
        == [
            "sliding_attention",
            "full_attention",
        ]
        * 2
    )
    theirs = load_with_transformers(tmp_path)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    block_size = 4
    for cached in (0, 9, 24):
        kv = PagedKVCache(4, 12, block_size, config.num_kv_heads, config.head_dim)
        table = list(range(10))
        if cached:
            ours.prefill(kv, [PrefillRequest(TOKENS[:cached], table)])
        (logits,) = ours.prefill(
            kv, [PrefillRequest(TOKENS, table, num_cached_tokens=cached)], return_all_logits=True
        )
        assert_close_to_scale(logits, expected[cached:])


@pytest.mark.parametrize("kind", ["mistral", "qwen2_alternating", "ministral_alternating"])
def test_a_sliding_window_checkpoint_served_with_kv_groups_matches_transformers(
    tmp_path: Path, kind: str
) -> None:
    """A checkpoint transformers writes (Mistral: every layer slides; Qwen2: alternating
    layer_types), served by the Engine on KV groups that release out-of-window blocks: its
    greedy continuation is transformers' own, from scratch and after a cached prefix."""
    from prefixkv.engine.facade import Engine

    common: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "sliding_window": 7,
    }
    torch.manual_seed(3)
    if kind == "mistral":
        theirs = transformers.MistralForCausalLM(
            transformers.MistralConfig(num_hidden_layers=2, **common)
        )
    elif kind == "ministral_alternating":
        layer_types = ["sliding_attention", "full_attention"] * 2
        theirs = transformers.MinistralForCausalLM(
            transformers.MinistralConfig(
                num_hidden_layers=4, head_dim=16, layer_types=layer_types, **common
            )
        )
    else:
        layer_types = ["sliding_attention", "full_attention"] * 2
        theirs = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                num_hidden_layers=4, use_sliding_window=True, layer_types=layer_types, **common
            )
        )
    theirs.save_pretrained(tmp_path)
    theirs = load_with_transformers(tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    engine = Engine(ours, num_blocks=24, block_size=4, max_num_batched_tokens=8)
    assert engine.grouped
    prompt = TOKENS.tolist()
    for tokens in (prompt, [*prompt[:32], 5, 6, 7]):  # the second reuses a cached prefix
        with torch.no_grad():
            expected = theirs.generate(
                torch.tensor([tokens]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )[0, len(tokens) :].tolist()
        (result,) = engine.generate([tokens], max_new_tokens=6, check_exactness=True)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
    assert result.cached_tokens >= 28
    assert engine.cache.stats().blocks_released > 0


# -- Ministral: Mistral with a per-layer pattern, read as MinistralConfig reads it -------------

MINISTRAL = {
    "model_type": "ministral",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def test_the_ministral_table_is_transformers_ministral_config() -> None:
    import dataclasses

    from prefixkv.models import hf_config

    defaults = hf_config.TYPE_DEFAULTS["ministral"]
    for field in dataclasses.fields(transformers.MinistralConfig):
        assert field.name in defaults or field.name in hf_config.KNOWN_HF_CONFIG_FIELDS
        if field.name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[field.name] == field.default, field.name


@pytest.mark.parametrize(
    "changes",
    [
        {},  # no layer_types: every layer slides (the default window, 4096)
        {"sliding_window": None},
        {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2},
        {"sliding_window": 6, "layer_types": ["full_attention"] * 4},
    ],
)
def test_ministral_configs_are_read_as_transformers_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    arguments = {
        key: value for key, value in {**MINISTRAL, **changes}.items() if key != "model_type"
    }
    theirs = transformers.MinistralConfig(**arguments)
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    expected = [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]
    assert list(ours.layer_sliding_windows) == expected
    assert ours.head_dim == 16 and not ours.qk_norm
    assert not (ours.attention_qkv_bias or ours.attention_output_bias or ours.mlp_bias)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        # transformers' Ministral reads a missing or null head_dim as None and fails.
        ({"head_dim": None}, "head_dim"),
        ({"sliding_window": None, "layer_types": ["sliding_attention"] * 4}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"use_sliding_window": True}, "use_sliding_window"),  # Qwen2's, not Ministral's
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_ministral_settings_it_cannot_compute_are_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    from prefixkv.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**MINISTRAL, **changes})
    absent = {key: value for key, value in MINISTRAL.items() if key != "head_dim"}
    with pytest.raises(InvalidInputError, match="head_dim"):
        ModelConfig.from_hf_config(absent)


def test_qwen2_5_s_published_config_loads_and_a_multimodal_rope_is_refused(
    tmp_path: Path,
) -> None:
    """Qwen2.5-7B's config.json as published: ``use_mrope: false``, which Qwen2Config does not
    declare and its modeling never reads, loads; ``true`` (Qwen2-VL's 3-D RoPE) is refused."""
    from prefixkv.errors import InvalidInputError

    raw = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
        "use_sliding_window": False, "vocab_size": 152064,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert (ours.head_dim, ours.num_kv_heads) == (3584 // 28, 4)
    assert ours.attention_qkv_bias and not ours.attention_output_bias
    assert (
        ours.layer_sliding_windows
        == (None,) * 28
        == tuple(None for kind in theirs.layer_types if kind == "full_attention")
    )
    with pytest.raises(InvalidInputError, match="use_mrope"):
        ModelConfig.from_hf_config({**raw, "use_mrope": True})


# -- Phi-3: Llama with fused q/k/v and gate/up weights, read only --------------------------------


@pytest.mark.parametrize("window", [None, 7])
def test_a_transformers_phi3_checkpoint_served_by_the_engine_is_transformers_own(
    tmp_path: Path, window: int | None
) -> None:
    """Fused ``qkv_proj`` / ``gate_up_proj`` split in transformers' order (q/k scaled up so a
    swapped slice shows), a window on every layer or none: greedy tokens equal to its
    `generate` from scratch and after a cached prefix, logits within float32 rounding."""
    from prefixkv.engine.facade import Engine

    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=None, sliding_window=window,
    )  # fmt: skip
    torch.manual_seed(3)
    theirs = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for layer in theirs.model.layers:
            layer.self_attn.qkv_proj.weight[: 64 + 32].mul_(20.0)  # the q and k rows
            layer.mlp.gate_up_proj.weight[96:].mul_(3.0)  # the up half
    theirs.save_pretrained(tmp_path)
    theirs = load_with_transformers(tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert set(ours.config.layer_sliding_windows) == {window}
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.forward_full(TOKENS), expected)
    engine = Engine(ours, num_blocks=24, block_size=4, max_num_batched_tokens=8)
    prompt = TOKENS.tolist()
    for tokens in (prompt, [*prompt[:32], 5, 6, 7]):
        with torch.no_grad():
            want = theirs.generate(
                torch.tensor([tokens]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )[0, len(tokens) :].tolist()
        (result,) = engine.generate([tokens], max_new_tokens=6, check_exactness=True)
        assert result.output_token_ids == want
    assert result.cached_tokens >= 28


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        # LongRoPE is computed (tests/test_phi3_longrope.py); without its factors, refused.
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "short_factor"),
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini's
        ({"resid_pdrop": "x"}, "resid_pdrop"),
    ],
)  # fmt: skip
def test_phi3_settings_it_cannot_compute_are_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    from prefixkv.errors import InvalidInputError

    raw = {"model_type": "phi3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, **changes}  # fmt: skip
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config(raw)


def test_a_phi3_fused_tensor_of_the_wrong_size_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from prefixkv.errors import InvalidInputError

    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
    )  # fmt: skip
    transformers.Phi3ForCausalLM(config).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.qkv_proj.weight"
    state[name] = state[name][:-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidInputError, match="qkv_proj"):
        LlamaModel.from_pretrained(tmp_path)


def test_phi3_s_table_and_a_published_style_config() -> None:
    """The table against Phi3Config, and Phi-3-mini-4k-instruct's config.json fields (its
    ``auto_map`` names remote code transformers' native Phi3 does not need): a window of 2047
    on every layer, no scaling."""
    import dataclasses

    from prefixkv.models import hf_config

    defaults = hf_config.TYPE_DEFAULTS["phi3"]
    for field in dataclasses.fields(transformers.Phi3Config):
        assert field.name in defaults or field.name in hf_config.KNOWN_HF_CONFIG_FIELDS
        if field.name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[field.name] == field.default, field.name
    raw = {
        "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                     "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
        "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2", "use_cache": True, "attention_bias": False,
        "vocab_size": 32064,
    }  # fmt: skip
    ours = ModelConfig.from_hf_config(raw)
    assert ours.layer_sliding_windows == (2047,) * 32 and ours.head_dim == 96
    assert ours.rope_scaling is None and ours.dtype == torch.bfloat16
