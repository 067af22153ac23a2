"""A small serving engine over the prefix cache: `Engine` (torch).

- `facade` (`Engine`, `RequestResult`): construction, `generate`, `from_pretrained`, the
  events, metrics and tiers wiring.
- `loop`: one `generate` call's per-step loop: schedule, run the model, sample, finish.
- `requests`: a request inside the engine (`ServedRequest`) and the `RequestResult` it builds.
- `pools`: the KV pools an engine builds, and the refusal of a request that can never fit.
- `scheduler`: the scheduling policy (what runs next, in which order, who yields).
- `inputs`: what a request is and how it becomes prompt token ids; chat template, stop tokens.
- `threads`: how many CPU threads torch should use beside other work.

The top layer of the library: it imports every layer below (block manager, tiers, events, KV,
models, text) and nothing imports it but the apps. The names are loaded on first use, so that
importing `prefixkv.engine.threads` does not build the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.engine.facade import (
        Engine,
        RequestResult,
        checkpoint_eos_token_ids,
        model_context,
        weights_digest,
    )

__all__ = [
    "Engine",
    "RequestResult",
    "checkpoint_eos_token_ids",
    "model_context",
    "weights_digest",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'prefixkv.engine.facade' has no attribute {name!r}")
    value = getattr(importlib.import_module("prefixkv.engine.facade"), name)
    globals()[name] = value
    return value
