"""Diagnosing a trace: for each request, its best earlier match, where they part, and why.

The causes, and the order in which they are tried, are described in docs/analyze.md
("Diagnosis"). A `Diagnosis` holds the positions (divergence, and the shared stretch after it)
that the what-if rewrites and the report read; `classify` names the cause.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from prefixkv.text.tokenizers import message_text, segment_at

from .match import (
    MIN_RUN_CHARS,
    MIN_RUN_TOKENS,
    RadixTrie,
    common_length,
    common_suffix_length,
    permuted_region,
    resync,
)
from .read import TraceRequest
from .replay import Prepared

__all__ = [
    "LAYOUT_CAUSES",
    "Diagnosis",
    "canonical_tool",
    "classify",
    "diagnose_all",
    "tool_sort_key",
]

# Causes whose fix is a layout change: their findings share one what-if (see whatif.py).
LAYOUT_CAUSES = ("variable_before_stable", "system_prompt")

_MONTHS = (
    "Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
    "Sep(?:tember)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?"
)
# In priority order: the first kind that overlaps the divergence names it.
_VOLATILE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "timestamp",
        re.compile(
            r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
        ),
    ),
    (
        "UUID",
        re.compile(
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
        ),
    ),
    (
        "date",
        re.compile(
            rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b|"
            rf"\b\d{{1,2}} (?:{_MONTHS}) \d{{4}}\b|\b(?:{_MONTHS}) \d{{1,2}},? \d{{4}}\b"
        ),
    ),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b")),
    ("unix time", re.compile(r"\b1[5-9]\d{8}(?:\d{3})?\b")),
    ("hex id", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b")),
    ("number", re.compile(r"\d+")),
)


def _volatile_kind(text: str, start: int, end: int) -> str | None:
    """The highest-priority volatile pattern overlapping text[start:end] (at least the
    character at `start`), searched within the surrounding lines."""
    end = max(end, start + 1)
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    window = text[line_start:line_end]
    for kind, pattern in _VOLATILE_PATTERNS:
        for match in pattern.finditer(window):
            if match.start() + line_start < end and match.end() + line_start > start:
                return kind
    return None


def canonical_tool(tool: Mapping[str, Any]) -> str:
    return json.dumps(tool, sort_keys=True, ensure_ascii=False)


def tool_sort_key(tool: Mapping[str, Any]) -> tuple[str, str]:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return (str(name or ""), canonical_tool(tool))


def _same_tools_other_order(a: TraceRequest, b: TraceRequest) -> bool:
    if not a.tools or not b.tools or len(a.tools) != len(b.tools):
        return False
    ca = [canonical_tool(t) for t in a.tools]
    cb = [canonical_tool(t) for t in b.tools]
    return ca != cb and sorted(ca) == sorted(cb)


_WHITESPACE = re.compile(r"\s+")


@dataclass
class Diagnosis:
    index: int
    partner: int  # -1: no earlier request in the isolation group
    prefix: int  # longest common token prefix with the partner
    this_resync: int = -1  # where the shared stretch after the divergence starts (this, other)
    other_resync: int = -1
    shared_after: int = 0  # its length in tokens
    cause: str = "ok"
    detail: str = ""
    # tool_order found in the prompt itself: a[s:e] and the partner's [s:e] hold the same runs
    # in another order, in characters of the text (region_in_text) or in tokens.
    region: tuple[int, int] | None = None
    region_in_text: bool = False


def diagnose_all(prepared: Sequence[Prepared], block_size: int) -> list[Diagnosis]:
    tries: dict[str | None, RadixTrie] = defaultdict(RadixTrie)
    out: list[Diagnosis] = []
    for index, item in enumerate(prepared):
        trie = tries[item.request.isolation]
        prefix, partner = trie.longest_match(item.tokens)
        diagnosis = Diagnosis(index, partner, prefix)
        if partner >= 0:
            classify(diagnosis, item, prepared[partner], block_size)
        else:
            diagnosis.cause = "first"
        trie.insert(item.tokens, index)
        out.append(diagnosis)
    return out


def classify(d: Diagnosis, this: Prepared, other: Prepared, block_size: int) -> None:
    tokens = this.tokens
    min_shared = max(2 * block_size, math.ceil(0.05 * len(tokens)))
    found = resync(tokens, other.tokens, d.prefix, block_size, min_shared)
    if found is None:
        d.cause = "ok" if d.prefix >= len(tokens) // 2 else "different_prompt"
        return
    d.this_resync, d.other_resync, d.shared_after = found
    request, other_request = this.request, other.request

    this_start, other_start = this.char_at(d.prefix), other.char_at(d.prefix)
    this_end, other_end = this.char_at(d.this_resync), other.char_at(d.other_resync)
    this_region = other_region = None
    if this.text is not None and this_start is not None and this_end is not None:
        this_region = this.text[this_start:this_end]
    if other.text is not None and other_start is not None and other_end is not None:
        other_region = other.text[other_start:other_end]

    this_segment, other_segment = this.segment(d.prefix), other.segment(d.prefix)
    # Where one prompt's message ends and the other's goes on, the divergence is in a message
    # on one side and in template text on the other: the message side names the place.
    segment = this_segment
    if (
        (segment is None or segment.source != "message")
        and other_segment is not None
        and other_segment.source == "message"
    ):
        segment = other_segment
    in_message = segment is not None and segment.source == "message"
    if _same_tools_other_order(request, other_request) and not in_message:
        d.cause = "tool_order"
        return
    if (
        this_region is not None
        and other_region is not None
        and _WHITESPACE.sub("", this_region) == _WHITESPACE.sub("", other_region)
    ):
        d.cause = "whitespace"
        return
    if _reordered(d, this, other):
        return
    volatile = None
    if this.text is not None and this_start is not None and this_end is not None:
        volatile = _volatile_kind(this.text, this_start, this_end)
    if volatile is None and other.text is not None and other_start is not None:
        volatile = _volatile_kind(
            other.text, other_start, other_start if other_end is None else other_end
        )
    if segment is not None and segment.source == "template":
        d.cause = "template"
        d.detail = f"inserts a {volatile}" if volatile else "differs around the role markers"
        return
    role = segment.role if segment is not None else None
    if volatile is not None and not (volatile == "number" and role == "user"):
        d.cause, d.detail = "variable_before_stable", volatile
        return
    if (
        segment is not None
        and segment.index is not None
        and role == "system"
        and request.messages is not None
        and other_request.messages is not None
        and segment.index < min(len(request.messages), len(other_request.messages))
    ):
        # One message of each, decoded alone: the partner may be a long conversation that
        # many requests are compared with.
        this_message = request.messages[segment.index]
        other_message = other_request.messages[segment.index]
        if other_message.get("role") == "system" and (
            _similarity(message_text(this_message), message_text(other_message)) >= 0.8
        ):
            d.cause = "system_prompt"
            return
    d.cause = "variable_before_stable"
    if segment is not None and segment.source == "message":
        # The query is the whole user message; when the repeated stretch lies inside the same
        # message, only part of it varies (retrieved passages, say). The middle of the stretch
        # decides: its first tokens may be a suffix that two different queries share ("?").
        resumes = this.segment(d.this_resync + d.shared_after // 2)
        whole = resumes is None or resumes.index != segment.index
        if segment.role == "user" and whole:
            d.detail = "user query"
        else:
            d.detail = (
                f"{segment.role} message" if whole else f"varying part of a {segment.role} message"
            )
    elif tokens and this.text is None:
        d.detail = "varying tokens"
    else:
        d.detail = "varying text"


def _reordered(d: Diagnosis, this: Prepared, other: Prepared) -> bool:
    """Name the cause tool_order when the divergence is the same pieces in another order, in
    the prompt text (tool schemas written into a system prompt or a prompt string) or in the
    token ids; the region is kept for the what-if."""
    if this.text is not None and other.text is not None:
        a, b = this.text, other.text
        start = common_length(a, 0, b, 0, min(len(a), len(b)))
        region = permuted_region(a, b, start, MIN_RUN_CHARS)
        if region is None:
            return False
        segment = segment_at(this.segments, region[0]) if this.segments else None
        where = f"in {segment.label}" if segment is not None else "in the prompt text"
        piece = a[region[0] : region[1]]
        what = "tool definitions" if piece.count('"name"') >= 2 else "blocks of text"
        d.region_in_text = True
    elif this.text is None and other.text is None:
        region = permuted_region(this.tokens, other.tokens, d.prefix, MIN_RUN_TOKENS)
        if region is None:
            return False
        what, where = "runs of tokens", "in the token ids"
    else:
        return False
    d.cause, d.region = "tool_order", region
    d.detail = f"{what} reordered {where}"
    return True


_SIMILARITY_CHARS = 20_000  # difflib is quadratic in the worst case; past this, a linear bound


def _similarity(a: str, b: str) -> float:
    """difflib's similarity ratio for prompts of ordinary length. For longer ones, a lower
    bound of it, linear in the length: the share of the two that their common prefix and
    suffix cover, which is exact when the prompts differ in one place (the common case for a
    system prompt that changes a word)."""
    if len(a) + len(b) <= _SIMILARITY_CHARS:
        return SequenceMatcher(None, a, b, autojunk=False).ratio()
    if not a and not b:
        return 1.0
    prefix = common_length(a, 0, b, 0, min(len(a), len(b)))
    rest = min(len(a), len(b)) - prefix
    suffix = common_suffix_length(a, len(a), b, len(b), rest)
    return 2 * (prefix + suffix) / (len(a) + len(b))
