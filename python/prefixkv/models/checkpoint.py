"""Local Hugging Face checkpoint directories: reading and writing a `LlamaModel`'s weights and
config, and the serving settings a checkpoint carries (its end-of-sequence tokens).

Never touches the network. Loading is strict: every parameter the model has must be present
exactly once with the right shape, and an unknown tensor is an error, so a checkpoint of another
architecture is refused rather than half-loaded. The one tolerated extra is transformers' own:
a tied-embedding checkpoint that also stores ``lm_head.weight`` (`_untie_if_head_differs`).
`find_chat_template` finds the chat template(s) a checkpoint ships, where transformers looks
for them; `checkpoint_eos_token_ids` its end-of-sequence tokens.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prefixkv.errors import ChatTemplateError, InvalidInputError
from prefixkv.models.config import ModelConfig

if TYPE_CHECKING:
    from prefixkv.models.decoder import LlamaModel
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate
    from prefixkv.text.tokenizers import HFTokenizer

__all__ = [
    "CHECKPOINT_TEMPLATE_SOURCES",
    "Checkpoint",
    "checkpoint_eos_token_ids",
    "find_chat_template",
    "load_checkpoint",
    "load_pretrained",
    "save_pretrained",
]

_log = logging.getLogger(__name__)


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


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """A Hugging Face checkpoint directory or a ``.gguf`` file (`prefixkv.gguf.load_gguf`),
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


def save_pretrained(model: LlamaModel, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in Hugging Face Llama layout.

    Adapters are not saved (they are not part of the base checkpoint).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        # safetensors refuses shared storage, and HF omits the tied head too.
        state.pop("lm_head.weight")
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf_config()
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_pretrained(
    model_class: type[LlamaModel],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    **config_overrides: Any,
) -> LlamaModel:
    """Load ``config.json`` plus ``*.safetensors`` (sharded or not) into `model_class`."""
    from safetensors import safe_open

    directory = Path(directory)
    overrides = dict(config_overrides)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = ModelConfig.from_hf_config(directory, **overrides)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidInputError(f"no *.safetensors files in {directory}")
    loaded: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not dicts
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from the config; old checkpoints store it
                if name in loaded:
                    raise InvalidInputError(f"tensor {name!r} appears in two files")
                loaded[name] = handle.get_tensor(name)
    if config.tie_word_embeddings and "lm_head.weight" in loaded:
        config = _untie_if_head_differs(config, loaded, directory)
    model = model_class(config.replace(dtype=torch.float32))
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    unknown = sorted(set(loaded) - set(expected))
    missing = sorted(set(expected) - set(loaded))
    if unknown or missing:
        raise InvalidInputError(
            f"checkpoint in {directory} does not match the config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}"
        )
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise InvalidInputError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    model.load_state_dict(loaded, strict=False)
    model.config = config
    return model.to(device=device, dtype=config.dtype)


def _untie_if_head_differs(
    config: ModelConfig, loaded: dict[str, torch.Tensor], directory: Path
) -> ModelConfig:
    """A tied-embedding checkpoint that stores ``lm_head.weight`` as well (many do).

    If the stored head equals the embedding, it is the same weight written twice: drop it and
    stay tied. If it differs, do what transformers 5 does: do not tie, each tensor keeps its
    stored value (transformers 4 overwrote the head with the embedding instead). The model then
    reports ``tie_word_embeddings=False``, which is what it computes.
    """
    head = loaded["lm_head.weight"]
    embedding = loaded.get("model.embed_tokens.weight")
    if embedding is not None and head.shape == embedding.shape and torch.equal(head, embedding):
        del loaded["lm_head.weight"]
        return config
    _log.warning(
        "%s: tie_word_embeddings is true but the checkpoint stores an lm_head.weight that "
        "differs from the embedding; loading them untied, as transformers does",
        directory,
    )
    return config.replace(tie_word_embeddings=False)


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
