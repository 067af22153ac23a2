"""What-ifs: the trace rewritten as a fix says, and replayed through the same cache.

A finding's advice is only as good as the gain it buys, so each fix is applied to the whole
trace and the rewritten trace is replayed (`replay_what_if`): variable content moved after the stable
content (`move_variable_last`), tools in one canonical order (`canonical_tool_order`),
whitespace normalised, or an unbounded cache. The report never presents a what-if that does not
raise the hit rate as the fix.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from prefixkv.text.tokenizers import Tokenizer, message_text

from .diagnose import LAYOUT_CAUSES, Diagnosis, diagnose_all, tool_sort_key
from .match import MIN_RUN_CHARS, MIN_RUN_TOKENS, common_length, permuted_region
from .read import JsonObjects, TraceRequest, token_array
from .replay import Prepared, Replay, Replayer

__all__ = [
    "WhatIf",
    "canonical_tool_order",
    "move_variable_last",
    "replay_what_if",
    "rewrite_tools",
    "rewrite_whitespace",
    "what_if_all",
]

_WHAT_IF_ROUNDS = 3  # diagnose-and-move rounds for text and token traces


@dataclass
class WhatIf:
    """The replayed result of one rewrite of the whole trace."""

    description: str
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    hit_rate_gain: float  # hit_rate minus the original trace's hit rate


def replay_what_if(
    replayer: Replayer, description: str, requests: Sequence[TraceRequest], baseline: Replay
) -> WhatIf:
    """Replay the rewritten `requests` and compare with the original trace's `baseline`."""
    result = replayer.run(replayer.prepare(requests, baseline.prepared))
    return WhatIf(
        description,
        result.hit_rate,
        result.hit_tokens,
        result.prompt_tokens,
        result.hit_rate - baseline.hit_rate,
    )


def move_variable_last(
    replayer: Replayer, requests: Sequence[TraceRequest], original: Sequence[Prepared]
) -> list[TraceRequest]:
    """Messages: reorder units, stable first. Text and tokens: move the divergent regions of
    layout findings to the end, re-diagnose, and repeat a few rounds. `original`: the trace as
    replayed, for requests the template refuses once rewritten."""
    stable = _stable_units(requests)
    current = [
        _stable_first_messages(r, stable.get(r.isolation, set())) if r.messages is not None else r
        for r in requests
    ]
    for _ in range(_WHAT_IF_ROUNDS):
        if all(r.messages is not None for r in current):
            break
        prepared = replayer.prepare(current, original)
        diagnoses = diagnose_all(prepared, replayer.block_size)
        moves = {
            i: spans
            for i, spans in _span_moves(prepared, diagnoses).items()
            if prepared[i].request.messages is None
        }
        if not moves:
            break
        current = _apply_span_moves(prepared, moves)
    return current


def what_if_all(
    replayer: Replayer,
    requests: Sequence[TraceRequest],
    causes: set[str],
    baseline: Replay,
    tools_in_prompt: bool = False,
) -> WhatIf | None:
    """Every applicable rewrite at once (`causes`: those with a what-if); None unless two or
    more different rewrites apply (the layout causes share one)."""
    if len({"layout" if cause in LAYOUT_CAUSES else cause for cause in causes}) < 2:
        return None
    rewritten = list(requests)
    steps = []
    if "whitespace" in causes:
        rewritten = [rewrite_whitespace(r) for r in rewritten]
        steps.append("whitespace normalised")
    if "tool_order" in causes:
        rewritten = canonical_tool_order(replayer, rewritten, baseline.prepared, tools_in_prompt)
        steps.append("tools in one canonical order" if tools_in_prompt else "tools sorted")
    if causes & set(LAYOUT_CAUSES):
        rewritten = move_variable_last(replayer, rewritten, baseline.prepared)
        steps.append("variable content moved last")
    if "evicted" in causes:
        replayer = dataclasses.replace(replayer, capacity_blocks=None)
        steps.append("an unbounded cache")
    return replay_what_if(replayer, ", ".join(steps), rewritten, baseline)


# -- Moving variable content last ------------------------------------------------------------

_Seq = TypeVar("_Seq", str, "array[int]")
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
    return dataclasses.replace(request, messages=JsonObjects(reordered))


def _unit_bounds(text: str) -> list[int]:
    """Where each line/sentence of `text` starts, and len(text) last."""
    bounds = [0]
    for unit in _units(text):
        bounds.append(bounds[-1] + len(unit))
    return bounds


def _expand_to_units(bounds: list[int], start: int, end: int) -> tuple[int, int]:
    """Widen [start, end) to whole lines/sentences (`bounds` from `_unit_bounds`), so a
    timestamp moves as one piece."""
    new_start, new_end = start, end
    i = bisect.bisect_right(bounds, start) - 1
    if 0 <= i < len(bounds) - 1:
        new_start = bounds[i]
    j = bisect.bisect_left(bounds, end)
    if 1 <= j < len(bounds):
        new_end = bounds[j]
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


def _span_moves(
    prepared: Sequence[Prepared], diagnoses: Sequence[Diagnosis]
) -> dict[int, list[tuple[int, int]]]:
    """Per request, the divergent regions (token spans) of layout findings: each diagnosed
    request's own region and its partner's."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for d in diagnoses:
        if d.cause not in LAYOUT_CAUSES:
            continue
        spans[d.index].append((d.prefix, d.this_resync))
        spans[d.partner].append((d.prefix, d.other_resync))
    return spans


def _apply_span_moves(
    prepared: Sequence[Prepared], moves: Mapping[int, list[tuple[int, int]]]
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for index, item in enumerate(prepared):
        request = item.request
        token_spans = moves.get(index)
        if not token_spans:
            out.append(request)
        elif request.kind == "tokens":
            kept_tokens, moved_tokens = _cut(item.tokens, _merge_spans(token_spans))
            out.append(dataclasses.replace(request, tokens=kept_tokens + moved_tokens))
        else:
            assert item.text is not None
            text = item.text
            bounds = _unit_bounds(text)  # once per request: a request may have many spans
            char_spans = []
            for start, end in token_spans:
                char_start, char_end = item.char_at(start), item.char_at(end)
                assert char_start is not None and char_end is not None
                char_spans.append(_expand_to_units(bounds, char_start, char_end))
            kept, moved = _cut(text, _merge_spans(char_spans))
            joiner = "" if kept.endswith("\n") or not kept else "\n"
            out.append(dataclasses.replace(request, text=kept + joiner + moved))
    return out


# -- Other rewrites ----------------------------------------------------------------------------


def _normalise_whitespace(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def rewrite_whitespace(request: TraceRequest) -> TraceRequest:
    if request.text is not None:
        return dataclasses.replace(request, text=_normalise_whitespace(request.text))
    if request.messages is not None:
        messages = JsonObjects(
            [{**m, "content": _normalise_whitespace(message_text(m))} for m in request.messages]
        )
        return dataclasses.replace(request, messages=messages)
    return request


def rewrite_tools(request: TraceRequest) -> TraceRequest:
    """The request's `tools` field sorted by name."""
    if not request.tools:
        return request
    return dataclasses.replace(request, tools=JsonObjects(sorted(request.tools, key=tool_sort_key)))


# -- Tools in one canonical order -------------------------------------------------------------

_TOOL_ROUNDS = 6  # diagnose-and-reorder rounds for tool definitions written into prompts


def canonical_tool_order(
    replayer: Replayer,
    requests: Sequence[TraceRequest],
    original: Sequence[Prepared],
    in_prompt: bool,
) -> list[TraceRequest]:
    """Every request's tools in one order: the `tools` field sorted by name and, when tool
    definitions are written into the prompt itself (`in_prompt`: a diagnosis found them there),
    each reordered region put in the order its best earlier match had. Rounds of diagnosis
    repeat that until no region is left, so each set of tools ends in the order of the first
    request that listed it: one canonical order per set, as sorting would give."""
    current = [rewrite_tools(r) for r in requests]
    for _ in range(_TOOL_ROUNDS if in_prompt else 0):
        prepared = replayer.prepare(current, original)
        diagnoses = diagnose_all(prepared, replayer.block_size)
        if not any(d.cause == "tool_order" and d.region is not None for d in diagnoses):
            break
        rewritten = _reorder_regions(prepared, diagnoses, replayer.tokenizer)
        if rewritten == current:
            break
        current = rewritten
    return current


def _reorder_regions(
    prepared: Sequence[Prepared], diagnoses: Sequence[Diagnosis], tokenizer: Tokenizer
) -> list[TraceRequest]:
    """Each diagnosed region rewritten to the order its partner has there, in trace order, so
    a partner was rewritten first: its rewritten form is compared afresh (same detection), with
    the original partner's region as the fallback. A request that copies a rewritten partner
    over that region (the same tools in the same order, so no finding of its own) takes the
    same rewrite. A reordering keeps the length, so every other position stays valid."""
    sequences: dict[int, str | array[int]] = {}
    applied: dict[int, tuple[int, int, bool]] = {}  # request -> the region it was rewritten in
    for d in diagnoses:
        if d.partner < 0:
            continue
        item, partner = prepared[d.index], prepared[d.partner]
        if d.cause == "tool_order" and d.region is not None:
            in_text, region = d.region_in_text, d.region
        elif d.partner in applied:
            start, end, in_text = applied[d.partner]
            region = (start, end)
        else:
            continue
        this = item.text if in_text else item.tokens
        source = partner.text if in_text else partner.tokens
        if this is None or source is None or len(this) < region[1]:
            continue
        rewritten = sequences.get(d.partner)
        if d.region is None:  # a copy of the partner's original there, or not concerned
            if rewritten is None or this[region[0] : region[1]] != source[region[0] : region[1]]:
                continue
            source = rewritten
        elif rewritten is not None:
            start = common_length(this, 0, rewritten, 0, min(len(this), len(rewritten)))
            found = permuted_region(
                this, rewritten, start, MIN_RUN_CHARS if in_text else MIN_RUN_TOKENS
            )
            if found is not None:
                region, source = found, rewritten
        start, end = region
        sequences[d.index] = this[:start] + source[start:end] + this[end:]  # type: ignore[operator]
        applied[d.index] = (start, end, in_text)
    out = [p.request for p in prepared]
    for index, sequence in sequences.items():
        out[index] = _with_sequence(prepared[index], sequence, tokenizer)
    return out


def _with_sequence(
    item: Prepared, sequence: str | array[int], tokenizer: Tokenizer
) -> TraceRequest:
    """The request rewritten to give `sequence` (its text, or its tokens). Messages keep their
    form when the rewrite stays inside message contents the template copied verbatim;
    otherwise the request becomes the tokens of the rewritten text."""
    request = item.request
    if not isinstance(sequence, str):
        return dataclasses.replace(request, tokens=sequence)
    if request.text is not None:
        return dataclasses.replace(request, text=sequence)
    assert request.messages is not None and item.text is not None
    messages = list(request.messages)
    changed: set[int] = set()
    for segment in item.segments or ():
        new = sequence[segment.start : segment.end]
        if new == item.text[segment.start : segment.end]:
            continue
        index = segment.index
        if (
            segment.source != "message"
            or index is None
            or index in changed
            or message_text(messages[index]) != item.text[segment.start : segment.end]
        ):
            tokens = token_array(tokenizer.encode(sequence), f"the ids {tokenizer.name} gives")
            return dataclasses.replace(
                request, kind="tokens", tokens=tokens, messages=None, tools=None
            )
        messages[index] = {**messages[index], "content": new}
        changed.add(index)
    return dataclasses.replace(request, messages=JsonObjects(messages))
