"""RoPE of the reference model, checked against the published formulas and RoPE's own invariants.

`rope_inverse_frequencies` is the one piece both forward paths share, so a bug in it (say, a
dropped scaling factor) would not show up as a cached-vs-full difference; these tests pin it
down on their own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import (
    LlamaModel,
    ModelConfig,
    PrefillRequest,
    RopeScaling,
    _apply_rotate_half_rope,
    rope_inverse_frequencies,
)


def plain_frequencies(theta: float, head_dim: int) -> np.ndarray:
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


@pytest.mark.parametrize("head_dim", [16, 32, 128])
def test_unscaled_frequencies_are_theta_powers(head_dim: int) -> None:
    config = ModelConfig(head_dim=head_dim, rope_theta=500000.0)
    got = rope_inverse_frequencies(config, 10).numpy()
    np.testing.assert_allclose(got, plain_frequencies(500000.0, head_dim), rtol=1e-12)
    assert got[0] == 1.0  # the fastest pair turns one radian per position


def test_linear_scaling_divides_every_frequency() -> None:
    config = ModelConfig(rope_scaling=RopeScaling("linear", 4.0))
    got = rope_inverse_frequencies(config, 10).numpy()
    np.testing.assert_allclose(got, plain_frequencies(10000.0, 16) / 4.0, rtol=1e-12)


@pytest.mark.parametrize("factor", [2.0, 8.0])
def test_static_ntk_keeps_the_fastest_pair_and_interpolates_the_slowest(factor: float) -> None:
    # NTK-aware scaling is defined by these two ends: the highest frequency (local order) is
    # untouched and the lowest is slowed by exactly `factor`, like position interpolation.
    head_dim = 32
    config = ModelConfig(head_dim=head_dim, rope_scaling=RopeScaling("ntk", factor))
    got = rope_inverse_frequencies(config, 10).numpy()
    plain = plain_frequencies(10000.0, head_dim)
    assert got[0] == pytest.approx(1.0)
    assert got[-1] == pytest.approx(plain[-1] / factor, rel=1e-12)
    assert np.all(np.diff(got / plain) < 0)  # slower pairs are stretched more


def test_dynamic_ntk_depends_on_length_only_beyond_the_trained_context() -> None:
    head_dim, trained, factor = 16, 32, 4.0
    config = ModelConfig(
        head_dim=head_dim,
        max_position_embeddings=trained,
        rope_scaling=RopeScaling("dynamic_ntk", factor),
    )
    plain = plain_frequencies(10000.0, head_dim)
    for length in (1, 17, trained):
        np.testing.assert_allclose(rope_inverse_frequencies(config, length).numpy(), plain)
    for length in (trained + 1, 2 * trained, 10 * trained):
        got = rope_inverse_frequencies(config, length).numpy()
        # HF's dynamic NTK: the slowest pair is slowed by factor * L / trained - (factor - 1).
        stretch = factor * length / trained - (factor - 1)
        assert got[0] == pytest.approx(1.0)
        assert got[-1] == pytest.approx(plain[-1] / stretch, rel=1e-12)
    assert config.position_encoding_is_length_dependent
    for scaling in (None, RopeScaling("linear", 2.0), RopeScaling("ntk", 2.0)):
        assert not ModelConfig(rope_scaling=scaling).position_encoding_is_length_dependent


def test_rotate_half_matches_complex_rotation_of_paired_halves() -> None:
    # HF's convention pairs dimension i with i + d/2 (not 2i with 2i+1): as a complex number
    # x_i + j x_{i+d/2}, RoPE multiplies it by exp(j * angle_i).
    generator = torch.Generator().manual_seed(0)
    tokens, heads, head_dim = 7, 3, 16
    x = torch.randn((tokens, heads, head_dim), generator=generator, dtype=torch.float64)
    angles = torch.rand((tokens, head_dim // 2), generator=generator, dtype=torch.float64) * 50
    got = _apply_rotate_half_rope(x, torch.cos(angles), torch.sin(angles))
    half = head_dim // 2
    as_complex = (
        torch.complex(x[..., :half], x[..., half:])
        * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    )
    expected = torch.cat((as_complex.real, as_complex.imag), dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@given(offset=st.integers(1, 5000), length=st.integers(2, 24))
def test_logits_are_invariant_to_the_absolute_position_offset(offset: int, length: int) -> None:
    # RoPE scores depend on position differences only, so shifting every position by the same
    # offset leaves the full-recompute logits unchanged, while the keys themselves (what a cache
    # stores) do change. Float64, so rounding of large angles cannot hide a real difference.
    config = ModelConfig(dtype=torch.float64, rope_scaling=RopeScaling("linear", 2.0))
    base = LlamaModel.random(config, seed=3)
    shifted = base.with_config(position_offset=offset)
    tokens = [(7 * i + 3) % config.vocab_size for i in range(length)]
    logits, keys, _ = base.forward_full_with_kv(tokens)
    shifted_logits, shifted_keys, _ = shifted.forward_full_with_kv(tokens)
    torch.testing.assert_close(shifted_logits, logits, rtol=0, atol=1e-9)
    assert not torch.allclose(shifted_keys[0], keys[0])

    # The paged path honours the same invariance.
    cache = PagedKVCache(
        config.num_layers, 8, 4, config.num_kv_heads, config.head_dim, dtype=torch.float64
    )
    paged = shifted.prefill(cache, [PrefillRequest(tokens, list(range(8)))])
    torch.testing.assert_close(paged[0], logits[-1], rtol=0, atol=1e-9)


def test_rope_scaling_changes_the_logits() -> None:
    # Guards against a scaling setting being silently ignored by both paths at once.
    tokens = list(range(40, 80))
    plain = LlamaModel.random(ModelConfig(), seed=1)
    reference = plain.forward_full(tokens)
    scale = reference.abs().max().item()
    for scaling in (RopeScaling("linear", 4.0), RopeScaling("ntk", 4.0)):
        scaled = plain.with_config(rope_scaling=scaling).forward_full(tokens)
        assert (scaled - reference).abs().max().item() > 0.05 * scale, scaling
    dynamic = plain.with_config(
        rope_scaling=RopeScaling("dynamic_ntk", 4.0), max_position_embeddings=16
    )
    assert (dynamic.forward_full(tokens) - reference).abs().max().item() > 0.05 * scale
    within = plain.with_config(rope_scaling=RopeScaling("dynamic_ntk", 4.0))
    torch.testing.assert_close(within.forward_full(tokens), reference, rtol=0, atol=0)


def test_large_positions_keep_their_angle_precision() -> None:
    # Angles are formed in float64: in float32, position 10^6 times frequency 1 keeps only ~1/16
    # radian of resolution, which would make KV at large offsets differ between paths.
    config = ModelConfig(position_offset=1_000_000)
    position = config.position_offset + 5
    angle = position * rope_inverse_frequencies(config, position + 1)[0].item()
    assert angle == float(position)
    assert math.isclose(math.cos(angle), math.cos(1_000_005), rel_tol=0, abs_tol=1e-12)
