"""SentencePiece vocabularies in GGUF files (issue 23: Llama 2 / Mistral as downloaded).

The files are written here with the `gguf` package's writer the way llama.cpp's converter
writes a SentencePiece model: pieces, scores and token types, the 256 byte-fallback pieces, no
merges. The vocabulary comes from a BPE trained here on a Metaspace split; its merge order
becomes the scores. Each file is read by `load_gguf` and by transformers' own GGUF loader
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), and the two must agree token for token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from prefixkv.engine.facade import Engine
from prefixkv.errors import InvalidInputError
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.models.gguf import load_gguf
from tests.gguf_files import add_model_tensors, finish, start_llama_file

gguf = pytest.importorskip("gguf")

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
CONTROL = ["[INST]", "[/INST]"]
USER_DEFINED = ["<tool>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CORPUS = [
    "Hello world, the sky is grey and the sea is blue.",
    "Order 2024 ships 17 units; naïve café owners smile.",
    "def main():\n    return the_answer  # a comment\n",
] * 20
#: Llama 2's chat format: the template writes BOS itself, before each turn.
LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "Hello world, 2024 🦙?"},
    {"role": "assistant", "content": "the sea is blue"},
    {"role": "user", "content": "and  the sky\nnaïve?"},
]
TEXTS = [
    "Hello world",
    " leading space",
    "  two leading spaces and  doubled  inside",
    "trailing space ",
    "new\nline\n\nand\r\ncrlf\ttab",
    "digits 2024 and 3.14159 and 00017",
    "unicode café naïve Ωmega 中文字符",
    "emoji needing bytes 🦙🚀 and é́ combining",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "[INST]glued[/INST]<tool>call</tool><unk>",
    "a literal \u2581 metaspace character",
    "",
    " ",
    "\n",
    "abcd and abcd, xbacd",
]


@pytest.fixture(scope="module")
def pieces() -> list[str]:
    return trained_pieces()


def trained_pieces() -> list[str]:
    """Pieces in the order a SentencePiece BPE model lists them: merged pieces by merge
    order, then single characters."""
    trainer_model = Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer_model.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=260))
    data = json.loads(trainer_model.to_str())
    merged = ["".join(m if isinstance(m, list) else m.split(" ")) for m in data["model"]["merges"]]
    singles = [t for t in data["model"]["vocab"] if len(t) == 1]
    # For equal scores: "cd" listed before "▁abc", yet the longer left part ("▁ab" +
    # "c") is merged first: " abcd" is "▁abc" "d". "ba" listed before "acd", yet the longer
    # right part ("a" + "cd") is merged first: "xbacd" ends "b" "acd".
    designed = ["cd", "ab", "▁ab", "▁abc", "ba", "acd"]
    return list(dict.fromkeys([*designed, *merged, *singles]))


def vocabulary(pieces: list[str], *, tied: int = 1) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) as llama.cpp's converter lists them."""
    tokens = [UNK, BOS, EOS, *BYTES, *CONTROL, *USER_DEFINED, *pieces]
    scores = [0.0] * (len(tokens) - len(pieces))
    # Rank by merge order, `tied` pieces to a score: with ties, the tie-break decides (with
    # one score for all, it alone does).
    scores += [-float(i // tied) for i in range(len(pieces))]
    types = [2, 3, 3, *[6] * 256, *[3] * len(CONTROL), *[4] * len(USER_DEFINED)]
    types += [1] * len(pieces)
    return tokens, scores, types


def write_spm_gguf(
    path: Path,
    tokens: list[str],
    scores: list[float],
    types: list[int],
    *,
    flags: dict[str, bool] | None = None,
    strings: dict[str, Any] | None = None,
) -> Path:
    """A tiny random Llama with the SentencePiece vocabulary `tokens`; `flags` are
    ``tokenizer.ggml.<key>`` bools, `strings` other string / string-array keys."""
    config = ModelConfig(vocab_size=len(tokens))
    model = LlamaModel.random(config, seed=3)
    writer = start_llama_file(path, "llama", "tiny sentencepiece model", config)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(tokens.index(BOS))
    writer.add_eos_token_id(tokens.index(EOS))
    writer.add_unk_token_id(tokens.index(UNK))
    for key, flag in (flags or {}).items():
        writer.add_bool(f"tokenizer.ggml.{key}", flag)
    for key, value in (strings or {}).items():
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
    add_model_tensors(writer, model)
    finish(writer)
    return path


def both(path: Path) -> tuple[Any, Any]:
    ours = load_gguf(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


@pytest.mark.parametrize("tied", [1, 4, 10_000])
def test_a_sentencepiece_file_encodes_as_transformers_gguf_loader(
    tmp_path: Path, pieces: list[str], tied: int
) -> None:
    path = write_spm_gguf(tmp_path / "m.gguf", *vocabulary(pieces, tied=tied))
    ours, theirs = both(path)
    assert ours.vocab_size == len(theirs)
    fallbacks = 0
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        # BOS added as the file (by default) says, where text is encoded with special tokens.
        assert ours._tokenizer.encode(text).ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
        fallbacks += sum(1 for i in ids if i in range(3, 259))
    assert fallbacks > 10  # emoji, CJK and combining marks went through the byte pieces
    assert ours.encode("Hello")[0] != ours.token_to_id("<0x48>")  # merges were applied


def test_add_bos_false_and_add_eos_true_are_followed(tmp_path: Path, pieces: list[str]) -> None:
    flags = {"add_bos_token": False, "add_eos_token": True, "add_space_prefix": True}
    path = write_spm_gguf(tmp_path / "m.gguf", *vocabulary(pieces), flags=flags)
    ours, theirs = both(path)
    for text in TEXTS:
        assert ours._tokenizer.encode(text).ids == theirs.encode(text), text
    assert ours._tokenizer.encode("hi").ids[-1] == ours.token_to_id(EOS)


def test_merges_listed_in_the_file_are_accepted_only_when_the_scores_imply_them(
    tmp_path: Path, pieces: list[str]
) -> None:
    tokens, scores, types = vocabulary(pieces)
    theirs = transformers.AutoTokenizer.from_pretrained(
        tmp_path, gguf_file=write_spm_gguf(tmp_path / "a.gguf", tokens, scores, types).name
    )
    implied = [
        " ".join(m) for m in json.loads(theirs.backend_tokenizer.to_str())["model"]["merges"]
    ]
    merges = {"tokenizer.ggml.merges": implied}
    ours = load_gguf(write_spm_gguf(tmp_path / "b.gguf", tokens, scores, types, strings=merges))
    assert ours.tokenizer is not None and ours.tokenizer.encode(TEXTS[0]) == theirs.encode(
        TEXTS[0], add_special_tokens=False
    )
    swapped = {"tokenizer.ggml.merges": [implied[1], implied[0], *implied[2:]]}
    with pytest.raises(InvalidInputError, match=r"tokenizer\.ggml\.merges"):
        load_gguf(write_spm_gguf(tmp_path / "c.gguf", tokens, scores, types, strings=swapped))


def test_what_cannot_be_reproduced_is_refused_by_name(tmp_path: Path, pieces: list[str]) -> None:
    tokens, scores, types = vocabulary(pieces)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("add_space_prefix", {"flags": {"add_space_prefix": False}}),
        ("tokenizer.ggml.model", {"strings": {"tokenizer.ggml.model": "t5"}}),
        ("add_bos_token", {"strings": {"tokenizer.ggml.add_bos_token": "yes"}}),
    ]
    for field, options in cases:
        with pytest.raises(InvalidInputError, match=re.escape(field)):
            load_gguf(write_spm_gguf(tmp_path / f"{field}.gguf", tokens, scores, types, **options))
    no_bytes = [t for t in tokens if t != "<0x41>"]
    fewer = [s for t, s in zip(tokens, scores, strict=True) if t != "<0x41>"]
    fewer_types = [k for t, k in zip(tokens, types, strict=True) if t != "<0x41>"]
    with pytest.raises(InvalidInputError, match="<0x41>"):
        load_gguf(write_spm_gguf(tmp_path / "nobyte.gguf", no_bytes, fewer, fewer_types))
    with pytest.raises(InvalidInputError, match=r"tokenizer\.ggml\.scores"):
        load_gguf(write_spm_gguf(tmp_path / "scores.gguf", tokens, scores[:-1], types))
    with pytest.raises(InvalidInputError, match=r"tokenizer\.ggml\.scores"):
        nan = [float("nan"), *scores[1:]]
        load_gguf(write_spm_gguf(tmp_path / "nan.gguf", tokens, nan, types))


def test_a_vocabulary_too_costly_to_derive_merges_from_is_refused(
    tmp_path: Path, pieces: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixkv.models import gguf_tokenizer

    tokens, scores, types = vocabulary(pieces)
    path = write_spm_gguf(tmp_path / "m.gguf", tokens, scores, types)
    work = sum(len(t) * (len(t) - 1) for t in tokens)
    monkeypatch.setattr(gguf_tokenizer, "_MAX_SPLIT_WORK", work - 1)
    with pytest.raises(InvalidInputError, match=r"tokenizer\.ggml\.tokens is too long"):
        load_gguf(path)
    monkeypatch.setattr(gguf_tokenizer, "_MAX_SPLIT_WORK", work)
    assert load_gguf(path).tokenizer is not None


def test_llama2_chat_through_the_engine_gives_transformers_apply_chat_template_ids(
    tmp_path: Path, pieces: list[str]
) -> None:
    template = {"tokenizer.chat_template": LLAMA2_TEMPLATE}
    path = write_spm_gguf(tmp_path / "m.gguf", *vocabulary(pieces), strings=template)
    checkpoint = load_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    engine = Engine(
        checkpoint.model,
        tokenizer=checkpoint.tokenizer,
        chat_template=checkpoint.chat_template,
        num_blocks=64,
        block_size=4,
    )
    ids = engine.encode(MESSAGES)
    assert ids == list(expected)
    assert ids.count(theirs.bos_token_id) == 2 and ids[0] == theirs.bos_token_id


@pytest.fixture(scope="module")
def loaded_pair(tmp_path_factory: pytest.TempPathFactory, pieces: list[str]) -> tuple[Any, Any]:
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "m.gguf", *vocabulary(pieces, tied=4))
    return both(path)


#: Text mixing the vocabulary's letters, spaces, newlines, digits, special tokens and any
#: character at all (most go through the byte pieces).
_TEXT = st.lists(
    st.sampled_from(["a", "b", "cd", "the", " ", "  ", "\n", "7", "▁", *CONTROL, BOS, EOS, UNK])
    | st.characters(),
    max_size=30,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=_TEXT)
# Found by hypothesis (2026-12-03): a lone UTF-16 surrogate is a Python str but not UTF-8 text;
# `tokenizers` raised a bare TypeError from inside our encode. Now refused by name.
@example(text="\ud800")
@example(text="a\udfffb")
def test_any_text_encodes_and_decodes_as_transformers_gguf_loader(
    loaded_pair: tuple[Any, Any], text: str
) -> None:
    ours, theirs = loaded_pair
    surrogate = re.search("[\ud800-\udfff]", text)
    if surrogate is not None:
        with pytest.raises(
            InvalidInputError, match=f"surrogate .* at position {surrogate.start()}"
        ):
            ours.encode(text)
        with pytest.raises(TypeError):
            theirs.encode(text, add_special_tokens=False)
        return
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids)
