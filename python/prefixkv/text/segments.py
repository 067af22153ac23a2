"""Where each character of a rendered prompt came from: `Segment`s, and how a template's
output is attributed to its messages and tools.

The analyzer maps a divergence token back through the tokenizer's character offsets to one of
these segments. Attribution (`attribute`) first renders again with each message's content
wrapped in private-use sentinel characters and locates them; a template that transforms
content (strip, upper...) breaks the sentinels, and then each content string is searched for in
the plain render instead; when even that fails the whole text is one "unknown" segment.
"""

from __future__ import annotations

import bisect
import json
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, overload

from prefixkv.errors import InvalidInputError

__all__ = ["Segment", "Segments", "attribute", "merge_adjacent", "message_text", "segment_at"]


@dataclass(frozen=True)
class Segment:
    """A character span `[start, end)` of a rendered prompt and where it came from.

    `source` is "message" (the content of `messages[index]`, whose role is `role`), "tool"
    (`tools[index]`), "template" (text the template added: role markers, separators) or
    "unknown" (the template's output could not be attributed).
    """

    start: int
    end: int
    source: str
    index: int | None = None
    role: str | None = None

    @property
    def label(self) -> str:
        if self.source == "message":
            return f"message {self.index} ({self.role})"
        if self.source == "tool":
            return f"tool {self.index}"
        return self.source


class Segments(Sequence[Segment]):
    """Segments in columns: ~30 bytes a segment where a `Segment` object and its ints cost ~200,
    which for a conversation of many short messages (two segments each) is many times the
    size of its text. A `Segment` is made when one is read; `at` finds one by bisection.

    `add` appends a span, extending the last one instead when both come from the template, as
    a template renders its role markers and separators piece by piece."""

    __slots__ = ("_ends", "_indexes", "_role_ids", "_roles", "_sources", "_starts")
    _SOURCES = ("message", "tool", "template", "unknown")
    _SOURCE_IDS: ClassVar[Mapping[str, int]] = {source: i for i, source in enumerate(_SOURCES)}
    _TEMPLATE = _SOURCES.index("template")

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self._starts = array("q")
        self._ends = array("q")
        self._sources = bytearray()
        self._indexes = array("q")  # -1: None
        self._roles: list[str | None] = [None]  # distinct roles; `_role_ids` index them
        self._role_ids = array("I")
        for segment in segments:
            self._append(segment.start, segment.end, segment.source, segment.index, segment.role)

    def add(
        self, start: int, end: int, source: str, index: int | None = None, role: str | None = None
    ) -> None:
        if source == "template" and self._sources and self._sources[-1] == self._TEMPLATE:
            self._ends[-1] = end
        else:
            self._append(start, end, source, index, role)

    def _append(
        self, start: int, end: int, source: str, index: int | None, role: str | None
    ) -> None:
        if source not in self._SOURCE_IDS:
            raise ValueError(f"unknown segment source {source!r}")
        self._starts.append(start)
        self._ends.append(end)
        self._sources.append(self._SOURCE_IDS[source])
        self._indexes.append(-1 if index is None else index)
        try:
            role_id = self._roles.index(role)  # a handful of roles: a list is enough
        except ValueError:
            role_id = len(self._roles)
            self._roles.append(role)
        self._role_ids.append(role_id)

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> Segment: ...

    @overload
    def __getitem__(self, i: slice) -> list[Segment]: ...

    def __getitem__(self, i: int | slice) -> Segment | list[Segment]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = range(len(self))[i]  # IndexError as a list gives it
        index = self._indexes[i]
        return Segment(
            self._starts[i],
            self._ends[i],
            self._SOURCES[self._sources[i]],
            None if index < 0 else index,
            self._roles[self._role_ids[i]],
        )

    def __iter__(self) -> Iterator[Segment]:
        return (self[i] for i in range(len(self)))

    def at(self, char: int) -> Segment | None:
        """`segment_at` without a pass over the segments."""
        if not self._starts:
            return None
        return self[max(0, bisect.bisect_right(self._starts, char) - 1)]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list is

    def __repr__(self) -> str:
        return f"Segments({list(self)!r})"


def segment_at(segments: Sequence[Segment], char: int) -> Segment | None:
    """The segment containing character `char` (the last segment for the end of the text)."""
    if isinstance(segments, Segments):
        return segments.at(char)
    if not segments:
        return None
    starts = [segment.start for segment in segments]
    i = bisect.bisect_right(starts, char) - 1
    if i < 0:
        return segments[0]
    return segments[i]


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string: a string as-is, None as "", OpenAI content parts
    joined (text parts only)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def _fill_gaps(spans: list[Segment], length: int, gap_source: str) -> list[Segment]:
    """Sort non-overlapping spans and fill the gaps so the segments tile [0, length)."""
    spans = sorted((s for s in spans if s.end > s.start), key=lambda s: s.start)
    out: list[Segment] = []
    pos = 0
    for span in spans:
        if span.start < pos:  # overlapping attribution: keep the earlier one
            continue
        if span.start > pos:
            out.append(Segment(pos, span.start, gap_source))
        out.append(span)
        pos = span.end
    if pos < length:
        out.append(Segment(pos, length, gap_source))
    return out


def merge_adjacent(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for segment in segments:
        if out and out[-1].source == "template" and segment.source == "template":
            out[-1] = Segment(out[-1].start, segment.end, "template")
        else:
            out.append(segment)
    return out


# Private-use characters: a real prompt practically never contains them, and no string filter
# a template might apply (trim, upper) changes them.
_OPEN, _SEP, _CLOSE = "\ue000", "\ue001", "\ue002"
_SENTINEL_RE = re.compile(f"{_OPEN}(\\d+){_SEP}(.*?){_CLOSE}", re.DOTALL)


def attribute(
    text: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    rerender: Callable[[list[dict[str, Any]]], str],
) -> list[Segment]:
    """Segments tiling `text`, the render of `messages` and `tools`; `rerender(messages)`
    renders other messages the same way (used with sentinel-wrapped contents)."""
    spans = _sentinel_spans(text, messages, rerender)
    if spans is None:
        spans = _search_spans(text, messages)
    if spans is None:
        return [Segment(0, len(text), "unknown")] if text else []
    spans.extend(_tool_spans(text, tools, spans))
    return merge_adjacent(_fill_gaps(spans, len(text), "template"))


def _sentinel_spans(
    text: str,
    messages: Sequence[Mapping[str, Any]],
    rerender: Callable[[list[dict[str, Any]]], str],
) -> list[Segment] | None:
    """Render with each message's content wrapped in sentinels; None unless removing the
    sentinels gives back exactly `text` (the template did not transform any content)."""
    wrapped: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        copy = dict(message)
        if isinstance(content, str):
            if any(c in content for c in (_OPEN, _SEP, _CLOSE)):
                return None
            copy["content"] = f"{_OPEN}{i}{_SEP}{content}{_CLOSE}"
        elif isinstance(content, list):
            copy["content"] = [
                {**part, "text": f"{_OPEN}{i}{_SEP}{part['text']}{_CLOSE}"}
                if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
        wrapped.append(copy)
    try:
        marked = rerender(wrapped)
    except InvalidInputError:
        return None
    spans: list[Segment] = []
    plain: list[str] = []
    pos = 0  # position in `marked`
    out_pos = 0  # position in the text without sentinels
    for match in _SENTINEL_RE.finditer(marked):
        before = marked[pos : match.start()]
        plain.append(before)
        out_pos += len(before)
        index = int(match.group(1))
        if index >= len(messages):
            return None
        content = match.group(2)
        role = str(messages[index].get("role", ""))
        spans.append(Segment(out_pos, out_pos + len(content), "message", index, role))
        plain.append(content)
        out_pos += len(content)
        pos = match.end()
    plain.append(marked[pos:])
    stripped = "".join(plain)
    if stripped != text or any(c in stripped for c in (_OPEN, _SEP, _CLOSE)):
        return None
    return spans


def _search_spans(text: str, messages: Sequence[Mapping[str, Any]]) -> list[Segment] | None:
    """Fallback attribution: find each message's content, in order, in the rendered text
    (as-is, then stripped). None if any non-empty content cannot be found."""
    spans: list[Segment] = []
    pos = 0
    for i, message in enumerate(messages):
        content = message_text(message)
        role = str(message.get("role", ""))
        for candidate in (content, content.strip()):
            if not candidate:
                break
            found = text.find(candidate, pos)
            if found >= 0:
                spans.append(Segment(found, found + len(candidate), "message", i, role))
                pos = found + len(candidate)
                break
        else:
            return None
    return spans


def _tool_spans(
    text: str, tools: Sequence[Mapping[str, Any]] | None, taken: Sequence[Segment]
) -> list[Segment]:
    """Tool schemas as templates usually print them (compact, or indented JSON)."""
    if not tools:
        return []
    out: list[Segment] = []
    occupied = [(s.start, s.end) for s in taken]
    for i, tool in enumerate(tools):
        for indent in (None, 4, 2):
            rendered = json.dumps(tool, ensure_ascii=False, indent=indent)
            found = text.find(rendered)
            if found < 0:
                continue
            end = found + len(rendered)
            if any(found < e and s < end for s, e in occupied):
                continue
            out.append(Segment(found, end, "tool", i))
            occupied.append((found, end))
            break
    return out
