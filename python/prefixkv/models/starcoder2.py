"""What Starcoder2 computes beyond Llama: the names of the activations its plain MLP may use
and the MLP itself (`PlainMLP`), which `prefixkv.models.layers` builds where
`ModelConfig.plain_mlp_activation` is set.

Below the model config in the layers, as `prefixkv.models.gemma` is: a Starcoder2 model is a
`LlamaModel` whose norms and MLP are other modules behind the same calls, so both forward
paths, the paged KV, the sliding-window groups and the loaders serve it unchanged.

What differs from Llama, as transformers' ``Starcoder2ForCausalLM`` computes it (transformers
5.24, ``modeling_starcoder2.py``):

* every norm (the two per layer and the final one) is ``nn.LayerNorm`` with a bias and
  ``norm_epsilon``: the mean is subtracted, computed in the model dtype
  (`ModelConfig.layer_norm`);
* the MLP is not gated: ``c_proj(act(c_fc(x)))``, ``act`` being ``ACT2FN[hidden_act]``
  (`PlainMLP`);
* ``use_bias`` biases all six projections (q/k/v/o, ``c_fc``, ``c_proj``) or none;
* ``sliding_window``, when set, applies to every layer (Mistral's convention,
  ``i - window < j <= i``); there is no per-layer pattern.

Its dropouts (``attention_dropout``, ``residual_dropout``, ``embedding_dropout``) are
training settings: no inference forward reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefixkv.models.gemma import gelu_tanh

__all__ = ["PLAIN_MLP_ACTIVATIONS", "PlainMLP"]

#: transformers' ``ACT2FN`` names this decoder computes exactly as transformers does (the same
#: torch function): ``GELUTanh`` is ``F.gelu(approximate="tanh")`` (every published
#: Starcoder2), ``GELUActivation`` is ``F.gelu``. Another name is refused (``gelu_new`` and
#: ``gelu_fast`` write the tanh formula by hand, which rounds differently).
PLAIN_MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": F.gelu,
}


class PlainMLP(nn.Module):
    """Starcoder2's MLP, ``c_proj(act(c_fc(x)))``, under its checkpoint's names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str):
        super().__init__()
        self.c_fc = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.c_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.activation = PLAIN_MLP_ACTIVATIONS[activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.activation(self.c_fc(hidden)))
