"""Reading a trace: JSONL lines in, `TraceRequest`s and `SkippedLine`s out.

This is the first stage of the analyzer and the only one that sees raw input, so it is where
hostile input stops: every line is either a valid request or a `SkippedLine` with its line
number and a one-line reason. The accepted shapes are documented in docs/analyze.md
("Trace format"); this module is their one implementation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SkippedLine", "TraceRequest", "parse_trace", "read_lines"]

_MAX_TOKEN_ID = 2**32  # token ids travel as u32
_PROMPT_KEYS = ("tokens", "text", "messages")


@dataclass(frozen=True)
class SkippedLine:
    """A malformed line: its 1-based number and why it was skipped."""

    line: int
    error: str


@dataclass(frozen=True)
class TraceRequest:
    """One valid trace line, before tokenization."""

    line: int
    request_id: str
    kind: str  # "tokens" | "text" | "messages"
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    tenant: str | None = None
    salt: str | None = None
    timestamp: str | float | None = None

    @property
    def isolation(self) -> str | None:
        """The salt handed to the cache: tenant and salt together, None when neither is set."""
        if self.tenant is None and self.salt is None:
            return None
        return json.dumps({"tenant": self.tenant, "salt": self.salt}, sort_keys=True)


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
        fields["tokens"] = tuple(tokens)
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
        fields["messages"] = tuple(messages)
        if "tools" in obj:
            tools = obj["tools"]
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                return "'tools' must be a list of objects"
            fields["tools"] = tuple(tools)
    return TraceRequest(
        line=line_no,
        request_id=str(request_id),
        kind=kind,
        tenant=obj.get("tenant"),
        salt=obj.get("salt"),
        timestamp=timestamp,
        **fields,
    )


def parse_trace(lines: Iterable[str]) -> tuple[list[TraceRequest], list[SkippedLine]]:
    """Valid requests in order, and the malformed lines (1-based line numbers)."""
    requests: list[TraceRequest] = []
    skipped: list[SkippedLine] = []
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        parsed = _parse_line(line_no, raw)
        if isinstance(parsed, str):
            skipped.append(SkippedLine(line_no, parsed))
        else:
            requests.append(parsed)
    return requests, skipped


def read_lines(path_or_lines: str | os.PathLike[str] | Iterable[str]) -> tuple[str, list[str]]:
    """(the trace's name, its lines): a path is read from disk; anything else is taken as lines."""
    if isinstance(path_or_lines, (str, os.PathLike)):
        path = Path(path_or_lines)
        with path.open(encoding="utf-8-sig", errors="replace") as handle:
            return str(path), handle.read().splitlines()
    return "<lines>", list(path_or_lines)
