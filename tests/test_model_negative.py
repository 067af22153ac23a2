"""Why a cache key must cover the context, not only the tokens: reused KV from another context
gives wrong logits.

Each case computes the KV of a prompt's first m tokens under one setting (the "producer"),
then continues the prompt from those pages under another setting (the "consumer"), and
compares the result with a full recompute under the consumer's setting. The tokens are the same
in both; only the context differs: RoPE theta, RoPE scaling, the LoRA adapter, the absolute
position offset, or (dynamic NTK) the total length the prefix was computed at. The error must
be far above the tolerance of the positive property tests (`FLOAT32_RTOL` there, 3e-5), and
each case has a control (producer = consumer) that must stay within it, so the difference is
the context's doing.

The measured figures (relative to the largest |logit|) are in the assertion messages and, with
``pytest -rA``, in each test's recorded properties.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest, RopeScaling

# The positive property tests' float32 tolerance (relative to the largest |logit|).
POSITIVE_RTOL = 3e-5
# Reuse across contexts must be off by at least this much (relative to the logits' scale):
# over two orders of magnitude above the positive tolerance, so the two cannot be confused.
NEGATIVE_MIN_RELATIVE_ERROR = 1e-2

BLOCK_SIZE = 4
BASE = ModelConfig(num_layers=2, lora_rank=4, lora_alpha=8.0)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE.vocab_size, (length,), generator=generator).tolist()


def reuse_error(
    producer: LlamaModel, consumer: LlamaModel, tokens: list[int], num_cached: int
) -> float:
    """Relative max error of the consumer continuing from the producer's prefix KV."""
    config = consumer.config
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    cache = PagedKVCache(
        config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim
    )
    table = list(range(num_blocks))
    producer.prefill(cache, [PrefillRequest(tokens[:num_cached], table)])
    cached = consumer.prefill(
        cache, [PrefillRequest(tokens, table, num_cached)], return_all_logits=True
    )[0]
    expected = consumer.forward_full(tokens)[num_cached:]
    return (cached - expected).abs().max().item() / expected.abs().max().item()


def with_adapter(model: LlamaModel, name: str | None) -> LlamaModel:
    copy = model.with_config()
    copy.set_adapter(name)
    return copy


def base_model(seed: int) -> LlamaModel:
    model = LlamaModel.random(BASE, seed=seed)
    model.load_adapter("a", LlamaModel.random_adapter(BASE, seed=10 + seed))
    model.load_adapter("b", LlamaModel.random_adapter(BASE, seed=20 + seed))
    return model


# name -> (producer, consumer) built from the base model.
CONTEXT_CHANGES: dict[str, Callable[[LlamaModel], tuple[LlamaModel, LlamaModel]]] = {
    "rope_theta 1e4 -> 5e5": lambda m: (m, m.with_config(rope_theta=500000.0)),
    "rope_scaling none -> linear x2": lambda m: (
        m,
        m.with_config(rope_scaling=RopeScaling("linear", 2.0)),
    ),
    "rope_scaling ntk x2 -> ntk x4": lambda m: (
        m.with_config(rope_scaling=RopeScaling("ntk", 2.0)),
        m.with_config(rope_scaling=RopeScaling("ntk", 4.0)),
    ),
    "adapter none -> a": lambda m: (m, with_adapter(m, "a")),
    "adapter a -> b": lambda m: (with_adapter(m, "a"), with_adapter(m, "b")),
    "position_offset 0 -> 7": lambda m: (m, m.with_config(position_offset=7)),
    "position_offset 100 -> 101": lambda m: (
        m.with_config(position_offset=100),
        m.with_config(position_offset=101),
    ),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("change", sorted(CONTEXT_CHANGES))
def test_kv_from_another_context_gives_wrong_logits(
    change: str, seed: int, record_property: Callable[[str, object], None]
) -> None:
    producer, consumer = CONTEXT_CHANGES[change](base_model(seed))
    tokens = prompt(32, seed)
    for num_cached in (8, 16, 30):
        control = reuse_error(consumer, consumer, tokens, num_cached)
        assert control <= POSITIVE_RTOL, f"control failed: {control:.3g}"
        error = reuse_error(producer, consumer, tokens, num_cached)
        record_property(f"relative_error_m{num_cached}", error)
        assert error >= NEGATIVE_MIN_RELATIVE_ERROR, (
            f"{change}: reusing KV across the change gave only {error:.3g} relative error at "
            f"m={num_cached} (control {control:.3g}); the negative property does not hold"
        )


@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_ntk_kv_computed_at_a_shorter_length_is_not_reusable(
    seed: int, record_property: Callable[[str, object], None]
) -> None:
    # Trained length 16: a 24-token prefix gets a RoPE base computed from length 24, the
    # 48-token recompute one from length 48. Same model, same tokens, same positions: only the
    # total length differs, and that alone makes the cached prefix wrong.
    model = LlamaModel.random(
        BASE.replace(rope_scaling=RopeScaling("dynamic_ntk", 4.0), max_position_embeddings=16),
        seed=seed,
    )
    assert model.config.position_encoding_is_length_dependent
    tokens = prompt(48, seed)
    error = reuse_error(model, model, tokens, 24)
    record_property("relative_error", error)
    assert error >= NEGATIVE_MIN_RELATIVE_ERROR, f"dynamic NTK reuse error only {error:.3g}"

    # Within the trained length the base does not move, and reuse is exact again: a cache may
    # allow it there.
    short = prompt(16, seed)
    assert reuse_error(model, model, short, 9) <= POSITIVE_RTOL


def test_static_settings_are_not_length_dependent() -> None:
    for scaling in (None, RopeScaling("linear", 4.0), RopeScaling("ntk", 4.0)):
        config = BASE.replace(rope_scaling=scaling, max_position_embeddings=16)
        assert not config.position_encoding_is_length_dependent
        model = LlamaModel.random(config, seed=0)
        assert reuse_error(model, model, prompt(48, 0), 24) <= POSITIVE_RTOL
