"""What a loaded checkpoint is: the `Checkpoint` record both loaders return (a Hugging Face
directory, `prefixkv.models.checkpoint.load_checkpoint`; a GGUF file, `prefixkv.models.gguf.load_gguf`).

Its own module so that the loaders sit above it and beside each other: `prefixkv.models.checkpoint`
dispatches to `prefixkv.models.gguf`, which imports only this record, not the dispatcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.models.decoder import LlamaModel
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate
    from prefixkv.text.tokenizers import HFTokenizer

__all__ = ["Checkpoint"]


@dataclass(frozen=True)
class Checkpoint:
    """A model as published, with what serving it needs: `load_checkpoint` reads one from a
    Hugging Face directory or a GGUF file. Serve it with
    ``Engine(c.model, tokenizer=c.tokenizer, chat_template=c.chat_template,
    stop_token_ids=c.eos_token_ids, model_id=c.name)`` (or ``Engine(**c.engine_options())``).
    """

    path: Path
    #: "hf" (a directory) or "gguf" (a file).
    format: str
    model: LlamaModel
    #: None for a directory without ``tokenizer.json`` (then requests must be token ids).
    tokenizer: HFTokenizer | None
    #: None when the checkpoint ships no template: chat requests are then refused.
    chat_template: JinjaChatTemplate | ChatTemplateSet | None
    eos_token_ids: tuple[int, ...]
    name: str
    #: GGUF only: tensor counts by stored type, e.g. ``{"Q4_1": 210, "F32": 61}``.
    tensor_types: Mapping[str, int] = field(default_factory=dict)

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for `prefixkv.Engine` (add num_blocks, block_size...)."""
        return {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "stop_token_ids": self.eos_token_ids,
            "model_id": self.name,
        }

    def describe(self) -> str:
        """One line: name, format and (GGUF) stored tensor types."""
        types = ", ".join(f"{count} {kind}" for kind, count in sorted(self.tensor_types.items()))
        return f"{self.name} ({self.format}{': ' + types if types else ''})"
