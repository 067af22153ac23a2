"""`prefixkv demo --model PATH` and `load_checkpoint` (issue 14), on tiny checkpoints written
here: a GGUF file (`gguf_files.write_gguf`) and the same model as a Hugging Face directory.

The real SmolLM2 run is `test_real_model.py` (opt-in).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from prefixkv.apps import cli
from prefixkv.errors import InvalidInputError
from prefixkv.models.checkpoint import load_checkpoint
from prefixkv.models.decoder import LlamaModel, ModelConfig
from tests.demo_support import run_demo_model
from tests.gguf_files import CHATML, write_gguf
from tests.gguf_files import tokenizer as tokenizer

CHAT = [{"role": "user", "content": "Name a colour of the sea."}]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the CLI sets it for the process


@pytest.fixture
def gguf_file(tmp_path: Path, tokenizer: Tokenizer) -> Path:
    model = LlamaModel.random(ModelConfig(vocab_size=tokenizer.get_vocab_size()), seed=2)
    return write_gguf(tmp_path / "tiny.gguf", model, tokenizer, qtype="Q8_0")


def test_demo_model_serves_a_gguf_with_its_template(
    gguf_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = run_demo_model(gguf_file, capsys)
    assert data["model"]["name"] == "tiny test model (gguf: 5 F32, 16 Q8_0)"
    # chatml.jinja renders tools itself: they stay tools, not system-prompt text.
    assert data["workload"]["tools_in_system_prompt"] is False
    assert len(data["answers"]) == 3 and all(a["query"] for a in data["answers"])
    assert data["workload"]["checked_requests"] == [0, 1, 2]  # 3 requests, sample of 3


def test_demo_model_refuses_a_checkpoint_without_a_template(
    tmp_path: Path,
    tokenizer: Tokenizer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = LlamaModel.random(ModelConfig(vocab_size=tokenizer.get_vocab_size()), seed=2)
    path = write_gguf(tmp_path / "bare.gguf", model, tokenizer, chat_template=None)
    assert cli.main(["demo", "--model", str(path), "--quiet", "--threads", "1"]) == 2
    assert "no chat template (looked for tokenizer.chat_template)" in capsys.readouterr().err
    assert cli.main(["demo", "--model", str(tmp_path / "none.gguf"), "--quiet"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_load_checkpoint_reads_both_formats_alike(
    tmp_path: Path,
    tokenizer: Tokenizer,
) -> None:
    model = LlamaModel.random(ModelConfig(vocab_size=tokenizer.get_vocab_size()), seed=2)
    gguf_path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(CHATML)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    eos = tokenizer.token_to_id("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    from_gguf, from_hf = load_checkpoint(gguf_path), load_checkpoint(directory)
    assert (from_gguf.format, from_hf.format) == ("gguf", "hf")
    assert from_gguf.eos_token_ids == from_hf.eos_token_ids == (eos,)
    for checkpoint in (from_gguf, from_hf):
        assert checkpoint.tokenizer is not None and checkpoint.chat_template is not None
    rendered = [c.chat_template.render(CHAT) for c in (from_gguf, from_hf)]  # type: ignore[union-attr]
    assert rendered[0] == rendered[1]
    ids = [c.tokenizer.encode(rendered[0]) for c in (from_gguf, from_hf)]  # type: ignore[union-attr]
    assert ids[0] == ids[1]
    tokens = torch.tensor(ids[0])
    assert torch.equal(from_gguf.model.forward_full(tokens), from_hf.model.forward_full(tokens))
    with pytest.raises(InvalidInputError, match="neither"):
        load_checkpoint(Path(__file__))
