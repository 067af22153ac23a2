"""Phi-3 LongRoPE (issue 23): read as transformers' ``Phi3Config`` and
``_compute_longrope_parameters`` read it, computed as its Phi-3 modeling computes it, and kept
out of prefix reuse wherever it could mix its two settings.

LongRoPE divides each rotated pair's frequency by ``short_factor[i]`` while the sequence is at
most ``original_max_position_embeddings`` long, by ``long_factor[i]`` beyond, and multiplies
cos/sin by an attention factor at every length. A prefix's KV therefore depends on the total
length it was computed for. The checkpoints are written by transformers' ``save_pretrained`` at
test time, with weights redrawn so attention is sharp (with its init, the wrong factor set barely
moves the logits).
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
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.config import ModelConfig
from prefixkv.models.decoder import LlamaModel, PrefillRequest
from prefixkv.models.rope import rope_attention_factor, rope_inverse_frequencies
from tests.test_model_hf import assert_close_to_scale, load_with_transformers

ORIGINAL = 32  # original_max_position_embeddings: the short factors serve up to 32 tokens
PAIRS = 8  # head_dim 16
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
LONG = [1.0, 1.5, 2.5, 4.0, 6.5, 10.0, 16.0, 25.0]
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4 * ORIGINAL,
    "original_max_position_embeddings": ORIGINAL,
    "pad_token_id": None,
    "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
}
TOKENS = torch.tensor([(29 * i + 3) % 256 for i in range(48)])
SHORT_PROMPT, LONG_PROMPT = TOKENS[:24], TOKENS[:44]  # below and above the original context


def sharpen(model: Any, seed: int) -> None:
    """Redraw a transformers Phi-3's weights so attention is sharp: the q and k rows of the
    fused ``qkv_proj`` scaled so scores have a standard deviation of about 8."""
    generator = torch.Generator().manual_seed(seed)
    q_and_k = TINY["hidden_size"] + TINY["hidden_size"] // 2  # 4 query heads, 2 key heads
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            elif name == "lm_head.weight":
                parameter.copy_(2.0 * noise / math.sqrt(parameter.shape[1]))
            else:
                parameter.copy_(noise / math.sqrt(parameter.shape[1]))
                if name.endswith("qkv_proj.weight"):
                    parameter[:q_and_k].mul_(math.sqrt(8.0))


def phi3_checkpoint(directory: Path, seed: int = 3, **changes: Any) -> Any:
    torch.manual_seed(seed)
    theirs = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**TINY, **changes}))
    sharpen(theirs, seed)
    theirs.save_pretrained(directory)
    return load_with_transformers(directory)


@pytest.mark.parametrize(
    "changes",
    [
        {},  # Phi-3-mini-128k's style: factor and attention factor from the two lengths
        {"rope_scaling": {"type": "su", "short_factor": SHORT, "long_factor": LONG,
                          "original_max_position_embeddings": 16}},  # required, then overridden
        {"rope_scaling": {"type": "yarn", "short_factor": SHORT, "long_factor": LONG,
                          "original_max_position_embeddings": 16}},  # the top-level one wins
        {"rope_scaling": None, "rope_parameters": {
            "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
            "factor": 2.0, "original_max_position_embeddings": 8, "rope_theta": 5e5}},
        {"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                          "attention_factor": 1.7}, "rope_theta": 2e4},
        {"max_position_embeddings": 16},  # factor below 1: attention factor 1
    ],
)  # fmt: skip
def test_configs_are_read_as_transformers_reads_them(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    """Every normalisation of Phi3Config (which original context wins, the defaulted factor
    and attention factor, theta inside or outside), on a config.json as published (written
    by hand, older keys included), checked through transformers' own reader and frequency
    function on both sides of the threshold."""
    raw = {**TINY, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    # As the model's rotary embedding does on construction: this normalises the parameters
    # once more ("su" then takes the top-level original context too).
    ROPE_INIT_FUNCTIONS["longrope"](theirs)
    ours = ModelConfig.from_hf_config(tmp_path)
    scaling = ours.rope_scaling
    assert scaling is not None and scaling.kind == "longrope"
    original = theirs.rope_parameters["original_max_position_embeddings"]
    assert scaling.original_max_position_embeddings == original
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    for length in (1, original, original + 1, 4 * original):
        inverse, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](theirs, seq_len=length)
        torch.testing.assert_close(
            rope_inverse_frequencies(ours, length), inverse.double(), rtol=1e-6, atol=0
        )
        assert rope_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-12)
    assert ours.position_encoding_is_length_dependent


def test_a_config_transformers_saves_is_read_back(tmp_path: Path) -> None:
    transformers.Phi3Config(**TINY).save_pretrained(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.rope_scaling is not None
    assert ours.rope_scaling.short_factor == tuple(theirs.rope_parameters["short_factor"])
    assert ours.rope_scaling.long_factor == tuple(theirs.rope_parameters["long_factor"])
    assert rope_attention_factor(ours) == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))


@pytest.mark.parametrize(
    ("rope_scaling", "field"),
    [
        ({"type": "su", "short_factor": SHORT, "long_factor": LONG}, "original_max_position"),
        ({"type": "longrope", "short_factor": SHORT[:7], "long_factor": LONG}, "short_factor"),
        ({"type": "longrope", "short_factor": SHORT, "long_factor": "x"}, "long_factor"),
        ({"type": "longrope", "short_factor": SHORT}, "long_factor"),
        ({"type": "longrope", "short_factor": SHORT, "long_factor": LONG, "mscale": 1.0},
         "mscale"),
        ({"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
          "attention_factor": 0}, "attention_factor"),
        ({"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
          "partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini's
        ({"type": "linear", "factor": 2.0}, "'linear'"),  # Phi3Config refuses it too
    ],
)  # fmt: skip
def test_longrope_settings_it_cannot_compute_are_refused_by_name(
    rope_scaling: dict[str, Any], field: str
) -> None:
    raw = {**TINY, "model_type": "phi3", "rope_scaling": rope_scaling}
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config(raw)


def test_longrope_is_read_only() -> None:
    config = ModelConfig.from_hf_config({**TINY, "model_type": "phi3"})
    with pytest.raises(InvalidInputError, match="longrope"):
        config.to_hf_config()


def paged_logits(model: LlamaModel, tokens: torch.Tensor, cached: int, chunk: int) -> torch.Tensor:
    """The paged path's logits for `tokens` after `cached` tokens computed as a prompt of their
    own, the rest computed in chunks of `chunk` tokens of one prefill of `tokens`."""
    config = model.config
    kv = PagedKVCache(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim)
    table = list(range(14))
    if cached:
        model.prefill(kv, [PrefillRequest(tokens[:cached], table)])
    rows = []
    for end in range(cached + chunk, tokens.numel() + chunk, chunk):
        request = PrefillRequest(
            tokens, table, num_cached_tokens=end - chunk, num_tokens=min(end, tokens.numel())
        )
        (logits,) = model.prefill(kv, [request], return_all_logits=True)
        rows.append(logits)
    return torch.cat(rows)


def test_logits_equal_transformers_below_and_above_the_original_context(tmp_path: Path) -> None:
    """Full recompute and the paged path (whole, in chunks that cross the threshold, and after
    a prefix cached below it) give transformers' logits; each planted bug (short factors
    beyond the threshold, long ones below it, no attention factor) is far from them."""
    theirs = phi3_checkpoint(tmp_path)
    ours = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    scaling = ours.config.rope_scaling
    assert scaling is not None and rope_attention_factor(ours.config) > 1.1
    plants = {
        "short beyond": ours.with_config(
            rope_scaling=dataclasses.replace(scaling, long_factor=scaling.short_factor)
        ),
        "long below": ours.with_config(
            rope_scaling=dataclasses.replace(scaling, short_factor=scaling.long_factor)
        ),
        "no attention factor": ours.with_config(
            rope_scaling=dataclasses.replace(scaling, attention_factor=1.0)
        ),
    }
    for tokens in (SHORT_PROMPT, LONG_PROMPT):
        with torch.no_grad():
            expected = theirs(tokens[None]).logits[0]
        scale = expected.abs().max().item()
        assert_close_to_scale(ours.forward_full(tokens), expected)
        assert_close_to_scale(paged_logits(ours, tokens, 0, tokens.numel()), expected)
        # Chunks of 8: the long prompt's first chunks end below the threshold, and must still
        # be rotated with the long factors the one forward over the prompt uses.
        assert_close_to_scale(paged_logits(ours, tokens, 0, 8), expected)
        if tokens.numel() <= ORIGINAL:
            # A prefix computed as a prompt of its own (short factors, as is the whole).
            assert_close_to_scale(paged_logits(ours, tokens, 12, 4), expected[12:])
        for name, planted in plants.items():
            if (name, tokens.numel() > ORIGINAL) in (("short beyond", False), ("long below", True)):
                continue  # that plant changes nothing on this side of the threshold
            for logits in (planted.forward_full(tokens), paged_logits(planted, tokens, 0, 8)):
                error = (logits - expected).abs().max().item()
                assert error > 1e-2 * scale, f"{name} at {tokens.numel()}: {error}"


def test_a_prefix_cached_under_the_short_factors_is_never_reused_across_the_threshold(
    tmp_path: Path,
) -> None:
    """Requests that stay within the original context (prompt, max_new_tokens and drafts)
    share prefixes among themselves: all their KV is short-factor KV. A request that may pass
    it is served from scratch, its own blocks salted: it never reads the short prefix cached
    before it, nor publishes what a short request could read. Every output equals
    transformers' `generate`; had the long request reused the short prefix, its logits would
    differ (checked below). A request that crosses the limit while decoding drops its KV and
    is computed again under the long factors at that step, as transformers' Phi-3 generation
    drops its cache there: without it the tokens after the crossing differ (checked)."""
    theirs = phi3_checkpoint(tmp_path, tie_word_embeddings=False)
    engine = Engine.from_pretrained(
        tmp_path, dtype=torch.float32, num_blocks=64, block_size=4, max_num_batched_tokens=8,
        num_speculative_tokens=2, stop_token_ids=(),
    )  # fmt: skip
    assert not engine.prefix_reuse and engine.prefix_reuse_limit == ORIGINAL
    assert "longrope" in (engine.prefix_reuse_off_reason or "")
    short = SHORT_PROMPT.tolist()
    runs = [
        (short, 6, False),  # 24 + 6 + 2 drafts = 32: within, the first computes everything
        (short, 6, True),  # within: reads the first one's blocks
        ([*short[:20], 9, 8], 6, True),  # within, a shared 20-token prefix
        (short, 7, False),  # 24 + 7 + 2 = 33 may pass 32: never reads the short blocks
        (LONG_PROMPT.tolist(), 4, False),  # starts with the short prompt, beyond the limit
        (LONG_PROMPT.tolist(), 4, False),  # and its own blocks are not shared either
        (short, 14, False),  # crosses during decode: recomputed there, as by transformers
        ([*short, 5, 6, 7, 8, 9], 5, False),  # 29 + 5: drafts or decode cross at 33
    ]
    for tokens, new, reused in runs:
        with torch.no_grad():
            want = theirs.generate(
                torch.tensor([tokens]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )[0, len(tokens) :].tolist()
        (result,) = engine.generate([tokens], max_new_tokens=new, check_exactness=True)
        assert result.output_token_ids == want
        assert (result.cached_tokens > 0) is reused, (len(tokens), new)
        if len(tokens) + new <= ORIGINAL or len(tokens) > ORIGINAL:
            # One setting throughout: every step's logits are a full recompute's.
            assert result.max_logit_diff is not None and result.max_logit_diff < 1e-4
        # Crossing during decode, the steps before the crossing were (rightly) computed under
        # the short factors, which a recompute of the final sequence does not use: there the
        # tokens equal to transformers' `generate` above are the check.
    # Why it matters: the long prompt's logits over a short-factor prefix are not transformers'.
    with torch.no_grad():
        expected = theirs(LONG_PROMPT[None]).logits[0]
    model = engine.model
    config = model.config
    kv = PagedKVCache(config.num_layers, 16, 4, config.num_kv_heads, config.head_dim)
    table = list(range(14))
    model.prefill(kv, [PrefillRequest(SHORT_PROMPT, table)])
    (reused,) = model.prefill(
        kv,
        [PrefillRequest(LONG_PROMPT, table, num_cached_tokens=SHORT_PROMPT.numel())],
        return_all_logits=True,
    )
    error = (reused - expected[SHORT_PROMPT.numel() :]).abs().max().item()
    assert error > 1e-2 * expected.abs().max().item()


def test_requests_crossing_the_limit_under_preemption_equal_transformers(tmp_path: Path) -> None:
    """Two requests that pass the original context while decoding, in a pool too small for
    both: the one preempted right after crossing is computed again under the long factors, and
    both equal transformers' `generate`. (Here the pool is so tight that its short-factor
    blocks are evicted anyway, so this does not catch a `_preempt` that resumed from them.)"""
    theirs = phi3_checkpoint(tmp_path, tie_word_embeddings=False)
    engine = Engine.from_pretrained(
        tmp_path, dtype=torch.float32, num_blocks=14, block_size=4, max_num_batched_tokens=16,
        stop_token_ids=(),
    )  # fmt: skip
    # The newer request crosses first and is preempted by the older one right after, before
    # its own step could recompute it (14 blocks: found by trying).
    prompts = [SHORT_PROMPT[:20].tolist(), [*SHORT_PROMPT.tolist(), 1, 2, 3, 4, 5, 6]]
    results = engine.generate(prompts, max_new_tokens=14)
    for tokens, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            want = theirs.generate(
                torch.tensor([tokens]), max_new_tokens=14, min_new_tokens=14, do_sample=False
            )[0, len(tokens) :].tolist()
        assert result.output_token_ids == want
    assert sum(result.preemptions for result in results) > 0
