"""Checkpoints as transformers writes them (issue 14): Qwen2-style and Llama-style biases, YaRN
RoPE, and refusal by name of any config field the decoder does not implement.

The transformers cross-checks of our own checkpoints are in `test_model_hf.py`; here the
checkpoints come from transformers itself, and the paged path with a cached prefix is checked
against the full recompute for the new settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest, RopeScaling

TOKENS = torch.tensor([(31 * i + 5) % 256 for i in range(48)])
SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _theirs_and_ours(directory: Path, config: transformers.PretrainedConfig) -> tuple:
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # default init leaves biases at zero: make them matter
        for name, parameter in theirs.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    theirs.save_pretrained(directory)
    return theirs, LlamaModel.from_pretrained(directory, dtype=torch.float32)


def _assert_same_logits(ours: LlamaModel, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    scale = expected.abs().max().item()
    torch.testing.assert_close(ours.forward_full(TOKENS), expected, rtol=0, atol=1e-5 * scale)


def test_a_transformers_qwen2_checkpoint_loads_with_its_biases(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**SMALL, rope_theta=1e6, attn_implementation="eager")
    theirs, ours = _theirs_and_ours(tmp_path, config)
    assert ours.config.attention_qkv_bias and not ours.config.attention_output_bias
    # Qwen2 configs carry a sliding_window that is off (use_sliding_window: false).
    assert ours.config.sliding_window is None
    _assert_same_logits(ours, theirs)


def test_a_transformers_llama_checkpoint_with_biases_and_yarn_loads(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        **SMALL,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
        attn_implementation="eager",
    )
    theirs, ours = _theirs_and_ours(tmp_path, config)
    assert ours.config.rope_scaling is not None and ours.config.rope_scaling.kind == "yarn"
    assert ours.config.attention_output_bias and ours.config.mlp_bias
    _assert_same_logits(ours, theirs)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": RopeScaling("yarn", 6.0, original_max_position_embeddings=24)},
        {"attention_qkv_bias": True},
        {"attention_qkv_bias": True, "attention_output_bias": True, "mlp_bias": True},
    ],
    ids=["yarn", "qwen2_bias", "llama_biases"],
)
def test_cached_prefix_gives_the_full_recompute_logits(changes: dict[str, object]) -> None:
    model = LlamaModel.random(ModelConfig(**changes), seed=3)  # type: ignore[arg-type]
    config, block = model.config, 8
    kv = PagedKVCache(config.num_layers, 8, block, config.num_kv_heads, config.head_dim)
    table = list(range(8))
    model.prefill(kv, [PrefillRequest(TOKENS[:24], table)])
    logits = model.prefill(
        kv, [PrefillRequest(TOKENS, table, num_cached_tokens=24)], return_all_logits=True
    )[0]
    torch.testing.assert_close(logits, model.forward_full(TOKENS)[24:], rtol=1e-4, atol=1e-4)


def test_yarn_settings_are_in_the_cache_context() -> None:
    plain = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    variants = [plain, RopeScaling("yarn", 4.0, original_max_position_embeddings=64, beta_fast=8)]
    variants.append(
        RopeScaling("yarn", 4.0, original_max_position_embeddings=64, attention_factor=1)
    )
    model = LlamaModel.random(ModelConfig(rope_scaling=plain), seed=0)
    fingerprints = {
        model.with_config(rope_scaling=scaling).cache_context(16).fingerprint()
        for scaling in variants
    }
    assert len(fingerprints) == len(variants)
    assert model.cache_context(16).reuse_is_safe  # static: no length enters


def test_an_unknown_config_field_is_refused_by_name(tmp_path: Path) -> None:
    LlamaModel.random(ModelConfig(), seed=0).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["attn_logit_softcapping"] = 50.0
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidInputError, match="'attn_logit_softcapping'"):
        LlamaModel.from_pretrained(tmp_path)


def test_our_bias_checkpoints_round_trip(tmp_path: Path) -> None:
    for index, changes in enumerate(
        [{"attention_qkv_bias": True}, {"attention_qkv_bias": True, "mlp_bias": True}]
    ):
        ours = LlamaModel.random(ModelConfig(**changes), seed=index)  # type: ignore[arg-type]
        if changes.get("mlp_bias"):
            # q/k/v biases without an output bias is Qwen2, which has no MLP bias.
            with pytest.raises(InvalidInputError, match="no Hugging Face config"):
                ours.save_pretrained(tmp_path / str(index))
            continue
        ours.save_pretrained(tmp_path / str(index))
        loaded = LlamaModel.from_pretrained(tmp_path / str(index))
        assert loaded.config == ours.config
        torch.testing.assert_close(loaded.forward_full(TOKENS), ours.forward_full(TOKENS))


def test_smollm2_style_config_fields_load(tmp_path: Path) -> None:
    """SmolLM2's published config.json carries nanotron and transformers.js fields."""
    LlamaModel.random(ModelConfig(), seed=0).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw.update(
        {
            "is_llama_config": True,
            "rope_interleaved": False,
            "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}},
        }
    )
    path.write_text(json.dumps(raw))
    assert LlamaModel.from_pretrained(tmp_path).config == ModelConfig()
    raw["rope_interleaved"] = True
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidInputError, match="rope_interleaved"):
        LlamaModel.from_pretrained(tmp_path)
