"""A `LlamaModel`'s weights and config in a Hugging Face checkpoint directory: `save_pretrained`
writes ``config.json`` and ``model.safetensors``, `load_pretrained` reads them back.

Below the model in the layers (`prefixkv.models.decoder` calls these from its methods; the model class is
passed in), so it imports nothing of the model. Loading is strict: every parameter the model has
must be present exactly once with the right shape, and an unknown tensor is an error, so a
checkpoint of another architecture is refused rather than half-loaded. The one tolerated extra
is transformers' own: a tied-embedding checkpoint that also stores ``lm_head.weight``
(`_untie_if_head_differs`). Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are split into the
separate projections on loading (`_split_fused_projections`); no fused checkpoint is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn

from prefixkv.errors import InvalidInputError
from prefixkv.models.config import ModelConfig, check_fits_in_memory
from prefixkv.models.hf_config import FUSED_PROJECTION_TYPES, checkpoint_model_type

__all__ = ["SavableModel", "load_pretrained", "save_pretrained"]

_log = logging.getLogger(__name__)

ModelT = TypeVar("ModelT", bound=nn.Module)


class SavableModel(Protocol):
    """What `save_pretrained` reads of a model (`prefixkv.models.decoder.LlamaModel` is one)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def dtype(self) -> torch.dtype: ...
    def state_dict(self) -> Mapping[str, torch.Tensor]: ...


def save_pretrained(model: SavableModel, directory: str | Path) -> None:
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
    model_class: Callable[[ModelConfig], ModelT],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    **config_overrides: Any,
) -> ModelT:
    """Load ``config.json`` plus ``*.safetensors`` (sharded or not) into `model_class`
    (`prefixkv.models.decoder.LlamaModel`), refusing a config too large for this machine's memory
    before anything is allocated (`check_fits_in_memory`)."""
    from safetensors import safe_open

    directory = Path(directory)
    overrides = dict(config_overrides)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = ModelConfig.from_hf_config(directory, **overrides)
    check_fits_in_memory(config, directory / "config.json")
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
    model_type = checkpoint_model_type(directory)
    if model_type in FUSED_PROJECTION_TYPES:
        _split_fused_projections(loaded, config)
    if model_type == "mixtral":
        # Mixtral checkpoints keep each layer's experts under ``block_sparse_moe``; the
        # decoder's MLP is ``mlp`` for every type (transformers renames it the same way).
        loaded = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in loaded.items()}
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
    # Built in float32 above; the config it reports is the one read (dtype, untying).
    cast(Any, model).config = config
    return model.to(device=device, dtype=config.dtype)


def _split_fused_projections(loaded: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Phi-3's ``qkv_proj`` (rows: queries, keys, values) and ``gate_up_proj`` (rows: gate,
    up), split in place into this decoder's separate projections, in the order its modeling
    code slices them. A fused tensor of another row count is refused, naming it."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    parts = {
        "self_attn.qkv_proj": (("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows),
                               ("self_attn.v_proj", kv_rows)),
        "mlp.gate_up_proj": (("mlp.gate_proj", config.intermediate_size),
                             ("mlp.up_proj", config.intermediate_size)),
    }  # fmt: skip
    for layer in range(config.num_layers):
        for fused, pieces in parts.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{layer}.{fused}.{kind}"
                tensor = loaded.pop(name, None)
                if tensor is None:
                    continue
                sizes = [rows for _, rows in pieces]
                if tensor.shape[0] != sum(sizes):
                    raise InvalidInputError(
                        f"tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                        f"({' + '.join(map(str, sizes))})"
                    )
                for (piece, _), part in zip(pieces, tensor.split(sizes), strict=True):
                    loaded[f"model.layers.{layer}.{piece}.{kind}"] = part.contiguous()


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
