"""The reference model: config, weights and checkpoints, adapters, and its API's edge cases.

Numerical agreement of the paged path with full recompute is in `test_model_paged.py`, RoPE in
`test_model_rope.py`, the negative (context must match) properties in `test_model_negative.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.kv.pages import KVDeviceError, KVDtypeError, KVIndexError, KVShapeError, PagedKVCache
from prefixkv.models.decoder import (
    DecodeRequest,
    LlamaModel,
    ModelConfig,
    PrefillRequest,
    RopeScaling,
)

TOKENS = [(13 * i + 7) % 256 for i in range(30)]


def cache_for(model: LlamaModel, num_blocks: int = 16, block_size: int = 4) -> PagedKVCache:
    config = model.config
    return PagedKVCache(
        config.num_layers,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype=model.dtype,
    )


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Equal up to float32 reordering: ``rtol`` relative to the largest |expected| entry."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * scale)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(ModelConfig(), seed=0)


# -- config -----------------------------------------------------------------------------------


def test_default_config_is_small_and_grouped() -> None:
    config = ModelConfig()
    assert config.num_layers <= 4 and config.hidden_size <= 128
    assert config.vocab_size >= 256  # a byte tokenizer fits
    assert config.num_kv_heads < config.num_heads  # grouped-query attention is exercised
    assert config.num_query_groups == config.num_heads // config.num_kv_heads
    assert not config.position_encoding_is_length_dependent


@pytest.mark.parametrize(
    "changes",
    [
        {"num_heads": 3, "num_kv_heads": 2},
        {"head_dim": 15},
        {"hidden_size": 0},
        {"num_layers": True},
        {"lora_rank": 4},
        {"lora_rank": 0, "lora_alpha": 1.0},
        {"sliding_window": 0},
        {"position_offset": -1},
        {"rope_theta": 1.0},
        {"dtype": torch.int32},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
)
def test_invalid_configs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError):
        ModelConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "factor"), [("longrope", 2.0), ("linear", 0.5), ("linear", float("nan"))]
)
def test_invalid_rope_scalings_are_refused(kind: str, factor: float) -> None:
    with pytest.raises(InvalidInputError):
        RopeScaling(kind, factor)  # type: ignore[arg-type]


TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.35.0",
    "use_cache": True,
    "vocab_size": 32000,
}


def test_from_hf_config_reads_a_llama_config() -> None:
    config = ModelConfig.from_hf_config(TINY_LLAMA_CONFIG)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (22, 32, 4)
    assert config.head_dim == 2048 // 32
    assert config.dtype == torch.bfloat16
    assert config.rope_scaling is None and config.sliding_window is None
    assert ModelConfig.from_hf_config(TINY_LLAMA_CONFIG, dtype=torch.float32).dtype == (
        torch.float32
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"type": "linear", "factor": 4.0}, RopeScaling("linear", 4.0)),
        ({"rope_type": "dynamic", "factor": 2.0}, RopeScaling("dynamic_ntk", 2.0)),
        ({"rope_type": "ntk", "factor": 8}, RopeScaling("ntk", 8.0)),
        ({"rope_type": "default"}, None),
    ],
)
def test_from_hf_config_reads_rope_scaling(
    raw: dict[str, object], expected: RopeScaling | None
) -> None:
    config = ModelConfig.from_hf_config({**TINY_LLAMA_CONFIG, "rope_scaling": raw})
    assert config.rope_scaling == expected


def test_from_hf_config_reads_transformers_5_rope_parameters() -> None:
    # transformers 5 moved rope_theta into rope_parameters; missing it would mean theta 10000.
    raw = {k: v for k, v in TINY_LLAMA_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config = ModelConfig.from_hf_config(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling is None
    raw["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    config = ModelConfig.from_hf_config(raw)
    assert config.rope_theta == 1e6
    assert config.rope_scaling == RopeScaling("dynamic_ntk", 2.0)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
        {"rope_scaling": "linear"},
        {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"rope_scaling": {"rope_type": "linear"}},
        # A parameter the decoder does not implement, inside an implemented scaling.
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "short_factor": [1.0]}},
        {"hidden_act": "gelu"},
        {"model_type": "gemma"},
        # Llama and Mistral apply one kind to every layer in transformers: a mixed list is
        # refused. Qwen2 reads one only with use_sliding_window; a kind not implemented, or a
        # list of the wrong length, is refused.
        {"layer_types": ["full_attention", "sliding_attention"] * 11},
        {"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"] * 11},
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "layer_types": ["chunked_attention", "sliding_attention"] * 11,
        },
        {
            "model_type": "qwen2",
            "use_sliding_window": True,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        {"pretraining_tp": 2},
        # Fields the decoder does not know: refused by name, never ignored.
        {"quantization_config": {"quant_method": "gptq"}},
        {"logit_softcapping": 30.0},
        {"torch_dtype": "int8"},
        {"vocab_size": None},
    ],
)
def test_from_hf_config_refuses_what_the_model_does_not_implement(
    changes: dict[str, object],
) -> None:
    raw = {**TINY_LLAMA_CONFIG, **changes}  # a null vocab_size is refused, as transformers does
    with pytest.raises(InvalidInputError):
        ModelConfig.from_hf_config(raw)


def test_from_hf_config_reads_mistral_sliding_window(tmp_path: Path) -> None:
    raw = {**TINY_LLAMA_CONFIG, "model_type": "mistral", "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_hf_config(tmp_path).sliding_window == 4096  # a directory
    assert ModelConfig.from_hf_config(tmp_path / "config.json").sliding_window == 4096
    with pytest.raises(InvalidInputError):
        ModelConfig.from_hf_config(tmp_path / "missing.json")


def test_from_hf_config_reads_qwen2_hybrid_layers() -> None:
    qwen2 = {**TINY_LLAMA_CONFIG, "model_type": "qwen2", "sliding_window": 64}
    # Off, the window is ignored, as transformers ignores it.
    assert ModelConfig.from_hf_config(qwen2).layer_sliding_windows == (None,) * 22
    # On: layers from max_window_layers on slide (transformers' rule) ...
    config = ModelConfig.from_hf_config(
        {**qwen2, "use_sliding_window": True, "max_window_layers": 20}
    )
    assert config.layer_sliding_windows == (None,) * 20 + (64, 64)
    # ... or an explicit list (gpt-oss / Gemma-style alternation) says which.
    alternating = ["sliding_attention", "full_attention"] * 11
    config = ModelConfig.from_hf_config(
        {**qwen2, "use_sliding_window": True, "layer_types": alternating}
    )
    assert config.layer_sliding_windows == (64, None) * 11
    assert config.to_hf_config()["layer_types"] == alternating
    # One kind everywhere collapses to the plain fields.
    config = ModelConfig.from_hf_config(
        {**qwen2, "use_sliding_window": True, "max_window_layers": 0}
    )
    assert config.layer_types is None and config.sliding_window == 64


def test_a_pattern_of_one_kind_is_written_as_the_plain_fields() -> None:
    all_full = ModelConfig(sliding_window=8, layer_types=("full_attention",) * 2)
    assert all_full.to_hf_config()["sliding_window"] is None
    assert ModelConfig.from_hf_config(all_full.to_hf_config()).layer_sliding_windows == (None,) * 2
    all_sliding = ModelConfig(sliding_window=8, layer_types=("sliding_attention",) * 2)
    assert ModelConfig.from_hf_config(all_sliding.to_hf_config()) == all_sliding.replace(
        layer_types=None
    )
    with pytest.raises(InvalidInputError, match="Qwen2"):
        ModelConfig(
            sliding_window=8, layer_types=("full_attention", "sliding_attention")
        ).to_hf_config()


@pytest.mark.parametrize(
    "changes",
    [
        {"layer_types": ("full_attention",)},
        {"layer_types": ("full_attention", "sliding_attention")},  # no window
        {"layer_types": ("full_attention", "local"), "sliding_window": 4},
        {"layer_types": "full_attention", "sliding_window": 4},
    ],
)
def test_model_config_refuses_bad_layer_types(changes: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError):
        ModelConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(),
        ModelConfig(
            rope_scaling=RopeScaling("dynamic_ntk", 2.0),
            max_position_embeddings=64,
            position_offset=3,
            sliding_window=8,
            lora_rank=2,
            lora_alpha=4.0,
            tie_word_embeddings=True,
            dtype=torch.bfloat16,
        ),
        ModelConfig(rope_scaling=RopeScaling("linear", 4.0), dtype=torch.float16),
        # Hybrid and all-sliding layers are written as Qwen2 (the one that reads a pattern).
        ModelConfig(
            num_layers=3,
            attention_qkv_bias=True,
            sliding_window=6,
            layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        ),
        ModelConfig(attention_qkv_bias=True, sliding_window=6),
    ],
)
def test_hf_config_round_trips(config: ModelConfig) -> None:
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


# -- weights and checkpoints -------------------------------------------------------------------


def test_random_weights_are_seeded() -> None:
    first = LlamaModel.random(ModelConfig(), seed=5).forward_full(TOKENS)
    again = LlamaModel.random(ModelConfig(), seed=5).forward_full(TOKENS)
    other = LlamaModel.random(ModelConfig(), seed=6).forward_full(TOKENS)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


def attention_rows(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Layer-0 attention probabilities ``[heads, n, n]``, rebuilt from the weights."""
    from prefixkv.models.decoder import (
        DecoderLayer,
        _apply_rotate_half_rope,
        rope_inverse_frequencies,
    )

    config = model.config
    n = len(tokens)
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    normed = layer.input_layernorm(model.model.embed_tokens(torch.tensor(tokens)))
    angles = torch.outer(torch.arange(n, dtype=torch.float64), rope_inverse_frequencies(config, n))
    cos, sin = angles.cos().float(), angles.sin().float()
    query = layer.self_attn.q_proj(normed).view(n, config.num_heads, -1)
    key = layer.self_attn.k_proj(normed).view(n, config.num_kv_heads, -1)
    query = _apply_rotate_half_rope(query, cos, sin).transpose(0, 1)
    key = _apply_rotate_half_rope(key, cos, sin).transpose(0, 1)
    key = key.repeat_interleave(config.num_query_groups, dim=0)
    scores = query @ key.transpose(1, 2) * config.head_dim**-0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def test_random_attention_is_sharp(model: LlamaModel) -> None:
    # The property the numerical tests rely on: most attention rows put most of their mass on
    # one key. With uniform-ish attention a mask or position bug would hardly move the logits.
    tokens = list(range(100, 164))
    rows = attention_rows(model, tokens)[:, 16:]  # rows with at least 17 keys to choose from
    top_weight = rows.max(dim=-1).values
    assert top_weight.median().item() > 0.5
    # For contrast, PyTorch's default init gives nearly uniform rows.
    flat = LlamaModel.random(ModelConfig(), seed=0, attention_sharpness=0.05)
    assert attention_rows(flat, tokens)[:, 16:].max(dim=-1).values.median().item() < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_save_and_reload_gives_identical_logits(
    tmp_path: Path, dtype: torch.dtype, tied: bool
) -> None:
    config = ModelConfig(
        dtype=dtype,
        tie_word_embeddings=tied,
        rope_scaling=RopeScaling("linear", 2.0),
        position_offset=2,
    )
    original = LlamaModel.random(config, seed=1)
    original.save_pretrained(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names
    assert ("lm_head.weight" in names) is not tied
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["num_hidden_layers"] == config.num_layers
    assert hf["torch_dtype"] == str(dtype).removeprefix("torch.")

    reloaded = LlamaModel.from_pretrained(tmp_path)
    assert reloaded.config == config
    assert torch.equal(reloaded.forward_full(TOKENS), original.forward_full(TOKENS))
    if tied:
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_from_pretrained_reads_sharded_checkpoints_and_converts_dtype(tmp_path: Path) -> None:
    original = LlamaModel.random(ModelConfig(), seed=2)
    original.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    rest = {k: state[k] for k in names[1::2]}
    rest["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older HF checkpoints
    save_file(rest, str(tmp_path / "model-00002-of-00002.safetensors"))
    reloaded = LlamaModel.from_pretrained(tmp_path)
    assert torch.equal(reloaded.forward_full(TOKENS), original.forward_full(TOKENS))
    half = LlamaModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.config.dtype == torch.bfloat16


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape", "no_files"])
def test_from_pretrained_refuses_mismatched_checkpoints(tmp_path: Path, damage: str) -> None:
    LlamaModel.random(ModelConfig(), seed=0).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    if damage == "missing":
        del state["model.layers.1.mlp.up_proj.weight"]
    elif damage == "unexpected":
        state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    elif damage == "shape":
        state["model.norm.weight"] = torch.ones(65)
    path.unlink()
    if damage != "no_files":
        save_file(state, str(path))
    with pytest.raises(InvalidInputError):
        LlamaModel.from_pretrained(tmp_path)


def test_with_config_keeps_weights_and_refuses_shape_changes(model: LlamaModel) -> None:
    same = model.with_config(sliding_window=1000)
    assert torch.equal(same.forward_full(TOKENS), model.forward_full(TOKENS))
    with pytest.raises(InvalidInputError):
        model.with_config(num_layers=3)


# -- adapters ---------------------------------------------------------------------------------


LORA = ModelConfig(lora_rank=4, lora_alpha=8.0)


def test_adapter_equals_merging_its_update_into_the_weights() -> None:
    model = LlamaModel.random(LORA, seed=0)
    weights = LlamaModel.random_adapter(LORA, seed=1)
    base_logits = model.forward_full(TOKENS)
    model.load_adapter("a", weights)
    assert model.active_adapter is None and model.adapter_names == ["a"]
    assert torch.equal(model.forward_full(TOKENS), base_logits)  # loaded is not active
    model.set_adapter("a")
    adapted = model.forward_full(TOKENS)
    assert (adapted - base_logits).abs().max() > 0.1

    merged = model.with_config()
    merged.set_adapter(None)
    scaling = LORA.lora_alpha / LORA.lora_rank  # type: ignore[operator]
    with torch.no_grad():
        for layer in range(LORA.num_layers):
            attention = merged.model.layers[layer].self_attn
            for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
                prefix = f"model.layers.{layer}.self_attn.{projection}"
                update = weights[f"{prefix}.lora_B.weight"] @ weights[f"{prefix}.lora_A.weight"]
                getattr(attention, projection).weight.add_(scaling * update)
    assert_close_to_scale(merged.forward_full(TOKENS), adapted)

    model.set_adapter(None)
    assert torch.equal(model.forward_full(TOKENS), base_logits)


def test_adapter_accepts_peft_names_and_partial_targets() -> None:
    model = LlamaModel.random(LORA, seed=0)
    weights = LlamaModel.random_adapter(LORA, seed=1)
    peft = {
        f"base_model.model.{name}": tensor
        for name, tensor in weights.items()
        if ".q_proj." in name or ".v_proj." in name
    }
    model.load_adapter("qv", peft)
    base_logits = model.forward_full(TOKENS)
    model.set_adapter("qv")
    assert (model.forward_full(TOKENS) - base_logits).abs().max() > 0.1


@pytest.mark.parametrize("damage", ["bad_key", "bad_layer", "shape", "half_pair", "int_dtype"])
def test_bad_adapters_are_refused(damage: str) -> None:
    model = LlamaModel.random(LORA, seed=0)
    weights = dict(LlamaModel.random_adapter(LORA, seed=1))
    key = "model.layers.0.self_attn.k_proj.lora_A.weight"
    if damage == "bad_key":
        weights["model.layers.0.mlp.up_proj.lora_A.weight"] = weights[key]
    elif damage == "bad_layer":
        weights["model.layers.9.self_attn.k_proj.lora_A.weight"] = weights.pop(key)
    elif damage == "shape":
        weights[key] = torch.zeros(5, 64)
    elif damage == "half_pair":
        del weights[key]
    elif damage == "int_dtype":
        weights[key] = weights[key].to(torch.int64)
    with pytest.raises(InvalidInputError):
        model.load_adapter("bad", weights)
    assert model.adapter_names == []


def test_adapters_need_a_lora_config(model: LlamaModel) -> None:
    with pytest.raises(InvalidInputError):
        model.load_adapter("a", LlamaModel.random_adapter(LORA))
    with pytest.raises(InvalidInputError):
        LlamaModel.random_adapter(ModelConfig())
    with pytest.raises(InvalidInputError):
        model.set_adapter("never-loaded")


# -- forward_full -----------------------------------------------------------------------------


def test_full_recompute_is_causal(model: LlamaModel) -> None:
    full = model.forward_full(TOKENS)
    assert full.shape == (len(TOKENS), model.config.vocab_size)
    assert full.dtype == torch.float32
    for length in (1, 7, 20):
        assert_close_to_scale(model.forward_full(TOKENS[:length]), full[:length])
    changed = [*TOKENS[:20], (TOKENS[20] + 1) % 256, *TOKENS[21:]]
    assert_close_to_scale(model.forward_full(changed)[:20], full[:20])


def test_token_ids_may_be_lists_arrays_or_tensors(model: LlamaModel) -> None:
    expected = model.forward_full(TOKENS)
    for tokens in (
        np.array(TOKENS, dtype=np.int32),
        np.array(TOKENS, dtype=np.uint8),
        torch.tensor(TOKENS),
        torch.tensor(TOKENS, dtype=torch.int32),
    ):
        assert torch.equal(model.forward_full(tokens), expected)


@pytest.mark.parametrize(
    "tokens",
    [[], [256], [-1], [1.5], "abc", np.array([1.0]), torch.tensor([[1, 2]]), [True]],
)
def test_bad_token_ids_are_refused(model: LlamaModel, tokens: object) -> None:
    with pytest.raises(InvalidInputError):
        model.forward_full(tokens)  # type: ignore[arg-type]


# -- paged path: behaviour ----------------------------------------------------------------------


def test_batched_prefill_equals_one_request_at_a_time(model: LlamaModel) -> None:
    requests = [
        PrefillRequest(TOKENS, [0, 1, 2, 3, 4, 5, 6, 7], num_cached_tokens=0),
        PrefillRequest(TOKENS[:9], [8, 9, 10], num_cached_tokens=0),
        PrefillRequest(TOKENS[5:], [11, 12, 13, 14, 15, 16, 17], num_cached_tokens=0),
    ]
    together = model.prefill(cache_for(model, 18), requests, return_all_logits=True)
    for request, logits in zip(requests, together, strict=True):
        alone = model.prefill(cache_for(model, 18), [request], return_all_logits=True)[0]
        assert_close_to_scale(logits, alone)
    last = model.prefill(cache_for(model, 18), requests)
    assert last.shape == (3, model.config.vocab_size)
    assert_close_to_scale(last[1], together[1][-1])


def test_full_hit_writes_nothing(model: LlamaModel) -> None:
    cache = cache_for(model)
    table = [3, 1, 4, 5, 9, 2, 6, 8]
    model.prefill(cache, [PrefillRequest(TOKENS, table)])
    before = cache.storage.clone()
    logits = model.prefill(cache, [PrefillRequest(TOKENS, table, len(TOKENS) - 1, write_kv=False)])
    assert torch.equal(cache.storage, before)
    assert_close_to_scale(logits[0], model.forward_full(TOKENS)[-1])


def test_decode_steps_extend_the_pages(model: LlamaModel) -> None:
    cache = cache_for(model)
    table = list(range(8))
    model.prefill(cache, [PrefillRequest(TOKENS[:20], table)])
    for length in range(21, 26):
        logits = model.decode_step(cache, [DecodeRequest(TOKENS[:length], table)])
        assert_close_to_scale(logits[0], model.forward_full(TOKENS[:length])[-1])
    keys, _ = cache.gather(1, table, 25)
    _, full_keys, _ = model.forward_full_with_kv(TOKENS[:25])
    assert_close_to_scale(keys, full_keys[1])


def test_reference_and_torch_attention_backends_agree(model: LlamaModel) -> None:
    table = list(range(8))
    results = []
    for backend in ("torch", "reference"):
        cache = cache_for(model)
        model.prefill(cache, [PrefillRequest(TOKENS[:11], table)], attention_backend=backend)
        results.append(
            model.prefill(cache, [PrefillRequest(TOKENS, table, 11)], attention_backend=backend)
        )
    assert_close_to_scale(results[0], results[1])


def test_generate_greedy_with_zero_tokens_is_empty(model: LlamaModel) -> None:
    assert model.generate_greedy(cache_for(model), TOKENS, list(range(8)), 0) == []
    assert model.generate_greedy_full(TOKENS, 0) == []


# -- paged path: bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_args", "error"),
    [
        ({"num_cached_tokens": 31}, InvalidInputError),  # m > n
        ({"num_cached_tokens": 30}, InvalidInputError),  # m == n: nothing to compute
        ({"num_cached_tokens": 10, "num_tokens": 10}, InvalidInputError),
        ({"num_tokens": 31}, InvalidInputError),  # beyond the tokens given
        ({"num_tokens": 0}, InvalidInputError),
        ({"num_cached_tokens": -1}, InvalidInputError),
        ({"num_cached_tokens": 2.0}, InvalidInputError),
        ({"block_table": [0, 1, 2]}, KVShapeError),  # too short for 30 tokens
        ({"block_table": [0, 1, 2, 3, 4, 5, 6, 16]}, KVIndexError),  # out of range
        ({"block_table": [0, 1, 2, 3, 4, 5, 6, -1]}, KVIndexError),
        ({"block_table": [0.0] * 8}, InvalidInputError),
        ({"block_table": [[0] * 8]}, InvalidInputError),
        ({"token_ids": [*TOKENS[:-1], 300]}, InvalidInputError),
    ],
)
def test_bad_requests_are_refused_before_anything_is_written(
    model: LlamaModel, request_args: dict[str, object], error: type[PrefixKVError]
) -> None:
    cache = cache_for(model)
    fields: dict[str, object] = {"token_ids": TOKENS, "block_table": list(range(8))}
    fields.update(request_args)
    good = PrefillRequest(TOKENS[:8], [8, 9])
    with pytest.raises(error):
        model.prefill(cache, [good, PrefillRequest(**fields)])  # type: ignore[arg-type]
    assert not cache.storage.any(), "a rejected batch wrote pages"


def test_two_requests_writing_one_block_are_refused(model: LlamaModel) -> None:
    cache = cache_for(model)
    with pytest.raises(KVIndexError):
        model.prefill(cache, [PrefillRequest(TOKENS[:4], [2]), PrefillRequest(TOKENS[4:8], [2])])
    # Reading a shared block is fine: that is what a cache hit is.
    model.prefill(cache, [PrefillRequest(TOKENS[:5], [2, 3])])
    model.prefill(
        cache,
        [
            PrefillRequest(TOKENS[:5], [2, 3], 4, write_kv=False),
            PrefillRequest(TOKENS[:6], [2, 4], 4),
        ],
    )


@pytest.mark.parametrize(
    ("cache_args", "error"),
    [
        ({"num_layers": 3}, KVShapeError),
        ({"num_kv_heads": 4}, KVShapeError),
        ({"head_dim": 32}, KVShapeError),
        ({"dtype": torch.float16}, KVDtypeError),
        ({"device": "meta"}, KVDeviceError),
    ],
)
def test_mismatched_caches_are_refused(
    model: LlamaModel, cache_args: dict[str, object], error: type[PrefixKVError]
) -> None:
    config = model.config
    args: dict[str, object] = {
        "num_layers": config.num_layers,
        "num_blocks": 8,
        "block_size": 4,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }
    args.update(cache_args)
    options = {k: args.pop(k) for k in ("dtype", "device") if k in args}
    cache = PagedKVCache(*args.values(), **options)  # type: ignore[arg-type]
    with pytest.raises(error):
        model.prefill(cache, [PrefillRequest(TOKENS[:4], [0])])


@pytest.mark.parametrize("batch", [[], PrefillRequest(TOKENS, [0]), [DecodeRequest(TOKENS, [0])]])
def test_bad_batches_are_refused(model: LlamaModel, batch: object) -> None:
    with pytest.raises(InvalidInputError):
        model.prefill(cache_for(model), batch)  # type: ignore[call-overload]


def test_bad_decode_batches_are_refused(model: LlamaModel) -> None:
    cache = cache_for(model)
    with pytest.raises(InvalidInputError):
        model.decode_step(cache, [DecodeRequest([], [0])])
    with pytest.raises(InvalidInputError):
        model.decode_step(cache, [PrefillRequest(TOKENS, [0])])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        model.prefill(object(), [PrefillRequest(TOKENS, [0])])  # type: ignore[call-overload]


def test_errors_are_value_errors_too(model: LlamaModel) -> None:
    # One `except ValueError` (or `except PrefixKVError`) covers every bad argument.
    with pytest.raises(ValueError):
        model.prefill(cache_for(model), [PrefillRequest(TOKENS, [0])])
