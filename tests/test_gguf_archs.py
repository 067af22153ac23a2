"""GGUF architectures beyond Llama / Qwen (issue 23), each from a tiny checkpoint transformers
writes at test time, saved both as a Hugging Face directory and as the GGUF file llama.cpp's
converter would write from it (`tests/gguf_files.py`). Each file must load as that checkpoint
(same config, same weights, logits within float32 rounding, the same greedy tokens through the
Engine) and as transformers' own GGUF conversion of the file computes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.models.decoder import LlamaModel
from prefixkv.models.gguf import load_gguf
from tests.gguf_files import TOKENS, add_model_tensors, finish, start_llama_file, write_gguf
from tests.gguf_files import tokenizer as tokenizer  # the module-scoped fixture

gguf = pytest.importorskip("gguf")


def _close(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """Within float32 rounding of the logits' scale."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * scale)


def _transformers_gguf_logits(directory: Path, path: Path, model_type: str) -> torch.Tensor:
    """Logits of `TOKENS` under transformers' own conversion of the file (config mapping, tensor
    names, fused layouts, dequantization), without the `accelerate` package that
    ``from_pretrained(gguf_file=...)`` asks for."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(directory, gguf_file=path.name)
    assert config.model_type == model_type
    theirs = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=theirs)["tensors"]
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        logits: torch.Tensor = theirs(TOKENS[None]).logits[0]
    return logits


def _phi3_checkpoint(directory: Path, tokenizer: Tokenizer, window: int | None) -> LlamaModel:
    """A Phi-3 checkpoint transformers writes, q/k rows and the up half scaled up so attention
    is sharp and a swapped slice of a fused tensor shows; read back by prefixkv's HF loader."""
    config = transformers.Phi3Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, pad_token_id=None, sliding_window=window,
    )  # fmt: skip
    torch.manual_seed(3)
    theirs = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for layer in theirs.model.layers:
            layer.self_attn.qkv_proj.weight[: 64 + 32].mul_(20.0)  # the q and k rows
            layer.mlp.gate_up_proj.weight[96:].mul_(3.0)  # the up half
    theirs.save_pretrained(directory)
    return LlamaModel.from_pretrained(directory, dtype=torch.float32)


@pytest.mark.parametrize(("window", "qtype"), [(None, "F32"), (7, "F32"), (None, "Q8_0")])
def test_a_phi3_file_loads_as_its_checkpoint_and_as_transformers_reads_it(
    tmp_path: Path, tokenizer: Tokenizer, window: int | None, qtype: str
) -> None:
    """``phi3``: fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up rows), Q/K not
    permuted, ``phi3.attention.sliding_window`` on every layer."""
    hf = _phi3_checkpoint(tmp_path, tokenizer, window)
    extra = {"phi3.rope.scaling.original_context_length": 256}  # llama.cpp always writes it
    if window is not None:
        extra["phi3.attention.sliding_window"] = window
    # A padding id in the vocabulary: else transformers' conversion keeps Phi3Config's 32000,
    # which its embedding refuses for a 300-token vocabulary.
    pad = {"tokenizer.ggml.padding_token_id": (0, gguf.GGUFValueType.UINT32)}
    path = write_gguf(
        tmp_path / "m.gguf", hf, tokenizer, arch="phi3", qtype=qtype, extra=extra, replace=pad
    )
    loaded = load_gguf(path).model
    assert loaded.config == hf.config
    assert set(loaded.config.layer_sliding_windows) == {window}
    if qtype == "F32":
        for name, tensor in hf.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
        _close(loaded.forward_full(TOKENS), hf.forward_full(TOKENS))
    if window is None:
        # transformers' phi3 mapping reads no sliding_window (Phi3Config's default, None):
        # compared where the file has none, so both compute the same thing.
        _close(loaded.forward_full(TOKENS), _transformers_gguf_logits(tmp_path, path, "phi3"))
    _assert_served_alike(hf, loaded, same_weights=qtype == "F32")


def test_a_longrope_phi3_file_is_refused_naming_its_factors(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """Phi-3-mini-128k / Phi-3.5 files carry LongRoPE's factors as ``rope_factors_long`` /
    ``rope_factors_short`` tensors; reading the file without them would compute another model."""
    hf = _phi3_checkpoint(tmp_path, tokenizer, None)
    path = tmp_path / "long.gguf"
    writer = start_llama_file(path, "phi3", "tiny longrope", hf.config)
    writer.add_vocab_size(hf.config.vocab_size)
    add_model_tensors(writer, hf, arch="phi3")
    factors = torch.linspace(1.0, 4.0, hf.config.head_dim // 2).numpy()
    writer.add_tensor("rope_factors_long.weight", factors)
    finish(writer)
    with pytest.raises(InvalidInputError, match="rope_factors_long"):
        load_gguf(path)


def _starcoder2_checkpoint(directory: Path, tokenizer: Tokenizer) -> LlamaModel:
    """A Starcoder2 checkpoint transformers writes (LayerNorm epsilon 1e-3, so reading the
    RMS key instead shows), q/k scaled up and the norms' biases made large enough to matter."""
    config = transformers.Starcoder2Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, norm_epsilon=1e-3, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(4)
    theirs = transformers.Starcoder2ForCausalLM(config)
    with torch.no_grad():
        for layer in theirs.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1.0, 0.3)
                norm.bias.normal_(0.0, 0.5)
        theirs.model.norm.bias.normal_(0.0, 0.5)
    theirs.save_pretrained(directory)
    return LlamaModel.from_pretrained(directory, dtype=torch.float32)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_starcoder2_file_loads_as_its_checkpoint_and_as_transformers_reads_it(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str
) -> None:
    """``starcoder2``: LayerNorms with biases (``output_norm.bias`` too) and the
    ``attention.layer_norm_epsilon`` key, biased projections, ``ffn_up`` / ``ffn_down`` as the
    plain MLP's ``c_fc`` / ``c_proj``, Q/K not permuted, tied embeddings."""
    hf = _starcoder2_checkpoint(tmp_path, tokenizer)
    assert hf.config.layer_norm and hf.config.tie_word_embeddings
    f32 = gguf.GGUFValueType.FLOAT32
    metadata = {
        "starcoder2.attention.layer_norm_epsilon": (1e-3, f32),
        # What Starcoder2-15B's file carries beside it: not what its LayerNorms use.
        "starcoder2.attention.layer_norm_rms_epsilon": (1e-6, f32),
    }
    path = write_gguf(
        tmp_path / "m.gguf", hf, tokenizer, arch="starcoder2", qtype=qtype, pre="starcoder",
        replace=metadata,
    )  # fmt: skip
    loaded = load_gguf(path).model
    assert loaded.config == hf.config
    if qtype == "F32":
        for name, tensor in hf.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
        _close(loaded.forward_full(TOKENS), hf.forward_full(TOKENS))
    _close(loaded.forward_full(TOKENS), _transformers_gguf_logits(tmp_path, path, "starcoder2"))
    _assert_served_alike(hf, loaded, same_weights=qtype == "F32")


def _assert_served_alike(hf: LlamaModel, loaded: LlamaModel, *, same_weights: bool) -> None:
    """Served through the Engine (equal to its own recompute, after a cached prefix and in
    8-token chunks): with the same weights, the same greedy tokens as the HF directory's model
    (a quantized file is a different model: its own recompute only)."""
    prompt = TOKENS.tolist()
    outputs = []
    for model in (hf, loaded):
        engine = Engine(model, num_blocks=32, block_size=4, max_num_batched_tokens=8)
        results = [
            engine.generate([tokens], max_new_tokens=6, check_exactness=True)[0]
            for tokens in (prompt, [*prompt[:24], 5, 6, 7])
        ]
        assert all(result.tokens_match for result in results)
        assert results[1].cached_tokens >= 20
        outputs.append([result.output_token_ids for result in results])
    if same_weights:
        assert outputs[0] == outputs[1]
