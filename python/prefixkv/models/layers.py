"""The layers of the reference decoder (`prefixkv.models.decoder.LlamaModel`) and their seeded random
init: HF Llama's modules with HF's attribute names, so a ``state_dict`` key is the checkpoint's
parameter name (``model.layers.N.self_attn.q_proj.weight``).

These hold weights and the pieces of per-layer math both forward paths share unchanged
(`RMSNorm`, `SwiGLU`, `SelfAttention.normalize_heads`; Starcoder2's `PlainMLP` and LayerNorm). The attention itself (projections plus adapter, RoPE, paged or
contiguous softmax, residual adds) is written in `prefixkv.models.decoder`, where the paged path and its
full-recompute oracle are read side by side.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.models.config import ModelConfig
from prefixkv.models.gemma import GemmaRMSNorm, gelu_tanh
from prefixkv.models.moe import SparseMoE, draw_random_moe
from prefixkv.models.starcoder2 import PlainMLP

__all__ = [
    "DecoderLayer",
    "DecoderStack",
    "RMSNorm",
    "SelfAttention",
    "SwiGLU",
    "draw_random_weights",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in (at least) float32 as HF Llama does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        wide = hidden.to(torch.promote_types(input_dtype, torch.float32))
        variance = wide.pow(2).mean(-1, keepdim=True)
        normalized = wide * torch.rsqrt(variance + self.eps)
        return self.weight * normalized.to(input_dtype)


def make_norm(config: ModelConfig, size: int) -> RMSNorm | GemmaRMSNorm | nn.LayerNorm:
    """The model's norm over `size` values: Gemma's ``(1 + weight)`` RMSNorm, Llama's, or
    Starcoder2's LayerNorm with a bias (torch's own module, as transformers builds it)."""
    if config.layer_norm:
        return nn.LayerNorm(size, eps=config.rms_norm_eps)
    if config.gemma is not None:
        return GemmaRMSNorm(size, config.rms_norm_eps)
    return RMSNorm(size, config.rms_norm_eps)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        qkv_bias = config.attention_qkv_bias
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_heads * config.head_dim, bias=qkv_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_kv_heads * config.head_dim, bias=qkv_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_kv_heads * config.head_dim, bias=qkv_bias
        )
        self.o_proj = nn.Linear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=config.attention_output_bias,
        )
        # Qwen3: one RMSNorm over each head's head_dim values (shared by all heads), for queries
        # and keys, before RoPE. None for the other architectures, so their state_dicts keep
        # their keys.
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        # gpt-oss: one softmax logit per query head with no value (both paths pass it to the
        # softmax; `prefixkv.kv.prefill` says how the paged kernels fold it in).
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None

    def normalize_heads(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[..., heads, head_dim]`` and keys through `q_norm` / `k_norm` (unchanged
        without them). Both forward paths call it between the projections and RoPE: the
        order matters, since a RoPE rotation does not commute with a per-dimension weight."""
        if self.q_norm is None or self.k_norm is None:
            return query, key
        return self.q_norm(query), self.k_norm(key)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        # Gemma gates with tanh-approximated GELU (GeGLU), Llama with SiLU.
        self.activation = F.silu if config.gemma is None else gelu_tanh

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(hidden)) * self.up_proj(hidden))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config)
        # Experts on the layers config.moe makes sparse (Mixtral, Qwen3-MoE, gpt-oss).
        moe = config.moe
        self.mlp: nn.Module
        if moe is not None and moe.layer_is_sparse(layer_index):
            self.mlp = SparseMoE(moe, config.hidden_size)
        elif config.plain_mlp_activation is not None:  # Starcoder2's, not gated
            self.mlp = PlainMLP(
                config.hidden_size,
                config.intermediate_size,
                config.mlp_bias,
                config.plain_mlp_activation,
            )
        else:
            self.mlp = SwiGLU(config)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        # Gemma's sandwich: a norm after attention (post_attention_layernorm, which in Llama
        # is the MLP's input norm) and a pair around the MLP. None elsewhere, so other
        # state_dicts keep their keys.
        sandwich = config.gemma is not None
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size) if sandwich else None
        self.post_feedforward_layernorm = (
            make_norm(config, config.hidden_size) if sandwich else None
        )

    def add_attention_and_mlp(
        self, hidden: torch.Tensor, attention_output: torch.Tensor
    ) -> torch.Tensor:
        """The rest of the layer after attention's output projection: both residual adds and
        the MLP between them (Llama's pre-norm, or Gemma's sandwich). Both forward paths call
        it, as they call the MLP."""
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden = hidden + attention_output
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attention_output)
        feed_forward = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(feed_forward)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.num_layers)
        )
        self.norm = make_norm(config, config.hidden_size)
        # Gemma multiplies the embedding by sqrt(hidden_size) (rounded to the model dtype).
        self.embedding_scale = None if config.gemma is None else config.hidden_size**0.5

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The first hidden states of `tokens`: the embedding rows, scaled for Gemma."""
        hidden: torch.Tensor = self.embed_tokens(tokens)
        if self.embedding_scale is None:
            return hidden
        return hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)


def draw_random_weights(
    stack: DecoderStack,
    lm_head: nn.Linear,
    config: ModelConfig,
    seed: int,
    attention_sharpness: float,
) -> None:
    """Overwrite `stack` and `lm_head` (float32) with seeded draws: the weights of
    `LlamaModel.random` (see it for what `attention_sharpness` means). The draw order is fixed,
    so a seed names the same weights for every config of the same shapes."""
    generator = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    hidden = config.hidden_size
    qk_std = math.sqrt(attention_sharpness / hidden)
    # A norm's gain is its weight, or ``1 + weight`` for Gemma's: the same gains for both.
    gain_offset = 0.0 if config.gemma is None else 1.0
    with torch.no_grad():
        stack.embed_tokens.weight.copy_(normal((config.vocab_size, hidden), 1.0))
        for layer in stack.layers:
            assert isinstance(layer, DecoderLayer)
            attention = layer.self_attn
            attention.q_proj.weight.copy_(normal(tuple(attention.q_proj.weight.shape), qk_std))
            attention.k_proj.weight.copy_(normal(tuple(attention.k_proj.weight.shape), qk_std))
            attention.v_proj.weight.copy_(
                normal(tuple(attention.v_proj.weight.shape), hidden**-0.5)
            )
            out_features = config.num_heads * config.head_dim
            attention.o_proj.weight.copy_(
                normal(tuple(attention.o_proj.weight.shape), out_features**-0.5)
            )
            mlp = layer.mlp
            dense: tuple[nn.Linear, ...] = ()
            if isinstance(mlp, SparseMoE):
                draw_random_moe(mlp, normal)
            elif isinstance(mlp, PlainMLP):
                mlp.c_fc.weight.copy_(normal(tuple(mlp.c_fc.weight.shape), hidden**-0.5))
                mlp.c_proj.weight.copy_(
                    normal(tuple(mlp.c_proj.weight.shape), config.intermediate_size**-0.5)
                )
                dense = (mlp.c_fc, mlp.c_proj)
            else:
                assert isinstance(mlp, SwiGLU)
                for projection in (mlp.gate_proj, mlp.up_proj):
                    projection.weight.copy_(normal(tuple(projection.weight.shape), hidden**-0.5))
                mlp.down_proj.weight.copy_(
                    normal(tuple(mlp.down_proj.weight.shape), config.intermediate_size**-0.5)
                )
                dense = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            if attention.sinks is not None:
                # Sinks near the typical score, so some rows give the sink much of their mass.
                attention.sinks.copy_(normal((config.num_heads,), attention_sharpness**0.5))
            # Biases large enough to move the logits, so a dropped one is visible.
            for projection in (
                attention.q_proj,
                attention.k_proj,
                attention.v_proj,
                attention.o_proj,
                *dense,
            ):
                if projection.bias is not None:
                    projection.bias.copy_(normal(tuple(projection.bias.shape), 0.5))
            # Norm weights away from 1, so a dropped or misapplied norm is visible.
            layer.input_layernorm.weight.copy_(1.0 - gain_offset + normal((hidden,), 0.2))
            layer.post_attention_layernorm.weight.copy_(1.0 - gain_offset + normal((hidden,), 0.2))
            if attention.q_norm is not None and attention.k_norm is not None:
                # The q/k norms set each head's scale (the projections' scale cancels), so the
                # sharpness is theirs: a score's std is about the product of the two weights.
                # Spread per dimension, so that a norm applied after RoPE (which rotates
                # dimension i with i + head_dim/2) computes something else.
                for norm in (attention.q_norm, attention.k_norm):
                    spread = 1.0 + normal((config.head_dim,), 0.4).abs()
                    gain = attention_sharpness**0.5 * spread / spread.mean()
                    norm.weight.copy_(gain - gain_offset)
        stack.norm.weight.copy_(1.0 - gain_offset + normal((hidden,), 0.2))
        for layer in stack.layers:
            # Gemma's feed-forward norms, drawn last so other models' draws are unchanged.
            assert isinstance(layer, DecoderLayer)
            for sandwich_norm in (
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
            ):
                if sandwich_norm is not None:
                    sandwich_norm.weight.copy_(normal((hidden,), 0.2))
        if config.layer_norm:
            # Starcoder2's LayerNorm biases, drawn last for the same reason; large enough that
            # a dropped one moves the logits.
            layer_norms = [
                norm
                for layer in stack.layers
                for norm in (layer.input_layernorm, layer.post_attention_layernorm)
            ]
            for layer_norm in (*layer_norms, stack.norm):
                assert isinstance(layer_norm, nn.LayerNorm)
                layer_norm.bias.copy_(normal((hidden,), 0.2))
        if not config.tie_word_embeddings:
            # Logits of order a few units: a peaked but not one-hot next-token distribution.
            lm_head.weight.copy_(normal((config.vocab_size, hidden), 2.0 * hidden**-0.5))
