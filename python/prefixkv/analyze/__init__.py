"""`prefixkv analyze TRACE`: how much of a request trace a prefix cache reuses, and why not more.

A prefix cache reuses KV block by block from the left: a request reuses exactly the full blocks
of its longest token prefix that an earlier request (of the same tenant and salt) already
computed. So stable content (system prompt, tool schemas, examples) must come first and
variable content (retrieved text, the user's query, timestamps) last. A trace that puts a
timestamp or the query first gets almost nothing, and nothing in the engine says so.

The analyzer follows each request down one path, a module per stage:

  read.py      JSONL lines to `TraceRequest`s; malformed lines become `SkippedLine`s
  replay.py    tokenize, and run the trace through a real `PrefixCache` to measure reuse
  match.py     the longest earlier match (a radix trie) and where two prompts meet again
  diagnose.py  where a request parts ways with its best match, and the cause
  whatif.py    the trace rewritten as the fix says, replayed through the same cache
  report.py    findings, their fixes and what-ifs; the terminal and JSON reports

Two rules hold the report honest. Every number about reuse comes from a replay through the
cache, not from a model of it; the seconds saved are the one estimate, and are labelled so. And
a fix is only advised with its what-if: the trace rewritten that way and replayed.

The trace format, the causes, the cost model and the JSON schema are documented in
docs/analyze.md; the command line (`prefixkv analyze`, its options and exit codes) lives in
`prefixkv.cli`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError
from prefixkv.text import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer

from .diagnose import diagnose_all
from .read import SkippedLine, TraceRequest, parse_trace, read_lines
from .replay import (
    DEFAULT_DTYPE_BYTES,
    DEFAULT_MODEL_SHAPE,
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    Replayer,
    bytes_per_block,
)
from .report import AnalysisReport, Divergence, Finding, build_findings, format_report
from .whatif import WhatIf, what_if_all

__all__ = [
    "DEFAULT_DTYPE_BYTES",
    "DEFAULT_MODEL_SHAPE",
    "DEFAULT_PREFILL_TOKENS_PER_SECOND",
    "AnalysisReport",
    "Divergence",
    "Finding",
    "SkippedLine",
    "TraceRequest",
    "WhatIf",
    "analyze_trace",
    "bytes_per_block",
    "format_report",
    "main",
    "parse_trace",
]


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
    """Replay a JSONL trace through `PrefixCache` and diagnose its reuse (docs/analyze.md).

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
    replayer = Replayer(tok, template, block_size, capacity_blocks, context)
    trace_name, lines = read_lines(path_or_lines)
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

    prepared, replay = replayer.replay(requests)
    settings["capacity_blocks"] = replay.capacity_blocks
    diagnoses = diagnose_all(prepared, block_size)
    findings = build_findings(replayer, requests, prepared, diagnoses, replay, max_examples)
    fixable = {f.cause for f in findings if f.what_if is not None}
    all_fixes = what_if_all(replayer, requests, fixable, replay)
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
        what_if_all=all_fixes,
        skipped_lines=skipped,
    )


def main(argv: list[str] | None = None) -> int:
    """`prefixkv analyze`; returns the exit status. The command line lives in `prefixkv.cli`;
    this name stays for code that called the analyzer's entry point directly."""
    from prefixkv.cli import analyze_main

    return analyze_main(argv)
