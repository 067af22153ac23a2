"""GGUF files (issue 14): tiny files written with the `gguf` package's own writer
(`tests/gguf_files.py`), from a random model and a byte-level BPE tokenizer trained there, each
compared with the same weights saved as a Hugging Face directory.

The writer does what llama.cpp's converter does (permutes the Q/K rows of the ``llama``
architecture, quantizes with ``gguf.quants.quantize``), so a loader that forgets to undo the
permutation, names a tensor wrongly or dequantizes the wrong type fails here. The real
SmolLM2 file is only used by `test_real_model.py` (opt-in: ``-m real_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.models.decoder import LlamaModel, RopeScaling
from prefixkv.models.gguf import is_gguf, load_gguf
from tests.gguf_files import TOKENS, finish, tiny_model, write_gguf
from tests.gguf_files import tokenizer as tokenizer  # the module-scoped fixture

gguf = pytest.importorskip("gguf")

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour of the sea, and 2024 + 17."},
]
TEXTS = ["Name a colour of the sea.", "order 00417 ships 12 units", " the  sky\n\nis grey's"]
#: Largest |dequantized - original| per element, relative to its 32-element block's absmax
#: (llama.cpp's formats): half a step for Q8_0 (1/127 of absmax) and the min/scale types
#: Q4_1/Q5_1 ((max - min) / 15 or 31); Q4_0/Q5_0 scale by the signed extreme over -8 / -16,
#: so the other side's largest value can be clipped by up to a whole step (1/8, 1/16).
RELATIVE_ERROR = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 4e-3,
    "Q8_0": 0.5 / 127 + 1e-3,
    "Q5_0": 1 / 16 + 1e-3,
    "Q5_1": 1 / 31 + 1e-3,
    "Q4_0": 1 / 8 + 1e-3,
    "Q4_1": 1 / 15 + 1e-3,
}


@pytest.mark.parametrize("qtype", sorted(RELATIVE_ERROR))  # K-quants: test_gguf_kquants.py
def test_each_supported_type_loads_the_same_weights_as_the_hf_directory(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str
) -> None:
    ours = tiny_model(tokenizer, tie_word_embeddings=qtype == "Q8_0")
    ours.save_pretrained(tmp_path / "hf")
    hf = LlamaModel.from_pretrained(tmp_path / "hf")
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", ours, tokenizer, qtype=qtype)).model
    assert loaded.config == hf.config
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for name, expected in hf.state_dict().items():
        got = loaded.state_dict()[name]
        if qtype == "F32" or expected.ndim == 1:
            assert torch.equal(got, expected), name
            continue
        # Exactly the HF weight through the file's quantization, in HF row order...
        values = expected.numpy()
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(values, quant), quant)
        assert torch.equal(got, torch.from_numpy(round_trip.reshape(values.shape))), name
        # ...hence within that quantization's own error of the HF weight.
        blocks = values.reshape(-1, 32)
        scale = np.abs(blocks).max(axis=1, keepdims=True)
        error = np.abs(got.numpy().reshape(-1, 32) - blocks)
        assert (error <= RELATIVE_ERROR[qtype] * scale + 1e-7).all(), name
    if qtype == "F32":
        assert torch.equal(loaded.forward_full(TOKENS), hf.forward_full(TOKENS))


def test_q_k_rows_are_unpermuted_for_llama_and_not_for_qwen2(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    for arch, changes in (("llama", {}), ("qwen2", {"attention_qkv_bias": True})):
        ours = tiny_model(tokenizer, **changes)
        path = write_gguf(tmp_path / f"{arch}.gguf", ours, tokenizer, arch=arch)
        loaded = load_gguf(path).model
        assert loaded.config == ours.config
        torch.testing.assert_close(loaded.forward_full(TOKENS), ours.forward_full(TOKENS))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_qwen3_file_loads_as_its_checkpoint_and_as_transformers_reads_it(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str
) -> None:
    """``qwen3``: q/k norms (``attn_q_norm`` / ``attn_k_norm``), a head_dim of its own (the
    key_length metadata), Q/K rows not permuted. Compared with the HF directory of the same
    weights and with transformers' own GGUF loader."""
    # head_dim 128 (not hidden / heads = 16): transformers' GGUF conversion does not read
    # key_length and takes Qwen3Config's default, 128, as every published Qwen3 has.
    ours = tiny_model(tokenizer, qk_norm=True, head_dim=128)
    ours.save_pretrained(tmp_path / "hf")
    hf = LlamaModel.from_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "m.gguf", ours, tokenizer, arch="qwen3", qtype=qtype)
    loaded = load_gguf(path).model
    assert loaded.config == hf.config and loaded.config.qk_norm
    if qtype == "F32":
        for name, tensor in hf.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
    # transformers' own GGUF reading (name mapping, row order, dequantization), without the
    # `accelerate` package its from_pretrained(gguf_file=...) asks for.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert config.model_type == "qwen3"
    theirs = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=theirs)["tensors"]
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        expected = theirs(TOKENS[None]).logits[0]
    logits = loaded.forward_full(TOKENS)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    # The norms under an architecture without them are refused, not dropped.
    with pytest.raises(InvalidInputError, match="q_norm"):
        load_gguf(write_gguf(tmp_path / "llama.gguf", ours, tokenizer, arch="llama"))


def test_yarn_metadata_is_read(tmp_path: Path, tokenizer: Tokenizer) -> None:
    scaling = RopeScaling("yarn", 4.0, original_max_position_embeddings=32)
    ours = tiny_model(tokenizer, rope_scaling=scaling, max_position_embeddings=128)
    loaded = load_gguf(write_gguf(tmp_path / "m.gguf", ours, tokenizer)).model
    assert loaded.config.rope_scaling == scaling


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_the_tokenizer_encodes_as_transformers_gguf_conversion(
    tmp_path: Path, tokenizer: Tokenizer, pre: str
) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model(tokenizer), tokenizer, pre=pre)
    ours = load_gguf(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    if pre == "default":  # the same split as the tokenizer it came from
        for text in TEXTS:
            assert ours.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_smollm_pre_tokenizer_splits_every_digit(
    smollm_tokenizer: Any, tokenizer: Tokenizer
) -> None:
    """llama.cpp's 'smollm' split (each digit alone, then GPT-2's): "2024" is four tokens
    even though the vocabulary has merges for it."""
    ours = smollm_tokenizer
    assert len(tokenizer.encode("2024", add_special_tokens=False).ids) < 4
    assert [ours.decode([i]) for i in ours.encode("2024")] == ["2", "0", "2", "4"]


@pytest.fixture(scope="module")
def smollm_tokenizer(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Any:
    path = tmp_path_factory.mktemp("smollm") / "m.gguf"
    return load_gguf(write_gguf(path, tiny_model(tokenizer), tokenizer, pre="smollm")).tokenizer


@given(text=st.text(max_size=40))
def test_the_tokenizer_round_trips_any_text(smollm_tokenizer: Any, text: str) -> None:
    """Byte-level: every string, any script or special-token text in it, comes back."""
    assert smollm_tokenizer.decode(smollm_tokenizer.encode(text)) == text


def test_chat_through_the_engine_gives_transformers_apply_chat_template_ids(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model(tokenizer), tokenizer)
    checkpoint = load_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    expected = theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    engine = Engine(
        checkpoint.model,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        stop_token_ids=checkpoint.eos_token_ids,
        num_blocks=64,
        block_size=4,
    )
    assert engine.encode(MESSAGES) == list(expected)
    assert checkpoint.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)


def test_engine_from_pretrained_serves_a_gguf_file_as_its_metadata_says(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    model = tiny_model(tokenizer)
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    engine = Engine.from_pretrained(path, num_blocks=64, block_size=4)
    checkpoint = load_gguf(path)
    assert engine.stop_token_ids == checkpoint.eos_token_ids
    assert engine.encode(MESSAGES) == Engine(**checkpoint.engine_options()).encode(MESSAGES)
    (result,) = engine.generate([MESSAGES], max_new_tokens=3, check_exactness=True)
    assert result.tokens_match
    # An explicit argument wins over the file's metadata.
    assert Engine.from_pretrained(path, stop_token_ids=()).stop_token_ids == ()
    bare = write_gguf(tmp_path / "bare.gguf", model, tokenizer, chat_template=None)
    with pytest.raises(InvalidInputError, match="has no chat template"):
        Engine.from_pretrained(bare).encode(MESSAGES)


def test_a_file_without_a_template_has_none(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write_gguf(tmp_path / "m.gguf", tiny_model(tokenizer), tokenizer, chat_template=None)
    assert load_gguf(path).chat_template is None


def test_refusals_name_the_problem(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model = tiny_model(tokenizer)
    good = write_gguf(tmp_path / "good.gguf", model, tokenizer)
    assert is_gguf(good) and not is_gguf(Path(__file__))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(InvalidInputError, match=r"truncated\.gguf"):
        load_gguf(truncated)
    with pytest.raises(InvalidInputError, match=r"'llama\.expert_count'"):
        load_gguf(
            write_gguf(tmp_path / "a.gguf", model, tokenizer, extra={"llama.expert_count": 8})
        )
    with pytest.raises(InvalidInputError, match="'smollm3'"):
        load_gguf(write_gguf(tmp_path / "b.gguf", model, tokenizer, arch="smollm3"))
    with pytest.raises(InvalidInputError, match="'mystery-bpe'"):
        load_gguf(write_gguf(tmp_path / "c.gguf", model, tokenizer, pre="mystery-bpe"))


def test_an_unsupported_tensor_type_is_refused_by_name(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(300)
    # A ternary type: not implemented here (K- and i-quants are, tests/test_gguf_[ki]quants.py).
    ternary = gguf.GGMLQuantizationType.TQ2_0
    raw = np.zeros(gguf.quants.quant_shape_to_byte_shape((300, 256), ternary), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=ternary)
    finish(writer)
    with pytest.raises(InvalidInputError, match="TQ2_0"):
        load_gguf(path)
