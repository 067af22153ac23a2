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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixkv.errors import InvalidInputError

__all__ = ["Segment", "attribute", "merge_adjacent", "message_text", "segment_at"]


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


def segment_at(segments: Sequence[Segment], char: int) -> Segment | None:
    """The segment containing character `char` (the last segment for the end of the text)."""
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
