"""Tiny GGUF files for the GGUF tests, written with the `gguf` package's own writer the way
llama.cpp's converter writes them: the Llama hyperparameters, Q/K rows permuted for the
``llama`` architecture, norms kept F32. `write_gguf` writes a random model with a byte-level
BPE vocabulary (the `tokenizer` fixture); `test_gguf_sentencepiece` writes its own vocabulary
through `start_llama_file` and `add_model_tensors`. `quant_checkpoint` builds a file of raw
K-quant or i-quant blocks and the Hugging Face directory of their dequantized values, and the
two `assert_...` helpers are the checks both quant test modules make of such a file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.models.checkpoint import Checkpoint
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.models.gguf import load_gguf
from tests import tokenizer_support

gguf = pytest.importorskip("gguf")

__all__ = [
    "CHATML",
    "SPECIALS",
    "TOKENS",
    "add_model_tensors",
    "assert_pre_scan_sizes_the_last_tensor_exactly",
    "assert_serves_as_its_dequantized_checkpoint",
    "byte_level_bpe",
    "finish",
    "gguf_name",
    "permute",
    "quant_checkpoint",
    "quant_matrices",
    "start_llama_file",
    "tiny_model",
    "tokenizer",
    "write_gguf",
]

CHATML = (Path(__file__).parent / "data" / "chatml.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = torch.tensor([(37 * i + 11) % 300 for i in range(40)])
_CORPUS = [
    *["You are terse. Name a colour of the sea. system user assistant"] * 20,
    *["the sky is grey, the sea is blue; order 2024 ships 17 units"] * 20,
]


def byte_level_bpe(corpus: list[str] = _CORPUS) -> Tokenizer:
    """A GPT-2 style tokenizer (byte-level BPE, 300 tokens, `SPECIALS`) trained on `corpus`."""
    tokenizer: Tokenizer = tokenizer_support.byte_level_bpe(
        corpus, vocab_size=300, special_tokens=SPECIALS
    )
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_level_bpe()


def tiny_model(tokenizer: Tokenizer, **changes: Any) -> LlamaModel:
    return LlamaModel.random(ModelConfig(vocab_size=tokenizer.get_vocab_size(), **changes), seed=5)


def start_llama_file(path: Path, arch: str, name: str, config: ModelConfig) -> Any:
    """A `gguf.GGUFWriter` for `path` holding `config`'s hyperparameters under `arch`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    return writer


def add_model_tensors(
    writer: Any,
    model: LlamaModel,
    *,
    arch: str = "llama",
    qtype: str = "F32",
    tensors: dict[str, np.ndarray] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> None:
    """`model`'s weights by GGUF name, matrices quantized to `qtype` (see `write_gguf`)."""
    config = model.config
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if arch == "phi3" and name.endswith(_FUSED_INTO):
            continue  # written inside its fused tensor
        if arch == "phi3" and name.endswith(tuple(_FUSED_FIRST)):
            # llama.cpp's phi3 keeps the checkpoint's fused attn_qkv / ffn_up (q, k, v rows;
            # gate, then up rows).
            first = next(key for key in _FUSED_FIRST if name.endswith(key))
            parts = [state[name.replace(first, piece)] for piece in _FUSED_FIRST[first][1]]
            values = torch.cat(parts).to(torch.float32).numpy()
            fused = gguf_name(name).replace(*_FUSED_FIRST[first][0])
            writer.add_tensor(fused, gguf.quants.quantize(values, quant), raw_dtype=quant)
            continue
        if raw_tensors and name in raw_tensors:
            blocks, raw_type = raw_tensors[name]
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=raw_type)
            continue
        values = tensor.to(torch.float32).numpy()
        values = (tensors or {}).get(gguf_name(name), values)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            if values.shape[0] % (2 * heads) == 0:
                values = permute(values, heads)
        if values.ndim == 1:  # norms and biases stay F32, as llama.cpp keeps them
            writer.add_tensor(gguf_name(name), values)
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, quant), raw_dtype=quant)


#: Phi-3's fused tensors: the first piece's name -> ((its GGUF name, the fused one), pieces).
_FUSED_FIRST = {
    "self_attn.q_proj.weight": (
        ("attn_q.", "attn_qkv."),
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "mlp.gate_proj.weight": (
        ("ffn_gate.", "ffn_up."),
        ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    ),
}
_FUSED_INTO = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")


def finish(writer: Any) -> None:
    """Write the header, the metadata and the tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(
    path: Path,
    model: LlamaModel,
    tokenizer: Tokenizer,
    *,
    qtype: str = "F32",
    arch: str = "llama",
    pre: str = "default",
    chat_template: str | None = CHATML,
    extra: dict[str, Any] | None = None,
    replace: dict[str, tuple[Any, Any]] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """`model` and `tokenizer` as llama.cpp's converter writes them; `replace` overwrites
    metadata keys with (value, GGUFValueType) and `tensors` tensors by GGUF name (hostile
    files for tests). `raw_tensors` gives some tensors (by Hugging Face name) as
    already-encoded blocks in the file's row order, with their quantization type (the `gguf`
    package has no quantizer for K-quants)."""
    config = model.config
    writer = start_llama_file(path, arch, "tiny test model", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(config.rope_scaling.kind))
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(config.rope_scaling.original_max_position_embeddings)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    data = json.loads(tokenizer.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIALS else 1 for token in tokens])
    merges = data["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, (value, value_type) in (replace or {}).items():
        sub_type = None
        if value_type == gguf.GGUFValueType.ARRAY:
            sub_type = gguf.GGUFValueType.get_type(value[0])
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    add_model_tensors(
        writer, model, arch=arch, qtype=qtype, tensors=tensors, raw_tensors=raw_tensors
    )
    finish(writer)
    return path


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute`, as written there."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "model.norm.bias": "output_norm.bias",
    }
    if hf_name in names:
        return names[hf_name]
    layer_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.c_fc": "ffn_up",  # Starcoder2's plain MLP
        "mlp.c_proj": "ffn_down",
    }
    _, _, layer, *rest = hf_name.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{layer_names[module]}.{kind}"


# -- files of raw quantized blocks (test_gguf_kquants, test_gguf_iquants) ----------------------


def _quant_config(tokenizer: Tokenizer, **changes: Any) -> ModelConfig:
    # Rows of 256 values: a K-quant or i-quant block spans a whole super-block of one row.
    return ModelConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=256,
        num_heads=4, num_kv_heads=2, head_dim=64, **changes,
    )  # fmt: skip


def quant_matrices(tokenizer: Tokenizer) -> list[str]:
    """The Hugging Face names of the matrices of `quant_checkpoint`'s model."""
    model = LlamaModel(_quant_config(tokenizer))
    return [name for name, tensor in model.state_dict().items() if tensor.ndim == 2]


def quant_checkpoint(
    directory: Path,
    tokenizer: Tokenizer,
    types: dict[str, str],
    draw_blocks: Callable[[str, int, int, float], np.ndarray],
    dequantize: Callable[[np.ndarray, str], np.ndarray],
    arch: str = "llama",
) -> tuple[Path, Path]:
    """A tiny Llama (Qwen3 for ``arch="qwen3"``) as a GGUF whose matrices are raw quantized
    blocks (`types`: Hugging Face name -> type; norms stay F32, as llama.cpp keeps them), and
    the same model as a Hugging Face directory holding the blocks' dequantized values.

    ``draw_blocks(qtype, rows, columns, std)`` gives a ``[rows, columns]`` tensor's blocks with
    about the spread `std` (one scale per tensor, so that each has about the spread
    `LlamaModel.random` gives it); ``dequantize(blocks, qtype)`` is the reference port."""
    config = _quant_config(tokenizer, qk_norm=arch == "qwen3")
    ours = LlamaModel.random(config, seed=5)
    state = dict(ours.state_dict())
    raw_tensors: dict[str, tuple[np.ndarray, Any]] = {}
    for name, qtype in types.items():
        rows, columns = state[name].shape
        blocks = draw_blocks(qtype, rows, columns, float(state[name].std()))
        state[name] = torch.from_numpy(dequantize(blocks, qtype))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter permutes Q/K rows; a row is whole blocks here.
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            blocks = permute(blocks, heads)
        raw_tensors[name] = (blocks, getattr(gguf.GGMLQuantizationType, qtype))
    ours.load_state_dict(state)
    ours.save_pretrained(directory / "hf")
    path = write_gguf(directory / "m.gguf", ours, tokenizer, arch=arch, raw_tensors=raw_tensors)
    return path, directory / "hf"


def assert_serves_as_its_dequantized_checkpoint(
    path: Path, hf_directory: Path, types: dict[str, str]
) -> Checkpoint:
    """The file's weights are exactly the Hugging Face directory's, its tensor types are
    `types`, and the engine serving it gives the directory's greedy tokens and logits (the
    second prompt after a cached prefix). Returns the loaded file."""
    checkpoint = load_gguf(path)
    hf = LlamaModel.from_pretrained(hf_directory)
    assert checkpoint.model.config == hf.config
    expected_types = {kind: list(types.values()).count(kind) for kind in set(types.values())}
    assert {k: v for k, v in checkpoint.tensor_types.items() if k != "F32"} == expected_types
    loaded = checkpoint.model.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    logits = checkpoint.model.forward_full(TOKENS)
    assert torch.equal(logits, hf.forward_full(TOKENS))
    assert logits.std() > 0.5  # a model that computes something, not all-zero weights

    engine = Engine.from_pretrained(
        path, num_blocks=64, block_size=4, max_num_batched_tokens=16, stop_token_ids=()
    )
    reference = Engine(hf, num_blocks=64, block_size=4)
    prompt = TOKENS.tolist()
    for tokens in (prompt, [*prompt[:24], 7, 8, 9]):  # the second after a cached prefix
        (ours,) = engine.generate([tokens], max_new_tokens=6, check_exactness=True)
        (theirs,) = reference.generate([tokens], max_new_tokens=6)
        assert ours.output_token_ids == theirs.output_token_ids
        assert ours.max_logit_diff is not None and ours.max_logit_diff < 1e-4
    assert ours.cached_tokens >= 20
    return checkpoint


def assert_pre_scan_sizes_the_last_tensor_exactly(
    path: Path, qtype: str, bad_row: int, refusal: str
) -> None:
    """The bounded pre-scan (`prefixkv.models.gguf_header`) counts the bytes of `path`'s last
    tensor (of `qtype`) from its blocks: the file one byte short of it is refused, naming it,
    before the reader sees it, and the file ending exactly there loads. With the first row of
    ``blk.0.attn_q.weight`` (256 values) made `bad_row` values, not whole blocks, the file is
    refused with a message matching `refusal`. Variants are written beside `path`."""
    good = path.read_bytes()
    last = gguf.GGUFReader(str(path)).tensors[-1]
    assert last.tensor_type == getattr(gguf.GGMLQuantizationType, qtype)
    end = int(last.data_offset) + int(last.n_bytes)
    short = path.parent / "short.gguf"
    short.write_bytes(good[: end - 1])
    with pytest.raises(InvalidInputError, match=rf"tensor '{last.name}' needs \d+ bytes"):
        load_gguf(short)
    (path.parent / "exact.gguf").write_bytes(good[:end])
    load_gguf(path.parent / "exact.gguf")  # the last tensor's bytes exactly: loads

    # Dims are u64s after the name and a u32 count.
    name = b"blk.0.attn_q.weight"
    at = good.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
    assert struct.unpack_from("<Q", good, at)[0] == 256
    bad = bytearray(good)
    struct.pack_into("<Q", bad, at, bad_row)
    (path.parent / "bad_row.gguf").write_bytes(bytes(bad))
    with pytest.raises(InvalidInputError, match=refusal):
        load_gguf(path.parent / "bad_row.gguf")
