"""Mixture-of-experts MLPs: each token's hidden state goes to a few of the layer's experts
(chosen by a linear router), and their outputs are summed with the router's weights.

Three routers and two expert shapes, each written from transformers' own modeling code in the
version `prefixkv.models.hf_config.TRANSFORMERS_VERSION` names, with its parameter names, so a
``state_dict`` key is the checkpoint's:

* ``mixtral`` (``MixtralSparseMoeBlock``, under ``block_sparse_moe``): softmax over all the
  experts' logits (float32), the top k taken, their probabilities renormalised to sum to 1.
  Experts are SwiGLUs named ``w1`` (gate), ``w3`` (up), ``w2`` (down).
* ``qwen3_moe`` (``Qwen3MoeSparseMoeBlock``, under ``mlp``): the same softmax and top k,
  renormalised only with ``norm_topk_prob``; experts named ``gate_proj`` / ``up_proj`` /
  ``down_proj`` of ``moe_intermediate_size``. Some layers keep a dense MLP
  (``decoder_sparse_step``, ``mlp_only_layers``: `MoESettings.sparse_layers`).
* ``gpt_oss`` (``GptOssMLP``, under ``mlp``): a router with a bias, the top k of the *logits*,
  a softmax over those k only. The experts are stored stacked (``gate_up_proj`` ``[experts,
  hidden, 2 * intermediate]`` with gate and up interleaved column by column, plus biases) and
  apply a clamped SwiGLU: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

Routing is per token, so a token's MLP output does not depend on which other tokens share the
batch: the paged path (new tokens only) and the full recompute route every token alike, and
cached KV stays exact. Experts run in ascending order, each over the tokens that chose it, and
their weighted outputs are added in that order, as transformers adds them (float sums in
another order would differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.errors import InvalidInputError

__all__ = ["MOE_KINDS", "MoESettings", "SparseMoE", "draw_random_moe"]

MoEKind = Literal["mixtral", "qwen3_moe", "gpt_oss"]
#: The routers this module implements (transformers' model_type names).
MOE_KINDS: tuple[MoEKind, ...] = ("mixtral", "qwen3_moe", "gpt_oss")


@dataclass(frozen=True)
class MoESettings:
    """How a model's MLPs mix experts (`prefixkv.models.config.ModelConfig.moe`).

    kind:
        Whose router and expert layout (see the module docstring).
    num_experts / experts_per_token:
        Experts per MoE layer, and how many each token uses (the top k).
    expert_intermediate_size:
        Width of one expert's SwiGLU (Mixtral and gpt-oss: ``intermediate_size``; Qwen3-MoE:
        ``moe_intermediate_size``, the dense layers keeping ``intermediate_size``).
    normalize_top_k:
        Renormalise the top k softmax probabilities to sum to 1 (always for Mixtral, Qwen3-MoE's
        ``norm_topk_prob``; gpt-oss's softmax over the top k sums to 1 by construction).
    sparse_layers:
        Per layer, whether its MLP is an expert mixture; None: every layer's is.
    swiglu_alpha / swiglu_limit:
        gpt-oss's clamped SwiGLU (sigmoid gain, clamp); unused by the other kinds.
    """

    kind: MoEKind
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    normalize_top_k: bool = True
    sparse_layers: tuple[bool, ...] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in MOE_KINDS:
            raise InvalidInputError(f"moe kind must be one of {MOE_KINDS}, got {self.kind!r}")
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"moe {name} must be a positive int, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise InvalidInputError(
                f"moe experts_per_token ({self.experts_per_token}) exceeds num_experts "
                f"({self.num_experts})"
            )
        if not isinstance(self.normalize_top_k, bool):
            raise InvalidInputError(
                f"moe normalize_top_k must be a bool, got {self.normalize_top_k!r}"
            )
        if self.sparse_layers is not None:
            if isinstance(self.sparse_layers, str) or not isinstance(self.sparse_layers, Sequence):
                raise InvalidInputError("moe sparse_layers must be a sequence of bool or None")
            layers = tuple(self.sparse_layers)
            if not all(isinstance(sparse, bool) for sparse in layers):
                raise InvalidInputError(f"moe sparse_layers must hold bools, got {layers!r}")
            object.__setattr__(self, "sparse_layers", None if all(layers) else layers)
        if self.sparse_layers is not None and self.kind != "qwen3_moe":
            raise InvalidInputError("moe sparse_layers (dense layers among experts) is Qwen3-MoE's")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value == value:
                raise InvalidInputError(f"moe {name} must be a number, got {value!r}")

    def layer_is_sparse(self, layer_index: int) -> bool:
        return self.sparse_layers is None or self.sparse_layers[layer_index]

    def parameter_count(self, hidden_size: int) -> int:
        """Weights of one MoE layer (router and experts)."""
        experts = self.num_experts * 3 * hidden_size * self.expert_intermediate_size
        router = self.num_experts * hidden_size
        if self.kind == "gpt_oss":  # router bias, gate/up and down biases
            router += self.num_experts
            experts += self.num_experts * (2 * self.expert_intermediate_size + hidden_size)
        return router + experts


class _Expert(nn.Module):
    """One SwiGLU expert, ``down(silu(gate(x)) * up(x))``, under the checkpoint's names."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names  # gate, up, down
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        result: torch.Tensor = down(F.silu(gate(hidden)) * up(hidden))
        return result


class _StackedExperts(nn.Module):
    """gpt-oss's experts as stored: stacked ``[experts, in, out]`` weights (``x @ W + b``)."""

    def __init__(self, settings: MoESettings, hidden: int) -> None:
        super().__init__()
        experts, intermediate = settings.num_experts, settings.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.zeros(experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.alpha, self.limit = settings.swiglu_alpha, settings.swiglu_limit

    def expert(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = hidden @ self.gate_up_proj[index] + self.gate_up_proj_bias[index]
        # Interleaved columns: gate at even, up at odd (not two halves, as Mixtral's).
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        result: torch.Tensor = gated @ self.down_proj[index] + self.down_proj_bias[index]
        return result


class SparseMoE(nn.Module):
    """A router and its experts (one MoE layer's MLP); ``forward`` takes ``[..., hidden]``."""

    def __init__(self, settings: MoESettings, hidden_size: int) -> None:
        super().__init__()
        self.settings = settings
        self.hidden_size = hidden_size
        experts, intermediate = settings.num_experts, settings.expert_intermediate_size
        if settings.kind == "gpt_oss":
            self.router = nn.Linear(hidden_size, experts, bias=True)
            self.experts: nn.ModuleList | _StackedExperts = _StackedExperts(settings, hidden_size)
        else:
            names = ("w1", "w3", "w2") if settings.kind == "mixtral" else (
                "gate_proj", "up_proj", "down_proj"
            )  # fmt: skip
            self.gate = nn.Linear(hidden_size, experts, bias=False)
            self.experts = nn.ModuleList(
                _Expert(hidden_size, intermediate, names) for _ in range(experts)
            )

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts ``[tokens, k]`` (int64) and their weights ``[tokens, k]``."""
        settings = self.settings
        if settings.kind == "gpt_oss":
            logits = self.router(hidden)
            top_logits, chosen = torch.topk(logits, settings.experts_per_token, dim=-1)
            return chosen, torch.softmax(top_logits, dim=-1)
        logits = self.gate(hidden)
        probabilities = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probabilities, settings.experts_per_token, dim=-1)
        if settings.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if settings.kind == "qwen3_moe":
            weights = weights.to(logits.dtype)  # Qwen3-MoE rounds them; Mixtral keeps float32
        return chosen, weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        flat = hidden.reshape(-1, self.hidden_size)
        chosen, weights = self.route(flat)
        output = torch.zeros_like(flat)
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            if isinstance(self.experts, _StackedExperts):
                computed = self.experts.expert(expert, flat[tokens])
            else:
                computed = self.experts[expert](flat[tokens])
            weighted = computed * weights[tokens, slot, None]
            output.index_add_(0, tokens, weighted.to(output.dtype))
        return output.reshape(shape)


def draw_random_moe(
    mlp: SparseMoE, normal: Callable[[tuple[int, ...], float], torch.Tensor]
) -> None:
    """Seeded weights for one MoE layer (`prefixkv.models.layers.draw_random_weights`): a router
    with logits of a few units, so tokens pick different experts with clear margins; experts
    drawn as the dense MLP is; gpt-oss's biases large enough that a dropped one shows."""
    hidden, intermediate = mlp.hidden_size, mlp.settings.expert_intermediate_size
    with torch.no_grad():
        router = mlp.router if mlp.settings.kind == "gpt_oss" else mlp.gate
        router.weight.copy_(normal(tuple(router.weight.shape), 3.0 * hidden**-0.5))
        if router.bias is not None:
            router.bias.copy_(normal(tuple(router.bias.shape), 0.5))
        if isinstance(mlp.experts, _StackedExperts):
            stacked = mlp.experts
            stacked.gate_up_proj.copy_(normal(tuple(stacked.gate_up_proj.shape), hidden**-0.5))
            stacked.down_proj.copy_(normal(tuple(stacked.down_proj.shape), intermediate**-0.5))
            stacked.gate_up_proj_bias.copy_(normal(tuple(stacked.gate_up_proj_bias.shape), 0.5))
            stacked.down_proj_bias.copy_(normal(tuple(stacked.down_proj_bias.shape), 0.5))
            return
        for expert in mlp.experts:
            assert isinstance(expert, _Expert)
            gate, up, down = (getattr(expert, name) for name in expert.names)
            for projection in (gate, up):
                projection.weight.copy_(normal(tuple(projection.weight.shape), hidden**-0.5))
            down.weight.copy_(normal(tuple(down.weight.shape), intermediate**-0.5))
