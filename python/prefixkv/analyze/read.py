"""Reading a trace: JSONL bytes in, `TraceRequest`s and `SkippedLine`s out.

This is the first stage of the analyzer and the only one that sees raw input, so it is where
hostile input stops: every line is either a valid request or a `SkippedLine` with its line
number and a one-line reason. The accepted shapes are documented in docs/analyze.md
("Trace format"); this module is their one implementation.

What a line is. JSONL lines end at "\n" (a "\r" before it is dropped), and nowhere else: not at
U+2028, U+2029 or U+0085, which str.splitlines() also breaks on and which JSON allows raw inside
strings. A line is bytes until it has been checked to be UTF-8; a line that is not is reported,
never repaired, since a repaired prompt is not the prompt the engine saw.

What a line may cost. A file is read in chunks, and a line longer than `max_line_bytes` is
counted and reported but never held: reading keeps at most the cap plus one chunk in memory,
however long the line. Reading stops at `max_trace_bytes`, so the rest of the analysis, which
holds the trace in memory and replays it a few times, is bounded too; the report says where the
trace was cut.

What a request costs once read. The analysis keeps every request for its what-ifs, so a request
is held in a form about the size of its line, not as parsed JSON: a conversation of 600,000
short messages is 7.8 MB as a line and ~115 MB as Python dicts. Messages and tools are kept as
their compact JSON text (`JsonObjects`) and decoded when a stage reads them; token ids are an
`array("I")`, 4 bytes each. Nesting is bounded here too (`MAX_NESTING`, the chat templates'
bound), so decoding again later can never meet Python's recursion limit.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from prefixkv.errors import InvalidInputError
from prefixkv.text.chat import MAX_NESTING, checked_input

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TRACE_BYTES",
    "JsonObjects",
    "SkippedLine",
    "TraceRead",
    "TraceRequest",
    "parse_trace",
    "read_trace",
]

DEFAULT_MAX_LINE_BYTES = 8 * 2**20  # ~2M tokens of text, or ~1M token ids written as JSON
DEFAULT_MAX_TRACE_BYTES = 1 * 2**30
_MAX_TOKEN_ID = 2**32  # token ids travel as u32
_PROMPT_KEYS = ("tokens", "text", "messages")
_CHUNK_BYTES = 2**20
# A raw surrogate (possible in str input) or a JSON escape of one (possible anywhere); only
# lines that match are searched for lone surrogates, which no tokenizer can encode.
_SURROGATE_HINT = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


@dataclass(frozen=True)
class SkippedLine:
    """A malformed line: its 1-based number and why it was skipped."""

    line: int
    error: str


def _plain(value: object) -> object:
    """What JSON cannot hold as it is: a mapping other than a dict is written as one."""
    if isinstance(value, Mapping):
        return dict(value)
    raise InvalidInputError(f"a {type(value).__name__} is not JSON")


_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_plain)
_DECODER = json.JSONDecoder()


class JsonObjects(Sequence[Mapping[str, Any]]):
    """A list of JSON objects (messages, tools) held as its compact JSON text, decoded on each
    read: iterating, `decode()` and slicing decode the whole list (one pass, C speed); `[i]`
    decodes only item `i`. Immutable; equal when the texts are.

    Every decode gives fresh dicts, so a caller may change what it got without changing the
    request; a stage that reads the items several times should `decode()` once. The objects
    must be nested at most `MAX_NESTING` deep (`read_trace` checks), so that encoding and
    decoding them never approaches Python's recursion limit."""

    __slots__ = ("_offsets", "_size", "_text")

    _text: str
    _size: int

    def __init__(self, items: Iterable[Mapping[str, Any]]) -> None:
        if isinstance(items, JsonObjects):
            self._text, self._size = items._text, items._size
        else:
            items = items if isinstance(items, (list, tuple)) else list(items)
            self._text, self._size = _COMPACT.encode(items), len(items)
        # Where each item starts in the text: found on the first `[i]`, 8 bytes an item.
        self._offsets: array[int] | None = None

    def decode(self) -> list[dict[str, Any]]:
        decoded: list[dict[str, Any]] = json.loads(self._text)
        return decoded

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.decode())

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return self.decode()[index]
        index = range(self._size)[index]  # IndexError as a list gives it; negative ones count back
        offsets = self._item_offsets()
        item, _ = _DECODER.raw_decode(self._text, offsets[index])
        return item  # type: ignore[no-any-return]

    def _item_offsets(self) -> array[int]:
        if self._offsets is None:
            offsets = array("q")
            position = 1  # past "["; compact text: items are separated by "," alone
            for _ in range(self._size):
                offsets.append(position)
                _, position = _DECODER.raw_decode(self._text, position)
                position += 1
            self._offsets = offsets
        return self._offsets

    def __eq__(self, other: object) -> bool:
        if isinstance(other, JsonObjects):
            return self._text == other._text
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"JsonObjects({self._size} items, {len(self._text)} characters)"


@dataclass(frozen=True)
class TraceRequest:
    """One valid trace line, before tokenization.

    Held compactly, since the analysis keeps every request: `tokens` as an `array("I")`
    (any sequence of ids in 0..2**32-1 is accepted and converted), `messages` and `tools` as
    `JsonObjects` (any sequence of mappings is accepted and converted; read them by iterating,
    or `decode()` once)."""

    line: int
    request_id: str
    kind: str  # "tokens" | "text" | "messages"
    tokens: array[int] | None = None
    text: str | None = None
    messages: JsonObjects | None = None
    tools: JsonObjects | None = None
    tenant: str | None = None
    salt: str | None = None
    timestamp: str | float | None = None

    def __post_init__(self) -> None:
        # Rewrites (`dataclasses.replace`) hand in tuples and lists: stored compactly as well.
        if self.tokens is not None and not (
            isinstance(self.tokens, array) and self.tokens.typecode == "I"
        ):
            object.__setattr__(self, "tokens", token_array(self.tokens, "tokens"))
        for name in ("messages", "tools"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, JsonObjects):
                object.__setattr__(self, name, JsonObjects(value))

    @property
    def isolation(self) -> str | None:
        """The salt handed to the cache: tenant and salt together, None when neither is set."""
        if self.tenant is None and self.salt is None:
            return None
        return json.dumps({"tenant": self.tenant, "salt": self.salt}, sort_keys=True)


def token_array(tokens: Iterable[int], what: str) -> array[int]:
    """Token ids as an `array("I")`; `InvalidInputError` naming `what` for an id that is not
    an int in 0..2**32-1."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    if not isinstance(tokens, Sequence):
        tokens = list(tokens)
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidInputError(f"{what} must be ints in 0..2**32-1 ({exc})") from None
    # array("I") takes True and False as 1 and 0; only the positions holding 0 or 1 can be
    # bools, so one vectorised pass finds the few to look at.
    for position in np.flatnonzero(np.frombuffer(packed, dtype=np.uint32) <= 1).tolist():
        if isinstance(tokens[position], bool):
            raise InvalidInputError(f"{what} must be ints, not bools (position {position})")
    return packed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_message(i: int, message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"messages[{i}] must be an object, got {type(message).__name__}"
    role = message.get("role")
    if not isinstance(role, str) or not role:
        return f"messages[{i}].role must be a non-empty string"
    content = message.get("content")
    if content is None or isinstance(content, str):
        return None
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                return f"messages[{i}].content[{j}] must be an object"
            if part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
                return f"messages[{i}].content[{j}].text must be a string"
        return None
    return f"messages[{i}].content must be a string, null or a list of parts"


def _unwrap(obj: dict[str, Any]) -> dict[str, Any]:
    """Accept the shapes real logs come in, mapped onto the documented fields.

    Fields other than the documented ones (``model``, ``temperature``, ...) are ignored. An
    OpenAI batch line (``{"custom_id", "body": {"messages": ...}}``) or a logged request
    (``{"request": {...}}``) is read from its body; a completions-style ``prompt`` is ``text``
    (a string) or ``tokens`` (a list).
    """
    if not any(key in obj for key in (*_PROMPT_KEYS, "prompt")):
        for wrapper in ("body", "request"):
            inner = obj.get(wrapper)
            if isinstance(inner, dict) and any(k in inner for k in (*_PROMPT_KEYS, "prompt")):
                merged = {k: v for k, v in obj.items() if k != wrapper}
                merged.update(inner)
                if "id" not in merged and "custom_id" in obj:
                    merged["id"] = obj["custom_id"]
                obj = merged
                break
    if "prompt" in obj and not any(key in obj for key in _PROMPT_KEYS):
        prompt = obj["prompt"]
        obj = {k: v for k, v in obj.items() if k != "prompt"}
        obj["tokens" if isinstance(prompt, list) else "text"] = prompt
    return obj


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) in `obj` holding a lone UTF-16 surrogate, if any."""
    stack = [obj]
    while stack:  # not recursive: the parser accepts deeper nesting than the call stack
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _parse_line(line_no: int, raw: str) -> TraceRequest | str:
    """A request, or the reason the line is malformed."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"invalid JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return "invalid JSON: nested too deeply"
    except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
        return f"invalid JSON: {exc}"
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if _SURROGATE_HINT.search(raw):
        bad = _lone_surrogate(obj)
        if bad is not None:
            char = _LONE_SURROGATE.search(bad)
            assert char is not None
            return (
                f"a string holds a lone UTF-16 surrogate (U+{ord(char.group()):04X}), "
                "which is not text any tokenizer can encode"
            )
    obj = _unwrap(obj)
    present = [key for key in _PROMPT_KEYS if key in obj]
    if len(present) != 1:
        found = ", ".join(present) if present else "none"
        return f"needs exactly one of 'tokens', 'text', 'messages' (found: {found})"
    kind = present[0]

    request_id = obj.get("id", f"line {line_no}")
    if not (isinstance(request_id, str) or _is_int(request_id)):
        return "'id' must be a string or an integer"
    for key in ("tenant", "salt"):
        if key in obj and not isinstance(obj[key], str):
            return f"'{key}' must be a string, got {type(obj[key]).__name__}"
    timestamp = obj.get("timestamp")
    if timestamp is not None and (
        isinstance(timestamp, bool) or not isinstance(timestamp, (str, int, float))
    ):
        return "'timestamp' must be a string or a number"
    if "tools" in obj and kind != "messages":
        return "'tools' is only allowed with 'messages'"

    fields: dict[str, Any] = {}
    if kind == "tokens":
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not tokens:
            return "'tokens' must be a non-empty list of integers"
        for i, token in enumerate(tokens):
            if not _is_int(token):
                return f"tokens[{i}] is {json.dumps(token)}, not an integer"
            if token < 0:
                return f"tokens[{i}] is negative ({token})"
            if token >= _MAX_TOKEN_ID:
                return f"tokens[{i}] = {token} does not fit in 32 bits"
        fields["tokens"] = array("I", tokens)  # checked above: ints in 0..2**32-1
    elif kind == "text":
        text = obj["text"]
        if not isinstance(text, str) or not text:
            return "'text' must be a non-empty string"
        fields["text"] = text
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, message in enumerate(messages):
            problem = _validate_message(i, message)
            if problem:
                return problem
        tools = obj.get("tools")
        if "tools" in obj and (
            not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
        ):
            return "'tools' must be a list of objects"
        # The chat templates' bound, checked here (the same check, the same message), so that
        # the compact form below can be encoded and decoded again at any stack depth. Only a
        # line with enough brackets can be that deep.
        if raw.count("[") + raw.count("{") > MAX_NESTING:
            try:
                checked_input(messages, tools)
            except InvalidInputError as exc:
                return str(exc)
        fields["messages"] = JsonObjects(messages)
        if tools is not None:
            fields["tools"] = JsonObjects(tools)
    return TraceRequest(
        line=line_no,
        request_id=str(request_id),
        kind=kind,
        tenant=obj.get("tenant"),
        salt=obj.get("salt"),
        timestamp=timestamp,
        **fields,
    )


def parse_trace(
    lines: Iterable[str], *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> tuple[list[TraceRequest], list[SkippedLine]]:
    """Valid requests in order, and the malformed lines (1-based line numbers); each item of
    `lines` is one line, whatever characters it holds."""
    read = read_trace(lines, max_line_bytes=max_line_bytes, max_trace_bytes=None)
    return read.requests, read.skipped_lines


@dataclass
class TraceRead:
    """What reading a trace gave: its name, the valid requests, the malformed lines, and the
    first line not read when `max_trace_bytes` cut the trace short (None: read to the end)."""

    name: str
    requests: list[TraceRequest] = field(default_factory=list)
    skipped_lines: list[SkippedLine] = field(default_factory=list)
    truncated_at_line: int | None = None


def read_trace(
    path_or_lines: str | os.PathLike[str] | Iterable[str | bytes],
    *,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_trace_bytes: int | None = DEFAULT_MAX_TRACE_BYTES,
) -> TraceRead:
    """Read and parse a trace. A path is streamed from disk; anything else is an iterable of
    lines (str, or bytes as a binary file gives them), one line each. Raises `OSError` for an
    unreadable file."""
    if isinstance(path_or_lines, (str, os.PathLike)):
        name = str(path_or_lines)
        lines = _file_lines(Path(path_or_lines), max_line_bytes, max_trace_bytes)
    else:
        name = "<lines>"
        lines = _given_lines(path_or_lines, max_line_bytes)
    out = TraceRead(name)
    total = 0
    for line in lines:
        if line.text is not None and not line.text.strip():
            continue  # blank lines are not requests, and do not count against the limit
        total += line.size + 1
        if line.cut or (max_trace_bytes is not None and total > max_trace_bytes):
            out.truncated_at_line = line.number
            break
        problem, text = _check(line, max_line_bytes)
        parsed = problem if text is None else _parse_line(line.number, text)
        if isinstance(parsed, str):
            out.skipped_lines.append(SkippedLine(line.number, parsed))
        else:
            out.requests.append(parsed)
    return out


@dataclass(frozen=True)
class _Line:
    number: int
    text: str | bytes | None  # None: over the cap, not kept
    size: int  # bytes before the line end
    cut: bool = False  # reading stopped inside this line (max_trace_bytes)


def _check(line: _Line, max_line_bytes: int) -> tuple[str, str | None]:
    """(the reason the line is unusable, "" if none; the line as text, None if unusable)."""
    if line.text is None:
        return (
            f"line is {line.size} bytes, over the limit of {max_line_bytes} (--max-line-bytes)",
            None,
        )
    if isinstance(line.text, str):
        return "", line.text
    try:
        return "", line.text.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line.text[exc.start]
        return f"not valid UTF-8: byte 0x{bad:02x} at byte {exc.start + 1} of the line", None


def _given_lines(lines: Iterable[str | bytes], max_line_bytes: int) -> Iterator[_Line]:
    for number, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            line = line.removesuffix(b"\n").removesuffix(b"\r")
            size = len(line)
        else:
            # A character is at least one byte: only a line that may be over the cap is encoded.
            size = len(line)
            if size * 4 > max_line_bytes and not line.isascii():
                size = len(line.encode("utf-8", "surrogatepass"))
        yield _Line(number, None if size > max_line_bytes else line, size)


def _file_lines(path: Path, max_line_bytes: int, max_trace_bytes: int | None) -> Iterator[_Line]:
    """The lines of a file, read in chunks: a line over the cap is measured, never held, and
    reading stops once `max_trace_bytes` have been read."""
    budget = math.inf if max_trace_bytes is None else max_trace_bytes + 1
    with path.open("rb") as handle:
        number, size, over, read = 1, 0, False, 0
        parts: list[bytes] = []
        while chunk := handle.read(_CHUNK_BYTES):
            read += len(chunk)
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                size += len(piece)
                if not over:
                    if size > max_line_bytes + 1:  # + 1: a "\r" before the "\n"
                        over, parts = True, []
                    else:
                        parts.append(piece)
                if end < 0:
                    break
                yield _joined(number, parts, over, size, max_line_bytes)
                number, size, parts, over = number + 1, 0, [], False
                start = end + 1
            if read > budget and over:
                # The limit is reached inside a line too long to keep: no need to read its end.
                yield _Line(number, None, size, cut=True)
                return
        if size:
            yield _joined(number, parts, over, size, max_line_bytes)


def _joined(number: int, parts: list[bytes], over: bool, size: int, max_line_bytes: int) -> _Line:
    if over:
        return _Line(number, None, size)
    line = b"".join(parts)
    if line.endswith(b"\r"):
        line = line[:-1]
    if number == 1 and line.startswith(codecs.BOM_UTF8):
        line = line[len(codecs.BOM_UTF8) :]
    return _Line(number, None if len(line) > max_line_bytes else line, len(line))
