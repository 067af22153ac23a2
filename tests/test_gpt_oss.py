"""gpt-oss (issue 23): sliding (window 128 by default) and full attention layers alternating,
attention sinks, biased attention, a biased top-k router with a softmax over the chosen logits,
clamped SwiGLU experts stored stacked and interleaved, YaRN RoPE without truncation.

The reference is transformers itself: ``GptOssConfig`` for how a config is read, checkpoints its
``GptOssForCausalLM.save_pretrained`` writes, its forward and ``generate``. Weights are redrawn
so that attention is sharp, the sinks take a real share of each softmax, routing differs per
token, and the experts' gate and up values often pass the clamp (with transformers' init, std
0.02, none of the three happens and a dropped sink or a wrong clamp would pass). Each of those
bugs is planted below and must move the logits far past the bound.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.engine.facade import Engine
from prefixkv.errors import BackendUnavailableError, InvalidInputError
from prefixkv.kv.decode import paged_decode_attention
from prefixkv.kv.prefill import paged_prefill_attention
from prefixkv.models import decoder as decoder_module
from prefixkv.models import hf_config
from prefixkv.models.config import ModelConfig
from prefixkv.models.decoder import LlamaModel
from prefixkv.models.moe import MoESettings, SparseMoE, _StackedExperts
from tests.test_model_hf import TOKENS, assert_close_to_scale, load_with_transformers
from tests.test_model_paged import Scenario, build_model, check_cached_matches_full, scenarios
from tests.test_moe import paged_logits
from tests.test_qwen3 import transformers_greedy

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "num_local_experts": 6,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
}
SHARPNESS = 8.0
#: A prompt longer than gpt-oss's default window (128).
LONG = torch.tensor([(37 * i + 11) % 256 for i in range(150)])


def sharpen(model: Any, seed: int) -> None:
    """Redraw a transformers gpt-oss model's weights (see the module docstring for why)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif name.endswith("sinks"):
                # Around a typical row's largest scores: some rows give the sink most weight.
                parameter.copy_(3.0 + 2.0 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.copy_(noise * math.sqrt(SHARPNESS / parameter.shape[1]))
            elif name.endswith("router.weight"):
                parameter.copy_(3.0 * noise / math.sqrt(parameter.shape[1]))
            elif name.endswith("experts.gate_up_proj"):  # [experts, hidden, 2 * intermediate]
                parameter.copy_(4.0 * noise / math.sqrt(parameter.shape[1]))
            elif name.endswith("experts.down_proj"):  # [experts, intermediate, hidden]
                parameter.copy_(0.3 * noise / math.sqrt(parameter.shape[1]))
            elif name.endswith(("bias", "_bias")):
                parameter.copy_(0.5 * noise)
            elif name == "lm_head.weight":
                parameter.copy_(2.0 * noise / math.sqrt(parameter.shape[1]))
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))


def gpt_oss_checkpoint(directory: Path, seed: int = 5, **changes: Any) -> Any:
    """A tiny random gpt-oss checkpoint written by transformers; returns transformers' model
    loaded back from it (float32, eager attention: the one that applies the sinks on CPU)."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**{**TINY, **changes})
    theirs = transformers.GptOssForCausalLM(config)
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


# -- the config, read as GptOssConfig reads it -------------------------------------------------


def test_the_type_table_is_transformers_gpt_oss_config() -> None:
    declared = {field.name: field for field in dataclasses.fields(transformers.GptOssConfig)}
    defaults = hf_config.TYPE_DEFAULTS["gpt_oss"]
    for name, field in declared.items():
        assert name in defaults or name in hf_config.KNOWN_HF_CONFIG_FIELDS, name
        if name in defaults and field.default is not dataclasses.MISSING:
            assert defaults[name] == field.default, (name, defaults[name], field.default)
    assert hf_config._DEFAULT_ROPE_THETA["gpt_oss"] == transformers.GptOssConfig.default_theta
    default_rope = transformers.GptOssConfig().rope_parameters
    assert default_rope == {**hf_config._GPT_OSS_ROPE, "rope_theta": 150000.0}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"num_hidden_layers": 3},  # layer_types derived: sliding, full, sliding
        {"layer_types": ["full_attention", "sliding_attention"] * 2, "sliding_window": 5},
        {"layer_types": ["sliding_attention"] * 4},
        {"attention_bias": False, "head_dim": 32, "num_key_value_heads": 4},
        {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                             "original_max_position_embeddings": 64, "truncate": True}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}},
        {"swiglu_limit": 3.0, "swiglu_alpha": 1.0, "num_experts_per_tok": 6},
    ],
    ids=["defaults", "odd_layers", "layer_types", "all_sliding", "no_bias", "yarn", "no_yarn",
         "swiglu"],
)  # fmt: skip
def test_configs_transformers_saves_are_read_as_it_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    theirs = transformers.GptOssConfig(**{**TINY, **changes})
    theirs.save_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.attention_sinks and not ours.qk_norm
    assert ours.attention_qkv_bias is ours.attention_output_bias is theirs.attention_bias
    assert ours.head_dim == theirs.head_dim
    assert ours.moe == MoESettings(
        "gpt_oss",
        theirs.num_local_experts,
        theirs.num_experts_per_tok,
        theirs.intermediate_size,
        swiglu_alpha=theirs.swiglu_alpha,
        swiglu_limit=theirs.swiglu_limit,
    )
    assert list(ours.layer_sliding_windows) == [
        theirs.sliding_window if kind == "sliding_attention" else None
        for kind in theirs.layer_types
    ]
    rope = theirs.rope_parameters
    assert ours.rope_theta == rope["rope_theta"]
    if rope["rope_type"] == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling is not None and ours.rope_scaling.kind == "yarn"
        assert ours.rope_scaling.factor == rope["factor"]
        assert ours.rope_scaling.truncate is rope.get("truncate", True)
        assert (
            ours.rope_scaling.original_max_position_embeddings
            == (rope["original_max_position_embeddings"])
        )


def _published_20b() -> dict[str, Any]:
    """openai/gpt-oss-20b's config.json as published (transformers 4.55 era): MXFP4 experts,
    OpenAI's own ``experts_per_token`` / ``initial_context_length``, old-style RoPE fields."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": 201088,
    }  # fmt: skip


def test_the_published_mxfp4_config_is_refused_by_name_and_its_dequantized_form_loads() -> None:
    with pytest.raises(InvalidInputError, match=r"quantization_config.*mxfp4"):
        ModelConfig.from_hf_config(_published_20b())
    raw = _published_20b()
    del raw["quantization_config"]  # as a bf16 re-upload ships it
    ours = ModelConfig.from_hf_config(raw)
    assert ours.layer_sliding_windows == (128, None) * 12
    assert ours.moe == MoESettings("gpt_oss", 32, 4, 2880)
    assert ours.rope_scaling is not None and ours.rope_scaling.truncate is False
    assert (ours.rope_theta, ours.rope_scaling.factor) == (150000.0, 32.0)
    # 20.9B parameters, as the model card says.
    assert 20.8e9 < ours.parameter_count < 21.0e9


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"head_dim": None}, "head_dim"),  # GptOssConfig types it int (strict)
        ({"sliding_window": None}, "sliding_window"),  # sliding layers without a window
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
        ({"swiglu_limit": "7"}, "swiglu_limit"),
        ({"swiglu_alpha": math.nan}, "swiglu_alpha"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ({"attention_bias": 1}, "attention_bias"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 32.0, "extra": 1}}, "extra"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_what_this_decoder_does_not_compute_is_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, "model_type": "gpt_oss", **changes})


# -- attention sinks in the paged kernels -------------------------------------------------------


def _dense_attention_with_sinks(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sinks: torch.Tensor,
    cached: int,
    window: int | None,
) -> torch.Tensor:
    """The definition, written out: ``softmax([q.k * scale, sink])`` without the sink's column,
    times the values. query ``[q, heads, dim]``, keys/values ``[n, kv_heads, dim]``."""
    q_len, heads, dim = query.shape
    n, kv_heads = keys.shape[0], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1).double()
    values = values.repeat_interleave(heads // kv_heads, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) / math.sqrt(dim)
    positions = torch.arange(cached, n)[:, None]
    key_positions = torch.arange(n)[None, :]
    allowed = key_positions <= positions
    if window is not None:
        allowed &= key_positions > positions - window
    scores = scores.masked_fill(~allowed, -math.inf)
    column = sinks.double()[:, None, None].expand(heads, q_len, 1)
    weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, values)


@settings(max_examples=30, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 8]),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=3),
    window=st.one_of(st.none(), st.integers(1, 12)),
    sink_scale=st.sampled_from([0.0, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_paged_kernels_with_sinks_match_the_definition(
    block_size: int,
    heads: tuple[int, int],
    lengths: list[tuple[int, int]],
    window: int | None,
    sink_scale: float,
    seed: int,
) -> None:
    """Prefill (torch and reference backends, every cached split, drawn windows and sink sizes
    up to ones that take nearly all the mass) and decode equal the written-out definition."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    dim = 8
    batch = [(new, new + cached) for new, cached in lengths]  # (query_len, seq_len)
    blocks_per = [-(-n // block_size) for _, n in batch]
    num_blocks = sum(blocks_per) + 2
    key_pages = torch.randn(num_blocks, block_size, num_kv_heads, dim, generator=generator) * 2
    value_pages = torch.randn(num_blocks, block_size, num_kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(batch), max(blocks_per), dtype=torch.int64)
    start = 0
    for row, count in enumerate(blocks_per):
        tables[row, :count] = torch.tensor(order[start : start + count])
        start += count
    query = torch.randn(sum(q for q, _ in batch), num_heads, dim, generator=generator) * 2
    sinks = torch.randn(num_heads, generator=generator) * sink_scale
    expected = []
    for row, (q_len, n) in enumerate(batch):
        pages = tables[row, : blocks_per[row]]
        keys = key_pages[pages].reshape(-1, num_kv_heads, dim)[:n]
        values = value_pages[pages].reshape(-1, num_kv_heads, dim)[:n]
        first = sum(q for q, _ in batch[:row])
        expected.append(
            _dense_attention_with_sinks(
                query[first : first + q_len], keys, values, sinks, n - q_len, window
            )
        )
    want = torch.cat(expected).float()
    for backend in ("torch", "reference"):
        got = paged_prefill_attention(
            query, key_pages, value_pages, tables, [q for q, _ in batch], [n for _, n in batch],
            sliding_window=window, sinks=sinks, backend=backend,  # type: ignore[arg-type]
        )  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Decode: each request's last query.
    lasts = torch.tensor([sum(q for q, _ in batch[: row + 1]) - 1 for row in range(len(batch))])
    got = paged_decode_attention(
        query[lasts], key_pages, value_pages, tables, [n for _, n in batch],
        scale=dim**-0.5, sliding_window=window, sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(got, want[lasts], rtol=1e-5, atol=1e-5)


def test_sinks_are_checked_and_the_triton_backend_refuses_them() -> None:
    query = torch.randn(3, 4, 8)
    pages = torch.randn(2, 4, 2, 8)
    tables = torch.tensor([[0]])
    with pytest.raises(InvalidInputError, match="sinks"):
        paged_prefill_attention(query, pages, pages, tables, [3], [3], sinks=torch.zeros(2))
    with pytest.raises(BackendUnavailableError, match="sinks"):
        paged_prefill_attention(
            query, pages, pages, tables, [3], [3], sinks=torch.zeros(4), backend="triton"
        )


# -- transformers' checkpoints, computed here ---------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "tokens"),
    [
        ({}, TOKENS),
        # gpt-oss's own window (128) and a prompt longer than it; YaRN as it ships.
        ({"sliding_window": 128, "num_hidden_layers": 2}, LONG),
        ({"attention_bias": False, "num_experts_per_tok": 3}, TOKENS),
    ],
    ids=["window_8", "window_128", "no_bias_top3"],
)
def test_logits_match_transformers_full_and_after_a_cached_prefix(
    tmp_path: Path, changes: dict[str, Any], tokens: torch.Tensor
) -> None:
    theirs = gpt_oss_checkpoint(tmp_path, **changes)
    with torch.no_grad():
        expected = theirs(tokens[None]).logits[0]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.parameter_count == sum(p.numel() for p in theirs.parameters())
    # Float32 rounding: sums over 150 keys and experts whose activations reach the clamp
    # (tens) are added in other orders than transformers', and the CPU's kernels choose their
    # own (one logit of 36,096 came 1.03e-5 of the scale off on an AMD EPYC; with top-3 routing,
    # one of 10,240 came 1.04e-5 off on an Intel Xeon, past a bound of 1e-5); the planted bugs
    # below move logits by more than 1e-2 of it, 300 times this bound.
    rtol = 3e-5
    assert_close_to_scale(ours.forward_full(tokens), expected, rtol=rtol)
    n = tokens.numel()
    for cached in (0, 9, n // 2 + 1, n - 1):
        assert_close_to_scale(_paged(ours, tokens, cached), expected[cached:], rtol=rtol)


def _paged(model: LlamaModel, tokens: torch.Tensor, cached: int) -> torch.Tensor:
    if tokens.numel() <= 64:
        return paged_logits(model, tokens, cached)
    from prefixkv.kv.pages import PagedKVCache
    from prefixkv.models.decoder import PrefillRequest

    config = model.config
    kv = PagedKVCache(config.num_layers, 40, 4, config.num_kv_heads, config.head_dim)
    table = list(range(40))
    if cached:
        model.prefill(kv, [PrefillRequest(tokens[:cached], table)])
    (logits,) = model.prefill(
        kv, [PrefillRequest(tokens, table, num_cached_tokens=cached)], return_all_logits=True
    )
    return logits


def test_the_weights_exercise_sinks_routing_and_the_clamp(tmp_path: Path) -> None:
    """What the planted bugs below rely on: tokens route to different experts, the clamp
    changes some gate and up values, and the sinks take a real share of attention."""
    gpt_oss_checkpoint(tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    layer = ours.model.layers[0]
    mlp = layer.mlp
    assert isinstance(mlp, SparseMoE) and isinstance(mlp.experts, _StackedExperts)
    hidden = layer.post_attention_layernorm(ours.model.embed_tokens(TOKENS))
    chosen, _ = mlp.route(hidden)
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) >= 4
    gate_up = hidden @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    limit = mlp.experts.limit
    assert (gate_up[:, ::2] > limit).float().mean() > 0.01
    assert (gate_up[:, 1::2].abs() > limit).float().mean() > 0.01
    sinks = layer.self_attn.sinks
    assert sinks is not None and sinks.max() > 4 and sinks.min() < 2


def test_dropped_sinks_a_wrong_clamp_or_routing_are_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = gpt_oss_checkpoint(tmp_path)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0][9:]
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    scale = expected.abs().max().item()
    assert_close_to_scale(paged_logits(ours, TOKENS, 9), expected)

    def far_off() -> bool:
        return (paged_logits(ours, TOKENS, 9) - expected).abs().max().item() > 1e-2 * scale

    with monkeypatch.context() as patch:  # the paged prefill kernel drops the sinks
        prefill = decoder_module.paged_prefill_attention
        patch.setattr(
            decoder_module,
            "paged_prefill_attention",
            lambda *args, sinks=None, **kwargs: prefill(*args, **kwargs),
        )
        assert far_off()
    with monkeypatch.context() as patch:  # the gate left unclamped (only the up value clamped)

        def gate_unclamped(self: _StackedExperts, index: int, hidden: torch.Tensor) -> Any:
            gate_up = hidden @ self.gate_up_proj[index] + self.gate_up_proj_bias[index]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2].clamp(-self.limit, self.limit)
            gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            return gated @ self.down_proj[index] + self.down_proj_bias[index]

        patch.setattr(_StackedExperts, "expert", gate_unclamped)
        assert far_off()
    with monkeypatch.context() as patch:  # Mixtral's routing: softmax over all, then top k

        def softmax_then_top_k(self: SparseMoE, hidden: torch.Tensor) -> Any:
            probabilities = torch.softmax(self.router(hidden), dim=-1)
            weights, chosen = torch.topk(probabilities, self.settings.experts_per_token, dim=-1)
            return chosen, weights

        patch.setattr(SparseMoE, "route", softmax_then_top_k)
        assert far_off()
    if True:  # YaRN's truncate flag flipped
        scaling = ours.config.rope_scaling
        assert scaling is not None and scaling.truncate is False
        flipped = ours.with_config(rope_scaling=dataclasses.replace(scaling, truncate=True))
        difference = (paged_logits(flipped, TOKENS, 9) - expected).abs().max().item()
        assert difference > 1e-3 * scale


def test_a_transformers_gpt_oss_checkpoint_served_by_the_engine_is_transformers_own(
    tmp_path: Path,
) -> None:
    """Greedy output token for token equal to transformers' `generate`, from scratch, after a
    cached prefix, in prefill chunks of 8 tokens and with prompt-lookup drafts, on the KV groups
    (sliding layers in their own pool); prompts five times the window."""
    theirs = gpt_oss_checkpoint(tmp_path)
    engine = Engine.from_pretrained(
        tmp_path,
        dtype=torch.float32,
        num_blocks=48,
        block_size=4,
        max_num_batched_tokens=8,
        num_speculative_tokens=3,
    )
    assert engine.grouped and engine.model.config.attention_sinks
    prompt = TOKENS.tolist()
    repetitive = prompt[:6] * 5
    drafted = 0
    for tokens in (prompt, [*prompt[:32], 5, 6, 7], repetitive):
        expected = transformers_greedy(theirs, tokens, 16)
        (result,) = engine.generate([tokens], max_new_tokens=16, check_exactness=True)
        assert result.output_token_ids == expected
        # The engine's logits against its own full recompute, within float32 rounding of
        # the logits' scale (see test_logits_match_transformers_full_and_after_a_cached_prefix).
        with torch.no_grad():
            scale = theirs(torch.tensor([tokens])).logits.abs().max().item()
        assert result.max_logit_diff is not None and result.max_logit_diff < 3e-5 * scale
        if tokens is prompt:
            assert engine.last_stats.prefill_chunks == 5
        drafted += result.draft_tokens
        assert len(set(expected)) > 3
    assert result.cached_tokens >= 4 and drafted > 0


@settings(max_examples=25, deadline=None)
@given(scenario=scenarios(), data=st.data())
def test_cached_prefix_matches_full_recompute_with_sinks_and_experts(
    scenario: Scenario, data: st.DataObject
) -> None:
    """tests/test_model_paged.py's property (drawn shapes, windows, adapters, cached splits and
    shuffled block tables: paged KV and logits equal full recompute) on gpt-oss-style models:
    sinks and clamped experts, in float32 (in half precision a near-tie between two experts
    may route a token differently on the two paths, which is not what this checks)."""
    config = scenario.config.replace(dtype=torch.float32, attention_sinks=True)
    experts = data.draw(st.integers(2, 5), label="experts")
    top_k = data.draw(st.integers(1, experts), label="top_k")
    moe = MoESettings("gpt_oss", experts, top_k, config.intermediate_size)
    scenario = dataclasses.replace(scenario, config=config.replace(moe=moe))
    check_cached_matches_full(build_model(scenario), scenario)
