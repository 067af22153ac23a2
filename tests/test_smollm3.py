"""SmolLM3 (issue 23): Llama with NoPE layers, read as transformers' ``SmolLM3Config`` reads
them (``no_rope_layers``, else no RoPE on every ``no_rope_layer_interval``-th layer; a RoPE
theta of 2e6 when none is given; a window only on the layers ``layer_types`` names).

Checked against transformers itself: checkpoints its ``SmolLM3ForCausalLM.save_pretrained``
writes, redrawn so attention is sharp (with its init, rotating or not barely moves the logits),
served by our `Engine` and compared token for token with its ``generate``.
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

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models import hf_config
from prefixkv.models.config import ModelConfig
from prefixkv.models.decoder import LlamaModel, PrefillRequest
from tests.test_model_hf import TOKENS, assert_close_to_scale, load_with_transformers

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": None,  # SmolLM3Config's 128004 is outside a 256-token vocabulary
}


def sharpen(model: Any, seed: int) -> None:
    """Redraw a transformers model's weights as `LlamaModel.random` draws ours: q/k
    projections scaled so attention scores have a standard deviation of about 8."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif name == "lm_head.weight":
                parameter.copy_(2.0 * noise / math.sqrt(parameter.shape[1]))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.copy_(noise * math.sqrt(8.0 / parameter.shape[1]))
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))


def smollm3_checkpoint(directory: Path, seed: int = 3, **changes: Any) -> Any:
    torch.manual_seed(seed)
    theirs = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**{**TINY, **changes}))
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


def test_the_type_table_is_transformers_smollm3_config() -> None:
    defaults = hf_config.TYPE_DEFAULTS["smollm3"]
    for field in dataclasses.fields(transformers.SmolLM3Config):
        assert field.name in defaults or field.name in hf_config.KNOWN_HF_CONFIG_FIELDS
        if field.name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[field.name] == field.default, field.name
    assert ModelConfig.from_hf_config({**TINY, "model_type": "smollm3"}).rope_theta == (
        transformers.SmolLM3Config.default_theta
    )


@pytest.mark.parametrize(
    "changes",
    [
        {},  # NoPE on layer 3 (every 4th)
        {"no_rope_layer_interval": 2},
        {"no_rope_layers": [0, 1, 1, 0, 1]},  # longer than the layers: the first 4 count
        {"no_rope_layers": [1, 1, 1, 1]},  # all RoPE: a Llama
        {"use_sliding_window": True, "sliding_window": 6},  # windows on the NoPE layers
        {
            "use_sliding_window": True,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
    ],
)
def test_configs_transformers_saves_are_read_as_it_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    theirs = transformers.SmolLM3Config(**{**TINY, **changes})
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    layers = range(theirs.num_hidden_layers)
    assert [ours.layer_applies_rope(i) for i in layers] == [
        bool(theirs.no_rope_layers[i]) for i in layers
    ]
    assert list(ours.layer_sliding_windows) == [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 2_000_000.0
    assert ours.attention_qkv_bias is ours.attention_output_bias is theirs.attention_bias
    assert ours.mlp_bias is theirs.mlp_bias and not ours.qk_norm
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings


def test_a_published_style_config_loads(tmp_path: Path) -> None:
    """The fields SmolLM3-3B's config.json carries (written by transformers 4.54), some of which
    its modeling code never reads (``max_window_layers``, ``pretraining_tp``): loaded as
    transformers loads it, NoPE on every fourth layer, theta from the file."""
    raw = {
        "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": 128012,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "layer_types": ["full_attention"] * 8,
        "max_position_embeddings": 65536, "max_window_layers": 28, "mlp_bias": False,
        "model_type": "smollm3", "no_rope_layer_interval": 4,
        "no_rope_layers": [1, 1, 1, 0] * 2, "num_attention_heads": 4, "num_hidden_layers": 8,
        "num_key_value_heads": 2, "pad_token_id": 128004, "pretraining_tp": 2,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0", "use_cache": False, "use_sliding_window": False,
        "vocab_size": 128256,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.rope_layers == tuple(bool(rope) for rope in theirs.no_rope_layers)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 5_000_000.0
    assert ours.layer_sliding_windows == (None,) * 8 and ours.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers"),  # truthy in transformers
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers"),  # fewer than the layers
        ({"no_rope_layers": "1110"}, "no_rope_layers"),
        ({"no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ({"layer_types": ["sliding_attention"] * 4, "sliding_window": 6}, "use_sliding_window"),
        ({"qk_norm": True}, "qk_norm"),
    ],
)
def test_settings_smollm3_does_not_compute_with_are_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, "model_type": "smollm3", **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"num_layers": 4, "rope_layers": (True, True, True, False)},
        {
            "num_layers": 4,
            "rope_layers": (False, True, False, True),
            "attention_qkv_bias": True,
            "attention_output_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
        },
        {
            "num_layers": 4,
            "rope_layers": (True, False, True, False),
            "sliding_window": 5,
            "layer_types": ("full_attention", "sliding_attention") * 2,
        },
    ],
    ids=["nope_last", "biases_tied", "windowed_nope"],
)
def test_our_smollm3_checkpoint_in_transformers_gives_our_logits(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    ours = LlamaModel.random(ModelConfig(**changes), seed=4)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "smollm3"
    assert LlamaModel.from_pretrained(tmp_path).config == ours.config
    with torch.no_grad():
        expected = load_with_transformers(tmp_path)(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.forward_full(TOKENS), expected)
    # The NoPE layers matter: rotating them too gives logits far from transformers'.
    rotated = ours.with_config(rope_layers=None).forward_full(TOKENS)
    assert (rotated - expected).abs().max() > 1e-2 * expected.abs().max()


@pytest.mark.parametrize("kind", ["nope", "windowed_nope"])
def test_a_transformers_smollm3_checkpoint_served_by_the_engine_is_transformers_own(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens equal transformers' `generate` from scratch, after a cached prefix, in
    8-token prefill chunks and with drafts; the paged logits after a cached prefix within
    float32 rounding of transformers', and far from them with RoPE on every layer."""
    # Untied: a tied head (SmolLM3's default) over unit-variance embeddings repeats the last
    # token, and a constant continuation would compare little.
    changes: dict[str, Any] = {"no_rope_layer_interval": 2, "tie_word_embeddings": False}
    if kind == "windowed_nope":
        changes |= {"use_sliding_window": True, "sliding_window": 7}
    theirs = smollm3_checkpoint(tmp_path, **changes)
    engine = Engine.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=8,
        num_speculative_tokens=3,
        stop_token_ids=(),
    )
    config = engine.model.config
    assert config.rope_layers == (True, False, True, False)
    assert engine.grouped is (kind == "windowed_nope")
    prompt = TOKENS.tolist()
    drafted = 0
    for tokens in (prompt, [*prompt[:32], 5, 6, 7], prompt[:6] * 5):
        with torch.no_grad():
            expected = theirs.generate(
                torch.tensor([tokens]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )[0, len(tokens) :].tolist()
        (result,) = engine.generate([tokens], max_new_tokens=12, check_exactness=True)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
        assert len(set(expected)) > 3  # a continuation that tells models apart
        drafted += result.draft_tokens
    assert result.cached_tokens > 0 and drafted > 0  # drafts proposed and verified

    with torch.no_grad():
        expected_logits = theirs(TOKENS[None]).logits[0]
    scale = expected_logits.abs().max().item()

    def paged_logits(cached: int) -> torch.Tensor:
        kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
        table = list(range(10))
        if cached:
            engine.model.prefill(kv, [PrefillRequest(TOKENS[:cached], table)])
        (logits,) = engine.model.prefill(
            kv, [PrefillRequest(TOKENS, table, num_cached_tokens=cached)], return_all_logits=True
        )
        return logits

    for cached in (0, 9, 24):
        assert_close_to_scale(paged_logits(cached), expected_logits[cached:])
    # A planted bug: the paged path rotating the NoPE layers as well.
    monkeypatch.setattr(ModelConfig, "layer_applies_rope", lambda self, index: True)
    assert (paged_logits(0) - expected_logits).abs().max().item() > 1e-2 * scale


def test_a_smollm3_model_s_cache_context_differs_from_llama_s_of_the_same_weights() -> None:
    smollm3 = LlamaModel.random(ModelConfig(rope_layers=(True, False)), seed=4)
    llama = smollm3.with_config(rope_layers=None)
    assert smollm3.cache_context(4, weights_digest="w") != llama.cache_context(
        4, weights_digest="w"
    )
    assert smollm3.cache_context(4) != llama.cache_context(4)
    assert ModelConfig(rope_layers=(True, True)).rope_layers is None  # all RoPE: a Llama
    with pytest.raises(InvalidInputError, match="rope_layers"):
        ModelConfig(rope_layers=(True,))
