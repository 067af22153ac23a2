"""GGUF files (llama.cpp's format) as a `LlamaModel`, a tokenizer, a chat template and stop
tokens: `load_gguf`.

size: one reader of one format; the per-architecture parts are small tables (metadata keys,
tensor names, layout transforms) that only make sense beside the code that applies them.

Read with the ``gguf`` package (`prefixkv[gguf]`), the reader llama.cpp maintains. Loading is
as strict as `prefixkv.models.checkpoint`'s: every metadata key of the architecture and every tensor
must be one this decoder implements, or the file is refused with an `InvalidInputError` naming
it; a file the reader cannot parse is refused the same way. Never a guess:

* **Architectures**: ``llama`` (Llama, Mistral, SmolLM...), ``qwen2`` (q/k/v biases),
  ``qwen3`` (dense: per-head q/k norms, ``attn_q_norm`` / ``attn_k_norm``) and ``phi3``
  (Phi-3-mini-4k: fused ``attn_qkv`` / ``ffn_up`` split as the HF loader splits them, the
  window on every layer; LongRoPE's ``rope_factors_*`` tensors are refused by name) and
  ``starcoder2`` (LayerNorms with biases, biased projections, the plain GELU-tanh MLP; no
  window: llama.cpp writes and applies none).
* **Weights** are dequantized to float32 by ``gguf.quants.dequantize`` for the types in
  `SUPPORTED_TYPES`: the float types, the 32-value block types the ``gguf`` package can also
  write (each tested against the same weights in a Hugging Face directory), and the K-quants
  Q2_K to Q6_K (256-value super-blocks, what a ``Q4_K_M`` file holds; the package has no
  quantizer for them, so ``tests/test_gguf_kquants.py`` checks its dequantizer against a port
  of llama.cpp's ``dequantize_row_q*_K``), and the i-quants IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS,
  IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M (codebook formats; no quantizer either, so
  ``tests/test_gguf_iquants.py`` checks the dequantizer against a port of llama.cpp's
  ``dequantize_row_iq*``). Ternary (TQ1_0, TQ2_0), Q8_K and the rest are refused by name.
* **Q/K row order**: llama.cpp's converter permutes the rows of ``q_proj`` / ``k_proj`` of the
  ``llama`` architecture so that its RoPE rotates adjacent pairs (GPT-J style); the HF layout
  this decoder uses rotates halves. `_unpermute` undoes it (``qwen2`` and ``qwen3`` files are
  not permuted).
* **Tokenizer**: built with the ``tokenizers`` library from the file's vocabulary and merges
  (a byte-level BPE, ``tokenizer.ggml.model == "gpt2"``), with the pre-tokenizer that
  ``tokenizer.ggml.pre`` names (`_PRE_TOKENIZERS`, each the split llama.cpp applies for that
  name). An unknown pre-tokenizer is refused: a different split gives different ids for the
  same text, a silent wrong prompt. SentencePiece vocabularies (``"llama"``: Llama 2, Mistral)
  are rebuilt by `prefixkv.models.gguf_tokenizer`; any other model is refused.
* **Chat template and stop tokens**: ``tokenizer.chat_template`` (and named
  ``tokenizer.chat_template.<name>`` templates), rendered with the file's BOS/EOS token text;
  stop tokens are ``tokenizer.ggml.eos_token_id`` plus the end-of-turn ids llama.cpp also
  stops at (``eot_token_id``, ``eom_token_id``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixkv.errors import InvalidInputError, MissingDependencyError
from prefixkv.models.checkpoint_record import Checkpoint
from prefixkv.models.config import ModelConfig, RopeScaling, check_fits_in_memory
from prefixkv.models.gguf_header import check_gguf_header
from prefixkv.models.hf_weights import _split_fused_projections

if TYPE_CHECKING:
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate
    from prefixkv.text.tokenizers import HFTokenizer

__all__ = ["SUPPORTED_TYPES", "is_gguf", "load_gguf"]

#: Tensor types loaded (dequantized to float32), by their ``GGMLQuantizationType`` name.
SUPPORTED_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    | {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    | {"IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"}
)

_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "starcoder2")

#: Metadata keys only some architectures have: llama.cpp's ``phi3`` applies its window
#: (``attention.sliding_window``, Phi3Config's ``sliding_window``) on every layer;
#: ``starcoder2``'s LayerNorms read ``attention.layer_norm_epsilon`` (``norm_epsilon``; an
#: ``attention.layer_norm_rms_epsilon`` beside it, as Starcoder2-15B's, is ignored as
#: transformers' Starcoder2 ignores ``rms_norm_eps``).
_ARCH_ONLY_KEYS = {
    "phi3": frozenset({"attention.sliding_window"}),
    "starcoder2": frozenset({"attention.layer_norm_epsilon"}),
}

#: ``{arch}.<key>`` metadata this loader reads or knows to be inert; any other is refused.
_KNOWN_ARCH_KEYS = frozenset(
    {
        "block_count", "context_length", "embedding_length", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
        "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
        "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow", "rope.scaling.attn_factor", "vocab_size",
        "rope.scaling.finetuned",
    }
)  # fmt: skip

#: GGUF tensor names (per layer after ``blk.N.``) to Hugging Face Llama parameter names.
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "output_norm.bias": "model.norm.bias",  # starcoder2's final LayerNorm
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: Per architecture, layer tensors named otherwise: Phi-3's fused ``attn_qkv`` (rows:
#: queries, keys, values) and ``ffn_up`` (rows: gate, then up), as its HF checkpoint stores
#: them, split afterwards as the HF loader splits them (`_split_fused_projections`);
#: Starcoder2's plain MLP (``ffn_up`` is ``c_fc``, ``ffn_down`` ``c_proj``).
_ARCH_LAYER_TENSOR_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "starcoder2": {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
}
_FUSED_ARCHITECTURES = frozenset({"phi3"})

# The splits llama.cpp applies before byte-level BPE, per ``tokenizer.ggml.pre`` (from its
# llama-vocab.cpp), as `tokenizers` pre-tokenizers. GPT-2's is `ByteLevel(use_regex=True)`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: pre-tokenizer name -> how text is split: "gpt2" (GPT-2's regex), "digits+gpt2" (each digit
#: alone, then GPT-2's regex: SmolLM, StarCoder), or a regex for `Split` (Llama 3, Qwen2).
_PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp's token types


def _missing_gguf() -> MissingDependencyError:
    return MissingDependencyError(
        "a GGUF file needs the 'gguf' package: pip install 'prefixkv[gguf]'"
    )


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False


def load_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Checkpoint:
    """Load a GGUF file: the model (dequantized, then cast to `dtype`), its tokenizer, chat
    template and stop tokens. Raises `InvalidInputError` naming the problem for a file that is
    not a readable GGUF, an architecture, metadata key, tensor or tensor type this decoder does
    not implement, or a tokenizer it cannot rebuild exactly."""
    try:
        import gguf
    except ImportError as exc:
        raise _missing_gguf() from exc
    from prefixkv.models.decoder import LlamaModel

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"no GGUF file at {path}")
    # The reader trusts the header's counts; a lying one would make it loop past the file.
    check_gguf_header(path, {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()})
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct.error, IndexError...
        raise InvalidInputError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = _Metadata(reader, path)
    architecture = metadata.get("general.architecture")
    if architecture not in _ARCHITECTURES:
        raise InvalidInputError(
            f"{path}: architecture {architecture!r} is not implemented (supported: "
            f"{', '.join(_ARCHITECTURES)})"
        )
    config = _config(metadata, architecture, dtype)
    check_fits_in_memory(config, path)  # before a tensor is dequantized
    state, tensor_types = _tensors(reader, config, architecture, path, gguf)
    tied = "lm_head.weight" not in state
    config = config.replace(tie_word_embeddings=tied)
    model = LlamaModel(config.replace(dtype=torch.float32))
    expected = dict(model.state_dict())
    if tied:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InvalidInputError(f"{path}: tensors missing for {missing[:5]}")
    for name, tensor in state.items():
        if name not in expected:
            raise InvalidInputError(f"{path}: tensor for {name!r}, which this config lacks")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise InvalidInputError(
                f"{path}: {name!r} has shape {tuple(tensor.shape)}, the config says "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)
    model.config = config
    model = model.to(device=device, dtype=dtype)
    tokenizer = _tokenizer(metadata, path)
    if tokenizer.vocab_size > config.vocab_size:
        raise InvalidInputError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} ids, the model {config.vocab_size}"
        )
    return Checkpoint(
        path=path,
        format="gguf",
        model=model,
        tokenizer=tokenizer,
        chat_template=_chat_template(metadata, path),
        eos_token_ids=_eos_token_ids(metadata, config.vocab_size),
        name=metadata.string("general.name", path.stem),
        tensor_types=tensor_types,
    )


class _Metadata:
    """The key/value metadata of a GGUF file, decoded lazily (the vocabulary is large)."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as exc:
            raise InvalidInputError(f"{self.path}: cannot decode metadata {key!r}: {exc}") from exc

    def number(self, key: str, default: float | None = None) -> float:
        """A finite float metadata value. GGUF stores float32, so 1e-5 reads back as
        9.99999974e-06: take the shortest decimal that is the same float32, which is what
        the Hugging Face config it came from says (and what its float64 math then uses)."""
        value = self.get(key)
        if value is None:
            if default is None:
                raise InvalidInputError(f"{self.path}: metadata {key!r} is missing")
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidInputError(
                f"{self.path}: metadata {key!r} must be a number, got {value!r:.60}"
            )
        number = float(str(np.float32(value)))
        if not math.isfinite(number):
            raise InvalidInputError(f"{self.path}: metadata {key!r} must be finite, got {value!r}")
        return number

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        """An int metadata value of at least `minimum`; a missing one is `default` (0 and
        missing alike, for the keys llama.cpp treats 0 as unset), else an error."""
        value = self.get(key)
        if value is None or (value == 0 and default is not None and minimum > 0):
            if default is None:
                raise InvalidInputError(f"{self.path}: metadata {key!r} is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise InvalidInputError(
                f"{self.path}: metadata {key!r} must be an int >= {minimum}, got {value!r:.60}"
            )
        return value

    def string(self, key: str, default: str | None = None) -> str:
        value = self.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            raise InvalidInputError(
                f"{self.path}: metadata {key!r} must be a string, got {value!r:.60}"
            )
        return value

    def strings(self, key: str) -> list[str]:
        """A required array of strings (the vocabulary, the merges)."""
        value = self.require(key)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise InvalidInputError(
                f"{self.path}: metadata {key!r} must be an array of strings, got {value!r:.60}"
            )
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise InvalidInputError(f"{self.path}: metadata {key!r} is missing")
        return value


def _config(metadata: _Metadata, arch: str, dtype: torch.dtype) -> ModelConfig:
    prefix = f"{arch}."
    unknown = sorted(
        key
        for key in metadata
        if key.startswith(prefix)
        and key[len(prefix) :] not in _KNOWN_ARCH_KEYS | _ARCH_ONLY_KEYS.get(arch, frozenset())
    )
    if unknown:
        raise InvalidInputError(
            f"{metadata.path}: metadata this decoder does not implement: {', '.join(map(repr, unknown))}"
        )
    if any(key.startswith("split.") for key in metadata):
        raise InvalidInputError(f"{metadata.path}: split GGUF files are not supported; merge them")

    def value(key: str) -> int:
        return metadata.integer(prefix + key)

    hidden = value("embedding_length")
    heads = value("attention.head_count")
    head_dim = metadata.integer(prefix + "attention.key_length", hidden // heads)
    value_dim = metadata.integer(prefix + "attention.value_length", head_dim)
    rotary = metadata.integer(prefix + "rope.dimension_count", head_dim)
    if value_dim != head_dim or rotary != head_dim:
        raise InvalidInputError(
            f"{metadata.path}: key/value/rotary dims {head_dim}/{value_dim}/{rotary} differ; "
            "only equal ones (full rotary) are implemented"
        )
    starcoder2 = arch == "starcoder2"
    has_tokens = metadata.get("tokenizer.ggml.tokens") is not None
    tokens = metadata.strings("tokenizer.ggml.tokens") if has_tokens else []
    vocab = metadata.integer(prefix + "vocab_size", len(tokens))
    if vocab <= 0:
        raise InvalidInputError(
            f"{metadata.path}: no vocabulary size ({prefix}vocab_size, tokenizer.ggml.tokens)"
        )
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=value("block_count"),
        num_heads=heads,
        num_kv_heads=metadata.integer(prefix + "attention.head_count_kv", heads),
        head_dim=head_dim,
        intermediate_size=value("feed_forward_length"),
        rms_norm_eps=metadata.number(
            prefix
            + ("attention.layer_norm_epsilon" if starcoder2 else "attention.layer_norm_rms_epsilon")
        ),
        rope_theta=metadata.number(prefix + "rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(metadata, prefix),
        max_position_embeddings=metadata.integer(prefix + "context_length", 2048),
        # llama.cpp's phi3 slides every layer when the key is set (0 or absent: none).
        sliding_window=metadata.integer(prefix + "attention.sliding_window", 0, minimum=0) or None,
        # Starcoder2: biases on all six projections (every published one has them; llama.cpp
        # writes no use_bias, so a file without them is refused as missing tensors), LayerNorms,
        # the plain MLP with GELU-tanh (llama.cpp's GELU; Starcoder2Config's default).
        attention_qkv_bias=arch == "qwen2" or starcoder2,
        attention_output_bias=starcoder2,
        mlp_bias=starcoder2,
        layer_norm=starcoder2,
        plain_mlp_activation="gelu_pytorch_tanh" if starcoder2 else None,
        qk_norm=arch == "qwen3",
        dtype=dtype,
    )


def _rope_scaling(metadata: _Metadata, prefix: str) -> RopeScaling | None:
    kind = metadata.string(prefix + "rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = metadata.number(prefix + "rope.scaling.factor")
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "yarn":
        original = metadata.integer(prefix + "rope.scaling.original_context_length")
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=original,
            beta_fast=metadata.number(prefix + "rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=metadata.number(prefix + "rope.scaling.yarn_beta_slow", 1.0),
            attention_factor=(
                metadata.number(prefix + "rope.scaling.attn_factor")
                if metadata.get(prefix + "rope.scaling.attn_factor") is not None
                else None
            ),
        )
    raise InvalidInputError(f"{metadata.path}: rope scaling type {kind!r} is not implemented")


def _tensors(
    reader: Any, config: ModelConfig, arch: str, path: Path, gguf: Any
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    state: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        name = _hf_name(tensor.name, config.num_layers, arch)
        if name is None:
            raise InvalidInputError(f"{path}: tensor {tensor.name!r} is not part of this decoder")
        if type_name not in SUPPORTED_TYPES:
            raise InvalidInputError(
                f"{path}: tensor {tensor.name!r} is {type_name}; supported types are "
                f"{', '.join(sorted(SUPPORTED_TYPES))}"
            )
        if name in state:
            raise InvalidInputError(f"{path}: tensor {tensor.name!r} appears twice")
        shape = tuple(
            int(d) for d in reversed(tensor.shape.tolist())
        )  # GGUF lists dims inner first
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            values = np.asarray(values, dtype=np.float32).reshape(shape)
        except Exception as exc:
            raise InvalidInputError(f"{path}: cannot read tensor {tensor.name!r}: {exc}") from exc
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            if values.shape != (heads * config.head_dim, config.hidden_size):
                # Checked here, not only with the others below: `_unpermute` reshapes by head.
                raise InvalidInputError(
                    f"{path}: {name!r} has shape {values.shape}, the config says "
                    f"{(heads * config.head_dim, config.hidden_size)}"
                )
            values = _unpermute(values, heads)
        state[name] = torch.from_numpy(values.copy())
        types[type_name] = types.get(type_name, 0) + 1
    if arch in _FUSED_ARCHITECTURES:
        try:
            _split_fused_projections(state, config)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{path}: {exc}") from exc
    return state, types


def _hf_name(gguf_name: str, num_layers: int, arch: str = "llama") -> str | None:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    layer, base, kind = int(parts[1]), parts[2], parts[3]
    names = _LAYER_TENSOR_NAMES | _ARCH_LAYER_TENSOR_NAMES.get(arch, {})
    if layer >= num_layers or base not in names or kind not in ("weight", "bias"):
        return None
    return f"model.layers.{layer}.{names[base]}.{kind}"


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` (convert_hf_to_gguf.py), which within each head reorders
    rows from halves ``[x0..x(d/2-1), y0..]`` to interleaved pairs ``[x0, y0, x1, y1, ...]``."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tokenizer(metadata: _Metadata, path: Path) -> HFTokenizer:
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as exc:
        raise MissingDependencyError(
            "a GGUF file's tokenizer needs the 'tokenizers' package: pip install 'prefixkv[gguf]'"
        ) from exc
    from prefixkv.text.tokenizers import HFTokenizer

    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        from prefixkv.models.gguf_tokenizer import sentencepiece_tokenizer

        return sentencepiece_tokenizer(metadata, path)
    if kind != "gpt2":  # compared, never used: any other value or type is refused here
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; byte-level BPE ('gpt2')"
            " and SentencePiece ('llama') are"
        )
    pre = metadata.string("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported (known: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}); another split would give other token ids"
        )
    tokens = metadata.strings("tokenizer.ggml.tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidInputError(f"{path}: tokenizer.ggml.tokens repeats a token")
    merges: list[tuple[str, str]] = []
    for merge in metadata.strings("tokenizer.ggml.merges"):
        left, space, right = merge.partition(" ")
        if not (left and space and right):
            raise InvalidInputError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not 'a b'")
        # `tokenizers` raises a bare Exception for these; name the entry instead.
        missing = [part for part in (left, right, left + right) if part not in vocab]
        if missing:
            raise InvalidInputError(
                f"{path}: tokenizer.ggml.merges entry {merge!r:.60} names {missing[0]!r:.40}, "
                "which is not in tokenizer.ggml.tokens"
            )
        merges.append((left, right))
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(token_types, list) or len(token_types) != len(tokens):
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.token_type must be an array with one entry per token"
        )
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as exc:  # tokenizers raises a bare Exception
        raise InvalidInputError(f"{path}: cannot build the BPE tokenizer: {exc}") from exc
    split = _PRE_TOKENIZERS[pre]
    gpt2_regex = split in ("gpt2", "digits+gpt2")  # else the Split does it
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex)
    if split == "gpt2":
        tokenizer.pre_tokenizer = byte_level
    elif split == "digits+gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) are matched whole and special; user-defined
    # ones (<think>) whole but not special: as llama.cpp and transformers do.
    special = [t for t, kind in zip(tokens, token_types, strict=False) if kind == _CONTROL_TOKEN]
    user = [t for t, kind in zip(tokens, token_types, strict=False) if kind == _USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return HFTokenizer(f"{path}#tokenizer", json_text=tokenizer.to_str())


def _token_text(metadata: _Metadata, key: str) -> str:
    token_id = _token_id(metadata, key)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    if token_id is None or not isinstance(tokens, list) or token_id >= len(tokens):
        return ""
    return str(tokens[token_id])


def _token_id(metadata: _Metadata, key: str) -> int | None:
    """``tokenizer.ggml.<key>``: None when absent, an int >= 0, or an error naming it."""
    if metadata.get(f"tokenizer.ggml.{key}") is None:
        return None
    return metadata.integer(f"tokenizer.ggml.{key}", minimum=0)


def _chat_template(metadata: _Metadata, path: Path) -> JinjaChatTemplate | ChatTemplateSet | None:
    from prefixkv.text.chat import ChatTemplateSet, JinjaChatTemplate

    sources: dict[str, str] = {}
    if metadata.get("tokenizer.chat_template"):
        sources["default"] = metadata.string("tokenizer.chat_template")
    for key in metadata:
        if key.startswith("tokenizer.chat_template.") and metadata.get(key):
            sources[key.removeprefix("tokenizer.chat_template.")] = metadata.string(key)
    if not sources:
        return None
    extra = {
        name: text
        for name, text in (
            ("pad_token", _token_text(metadata, "padding_token_id")),
            ("unk_token", _token_text(metadata, "unknown_token_id")),
        )
        if text
    }
    templates = {
        name: JinjaChatTemplate(
            source,
            bos_token=_token_text(metadata, "bos_token_id"),
            eos_token=_token_text(metadata, "eos_token_id"),
            name=f"{path}#{name}",
            extra_context=extra,
        )
        for name, source in sources.items()
    }
    if list(templates) == ["default"]:
        return templates["default"]
    return ChatTemplateSet(templates, name=str(path))


def _eos_token_ids(metadata: _Metadata, vocab_size: int) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _token_id(metadata, key)
        if value is not None and value < vocab_size and value not in ids:
            ids.append(value)
    return tuple(ids)
