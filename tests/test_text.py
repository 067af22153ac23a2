"""Tokenizers and chat templates: round trips, offsets, digests, and segment attribution."""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.text.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    JinjaChatTemplate,
    Segment,
    SimpleChatTemplate,
    load_chat_template,
    load_tokenizer,
    message_text,
    segment_at,
)
from tests.tokenizer_support import byte_level_bpe

DATA = Path(__file__).parent / "data"

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "  Hi there  "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Ship it?"},
]
TOOLS = [
    {"type": "function", "function": {"name": "b_tool", "description": "<b> & c"}},
    {"type": "function", "function": {"name": "a_tool", "parameters": {"type": "object"}}},
]


def train_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer.json, trained here rather than downloaded."""
    corpus = [
        "You are a helpful assistant. Answer briefly and cite the policy section.",
        "Current time: 2024-05-01T10:00:00Z. Where is my parcel? The order id is 1234.",
        "système, naïve café — 東京 ✓",
    ]
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    byte_level_bpe(corpus * 20, vocab_size=600, special_tokens=specials).save(str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


# -- ByteTokenizer ------------------------------------------------------------------------


@given(st.text())
def test_byte_tokenizer_round_trips_and_offsets_cover_the_text(text: str) -> None:
    tok = ByteTokenizer()
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    assert len(offsets) == len(ids)
    assert all(0 <= i < tok.vocab_size for i in ids)
    # Offsets are non-decreasing character spans; every character is covered.
    covered: set[int] = set()
    for start, end in offsets:
        assert 0 <= start < end <= len(text)
        covered.update(range(start, end))
    assert covered == set(range(len(text)))
    # The compact form the analyzer keeps: the same ids and each token's start.
    compact_ids, starts = tok.encode_with_starts(text)
    assert compact_ids == ids and list(starts) == [start for start, _ in offsets]


def test_byte_tokenizer_specials_are_single_ids() -> None:
    tok = ByteTokenizer()
    ids, offsets = tok.encode_with_offsets("<|user|>\nhé<|end|>")
    assert ids == [tok.token_to_id("<|user|>"), 10, 104, 0xC3, 0xA9, tok.token_to_id("<|end|>")]
    assert offsets == [(0, 8), (8, 9), (9, 10), (10, 11), (10, 11), (11, 18)]
    assert tok.decode(ids) == "<|user|>\nhé<|end|>"


def test_byte_tokenizer_digest_is_stable_sha256() -> None:
    digest = ByteTokenizer().digest()
    assert digest == ByteTokenizer().digest()
    assert len(digest) == 64 and int(digest, 16) >= 0


# -- HFTokenizer --------------------------------------------------------------------------


def test_hf_tokenizer_round_trip_offsets_and_digest(tokenizer_json: Path) -> None:
    tok = HFTokenizer(tokenizer_json)
    text = "<s>Current time: 2024-05-01T10:00:00Z. système 東京"
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == tok.token_to_id("<s>")  # special tokens in text are matched
    assert len(offsets) == len(ids) and offsets[-1][1] == len(text)
    assert tok.digest() == hashlib.sha256(tokenizer_json.read_bytes()).hexdigest()
    assert tok.vocab_size <= 600
    compact_ids, starts = tok.encode_with_starts(text)
    assert compact_ids == ids and list(starts) == [start for start, _ in offsets]


def test_load_tokenizer(tokenizer_json: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    from_file = load_tokenizer(str(tokenizer_json))
    from_dir = load_tokenizer(tokenizer_json.parent)
    assert isinstance(from_file, HFTokenizer) and isinstance(from_dir, HFTokenizer)
    assert from_file.digest() == from_dir.digest()
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    with pytest.raises(InvalidInputError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(broken)


def test_missing_optional_package_names_the_extra(
    tokenizer_json: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"prefixkv\[hf\]") as info:
        HFTokenizer(tokenizer_json)
    assert isinstance(info.value, PrefixKVError)
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"'jinja2'.*prefixkv\[hf\]"):
        JinjaChatTemplate("{{ messages }}")


# -- Segments -----------------------------------------------------------------------------


def assert_segments_tile(text: str, segments: list[Segment]) -> None:
    assert segments[0].start == 0 and segments[-1].end == len(text)
    for left, right in itertools.pairwise(segments):
        assert left.end == right.start


def test_simple_template_renders_tools_in_given_order_and_attributes_every_char() -> None:
    template = SimpleChatTemplate()
    text, segments = template.render_with_segments(MESSAGES, tools=TOOLS)
    tool_lines = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TOOLS)
    assert text == (
        "<|system|>\nBe brief.<|end|>\n"
        f"<|tools|>\n{tool_lines}<|end|>\n"
        "<|user|>\n  Hi there  <|end|>\n"
        "<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nShip it?<|end|>\n"
        "<|assistant|>\n"
    )
    assert text == template.render(MESSAGES, tools=TOOLS)
    assert_segments_tile(text, segments)
    for segment in segments:
        piece = text[segment.start : segment.end]
        if segment.source == "message":
            assert segment.index is not None
            assert piece == MESSAGES[segment.index]["content"]
            assert segment.role == MESSAGES[segment.index]["role"]
        elif segment.source == "tool":
            assert segment.index is not None
            assert piece == json.dumps(TOOLS[segment.index])
    assert [s.index for s in segments if s.source == "tool"] == [0, 1]
    # Shuffling the tools changes the prompt: the order is visible to the analyzer.
    assert template.render(MESSAGES, tools=TOOLS[::-1]) != text
    assert not template.render(MESSAGES, add_generation_prompt=False).endswith("<|assistant|>\n")


def test_segment_at_and_labels() -> None:
    text, segments = SimpleChatTemplate().render_with_segments(MESSAGES)
    position = text.index("Ship it?")
    found = segment_at(segments, position + 3)
    assert found is not None and found.label == "message 3 (user)"
    first = segment_at(segments, 0)
    assert first is not None and first.label == "template"
    last = segment_at(segments, len(text))
    assert last is not None and last.source == "template"


def test_message_text_accepts_openai_content_parts() -> None:
    parts = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a"},
            {"type": "image"},
            {"type": "text", "text": "b"},
        ],
    }
    assert message_text(parts) == "ab"
    assert message_text({"role": "assistant", "content": None}) == ""


def test_jinja_template_segments_from_sentinels() -> None:
    template = JinjaChatTemplate.from_file(DATA / "chatml.jinja", bos_token="<s>")
    text, segments = template.render_with_segments(MESSAGES, tools=TOOLS)
    assert text == template.render(MESSAGES, tools=TOOLS)
    assert text.startswith("<s><|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"description": "<b> & c"' in text  # Hugging Face tojson: no HTML escaping
    assert_segments_tile(text, segments)
    messages = [s for s in segments if s.source == "message"]
    assert [(s.index, s.role) for s in messages] == [
        (0, "system"),
        (1, "user"),
        (2, "assistant"),
        (3, "user"),
    ]
    for segment in messages:
        assert segment.index is not None
        assert text[segment.start : segment.end] == MESSAGES[segment.index]["content"]
    assert [s.index for s in segments if s.source == "tool"] == [0, 1]


def test_jinja_template_that_transforms_content_falls_back() -> None:
    # `trim` changes the content, so the sentinels cannot be used: search finds it instead.
    trimming = JinjaChatTemplate(
        "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}"
    )
    text, segments = trimming.render_with_segments(MESSAGES)
    user = [s for s in segments if s.source == "message" and s.index == 1]
    assert len(user) == 1 and text[user[0].start : user[0].end] == "Hi there"
    assert_segments_tile(text, segments)
    # `upper` leaves the sentinels intact, so the upper-cased span is still attributed.
    shouting = JinjaChatTemplate("{% for m in messages %}{{ m.content | upper }}|{% endfor %}")
    text, segments = shouting.render_with_segments(MESSAGES)
    assert text.startswith("BE BRIEF.|")
    assert segments[0] == Segment(0, 9, "message", 0, "system")
    # Slicing cuts through the sentinels and the content is nowhere in the text: "unknown".
    slicing = JinjaChatTemplate("{% for m in messages %}{{ m.content[:4] }}{% endfor %}")
    text, segments = slicing.render_with_segments(MESSAGES)
    assert segments == [Segment(0, len(text), "unknown")]


def test_jinja_template_from_tokenizer_config(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "chat_template": (DATA / "chatml.jinja").read_text(),
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
            }
        )
    )
    template = load_chat_template(config)
    assert isinstance(template, JinjaChatTemplate)
    assert template.render(MESSAGES[:2]).startswith("<s><|im_start|>system\n")
    assert template.digest() != JinjaChatTemplate.from_file(DATA / "chatml.jinja").digest()


def test_jinja_template_errors_are_prefixkv_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="syntax error"):
        JinjaChatTemplate("{% for %}")
    raising = JinjaChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidInputError, match="roles must alternate"):
        raising.render(MESSAGES)
    # The sandbox refuses attribute tricks that would escape to Python internals.
    escaping = JinjaChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidInputError):
        escaping.render(MESSAGES)
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_chat_template(tmp_path / "missing.jinja")


def test_template_digests_differ_and_are_stable() -> None:
    source = (DATA / "chatml.jinja").read_text()
    assert JinjaChatTemplate(source).digest() == JinjaChatTemplate(source).digest()
    assert JinjaChatTemplate(source).digest() != JinjaChatTemplate(source + " ").digest()
    assert SimpleChatTemplate().digest() != JinjaChatTemplate(source).digest()
    assert isinstance(load_chat_template(None), SimpleChatTemplate)


@st.composite
def nested_items(draw: st.DrawFn) -> list[object]:
    """A few items, mostly mappings, one of them holding a chain of lists, tuples and dicts
    around `MAX_NESTING` deep, with scalars on the way."""
    from prefixkv.text.chat import MAX_NESTING

    items: list[object] = [
        {"role": "user", "content": "hi"} for _ in range(draw(st.integers(0, 3)))
    ]
    depth = draw(st.integers(MAX_NESTING - 3, MAX_NESTING + 3))
    value: object = draw(st.sampled_from(["leaf", 1, 2.5, None, True]))
    for _ in range(depth - 1):
        kind = draw(st.sampled_from(["dict", "list", "tuple"]))
        value = (
            {"k": value, "s": "x"} if kind == "dict" else [1, value] if kind == "list" else (value,)
        )
    items.insert(draw(st.integers(0, len(items))), {"role": "tool", "content": value})
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), draw(st.sampled_from(["text", 3, None])))
    return items


@given(nested_items())
def test_checked_input_names_the_first_bad_item_as_the_item_by_item_check_does(
    items: list[object],
) -> None:
    # checked_input checks all items at once, a level at a time, and only on a failure goes
    # item by item to name the first bad one: the verdict and the message are those of the
    # item-by-item check.
    from collections.abc import Mapping

    from prefixkv.text.chat import _check_nesting, checked_input

    expected = None
    try:
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise InvalidInputError(
                    f"messages[{i}] must be a mapping, got {type(item).__name__}"
                )
            _check_nesting(item, f"messages[{i}]")
    except InvalidInputError as exc:
        expected = str(exc)
    if expected is None:
        assert checked_input(items, None) == (items, None)
    else:
        with pytest.raises(InvalidInputError) as raised:
            checked_input(items, None)
        assert str(raised.value) == expected


@given(
    st.lists(
        st.tuples(
            st.integers(1, 5),
            st.sampled_from(["message", "tool", "template", "unknown"]),
            st.sampled_from(["system", "user", None]),
        ),
        max_size=12,
    ),
    st.integers(-2, 70),
)
def test_segments_in_columns_read_as_the_list_they_hold(
    pieces: list[tuple[int, str, str | None]], char: int
) -> None:
    from prefixkv.text.segments import Segment, Segments

    listed: list[Segment] = []
    compact = Segments()
    position = 0
    for i, (length, source, role) in enumerate(pieces):
        segment = Segment(position, position + length, source, i, role)
        compact.add(segment.start, segment.end, source, i, role)
        if source == "template" and listed and listed[-1].source == "template":
            listed[-1] = Segment(
                listed[-1].start, segment.end, "template", listed[-1].index, listed[-1].role
            )
        else:
            listed.append(segment)
        position += length
    assert compact == listed and list(compact) == listed and len(compact) == len(listed)
    assert [compact[i] for i in range(-len(listed), len(listed))] == listed + listed
    assert compact[1:] == listed[1:] and Segments(listed) == listed
    assert segment_at(compact, char) == segment_at(listed, char)
