"""What Gemma 2 and Gemma 3 (text) compute beyond Llama: `GemmaSettings` (read from their
``config.json`` by `prefixkv.models.hf_config`) and the pieces of math the decoder calls where
they are set.

Below the model config in the layers: `prefixkv.models.config.ModelConfig` holds a
`GemmaSettings` (``gemma``), `prefixkv.models.layers` builds Gemma's norms and MLP from it and
`prefixkv.models.decoder` runs both forward paths through the same hooks, so a Gemma model is
a `LlamaModel` (served, cached and loaded as one) and not a second decoder to keep in step.

What differs from Llama, as transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``
compute it (transformers 5.24):

* the embedding is multiplied by ``sqrt(hidden_size)``, rounded to the model dtype first;
* every RMSNorm multiplies by ``1 + weight`` and rounds once, after the multiplication
  (`GemmaRMSNorm`; Llama rounds before it);
* a layer is a sandwich: ``x + post_attention_norm(attn(input_norm(x)))``, then
  ``x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))``;
* the MLP's gate goes through tanh-approximated GELU (``gelu_pytorch_tanh``), not SiLU;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
* Gemma 2 caps attention scores, ``tanh(s / cap) * cap`` after scaling and before the mask
  (`softcap`; the paged kernels take it as ``softcap=``); Gemma 3's config has the field but
  its attention never passes it on, so it is read and ignored, as there;
* both cap the final logits the same way (``final_logit_softcapping``);
* Gemma 3 adds per-head q/k norms before RoPE (the ``(1 + weight)`` kind) and rotates its
  sliding layers with their own base (``rope_local_base_freq``, no scaling), its full layers
  with ``rope_theta`` and the config's scaling (`GemmaSettings.local_rope_theta`).

The sliding/full layer pattern itself is `ModelConfig.layer_types`, as for every hybrid model,
so the sliding layers run on the KV groups (docs/hybrid.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.errors import InvalidInputError

__all__ = ["GEMMA_MODEL_TYPES", "GemmaRMSNorm", "GemmaSettings", "gelu_tanh", "softcap"]

#: The ``model_type`` values read as Gemma (`prefixkv.models.hf_config`).
GEMMA_MODEL_TYPES = frozenset({"gemma2", "gemma3_text"})


@dataclass(frozen=True)
class GemmaSettings:
    """Gemma's settings beyond a Llama config (see the module docstring for what each does).

    model_type: ``"gemma2"`` or ``"gemma3_text"`` (what the checkpoint is; named in the cache
        context).
    query_pre_attn_scalar: attention scores are multiplied by its inverse square root.
    attn_logit_softcapping: the cap of attention scores, or None (always None for Gemma 3,
        whose attention ignores the field).
    final_logit_softcapping: the cap of the logits, or None.
    local_rope_theta: Gemma 3: the RoPE base of sliding-window layers (which take no
        scaling); None when every layer rotates alike (Gemma 2).
    """

    model_type: str
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.model_type not in GEMMA_MODEL_TYPES:
            raise InvalidInputError(
                f"GemmaSettings.model_type must be one of {sorted(GEMMA_MODEL_TYPES)}, "
                f"got {self.model_type!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "local_rope_theta"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name != "query_pre_attn_scalar":
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise InvalidInputError(
                    f"GemmaSettings.{name} must be a positive finite number, got {value!r}"
                )
        if self.local_rope_theta is not None and not self.local_rope_theta > 1:
            raise InvalidInputError(
                f"GemmaSettings.local_rope_theta must be > 1, got {self.local_rope_theta!r}"
            )

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by (before any cap)."""
        return float(self.query_pre_attn_scalar) ** -0.5


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalize in float32, multiply by ``1 + weight`` in float32, then round
    to the input dtype once (Llama's rounds before the weight). The weight starts at 0."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        wide = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        normalized = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalized * (1.0 + self.weight.to(wide.dtype))).to(hidden.dtype)


def gelu_tanh(hidden: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``: GELU with torch's tanh approximation."""
    return F.gelu(hidden, approximate="tanh")


def softcap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(values / cap) * cap``: Gemma's soft cap of logits (and Gemma 2's of attention
    scores), smooth and bounded by ``cap``."""
    return torch.tanh(values / cap) * cap
