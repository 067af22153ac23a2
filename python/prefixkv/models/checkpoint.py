"""Local checkpoints as served: `load_checkpoint` reads a Hugging Face directory or a GGUF file
(`prefixkv.models.gguf`) into a `Checkpoint` with its tokenizer, chat template and end-of-sequence
tokens.

Never touches the network. The weights are read by `prefixkv.models.hf_weights` (strict: every
parameter present once with the right shape, re-exported here as `load_pretrained` /
`save_pretrained`); this module adds what serving needs: `find_chat_template` finds the chat
template(s) a checkpoint ships, where transformers looks for them; `checkpoint_eos_token_ids`
its end-of-sequence tokens. Layers: the record (`prefixkv.models.checkpoint_record`) and the model
below, the GGUF loader beside, this dispatcher above both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prefixkv.errors import ChatTemplateError, InvalidInputError
from prefixkv.models.checkpoint_record import Checkpoint
from prefixkv.models.hf_weights import load_pretrained, save_pretrained

if TYPE_CHECKING:
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate

__all__ = [
    "CHECKPOINT_TEMPLATE_SOURCES",
    "Checkpoint",
    "checkpoint_eos_token_ids",
    "find_chat_template",
    "load_checkpoint",
    "load_pretrained",
    "save_pretrained",
]


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """A Hugging Face checkpoint directory or a ``.gguf`` file (`prefixkv.models.gguf.load_gguf`),
    with its tokenizer, chat template (`find_chat_template`) and end-of-sequence tokens
    (`checkpoint_eos_token_ids`). Offline; strict, as `load_pretrained` and `load_gguf` are."""
    from prefixkv.models.decoder import LlamaModel
    from prefixkv.models.gguf import is_gguf, load_gguf
    from prefixkv.text.tokenizers import HFTokenizer

    path = Path(path)
    if path.is_file() and is_gguf(path):
        return load_gguf(path, dtype=dtype or torch.float32, device=device)
    if not path.is_dir():
        raise InvalidInputError(
            f"{path} is neither a Hugging Face checkpoint directory nor a GGUF file"
        )
    model = LlamaModel.from_pretrained(path, dtype=dtype, device=device)
    tokenizer_path = path / "tokenizer.json"
    return Checkpoint(
        path=path,
        format="hf",
        model=model,
        tokenizer=HFTokenizer(tokenizer_path) if tokenizer_path.is_file() else None,
        chat_template=find_chat_template(path),
        eos_token_ids=checkpoint_eos_token_ids(path),
        name=path.name,
    )


def checkpoint_eos_token_ids(directory: str | Path) -> tuple[int, ...]:
    """The end-of-sequence token ids of a Hugging Face checkpoint: ``eos_token_id`` of
    ``generation_config.json``, else of ``config.json`` (what transformers' `generate` reads),
    an int or a list of ints; ``()`` when neither names one."""
    directory = Path(directory)
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInputError(f"cannot read {path}: {exc}") from exc
        value = raw.get("eos_token_id") if isinstance(raw, dict) else None
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise InvalidInputError(
                f"{path}: eos_token_id must be an int or a list of ints, got {value!r}"
            )
        return tuple(values)
    return ()


#: Where `find_chat_template` looks, in transformers' order of priority.
CHECKPOINT_TEMPLATE_SOURCES = (
    "chat_template.jinja",
    "additional_chat_templates/*.jinja",
    "'chat_template' in tokenizer_config.json",
    "chat_template.json",
)


def find_chat_template(
    directory: str | os.PathLike[str],
) -> JinjaChatTemplate | ChatTemplateSet | None:
    """The chat template a Hugging Face checkpoint directory ships, or None if it has none.

    Found as transformers' tokenizer finds it: ``chat_template.jinja`` (the default template)
    and ``additional_chat_templates/<name>.jinja`` take priority over the ``chat_template`` of
    ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``); a processor's
    legacy ``chat_template.json`` comes last. The special tokens of ``tokenizer_config.json``
    (``bos_token``, ``eos_token``, ``pad_token``...) are passed to the template, as transformers
    passes them. Several templates give a `ChatTemplateSet`.
    """
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate, special_tokens

    root = Path(directory)
    config_path = root / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"cannot read {config_path}: {exc}") from exc
        if isinstance(loaded, dict):
            config = loaded
    tokens = special_tokens(config)

    sources: dict[str, tuple[str, str]] = {}  # template name -> (source text, where from)

    def read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read chat template {path}: {exc}") from exc

    if (root / "chat_template.jinja").is_file():
        sources["default"] = (read(root / "chat_template.jinja"), str(root / "chat_template.jinja"))
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            sources[path.name.removesuffix(".jinja")] = (read(path), str(path))
    if not sources and config.get("chat_template"):
        entry = config["chat_template"]
        where = str(config_path)
        if isinstance(entry, str):
            sources["default"] = (entry, where)
        elif isinstance(entry, list):
            for item in entry:
                if not (
                    isinstance(item, Mapping)
                    and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)
                ):
                    raise ChatTemplateError(
                        f"{config_path}: a chat_template list holds {{'name', 'template'}} "
                        f"objects, got {item!r:.80}"
                    )
                sources[item["name"]] = (item["template"], f"{where}[{item['name']}]")
        else:
            raise ChatTemplateError(
                f"{config_path}: chat_template must be a string or a list of named templates"
            )
    legacy = root / "chat_template.json"
    if not sources and legacy.is_file():
        try:
            entry = json.loads(read(legacy)).get("chat_template")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ChatTemplateError(f"{legacy}: not a JSON object: {exc}") from exc
        if not isinstance(entry, str):
            raise ChatTemplateError(f"{legacy}: no 'chat_template' string in it")
        sources["default"] = (entry, str(legacy))
    if not sources:
        return None

    bos_token = tokens.pop("bos_token", "")
    eos_token = tokens.pop("eos_token", "")
    templates = {
        name: JinjaChatTemplate(
            source, bos_token=bos_token, eos_token=eos_token, name=where, extra_context=tokens
        )
        for name, (source, where) in sources.items()
    }
    if list(templates) == ["default"]:
        return templates["default"]
    return ChatTemplateSet(templates, name=str(root))
