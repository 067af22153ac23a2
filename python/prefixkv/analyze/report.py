"""Reporting: diagnoses grouped into findings, each with its fix and its replayed what-if, and
the report rendered for a terminal (`format_report`) or as JSON (`AnalysisReport.to_json`).

The JSON schema is documented in docs/analyze.md ("JSON output"); the dataclasses here are its
one implementation (`to_dict` is `dataclasses.asdict`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .diagnose import LAYOUT_CAUSES, Diagnosis
from .read import SkippedLine, TraceRequest
from .replay import Prepared, Replay, Replayer
from .whatif import (
    WhatIf,
    canonical_tool_order,
    move_variable_last,
    replay_what_if,
    rewrite_whitespace,
)

__all__ = [
    "AnalysisReport",
    "Divergence",
    "Finding",
    "build_findings",
    "confirm_fix",
    "format_report",
]

_CONTEXT_CHARS = 48  # characters of context shown on each side of a divergence
_CONTEXT_TOKENS = 8  # token ids shown on each side, for token traces

_TITLES = {
    "variable_before_stable": "Variable content placed before stable content",
    "system_prompt": "System prompt changes slightly between requests",
    "tool_order": "Same tools listed in a different order",
    "whitespace": "Whitespace differences in otherwise identical content",
    "template": "The chat template renders identical messages differently",
    "evicted": "Shared prefix evicted before it was reused",
    "different_prompt": "Genuinely different prompts (not a problem)",
}


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
    truncated_at_line: int | None = None  # the first line not read (max_trace_bytes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        """Strict JSON (RFC 8259): a non-finite number, which JSON cannot hold, is null."""
        return json.dumps(
            _finite(self.to_dict()), indent=indent, ensure_ascii=False, allow_nan=False
        )


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


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
        "tools always give the same prompt."
        if not detail
        else "List the tools in one canonical order (for example sorted by name) wherever "
        "they are written into the prompt, so the same tools always give the same tokens.",
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


# -- Findings ---------------------------------------------------------------------------------


def _divergence(d: Diagnosis, prepared: Sequence[Prepared], block_size: int) -> Divergence:
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
        out.this_tokens = this.tokens[lo : d.prefix + _CONTEXT_TOKENS].tolist()
        out.other_tokens = other.tokens[lo : d.prefix + _CONTEXT_TOKENS].tolist()
    return out


def build_findings(
    replayer: Replayer,
    requests: Sequence[TraceRequest],
    prepared: Sequence[Prepared],
    diagnoses: Sequence[Diagnosis],
    replay: Replay,
    max_examples: int,
) -> list[Finding]:
    block_size = replayer.block_size
    groups: dict[tuple[str, str], list[Diagnosis]] = defaultdict(list)
    for d in diagnoses:
        if d.cause in ("ok", "first"):
            continue
        detail = d.detail if d.cause in ("variable_before_stable", "tool_order") else ""
        groups[(d.cause, detail)].append(d)
    tools_in_prompt = any(d.cause == "tool_order" and d.region is not None for d in diagnoses)

    findings: list[Finding] = []
    what_if_cache: dict[str, WhatIf] = {}
    for (cause, detail), members in groups.items():
        recoverable = sum((d.shared_after // block_size) * block_size for d in members)
        what_if: WhatIf | None = None
        if cause in LAYOUT_CAUSES:
            if "layout" not in what_if_cache:
                what_if_cache["layout"] = replay_what_if(
                    replayer,
                    "variable content moved after the stable content",
                    move_variable_last(replayer, requests, replay.prepared),
                    replay,
                )
            what_if = what_if_cache["layout"]
        elif cause == "tool_order":
            if "tools" not in what_if_cache:
                what_if_cache["tools"] = replay_what_if(
                    replayer,
                    "tool definitions listed in one canonical order in every request"
                    if tools_in_prompt
                    else "tools sorted by name in every request",
                    canonical_tool_order(replayer, requests, replay.prepared, tools_in_prompt),
                    replay,
                )
            what_if = what_if_cache["tools"]
        elif cause == "whitespace":
            what_if = replay_what_if(
                replayer,
                "whitespace normalised in every request",
                [rewrite_whitespace(r) for r in requests],
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
    def reusable(d: Diagnosis) -> int:
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
        if replayer.capacity_blocks is not None:
            unbounded = dataclasses.replace(replayer, capacity_blocks=None)
            what_if = replay_what_if(
                unbounded, "a cache large enough for the whole trace", requests, replay
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


def confirm_fix(cause: str, detail: str, what_if: WhatIf | None) -> str:
    """The fix to print for a finding. A rule of the report: a rewrite whose replay does not
    raise the hit rate is never advised, whatever the diagnosis said; the finding then says
    so, and the divergence it shows is the lead to follow."""
    if what_if is not None and what_if.hit_rate_gain <= 0:
        return (
            f"No fix confirmed: the trace rewritten that way ({what_if.description}) replays "
            f"at a hit rate no better than now ({what_if.hit_rate:.1%}), so it is not advised. "
            "The divergence below shows where these requests part ways."
        )
    if what_if is not None and what_if.hit_rate_gain < 0.01:
        return _fix_sentence(cause, detail) + _NO_GAIN
    return _fix_sentence(cause, detail)


def _finding(
    cause: str,
    detail: str,
    members: Sequence[Diagnosis],
    recoverable: int,
    prepared: Sequence[Prepared],
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
        fix=confirm_fix(cause, detail, what_if),
        divergence=_divergence(members[0], prepared, block_size) if members else None,
        what_if=what_if,
    )


# -- Terminal report ---------------------------------------------------------------------------


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
        w = report.what_if_all
        if w is not None and w.hit_rate_gain > 0:
            out += [
                "",
                f"All fixes together ({w.description}): hit rate {report.hit_rate:.1%} "
                f"-> {w.hit_rate:.1%}",
            ]
        elif w is not None:
            out += [
                "",
                f"Every rewrite at once ({w.description}) replays at {w.hit_rate:.1%}: no "
                "gain, not advised",
            ]
    if report.truncated_at_line is not None:
        limit = s.get("max_trace_bytes")
        out += [
            "",
            f"Trace truncated at line {report.truncated_at_line}: reading stopped after "
            f"{_size(limit) if limit else 'the limit'} (--max-trace-bytes); the lines from there "
            "on were not analysed",
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
        verdict = "replayed" if f.what_if.hit_rate_gain > 0 else "replayed; no gain, not advised"
        lines.append(
            f"     what-if ({f.what_if.description}): hit rate {hit_rate:.1%} -> "
            f"{f.what_if.hit_rate:.1%} ({verdict})"
        )
    return lines
