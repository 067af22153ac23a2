"""Starcoder2 (issue 23): Llama with LayerNorms (a bias, ``norm_epsilon``), a plain
``c_proj(gelu(c_fc(x)))`` MLP, ``use_bias`` on all six projections and Mistral's window on
every layer, read as transformers' ``Starcoder2Config`` reads it.

Checked against transformers itself: checkpoints its ``Starcoder2ForCausalLM.save_pretrained``
writes, redrawn so attention is sharp and every bias (the norms' too) moves the logits, served
by our `Engine` and compared token for token with its ``generate``, with a window shorter than
the prompt; planted bugs (no window, no LayerNorm bias, the exact GELU for the tanh one) are
shown to fail the same comparisons.
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
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models import config as model_config
from prefixkv.models import hf_config
from prefixkv.models.config import ModelConfig
from prefixkv.models.decoder import LlamaModel, PrefillRequest
from prefixkv.models.starcoder2 import PLAIN_MLP_ACTIVATIONS
from tests.demo_support import run_demo_model
from tests.test_config_reading import WRONG_VALUES
from tests.test_gguf import tokenizer as tokenizer
from tests.test_model_hf import TOKENS, assert_close_to_scale, load_with_transformers
from tests.test_model_paged import Scenario, build_model, check_cached_matches_full, scenarios
from tests.test_qwen3 import transformers_greedy
from tests.test_smollm3 import sharpen

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # Starcoder2Config's 50256 lies outside a 256-token vocabulary (transformers warns).
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def starcoder2_checkpoint(directory: Path, seed: int = 6, **changes: Any) -> Any:
    """A tiny random Starcoder2 checkpoint written by transformers, with sharp attention and
    biases and norm weights away from their init; returns transformers' model loaded back."""
    torch.manual_seed(seed)
    config = transformers.Starcoder2Config(**{**TINY, **changes})
    theirs = transformers.Starcoder2ForCausalLM(config)
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


# -- the config, read as Starcoder2Config reads it -----------------------------------------------


def test_the_type_table_is_transformers_starcoder2_config() -> None:
    declared = {field.name: field for field in dataclasses.fields(transformers.Starcoder2Config)}
    defaults = hf_config.TYPE_DEFAULTS["starcoder2"]
    assert set(declared) - set(hf_config.KNOWN_HF_CONFIG_FIELDS) <= set(defaults)
    for name, field in declared.items():
        if name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[name] == field.default, (name, defaults[name], field.default)
    # No default_theta of its own: PreTrainedConfig's.
    ours = ModelConfig.from_hf_config({**TINY, "model_type": "starcoder2"})
    assert ours.rope_theta == transformers.Starcoder2Config.default_theta == 10000.0


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"use_bias": False, "tie_word_embeddings": False},
        {"sliding_window": 7, "norm_epsilon": 1e-3},
        {"hidden_act": "gelu", "num_key_value_heads": 1},
        {"head_dim": 32, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                              "rope_theta": 1e5}},
    ],
    ids=["defaults", "no_bias_untied", "window_eps", "gelu_mqa", "head_dim_scaled_rope"],
)  # fmt: skip
def test_configs_transformers_saves_are_read_as_it_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    theirs = transformers.Starcoder2Config(**{**TINY, **changes})
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.layer_norm and ours.plain_mlp_activation == theirs.hidden_act
    assert ours.rms_norm_eps == theirs.norm_epsilon
    assert ours.attention_qkv_bias is ours.attention_output_bias is ours.mlp_bias
    assert ours.mlp_bias is theirs.use_bias
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)
    assert (ours.num_heads, ours.num_kv_heads) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
    )
    assert ours.layer_sliding_windows == (theirs.sliding_window,) * theirs.num_hidden_layers
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert not ours.qk_norm and ours.gemma is None and ours.moe is None


def test_starcoder2_15b_s_published_config_loads(tmp_path: Path) -> None:
    """Starcoder2-15B's config.json as published (transformers 4.37 wrote it): BigCode's
    ``mlp_type`` / ``norm_type`` at the values transformers computes with, an
    ``rms_norm_eps`` its modeling never reads, the RoPE theta at the top level."""
    raw = {
        "architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.1,
        "residual_dropout": 0.1, "embedding_dropout": 0.1, "bos_token_id": 0,
        "eos_token_id": 0, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 6144,
        "initializer_range": 0.01275, "intermediate_size": 24576,
        "max_position_embeddings": 16384, "mlp_type": "default", "model_type": "starcoder2",
        "norm_epsilon": 1e-05, "norm_type": "layer_norm", "num_attention_heads": 48,
        "num_hidden_layers": 40, "num_key_value_heads": 4, "rms_norm_eps": 0.5,
        "rope_theta": 100000, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.37.0.dev0", "use_bias": True,
        "use_cache": True, "vocab_size": 49152,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert (ours.num_layers, ours.head_dim, ours.num_kv_heads) == (40, 128, 4)
    assert ours.rms_norm_eps == theirs.norm_epsilon == 1e-5  # not rms_norm_eps's 0.5
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 100_000
    assert ours.layer_sliding_windows == (4096,) * 40 and not ours.tie_word_embeddings
    # Sized as transformers builds it (15.96B parameters), before anything is allocated.
    assert 15.9e9 < ours.parameter_count < 16.0e9


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        # Written by hand (gelu_new, gelu_fast) or not a GELU: refused, not approximated.
        ({"hidden_act": "gelu_new"}, "hidden_act"),
        ({"hidden_act": "silu"}, "hidden_act"),
        # BigCode's settings at a value that claims another architecture.
        ({"mlp_type": "gated"}, "mlp_type"),
        ({"norm_type": "rms_norm"}, "norm_type"),
        # Typed as Starcoder2Config types them.
        ({"use_bias": 1}, "use_bias"),
        ({"norm_epsilon": None}, "norm_epsilon"),
        ({"residual_dropout": "0.1"}, "residual_dropout"),
        ({"sliding_window": 0}, "sliding_window"),
        # Other types' fields: Llama's bias switches, Qwen2's window switch, a pattern.
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_settings_starcoder2_cannot_compute_are_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, "model_type": "starcoder2", **changes})


#: The fields the Starcoder2 reader reads.
STARCODER2_FIELDS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "norm_epsilon",
    "rope_theta", "rope_parameters", "max_position_embeddings", "sliding_window", "use_bias",
    "tie_word_embeddings", "residual_dropout", "embedding_dropout", "mlp_type", "norm_type",
]  # fmt: skip


@given(field=st.sampled_from(STARCODER2_FIELDS), value=WRONG_VALUES)
def test_any_wrong_value_is_a_typed_error_naming_the_field(field: str, value: Any) -> None:
    raw = {**TINY, "model_type": "starcoder2", field: value}
    try:
        ModelConfig.from_hf_config(raw)
    except InvalidInputError as exc:
        # A RoPE setting may be named by the object holding it, as for the other types.
        names = {field, "rope_parameters", "rope_scaling"} if field.startswith("rope") else {field}
        assert any(name in str(exc) for name in names), (field, value, str(exc))
    else:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        harmless = (
            (value is None and field in ("num_key_value_heads", "head_dim", "sliding_window",
                                         "rope_parameters"))
            or (field == "rope_parameters" and value == {})
            or (field in ("use_bias", "tie_word_embeddings") and isinstance(value, bool))
            or (field == "hidden_act" and value in PLAIN_MLP_ACTIVATIONS)
            or (field in ("norm_epsilon", "rope_theta", "residual_dropout", "embedding_dropout")
                and number and math.isfinite(value))
        )  # fmt: skip
        assert harmless, (field, value)


# -- our checkpoints in transformers, and transformers' in our engine ---------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"plain_mlp_activation": "gelu", "tie_word_embeddings": True, "num_kv_heads": 1},
        {"attention_qkv_bias": False, "attention_output_bias": False, "mlp_bias": False,
         "sliding_window": 5, "rms_norm_eps": 1e-2},
    ],
    ids=["biased", "gelu_tied_mqa", "unbiased_window"],
)  # fmt: skip
def test_our_starcoder2_checkpoint_in_transformers_gives_our_logits(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    base = {
        "layer_norm": True,
        "plain_mlp_activation": "gelu_pytorch_tanh",
        "attention_qkv_bias": True,
        "attention_output_bias": True,
        "mlp_bias": True,
    }
    ours = LlamaModel.random(ModelConfig(**{**base, **changes}), seed=4)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "starcoder2"
    assert LlamaModel.from_pretrained(tmp_path).config == ours.config
    with torch.no_grad():
        expected = load_with_transformers(tmp_path)(TOKENS[None]).logits[0]
    assert_close_to_scale(ours.forward_full(TOKENS), expected)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"plain_mlp_activation": None}, "plain_mlp_activation"),  # a LayerNorm Llama
        ({"layer_norm": False}, "layer_norm"),  # a plain MLP under RMSNorms
        ({"attention_qkv_bias": True, "attention_output_bias": True}, "mlp_bias"),
        ({"qk_norm": True}, "qk_norm"),
        ({"rope_layers": (True, False)}, "rope_layers"),
        ({"sliding_window": 4, "layer_types": ("sliding_attention", "full_attention")},
         "layer_types"),
    ],
)  # fmt: skip
def test_a_config_starcoder2_cannot_say_is_not_written(changes: dict[str, Any], named: str) -> None:
    base = {"layer_norm": True, "plain_mlp_activation": "gelu_pytorch_tanh"}
    with pytest.raises(InvalidInputError, match=named):
        ModelConfig(**{**base, **changes}).to_hf_config()


def test_settings_the_decoder_lacks_are_refused_by_model_config() -> None:
    with pytest.raises(InvalidInputError, match="plain_mlp_activation"):
        ModelConfig(plain_mlp_activation="relu")
    with pytest.raises(InvalidInputError, match="layer_norm"):
        ModelConfig(layer_norm=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["full", "windowed"])
def test_a_transformers_starcoder2_checkpoint_served_by_the_engine_is_transformers_own(
    tmp_path: Path, kind: str
) -> None:
    """Greedy tokens equal transformers' `generate` from scratch, after a cached prefix, in
    8-token prefill chunks and with drafts (windowed: a window of 7, far shorter than the
    40-token prompt, served on the KV groups); the paged logits after a cached prefix within
    float32 rounding of transformers'."""
    # Untied: a tied head over unit-variance embeddings repeats the last token, and a constant
    # continuation would compare little.
    changes: dict[str, Any] = {"tie_word_embeddings": False}
    if kind == "windowed":
        changes["sliding_window"] = 7
    theirs = starcoder2_checkpoint(tmp_path, **changes)
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
    assert config.layer_norm and config.plain_mlp_activation == "gelu_pytorch_tanh"
    assert config.layer_sliding_windows == (changes.get("sliding_window"),) * 2
    assert engine.grouped is (kind == "windowed")
    prompt = TOKENS.tolist()
    drafted = 0
    for tokens in (prompt, [*prompt[:32], 5, 6, 7], prompt[:6] * 5):
        expected = transformers_greedy(theirs, tokens, 12)
        (result,) = engine.generate([tokens], max_new_tokens=12, check_exactness=True)
        assert result.output_token_ids == expected
        assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
        if tokens is prompt:
            assert engine.last_stats.prefill_chunks == 5  # 40 tokens, 8 a step
        assert len(set(expected)) > 3  # a continuation that tells models apart
        drafted += result.draft_tokens
    assert result.cached_tokens > 0 and drafted > 0  # drafts proposed and verified

    with torch.no_grad():
        expected_logits = theirs(TOKENS[None]).logits[0]
    for cached in (0, 9, 24):
        assert_close_to_scale(paged_logits(engine.model, cached), expected_logits[cached:])


def paged_logits(model: LlamaModel, cached: int) -> torch.Tensor:
    """Every position's logits from the paged path, after `cached` tokens a separate call
    prefilled."""
    config = model.config
    kv = PagedKVCache(config.num_layers, 12, 4, config.num_kv_heads, config.head_dim)
    table = list(range(10))
    if cached:
        model.prefill(kv, [PrefillRequest(TOKENS[:cached], table)])
    (logits,) = model.prefill(
        kv, [PrefillRequest(TOKENS, table, num_cached_tokens=cached)], return_all_logits=True
    )
    return logits


@pytest.mark.parametrize("bug", ["no_window", "no_norm_bias", "exact_gelu", "rms_norm"])
def test_a_planted_bug_fails_the_comparison(tmp_path: Path, bug: str) -> None:
    """The comparison above sees each thing Starcoder2 computes differently: the window, the
    LayerNorms' biases and mean, the tanh GELU."""
    theirs = starcoder2_checkpoint(tmp_path, sliding_window=7)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert_close_to_scale(paged_logits(ours, 9), expected[9:])
    if bug == "no_window":
        ours = ours.with_config(sliding_window=None)
    elif bug == "exact_gelu":
        ours = ours.with_config(plain_mlp_activation="gelu")
    else:
        with torch.no_grad():
            for module in ours.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    if bug == "no_norm_bias":
                        module.bias.zero_()
                    else:  # an RMSNorm's output: the mean not subtracted, no bias
                        module.forward = _rms_norm(module)  # type: ignore[method-assign]
    difference = (paged_logits(ours, 9) - expected[9:]).abs().max().item()
    # The tanh GELU differs from the exact one by less than 1e-3: it moves the logits far less
    # than the others (about 1e-4 of their scale), still several times past the comparison's
    # bound (1e-5 of their scale).
    bound = 3e-5 if bug == "exact_gelu" else 1e-2
    assert difference > bound * expected.abs().max().item(), difference


def _rms_norm(module: torch.nn.LayerNorm) -> Any:
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.eps)
        return module.weight * hidden * scale

    return forward


# -- sizes, cache identity, the CLI ------------------------------------------------------------


def test_the_loader_s_memory_bound_counts_starcoder2_s_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`parameter_count` is transformers' own count (LayerNorm biases, two MLP projections,
    biases, a tied head counted once), so the loader refuses a checkpoint one byte over the
    machine's memory before building anything; published sizes come out as published."""
    for changes in ({}, {"use_bias": False, "tie_word_embeddings": False}):
        theirs = starcoder2_checkpoint(tmp_path, **changes)
        ours = ModelConfig.from_hf_config(tmp_path)
        assert ours.parameter_count == sum(p.numel() for p in theirs.parameters())
    needed = ours.weight_bytes()
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: needed - 1)
    with pytest.raises(MemoryError, match=f"{needed:,} bytes"):
        LlamaModel.from_pretrained(tmp_path)
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: needed)
    LlamaModel.from_pretrained(tmp_path)
    # Starcoder2-3B (30 layers of 3072, 2 KV heads, tied): 3.03B parameters.
    three_b = {
        **TINY, "model_type": "starcoder2", "vocab_size": 49152, "hidden_size": 3072,
        "intermediate_size": 12288, "num_hidden_layers": 30, "num_attention_heads": 24,
    }  # fmt: skip
    assert 3.02e9 < ModelConfig.from_hf_config(three_b).parameter_count < 3.04e9


def test_a_starcoder2_model_s_cache_context_differs_from_llama_s() -> None:
    """Under a weights digest the caller names, Starcoder2's norms and MLP still keep its KV
    apart from a Llama's (or a half-Starcoder2's) of the same shapes."""
    contexts = [
        LlamaModel.random(ModelConfig(**changes), seed=4).cache_context(4, weights_digest="w")
        for changes in (
            {},
            {"layer_norm": True},
            {"plain_mlp_activation": "gelu"},
            {"layer_norm": True, "plain_mlp_activation": "gelu"},
            {"layer_norm": True, "plain_mlp_activation": "gelu_pytorch_tanh"},
        )
    ]
    assert len(set(contexts)) == len(contexts)
    assert dict(contexts[0].extra) == {}  # a Llama's context is what it was


@given(scenario=scenarios(), data=st.data())
def test_cached_prefix_matches_full_recompute_on_starcoder2_models(
    scenario: Scenario, data: st.DataObject
) -> None:
    """tests/test_model_paged.py's property (drawn shapes, dtypes, windows, adapters, cached
    splits and shuffled block tables: the paged KV and logits equal full recompute within the
    dtype's bound) on Starcoder2-style models."""
    bias = data.draw(st.booleans(), label="use_bias")
    config = scenario.config.replace(
        layer_norm=True,
        plain_mlp_activation=data.draw(st.sampled_from(sorted(PLAIN_MLP_ACTIVATIONS))),
        attention_qkv_bias=bias,
        attention_output_bias=bias,
        mlp_bias=bias,
    )
    scenario = dataclasses.replace(scenario, config=config)
    check_cached_matches_full(build_model(scenario), scenario)


def test_prefixkv_demo_serves_a_starcoder2_checkpoint(
    tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prefixkv demo --model` on a Starcoder2 directory transformers wrote (a window of 16 on
    every layer, a tokenizer and a chat template beside it): its greedy tokens those of a full
    recompute, the stable-first layout hitting the cache."""
    from tests.test_engine_checkpoint import CHATML

    eos = tokenizer.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    config = transformers.Starcoder2Config(
        **{
            **TINY,
            "vocab_size": tokenizer.get_vocab_size(),
            "sliding_window": 16,
            "max_position_embeddings": 4096,
            "eos_token_id": eos,
        }
    )
    transformers.Starcoder2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    # Chunked: the window lets blocks go.
    data = run_demo_model(tmp_path, capsys, "--max-num-batched-tokens", "64")
    stable = data["layouts"]["stable_first"]
    # Every layer slides: no full-attention group to compare the held KV with.
    assert stable["peak_kv_bytes"] > 0 and stable["peak_kv_bytes_all_full"] is None
