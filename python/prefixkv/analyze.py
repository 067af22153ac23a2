"""`prefixkv analyze TRACE`: how much of a request trace a prefix cache reuses, and why not more.

A prefix cache reuses KV block by block from the left: a request reuses exactly the full blocks
of its longest token prefix that an earlier request (of the same tenant and salt) already
computed. So stable content (system prompt, tool schemas, examples) must come first and
variable content (retrieved text, the user's query, timestamps) last. A trace that puts a
timestamp or the query first gets almost nothing, and nothing in the engine says so. This module
replays a trace through the real `PrefixCache`, measures the reuse, and for requests that reuse
little finds where they part ways with their best earlier match, names the cause, and replays a
rewritten trace to show what the fix would buy.

Trace format (JSONL, one request per line, replayed in file order; blank lines are ignored)
-----------------------------------------------------------------------------------------
Exactly one of
  "tokens":   [int, ...]           token ids, 0 <= id < 2**32, not empty
  "text":     "..."                prompt text, encoded with the tokenizer
  "messages": [{"role": str, "content": str | null | [{"type": "text", "text": str}]}, ...]
              rendered with the chat template (other message keys are passed to the template)
and optionally
  "tools":     [{...}, ...]        OpenAI-style tool schemas (only with "messages")
  "tenant":    str                 \\  cache isolation: requests share cached blocks only when
  "salt":      str                 /   both tenant and salt are equal
  "timestamp": str | number        informational; the replay order is the file order
  "id":        str | int           shown in findings (default: "line N")
Other keys (``model``, ``temperature``, ...) are ignored, so logs can be fed as they are. An
OpenAI batch line (``{"custom_id", "body": {"messages": ...}}``) or a logged request
(``{"request": {...}}``) is read from its body, and a completions-style ``prompt`` counts as
``text`` (a string) or ``tokens`` (a list). A line without exactly one prompt field, or with a
field of the wrong type, is malformed: reported with its line number and skipped.

Exit codes of `main`
--------------------
  0  the whole trace was analysed
  1  the analysis ran, but some lines were malformed and skipped
  2  nothing usable: the file is missing or unreadable, no line is a valid request, or a bad
     option (argparse's own usage errors also exit with 2)

Cost model
----------
Reuse is measured in tokens whose prefill is skipped. Seconds saved are an ESTIMATE:
hit tokens / `prefill_tokens_per_second` (default 10,000 tokens/s, roughly an 8B model on one
data-centre GPU at moderate batch; pass the figure measured on your engine). It is linear and
ignores attention's quadratic term, so it understates the saving on long prompts. Memory is
`bytes_per_block` = 2 (K and V) x layers x KV heads x head dim x dtype bytes x block size; the
default model shape is 32 layers, 8 KV heads, head dim 128, 2-byte dtype (Llama-3-8B-like).

Diagnosis
---------
Every request is matched against a radix trie of the earlier requests of its tenant: the longest
common token prefix gives the best earlier match and the divergence position. The analyzer then
looks for a long stretch (at least two blocks and 5% of the prompt) that both requests share
*after* the divergence: if there is one, stable content sits behind variable content and the
cache cannot reach it. The cause is classified from the divergent region (in this order):
  tool_order               same tool schemas in a different order
  whitespace               the divergent regions are equal once whitespace is removed
  template                 the chat template itself renders identical messages differently
  variable_before_stable   a timestamp, date, time, UUID, hex id or number, the user's query, or
                           other varying text comes before content that every request repeats
  system_prompt            the system message differs slightly (a word or two) between requests
Two more causes need no layout analysis:
  evicted                  an earlier request had the prefix, but it was evicted before reuse
  different_prompt         no long shared stretch at all: genuinely different prompts (no fix)
Each finding carries a WHAT-IF: the trace rewritten as the fix says (variable units moved after
the stable ones, tools sorted, whitespace normalised, or an unbounded cache) and replayed through
the same cache. The layout rewrite is one rewrite for the whole trace: findings of causes
variable_before_stable and system_prompt share its what-if. For message traces it keeps units
(lines, sentences) found in at least half of a tenant's requests in place and moves the rest
after them; for text and token traces it moves each divergent region to the end of its request
and re-diagnoses, for up to three rounds.

JSON output (`--json`, `AnalysisReport.to_dict()`)
---------------------------------------------------
  trace                         the trace path (or "<lines>")
  settings                      block_size, capacity_blocks, capacity_given (false: sized to
                                hold the whole trace), bytes_per_block,
                                prefill_tokens_per_second, tokenizer, tokenizer_digest,
                                chat_template, chat_template_digest
  requests                      usable requests replayed
  isolation_groups              distinct (tenant, salt) pairs
  prompt_tokens, hit_tokens     totals over the replay; hit_rate = hit_tokens / prompt_tokens
  prefill_seconds_estimate      prompt_tokens / prefill rate (no cache)
  prefill_seconds_saved_estimate  hit_tokens / prefill rate
  cost                          peak_blocks, peak_bytes, evictions, out_of_blocks_requests
                                (requests the cache could not admit; counted as all-miss)
  first_requests                requests with no earlier request in their isolation group
  causes                        {cause: number of requests}
  findings                      list, largest loss first, of
      cause, title, detail, requests, recoverable_tokens (a lower bound: the first stretch after
      the divergence that the earlier request also had, in full blocks, summed over requests;
      for "evicted": the tokens lost to eviction), example_ids, example_lines, fix,
      divergence: {request_id, line, other_request_id, other_line, token, block, this_segment,
                   other_segment, context_before, this_text, other_text, this_tokens,
                   other_tokens}
      what_if: {description, hit_rate, hit_tokens, prompt_tokens, hit_rate_gain} or null
  what_if_all                   every applicable rewrite at once (same fields) or null
  skipped_lines                 [{line, error}]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, TypeVar

from prefixkv.cache import PrefixCache
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError, OutOfBlocksError, PrefixKVError
from prefixkv.text import (
    ChatTemplate,
    Segment,
    Tokenizer,
    load_chat_template,
    load_tokenizer,
    message_text,
    segment_at,
)

__all__ = [
    "AnalysisReport",
    "Divergence",
    "Finding",
    "SkippedLine",
    "TraceRequest",
    "WhatIf",
    "analyze_trace",
    "format_report",
    "main",
    "parse_trace",
]

DEFAULT_PREFILL_TOKENS_PER_SECOND = 10_000.0
DEFAULT_MODEL_SHAPE = (32, 8, 128)  # layers, KV heads, head dim: Llama-3-8B-like
DEFAULT_DTYPE_BYTES = 2
_MAX_TOKEN_ID = 2**32  # token ids travel as u32
_PROMPT_KEYS = ("tokens", "text", "messages")
_CONTEXT_CHARS = 48  # characters of context shown on each side of a divergence
_CONTEXT_TOKENS = 8  # token ids shown on each side, for token traces
_WHAT_IF_ROUNDS = 3  # diagnose-and-move rounds for text and token traces


# --------------------------------------------------------------------------------------------
# Trace parsing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SkippedLine:
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


# --------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------


@dataclass
class _Prepared:
    """A request as the cache sees it, with what is needed to explain a divergence."""

    request: TraceRequest
    tokens: list[int]
    text: str | None = None
    offsets: list[tuple[int, int]] | None = None
    segments: list[Segment] | None = None

    def char_at(self, token: int) -> int | None:
        """Character position in `text` where token `token` starts (len(text) past the end)."""
        if self.text is None or self.offsets is None:
            return None
        if token >= len(self.offsets):
            return len(self.text)
        return self.offsets[token][0]

    def segment_label(self, token: int) -> str | None:
        char = self.char_at(token)
        if char is None:
            return None
        if self.segments is None:
            return "text"
        segment = segment_at(self.segments, char)
        return segment.label if segment else None

    def segment(self, token: int) -> Segment | None:
        char = self.char_at(token)
        if char is None or not self.segments:
            return None
        return segment_at(self.segments, char)


def _prepare(
    requests: Sequence[TraceRequest], tokenizer: Tokenizer, template: ChatTemplate
) -> list[_Prepared]:
    out: list[_Prepared] = []
    for request in requests:
        if request.tokens is not None:
            out.append(_Prepared(request, list(request.tokens)))
            continue
        segments: list[Segment] | None = None
        if request.messages is not None:
            text, segments = template.render_with_segments(request.messages, True, request.tools)
        else:
            text = request.text or ""
        tokens, offsets = tokenizer.encode_with_offsets(text)
        out.append(_Prepared(request, tokens, text, offsets, segments))
    return out


# --------------------------------------------------------------------------------------------
# The replay: the only place that talks to the cache
# --------------------------------------------------------------------------------------------


@dataclass
class _Replay:
    capacity_blocks: int
    cached: list[int]  # per request: prefix tokens whose KV was reused
    prompt_tokens: int
    hit_tokens: int
    evictions: int
    peak_blocks: int
    out_of_blocks: list[int]  # request indices the cache could not admit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _blocks_needed(prepared: Sequence[_Prepared], block_size: int) -> int:
    return sum(-(-len(p.tokens) // block_size) for p in prepared) + 1


def _replay(
    prepared: Sequence[_Prepared],
    *,
    capacity_blocks: int,
    context: CacheContext,
) -> _Replay:
    """Run every request through a fresh `PrefixCache`: begin, commit the whole prompt, finish.

    A request the cache cannot admit (`OutOfBlocksError`) counts as all-miss and is noted."""
    cache = PrefixCache(capacity_blocks, context=context)
    cached: list[int] = []
    out_of_blocks: list[int] = []
    peak = 0
    for index, item in enumerate(prepared):
        try:
            request = cache.begin(item.tokens, salt=item.request.isolation)
        except OutOfBlocksError:
            cached.append(0)
            out_of_blocks.append(index)
            continue
        cached.append(request.num_cached_tokens)
        cache.commit(request, len(item.tokens))
        peak = max(peak, capacity_blocks - cache.stats().blocks_free)
        cache.finish(request)
    stats = cache.stats()
    return _Replay(
        capacity_blocks=capacity_blocks,
        cached=cached,
        prompt_tokens=sum(len(p.tokens) for p in prepared),
        hit_tokens=sum(cached),
        evictions=stats.evictions,
        peak_blocks=peak,
        out_of_blocks=out_of_blocks,
    )


# --------------------------------------------------------------------------------------------
# Matching: a radix trie of earlier requests, and the re-synchronisation after a divergence
# --------------------------------------------------------------------------------------------


def _common_length(
    a: Sequence[int], a_start: int, b: Sequence[int], b_start: int, limit: int
) -> int:
    """Length of the common run a[a_start:] / b[b_start:], at most `limit`."""
    matched = 0
    chunk = 64
    while matched < limit:
        step = min(chunk, limit - matched)
        i, j = a_start + matched, b_start + matched
        if a[i : i + step] == b[j : j + step]:
            matched += step
            continue
        while a[i] == b[j]:
            i += 1
            j += 1
            matched += 1
        return matched
    return matched


class _Node:
    __slots__ = ("children", "end", "owner", "seq", "start")

    def __init__(self, seq: int, start: int, end: int, owner: int) -> None:
        self.seq = seq  # the edge into this node is _RadixTrie._seqs[seq][start:end]
        self.start = start
        self.end = end
        self.owner = owner  # the latest request whose tokens pass through this node
        self.children: dict[int, _Node] = {}


class _RadixTrie:
    """Token sequences of earlier requests; an edge is a slice of one stored sequence, so the
    trie costs O(requests) nodes rather than O(tokens)."""

    def __init__(self) -> None:
        self._seqs: list[Sequence[int]] = []
        self._root = _Node(-1, 0, 0, -1)

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(length of the longest common prefix with any stored sequence, the latest request
        sharing that prefix); (0, -1) when the trie is empty or nothing matches."""
        node, pos, owner = self._root, 0, -1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            label = self._seqs[child.seq]
            edge = child.end - child.start
            matched = _common_length(tokens, pos, label, child.start, min(edge, len(tokens) - pos))
            pos += matched
            owner = child.owner
            if matched < edge:
                break
            node = child
        return pos, owner

    def insert(self, tokens: Sequence[int], owner: int) -> None:
        self._seqs.append(tokens)
        seq = len(self._seqs) - 1
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = _Node(seq, pos, len(tokens), owner)
                return
            label = self._seqs[child.seq]
            edge = child.end - child.start
            matched = _common_length(tokens, pos, label, child.start, min(edge, len(tokens) - pos))
            if matched < edge:  # split the edge: `middle` takes the shared part
                middle = _Node(child.seq, child.start, child.start + matched, owner)
                child.start += matched
                middle.children[label[child.start]] = child
                node.children[tokens[pos]] = middle
                child = middle
            child.owner = owner
            pos += matched
            node = child


def _to_bytes(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def _resync(
    this: Sequence[int], other: Sequence[int], start: int, anchor: int, min_length: int
) -> tuple[int, int, int] | None:
    """The first long stretch (at least `min_length` tokens) that `this[start:]` and
    `other[start:]` share, at possibly different positions: (position in this, position in
    other, length).

    `other` is indexed only at every `anchor`-th position; any shared stretch of at least
    2*anchor-1 tokens contains one indexed `anchor`-gram, and extending the hit backwards and
    forwards recovers the whole stretch. Repeated content can align a stretch with the wrong
    copy, so once a long stretch is found the next `anchor` positions are tried too and the
    longest stretch wins."""
    if len(this) - start < min_length or len(other) - start < min_length:
        return None
    this_bytes, other_bytes = _to_bytes(this), _to_bytes(other)
    width = 4 * anchor
    index: dict[bytes, list[int]] = defaultdict(list)
    for q in range(start, len(other) - anchor + 1, anchor):
        positions = index[other_bytes[4 * q : 4 * q + width]]
        if len(positions) < 4:
            positions.append(q)
    best: tuple[int, int, int] | None = None
    deadline = len(this) - anchor + 1
    covered: dict[int, int] = {}  # diagonal (p - q) -> end of the stretch already measured
    attempts = 0
    for p in range(start, len(this) - anchor + 1):
        if p >= deadline:
            break
        for hit in index.get(this_bytes[4 * p : 4 * p + width], ()):
            if covered.get(p - hit, -1) > p:
                continue
            attempts += 1
            p0, q0 = p, hit
            while p0 > start and q0 > start and this[p0 - 1] == other[q0 - 1]:
                p0 -= 1
                q0 -= 1
            length = _common_length(this, p0, other, q0, min(len(this) - p0, len(other) - q0))
            covered[p - hit] = p0 + length
            if length >= min_length:
                if best is None:
                    deadline = min(deadline, p0 + anchor)
                if best is None or length > best[2]:
                    best = (p0, q0, length)
        if attempts > 256 and best is None:  # repetitive content: give up, do not go quadratic
            return None
    return best


# --------------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------------

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

_TITLES = {
    "variable_before_stable": "Variable content placed before stable content",
    "system_prompt": "System prompt changes slightly between requests",
    "tool_order": "Same tools listed in a different order",
    "whitespace": "Whitespace differences in otherwise identical content",
    "template": "The chat template renders identical messages differently",
    "evicted": "Shared prefix evicted before it was reused",
    "different_prompt": "Genuinely different prompts (not a problem)",
}


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


def _canonical_tool(tool: Mapping[str, Any]) -> str:
    return json.dumps(tool, sort_keys=True, ensure_ascii=False)


def _tool_sort_key(tool: Mapping[str, Any]) -> tuple[str, str]:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return (str(name or ""), _canonical_tool(tool))


def _same_tools_other_order(a: TraceRequest, b: TraceRequest) -> bool:
    if not a.tools or not b.tools or len(a.tools) != len(b.tools):
        return False
    ca = [_canonical_tool(t) for t in a.tools]
    cb = [_canonical_tool(t) for t in b.tools]
    return ca != cb and sorted(ca) == sorted(cb)


_WHITESPACE = re.compile(r"\s+")


@dataclass
class _Diagnosis:
    index: int
    partner: int  # -1: no earlier request in the isolation group
    prefix: int  # longest common token prefix with the partner
    this_resync: int = -1  # where the shared stretch after the divergence starts (this, other)
    other_resync: int = -1
    shared_after: int = 0  # its length in tokens
    cause: str = "ok"
    detail: str = ""


def _diagnose_all(prepared: Sequence[_Prepared], block_size: int) -> list[_Diagnosis]:
    tries: dict[str | None, _RadixTrie] = defaultdict(_RadixTrie)
    out: list[_Diagnosis] = []
    for index, item in enumerate(prepared):
        trie = tries[item.request.isolation]
        prefix, partner = trie.longest_match(item.tokens)
        diagnosis = _Diagnosis(index, partner, prefix)
        if partner >= 0:
            _classify(diagnosis, item, prepared[partner], block_size)
        else:
            diagnosis.cause = "first"
        trie.insert(item.tokens, index)
        out.append(diagnosis)
    return out


def _classify(d: _Diagnosis, this: _Prepared, other: _Prepared, block_size: int) -> None:
    tokens = this.tokens
    min_shared = max(2 * block_size, math.ceil(0.05 * len(tokens)))
    found = _resync(tokens, other.tokens, d.prefix, block_size, min_shared)
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
        and other_request.messages[segment.index].get("role") == "system"
    ):
        this_system = message_text(request.messages[segment.index])
        other_system = message_text(other_request.messages[segment.index])
        if SequenceMatcher(None, this_system, other_system, autojunk=False).ratio() >= 0.8:
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


# --------------------------------------------------------------------------------------------
# What-if rewrites
# --------------------------------------------------------------------------------------------

_Seq = TypeVar("_Seq", str, list[int])
_UNIT_SPLIT = re.compile(r"(?<=\n)|(?<=[.!?][ \t])")


def _units(text: str) -> list[str]:
    """Lines, and sentences within lines; "".join(_units(t)) == t."""
    return [unit for unit in _UNIT_SPLIT.split(text) if unit]


def _stable_units(requests: Sequence[TraceRequest]) -> dict[str | None, set[str]]:
    """Per isolation group, the units (lines/sentences) found in at least half of its requests
    (and at least two): the content that should come first."""
    counts: dict[str | None, Counter[str]] = defaultdict(Counter)
    sizes: Counter[str | None] = Counter()
    for request in requests:
        group = request.isolation
        sizes[group] += 1
        seen: set[str] = set()
        for text in _request_texts(request):
            seen.update(u.strip() for u in _units(text) if u.strip())
        counts[group].update(seen)
    return {
        group: {u for u, n in counter.items() if n >= max(2, math.ceil(sizes[group] / 2))}
        for group, counter in counts.items()
    }


def _request_texts(request: TraceRequest) -> Iterator[str]:
    if request.messages is not None:
        for message in request.messages:
            yield message_text(message)
    elif request.text is not None:
        yield request.text


def _stable_first_messages(request: TraceRequest, stable: set[str]) -> TraceRequest:
    """Stable units (shared by most requests) stay where they are; messages with no stable unit
    move after the others (system messages excepted), and variable units inside otherwise stable
    messages are appended to the last message, so the volatile lines go last."""
    assert request.messages is not None
    kept: list[Mapping[str, Any]] = []
    moved: list[Mapping[str, Any]] = []
    moved_units: list[str] = []
    for message in request.messages:
        units = _units(message_text(message))
        is_stable = [not u.strip() or u.strip() in stable for u in units]
        has_stable = any(u.strip() and s for u, s in zip(units, is_stable, strict=True))
        if not has_stable and message.get("role") != "system":
            moved.append(message)
            continue
        kept.append(
            {**message, "content": "".join(u for u, s in zip(units, is_stable, strict=True) if s)}
        )
        moved_units.extend(u for u, s in zip(units, is_stable, strict=True) if not s)
    reordered = kept + moved
    if moved_units:
        last = reordered[-1]
        tail = "".join(moved_units).strip()
        content = message_text(last).rstrip()
        reordered[-1] = {**last, "content": f"{content}\n{tail}" if content else tail}
    return dataclasses.replace(request, messages=tuple(reordered))


def _expand_to_units(text: str, start: int, end: int) -> tuple[int, int]:
    """Widen [start, end) to whole lines/sentences, so a timestamp moves as one piece."""
    pos = 0
    new_start, new_end = start, end
    for unit in _units(text):
        unit_end = pos + len(unit)
        if pos <= start < unit_end:
            new_start = pos
        if pos < end <= unit_end:
            new_end = unit_end
        pos = unit_end
    return new_start, max(new_end, new_start)


def _merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _cut(seq: _Seq, spans: list[tuple[int, int]]) -> tuple[_Seq, _Seq]:
    """(seq without the given merged spans, the spans' contents in order)."""
    kept, moved = seq[:0], seq[:0]
    pos = 0
    for start, end in spans:
        kept += seq[pos:start]
        moved += seq[start:end]
        pos = end
    return kept + seq[pos:], moved


_LAYOUT_CAUSES = ("variable_before_stable", "system_prompt")


def _span_moves(
    prepared: Sequence[_Prepared], diagnoses: Sequence[_Diagnosis]
) -> dict[int, list[tuple[int, int]]]:
    """Per request, the divergent regions (token spans) of layout findings: each diagnosed
    request's own region and its partner's."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for d in diagnoses:
        if d.cause not in _LAYOUT_CAUSES:
            continue
        spans[d.index].append((d.prefix, d.this_resync))
        spans[d.partner].append((d.prefix, d.other_resync))
    return spans


def _apply_span_moves(
    prepared: Sequence[_Prepared], moves: Mapping[int, list[tuple[int, int]]]
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for index, item in enumerate(prepared):
        request = item.request
        token_spans = moves.get(index)
        if not token_spans:
            out.append(request)
        elif request.kind == "tokens":
            kept_tokens, moved_tokens = _cut(list(item.tokens), _merge_spans(token_spans))
            out.append(dataclasses.replace(request, tokens=tuple(kept_tokens + moved_tokens)))
        else:
            assert item.text is not None
            text = item.text
            char_spans = []
            for start, end in token_spans:
                char_start, char_end = item.char_at(start), item.char_at(end)
                assert char_start is not None and char_end is not None
                char_spans.append(_expand_to_units(text, char_start, char_end))
            kept, moved = _cut(text, _merge_spans(char_spans))
            joiner = "" if kept.endswith("\n") or not kept else "\n"
            out.append(dataclasses.replace(request, text=kept + joiner + moved))
    return out


def _normalise_whitespace(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def _rewrite_whitespace(request: TraceRequest) -> TraceRequest:
    if request.text is not None:
        return dataclasses.replace(request, text=_normalise_whitespace(request.text))
    if request.messages is not None:
        messages = tuple(
            {**m, "content": _normalise_whitespace(message_text(m))} for m in request.messages
        )
        return dataclasses.replace(request, messages=messages)
    return request


def _rewrite_tools(request: TraceRequest) -> TraceRequest:
    if not request.tools:
        return request
    return dataclasses.replace(request, tools=tuple(sorted(request.tools, key=_tool_sort_key)))


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


@dataclass
class WhatIf:
    description: str
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    hit_rate_gain: float  # hit_rate minus the original trace's hit rate


@dataclass
class Divergence:
    request_id: str
    line: int
    other_request_id: str
    other_line: int
    token: int
    block: int
    this_segment: str | None
    other_segment: str | None
    context_before: str | None = None
    this_text: str | None = None
    other_text: str | None = None
    this_tokens: list[int] | None = None
    other_tokens: list[int] | None = None


@dataclass
class Finding:
    cause: str
    title: str
    detail: str
    requests: int
    recoverable_tokens: int
    example_ids: list[str]
    example_lines: list[int]
    fix: str
    divergence: Divergence | None
    what_if: WhatIf | None


@dataclass
class AnalysisReport:
    trace: str
    settings: dict[str, Any]
    requests: int
    isolation_groups: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    prefill_seconds_estimate: float
    prefill_seconds_saved_estimate: float
    cost: dict[str, int]
    first_requests: int
    causes: dict[str, int]
    findings: list[Finding] = field(default_factory=list)
    what_if_all: WhatIf | None = None
    skipped_lines: list[SkippedLine] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


def _fix_sentence(cause: str, detail: str) -> str:
    if cause == "variable_before_stable":
        if detail == "user query":
            return (
                "Put the user's query last: system prompt, tool schemas and examples first, "
                "then the query."
            )
        return (
            f"Move the {detail} after the stable content (system prompt, tools, examples), "
            "next to the user's query at the end, so everything before it can be reused."
        )
    return {
        "system_prompt": "Keep the system prompt byte-identical across requests and put the "
        "per-request part in a later message.",
        "tool_order": "Sort the tool list (for example by name) before rendering, so the same "
        "tools always give the same prompt.",
        "whitespace": "Normalise whitespace (trailing spaces, blank lines, indentation) before "
        "rendering, so identical content gives identical tokens.",
        "template": f"The chat template {detail}: pin its variables (a fixed date) or move that "
        "part to the last message.",
        "evicted": "Give the cache more blocks (--capacity-blocks), or schedule requests that "
        "share a prefix closer together.",
        "different_prompt": "Nothing to fix: these prompts share little with earlier requests.",
    }[cause]


def _show(text: str) -> str:
    """Printable, one line: newlines and tabs as escapes, other text as-is."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# --------------------------------------------------------------------------------------------
# The analysis
# --------------------------------------------------------------------------------------------


@dataclass
class _Setup:
    tokenizer: Tokenizer
    template: ChatTemplate
    block_size: int
    capacity_blocks: int | None  # None: enough for the whole trace
    context: CacheContext

    def replay(self, requests: Sequence[TraceRequest]) -> tuple[list[_Prepared], _Replay]:
        prepared = _prepare(requests, self.tokenizer, self.template)
        capacity = self.capacity_blocks or _blocks_needed(prepared, self.block_size)
        return prepared, _replay(prepared, capacity_blocks=capacity, context=self.context)

    def what_if(
        self, description: str, requests: Sequence[TraceRequest], baseline: _Replay
    ) -> WhatIf:
        _, result = self.replay(requests)
        return WhatIf(
            description,
            result.hit_rate,
            result.hit_tokens,
            result.prompt_tokens,
            result.hit_rate - baseline.hit_rate,
        )

    def move_variable_last(self, requests: Sequence[TraceRequest]) -> list[TraceRequest]:
        """Messages: reorder units, stable first. Text and tokens: move the divergent regions of
        layout findings to the end, re-diagnose, and repeat a few rounds."""
        stable = _stable_units(requests)
        current = [
            _stable_first_messages(r, stable.get(r.isolation, set()))
            if r.messages is not None
            else r
            for r in requests
        ]
        for _ in range(_WHAT_IF_ROUNDS):
            if all(r.messages is not None for r in current):
                break
            prepared = _prepare(current, self.tokenizer, self.template)
            diagnoses = _diagnose_all(prepared, self.block_size)
            moves = {
                i: spans
                for i, spans in _span_moves(prepared, diagnoses).items()
                if prepared[i].request.messages is None
            }
            if not moves:
                break
            current = _apply_span_moves(prepared, moves)
        return current


def _read_lines(path_or_lines: str | os.PathLike[str] | Iterable[str]) -> tuple[str, list[str]]:
    if isinstance(path_or_lines, (str, os.PathLike)):
        path = Path(path_or_lines)
        with path.open(encoding="utf-8-sig", errors="replace") as handle:
            return str(path), handle.read().splitlines()
    return "<lines>", list(path_or_lines)


def bytes_per_block(
    block_size: int,
    model_shape: tuple[int, int, int] = DEFAULT_MODEL_SHAPE,
    dtype_bytes: int = DEFAULT_DTYPE_BYTES,
) -> int:
    """KV bytes one block holds: K and V, for every layer and KV head."""
    layers, kv_heads, head_dim = model_shape
    return 2 * layers * kv_heads * head_dim * dtype_bytes * block_size


def analyze_trace(
    path_or_lines: str | os.PathLike[str] | Iterable[str],
    *,
    block_size: int = 16,
    capacity_blocks: int | None = None,
    tokenizer: Tokenizer | str | None = None,
    chat_template: ChatTemplate | str | None = None,
    prefill_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND,
    model_shape: tuple[int, int, int] = DEFAULT_MODEL_SHAPE,
    dtype_bytes: int = DEFAULT_DTYPE_BYTES,
    max_examples: int = 3,
) -> AnalysisReport:
    """Replay a JSONL trace through `PrefixCache` and diagnose its reuse (see the module doc).

    `path_or_lines` is a path or an iterable of JSONL lines. `capacity_blocks=None` sizes the
    cache to hold the whole trace, so only layout limits reuse. Raises `FileNotFoundError` /
    `OSError` for an unreadable file and `InvalidInputError` for bad settings; malformed lines
    are not errors but `skipped_lines`."""
    if block_size < 1:
        raise InvalidInputError(f"block_size must be positive, got {block_size}")
    if capacity_blocks is not None and capacity_blocks < 1:
        raise InvalidInputError(f"capacity_blocks must be positive, got {capacity_blocks}")
    if prefill_tokens_per_second <= 0:
        raise InvalidInputError("prefill_tokens_per_second must be positive")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    template = (
        chat_template
        if isinstance(chat_template, ChatTemplate)
        else load_chat_template(chat_template)
    )
    bpb = bytes_per_block(block_size, model_shape, dtype_bytes)
    # The tokenizer and template are part of what must match: the same ids from another
    # vocabulary are another prompt.
    context = CacheContext(
        tokenizer_id=tok.name,
        tokenizer_digest=tok.digest(),
        chat_template_version=f"{template.version}:{template.digest()}",
        block_size=block_size,
    )
    setup = _Setup(tok, template, block_size, capacity_blocks, context)
    trace_name, lines = _read_lines(path_or_lines)
    requests, skipped = parse_trace(lines)
    settings: dict[str, Any] = {
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        "capacity_given": capacity_blocks is not None,
        "bytes_per_block": bpb,
        "prefill_tokens_per_second": prefill_tokens_per_second,
        "tokenizer": tok.name,
        "tokenizer_digest": tok.digest(),
        "chat_template": template.name,
        "chat_template_digest": template.digest(),
    }
    empty_cost = {"peak_blocks": 0, "peak_bytes": 0, "evictions": 0, "out_of_blocks_requests": 0}
    if not requests:
        return AnalysisReport(
            trace_name,
            settings,
            0,
            0,
            0,
            0,
            0.0,
            0.0,
            0.0,
            empty_cost,
            0,
            {},
            skipped_lines=skipped,
        )

    prepared, replay = setup.replay(requests)
    settings["capacity_blocks"] = replay.capacity_blocks
    diagnoses = _diagnose_all(prepared, block_size)
    findings = _findings(setup, requests, prepared, diagnoses, replay, max_examples)
    what_if_all = _what_if_all(setup, requests, findings, replay)
    causes = Counter(d.cause for d in diagnoses if d.cause not in ("ok", "first"))
    for finding in findings:
        if finding.cause == "evicted":
            causes["evicted"] = finding.requests

    return AnalysisReport(
        trace=trace_name,
        settings=settings,
        requests=len(requests),
        isolation_groups=len({r.isolation for r in requests}),
        prompt_tokens=replay.prompt_tokens,
        hit_tokens=replay.hit_tokens,
        hit_rate=replay.hit_rate,
        prefill_seconds_estimate=replay.prompt_tokens / prefill_tokens_per_second,
        prefill_seconds_saved_estimate=replay.hit_tokens / prefill_tokens_per_second,
        cost={
            "peak_blocks": replay.peak_blocks,
            "peak_bytes": replay.peak_blocks * bpb,
            "evictions": replay.evictions,
            "out_of_blocks_requests": len(replay.out_of_blocks),
        },
        first_requests=sum(d.cause == "first" for d in diagnoses),
        causes=dict(causes.most_common()),
        findings=findings,
        what_if_all=what_if_all,
        skipped_lines=skipped,
    )


def _divergence(d: _Diagnosis, prepared: Sequence[_Prepared], block_size: int) -> Divergence:
    this, other = prepared[d.index], prepared[d.partner]
    out = Divergence(
        request_id=this.request.request_id,
        line=this.request.line,
        other_request_id=other.request.request_id,
        other_line=other.request.line,
        token=d.prefix,
        block=d.prefix // block_size,
        this_segment=this.segment_label(d.prefix),
        other_segment=other.segment_label(d.prefix),
    )
    this_char, other_char = this.char_at(d.prefix), other.char_at(d.prefix)
    if (
        this.text is not None
        and other.text is not None
        and this_char is not None
        and other_char is not None
    ):
        out.context_before = this.text[max(0, this_char - _CONTEXT_CHARS) : this_char]
        out.this_text = this.text[this_char : this_char + _CONTEXT_CHARS]
        out.other_text = other.text[other_char : other_char + _CONTEXT_CHARS]
    else:
        lo = max(0, d.prefix - _CONTEXT_TOKENS)
        out.this_tokens = this.tokens[lo : d.prefix + _CONTEXT_TOKENS]
        out.other_tokens = other.tokens[lo : d.prefix + _CONTEXT_TOKENS]
    return out


def _findings(
    setup: _Setup,
    requests: Sequence[TraceRequest],
    prepared: Sequence[_Prepared],
    diagnoses: Sequence[_Diagnosis],
    replay: _Replay,
    max_examples: int,
) -> list[Finding]:
    block_size = setup.block_size
    groups: dict[tuple[str, str], list[_Diagnosis]] = defaultdict(list)
    for d in diagnoses:
        if d.cause in ("ok", "first"):
            continue
        detail = d.detail if d.cause == "variable_before_stable" else ""
        groups[(d.cause, detail)].append(d)

    findings: list[Finding] = []
    what_if_cache: dict[str, WhatIf] = {}
    for (cause, detail), members in groups.items():
        recoverable = sum((d.shared_after // block_size) * block_size for d in members)
        what_if: WhatIf | None = None
        if cause in _LAYOUT_CAUSES:
            if "layout" not in what_if_cache:
                what_if_cache["layout"] = setup.what_if(
                    "variable content moved after the stable content",
                    setup.move_variable_last(requests),
                    replay,
                )
            what_if = what_if_cache["layout"]
        elif cause == "tool_order":
            what_if = setup.what_if(
                "tools sorted by name in every request",
                [_rewrite_tools(r) for r in requests],
                replay,
            )
        elif cause == "whitespace":
            what_if = setup.what_if(
                "whitespace normalised in every request",
                [_rewrite_whitespace(r) for r in requests],
                replay,
            )
        if cause == "template":
            detail = members[0].detail
        findings.append(
            _finding(
                cause, detail, members, recoverable, prepared, what_if, block_size, max_examples
            )
        )

    # Capacity: a block-aligned prefix an earlier request had, but the cache no longer did.
    # A full hit still computes the last token, so at most len - 1 tokens are reused.
    def reusable(d: _Diagnosis) -> int:
        return min((d.prefix // block_size) * block_size, len(prepared[d.index].tokens) - 1)

    # Requests the cache could not admit at all, or whose best match was never admitted, are
    # counted under cost.out_of_blocks_requests, not here.
    refused = set(replay.out_of_blocks)
    evicted = [
        d
        for d in diagnoses
        if d.partner >= 0
        and d.index not in refused
        and d.partner not in refused
        and replay.cached[d.index] < reusable(d)
    ]
    if evicted:
        lost = sum(reusable(d) - replay.cached[d.index] for d in evicted)
        what_if = None
        if setup.capacity_blocks is not None:
            unbounded = dataclasses.replace(setup, capacity_blocks=None)
            what_if = unbounded.what_if(
                "a cache large enough for the whole trace", requests, replay
            )
        findings.append(
            _finding("evicted", "", evicted, lost, prepared, what_if, block_size, max_examples)
        )
    findings.sort(key=lambda f: (f.cause == "different_prompt", -f.recoverable_tokens))
    return findings


_NO_GAIN = (
    " (The what-if gains little here: the content that repeats is not shared by most "
    "requests, for example retrieved passages in varying order.)"
)


def _finding(
    cause: str,
    detail: str,
    members: Sequence[_Diagnosis],
    recoverable: int,
    prepared: Sequence[_Prepared],
    what_if: WhatIf | None,
    block_size: int,
    max_examples: int,
) -> Finding:
    examples = [prepared[d.index].request for d in members[:max_examples]]
    return Finding(
        cause=cause,
        title=_TITLES[cause],
        detail=detail,
        requests=len(members),
        recoverable_tokens=recoverable,
        example_ids=[r.request_id for r in examples],
        example_lines=[r.line for r in examples],
        fix=_fix_sentence(cause, detail)
        + (_NO_GAIN if what_if is not None and what_if.hit_rate_gain < 0.01 else ""),
        divergence=_divergence(members[0], prepared, block_size) if members else None,
        what_if=what_if,
    )


def _what_if_all(
    setup: _Setup,
    requests: Sequence[TraceRequest],
    findings: Sequence[Finding],
    baseline: _Replay,
) -> WhatIf | None:
    """Every applicable rewrite at once; None unless two or more kinds of fix apply."""
    causes = {f.cause for f in findings if f.what_if is not None}
    if len(causes) < 2:
        return None
    rewritten = list(requests)
    steps = []
    if "whitespace" in causes:
        rewritten = [_rewrite_whitespace(r) for r in rewritten]
        steps.append("whitespace normalised")
    if "tool_order" in causes:
        rewritten = [_rewrite_tools(r) for r in rewritten]
        steps.append("tools sorted")
    if causes & set(_LAYOUT_CAUSES):
        rewritten = setup.move_variable_last(rewritten)
        steps.append("variable content moved last")
    if "evicted" in causes:
        setup = dataclasses.replace(setup, capacity_blocks=None)
        steps.append("an unbounded cache")
    return setup.what_if(", ".join(steps), rewritten, baseline)


# --------------------------------------------------------------------------------------------
# Terminal report
# --------------------------------------------------------------------------------------------


def _size(n_bytes: int) -> str:
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:,.1f} s"


def format_report(report: AnalysisReport) -> str:
    """The human-readable report `prefixkv analyze` prints."""
    s = report.settings
    out: list[str] = [f"prefixkv analyze: {report.trace}"]
    skipped = (
        f", {len(report.skipped_lines)} malformed lines skipped" if report.skipped_lines else ""
    )
    if report.requests == 0:
        out.append(f"  no usable requests{skipped}")
    else:
        groups = report.isolation_groups
        out.append(
            f"  {report.requests:,} requests in {groups} isolation group{'s' * (groups != 1)}"
            f"{skipped}; block size {s['block_size']}, cache {s['capacity_blocks']:,} blocks "
            f"({_size(s['capacity_blocks'] * s['bytes_per_block'])}"
            f"{'' if s['capacity_given'] else ', sized to hold the whole trace'}); tokenizer "
            f"{s['tokenizer']}, template {s['chat_template']}"
        )
        rate = s["prefill_tokens_per_second"]
        cost = report.cost
        out += [
            "",
            "Reuse",
            f"  prompt tokens      {report.prompt_tokens:>12,}",
            f"  hit tokens         {report.hit_tokens:>12,}   hit rate {report.hit_rate:.1%}",
            f"  prefill saved      {_seconds(report.prefill_seconds_saved_estimate):>12} of "
            f"{_seconds(report.prefill_seconds_estimate)} (ESTIMATE: {rate:,.0f} tokens/s, "
            "linear; set --prefill-tokens-per-second)",
            f"  cache at peak      {cost['peak_blocks']:>12,} blocks "
            f"({_size(cost['peak_bytes'])}), {cost['evictions']:,} evictions"
            + (
                f", {cost['out_of_blocks_requests']} requests did not fit"
                if cost["out_of_blocks_requests"]
                else ""
            ),
        ]
        out += ["", "Findings"]
        if not report.findings:
            out.append("  none: every request reuses what an earlier request of its group had")
        for number, finding in enumerate(report.findings, 1):
            out += _format_finding(number, finding, report.hit_rate, report.requests)
        if report.what_if_all is not None:
            w = report.what_if_all
            out += [
                "",
                f"All fixes together ({w.description}): hit rate {report.hit_rate:.1%} "
                f"-> {w.hit_rate:.1%}",
            ]
    if report.skipped_lines:
        out += ["", "Skipped lines"]
        out += [f"  line {s.line}: {s.error}" for s in report.skipped_lines[:20]]
        if len(report.skipped_lines) > 20:
            out.append(f"  ... and {len(report.skipped_lines) - 20} more")
    return "\n".join(out)


def _format_finding(number: int, f: Finding, hit_rate: float, total: int) -> list[str]:
    detail = f" [{f.detail}]" if f.detail else ""
    if f.cause == "evicted":
        loss = f"; {f.recoverable_tokens:,} tokens were cached earlier but evicted before reuse"
    elif f.cause == "different_prompt":
        loss = ""
    else:
        loss = (
            f"; at least {f.recoverable_tokens:,} tokens after the divergence repeat an "
            "earlier request"
        )
    lines = [
        "",
        f"  {number}. {f.title}{detail}",
        f"     {f.requests} of {total} requests{loss}",
        f"     e.g. {', '.join(map(repr, f.example_ids))} (line "
        f"{', '.join(map(str, f.example_lines))})",
    ]
    d = f.divergence
    if d is not None and f.cause != "evicted":
        where = f", in {d.this_segment}" if d.this_segment else ""
        other_where = (
            f" (there: {d.other_segment})"
            if d.other_segment and d.other_segment != d.this_segment
            else ""
        )
        lines.append(
            f"     diverges from {d.other_request_id!r} (line {d.other_line}) at token {d.token} "
            f"(block {d.block}){where}{other_where}"
        )
        if d.context_before is not None:
            lines += [
                f'       before  "...{_show(d.context_before)}"',
                f'       this  > "{_show(d.this_text or "")}"...',
                f'       other > "{_show(d.other_text or "")}"...',
            ]
        elif d.this_tokens is not None:
            lines += [f"       this  > {d.this_tokens}", f"       other > {d.other_tokens}"]
    lines.append(f"     fix: {f.fix}")
    if f.what_if is not None:
        lines.append(
            f"     what-if ({f.what_if.description}): hit rate {hit_rate:.1%} -> "
            f"{f.what_if.hit_rate:.1%} (replayed)"
        )
    return lines


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _model_shape(value: str) -> tuple[int, int, int]:
    try:
        layers, heads, head_dim = (int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            "expected LAYERS,KV_HEADS,HEAD_DIM, e.g. 32,8,128"
        ) from None
    if min(layers, heads, head_dim) < 1:
        raise argparse.ArgumentTypeError("every dimension must be positive")
    return layers, heads, head_dim


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {number}")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixkv analyze",
        description="Replay a JSONL request trace through the prefix cache: how much it reuses, "
        "where requests part ways, and what a better prompt layout would gain.",
        epilog="Exit status: 0 clean; 1 some lines were malformed and skipped; 2 nothing "
        "usable (missing file, no valid line, bad option).",
    )
    parser.add_argument(
        "trace",
        help="JSONL trace: one request per line (tokens, text or "
        "messages; optional tools, tenant, salt, timestamp, id)",
    )
    parser.add_argument(
        "--block-size", type=_positive_int, default=16, help="tokens per cache block (default 16)"
    )
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument(
        "--capacity-blocks",
        type=_positive_int,
        help="cache size in blocks (default: enough for the whole trace)",
    )
    capacity.add_argument(
        "--capacity-bytes",
        type=_positive_int,
        help="cache size in bytes of KV, converted with --model-shape",
    )
    parser.add_argument(
        "--model-shape",
        type=_model_shape,
        default=DEFAULT_MODEL_SHAPE,
        metavar="LAYERS,KV_HEADS,HEAD_DIM",
        help="for bytes per block (default 32,8,128: Llama-3-8B-like)",
    )
    parser.add_argument(
        "--dtype-bytes",
        type=_positive_int,
        default=DEFAULT_DTYPE_BYTES,
        help="bytes per KV element (default 2: fp16/bf16)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a directory holding one (default: built-in byte tokenizer)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template file or tokenizer_config.json (default: "
        "built-in simple template)",
    )
    parser.add_argument(
        "--prefill-tokens-per-second",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_SECOND,
        help="prefill throughput for the time-saved ESTIMATE (default 10000)",
    )
    parser.add_argument(
        "--examples",
        type=_positive_int,
        default=3,
        help="example request ids per finding (default 3)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`prefixkv analyze`; returns the exit status (see the module doc)."""
    args = _parser().parse_args(argv)
    capacity_blocks = args.capacity_blocks
    if args.capacity_bytes is not None:
        bpb = bytes_per_block(args.block_size, args.model_shape, args.dtype_bytes)
        capacity_blocks = args.capacity_bytes // bpb
        if capacity_blocks < 1:
            print(
                f"prefixkv analyze: --capacity-bytes {args.capacity_bytes} is less than one "
                f"block ({bpb} bytes)",
                file=sys.stderr,
            )
            return 2
    try:
        report = analyze_trace(
            args.trace,
            block_size=args.block_size,
            capacity_blocks=capacity_blocks,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            prefill_tokens_per_second=args.prefill_tokens_per_second,
            model_shape=args.model_shape,
            dtype_bytes=args.dtype_bytes,
            max_examples=args.examples,
        )
    except OSError as exc:
        print(f"prefixkv analyze: cannot read {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except PrefixKVError as exc:
        print(f"prefixkv analyze: {exc}", file=sys.stderr)
        return 2
    print(report.to_json(indent=2) if args.json else format_report(report))
    if report.requests == 0:
        return 2
    return 1 if report.skipped_lines else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
