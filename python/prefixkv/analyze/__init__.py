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
a fix is only advised with its what-if, the trace rewritten that way and replayed, and only when
that replay raises the hit rate: a diagnosis can be wrong, the replay cannot.

Traces are hostile input (logs cut mid-line, other encodings, one enormous request), so reading
is strict and bounded: a line is bytes up to "\n" that must be UTF-8 JSON under a size cap, or
it is reported and skipped, and no step of the analysis is worse than linear in the trace.

The trace format, the causes, the cost model and the JSON schema are documented in
docs/analyze.md; the command line (`prefixkv analyze`, its options and exit codes) lives in
`prefixkv.apps.cli`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError
from prefixkv.text.tokenizers import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer

from .diagnose import diagnose_all
from .read import (
    DEFAULT_MAX_LINE_BYTES,
    DEFAULT_MAX_TRACE_BYTES,
    SkippedLine,
    TraceRequest,
    parse_trace,
    read_trace,
)
from .replay import (
    DEFAULT_DTYPE_BYTES,
    DEFAULT_MODEL_SHAPE,
    DEFAULT_PREFILL_TOKENS_PER_SECOND,
    Replayer,
    bytes_per_block,
)
from .report import AnalysisReport, Divergence, Finding, build_findings, format_report
from .whatif import WhatIf, what_if_all

_MAX_U32 = 2**32 - 1
_MAX_BLOCK_SIZE = 2**31

__all__ = [
    "DEFAULT_DTYPE_BYTES",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TRACE_BYTES",
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
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    max_trace_bytes: int | None = DEFAULT_MAX_TRACE_BYTES,
) -> AnalysisReport:
    """Replay a JSONL trace through `PrefixCache` and diagnose its reuse (docs/analyze.md).

    `path_or_lines` is a path or an iterable of JSONL lines. `capacity_blocks=None` sizes the
    cache to hold the whole trace, so only layout limits reuse. A line over `max_line_bytes` is
    malformed; reading stops after `max_trace_bytes` (None: no limit). Raises
    `FileNotFoundError` / `OSError` for an unreadable file and `InvalidInputError` for bad
    settings; malformed lines are not errors but `skipped_lines`."""
    _check_count("block_size", block_size, _MAX_BLOCK_SIZE)
    if capacity_blocks is not None:
        _check_count("capacity_blocks", capacity_blocks, _MAX_U32)
    if (
        isinstance(prefill_tokens_per_second, bool)
        or not isinstance(prefill_tokens_per_second, (int, float))
        or not math.isfinite(prefill_tokens_per_second)
        or prefill_tokens_per_second <= 0
    ):
        raise InvalidInputError(
            "prefill_tokens_per_second must be a finite positive number, "
            f"got {prefill_tokens_per_second!r}"
        )
    if len(model_shape) != 3:
        raise InvalidInputError(f"model_shape is (layers, kv_heads, head_dim), got {model_shape}")
    for name, value in zip(("layers", "kv_heads", "head_dim"), model_shape, strict=True):
        _check_count(f"model_shape {name}", value, _MAX_U32)
    _check_count("dtype_bytes", dtype_bytes, _MAX_U32)
    _check_count("max_examples", max_examples, None)
    _check_count("max_line_bytes", max_line_bytes, None)
    if max_trace_bytes is not None:
        _check_count("max_trace_bytes", max_trace_bytes, None)
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    template = (
        chat_template
        if isinstance(chat_template, ChatTemplate)
        else load_chat_template(chat_template)
    )
    block_bytes = bytes_per_block(block_size, model_shape, dtype_bytes)
    # The tokenizer and template are part of what must match: the same ids from another
    # vocabulary are another prompt.
    context = CacheContext(
        tokenizer_id=tok.name,
        tokenizer_digest=tok.digest(),
        chat_template_version=f"{template.version}:{template.digest()}",
        block_size=block_size,
    )
    replayer = Replayer(tok, template, block_size, capacity_blocks, context)
    trace = read_trace(
        path_or_lines, max_line_bytes=max_line_bytes, max_trace_bytes=max_trace_bytes
    )
    prepared, refused = replayer.prepare_trace(trace.requests)
    requests = [p.request for p in prepared]
    skipped = sorted(trace.skipped_lines + refused, key=lambda s: s.line)
    settings: dict[str, Any] = {
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        "capacity_given": capacity_blocks is not None,
        "bytes_per_block": block_bytes,
        "prefill_tokens_per_second": prefill_tokens_per_second,
        "tokenizer": tok.name,
        "tokenizer_digest": tok.digest(),
        "chat_template": template.name,
        "chat_template_digest": template.digest(),
        "max_line_bytes": max_line_bytes,
        "max_trace_bytes": max_trace_bytes,
    }
    empty_cost = {"peak_blocks": 0, "peak_bytes": 0, "evictions": 0, "out_of_blocks_requests": 0}
    if not requests:
        return AnalysisReport(
            trace.name,
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
            truncated_at_line=trace.truncated_at_line,
        )

    replay = replayer.run(prepared)
    settings["capacity_blocks"] = replay.capacity_blocks
    diagnoses = diagnose_all(prepared, block_size)
    findings = build_findings(replayer, requests, prepared, diagnoses, replay, max_examples)
    fixable = {f.cause for f in findings if f.what_if is not None}
    tools_in_prompt = any(d.region is not None for d in diagnoses)
    all_fixes = what_if_all(replayer, requests, fixable, replay, tools_in_prompt)
    causes = Counter(d.cause for d in diagnoses if d.cause not in ("ok", "first"))
    for finding in findings:
        if finding.cause == "evicted":
            causes["evicted"] = finding.requests

    return AnalysisReport(
        trace=trace.name,
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
            "peak_bytes": replay.peak_blocks * block_bytes,
            "evictions": replay.evictions,
            "out_of_blocks_requests": len(replay.out_of_blocks),
        },
        first_requests=sum(d.cause == "first" for d in diagnoses),
        causes=dict(causes.most_common()),
        findings=findings,
        what_if_all=all_fixes,
        skipped_lines=skipped,
        truncated_at_line=trace.truncated_at_line,
    )


def _check_count(name: str, value: object, upper: int | None) -> None:
    """A positive int, at most `upper`: the cache takes sizes as u32, and the bytes figures
    must stay within what a float (and so the terminal report) can show."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    if upper is not None and value > upper:
        raise InvalidInputError(f"{name} must be at most {upper}, got {value}")


def __getattr__(name: str) -> Any:
    # `prefixkv.analyze.main` was the command's entry point before the CLI moved to
    # `prefixkv.apps.cli` (the apps sit above the library); kept, deprecated, until 0.2. Looked
    # up lazily: importing the CLI from here would make the library import the apps above it.
    if name != "main":
        raise AttributeError(f"module 'prefixkv.analyze' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(
        "prefixkv.analyze.main moved to prefixkv.apps.cli.analyze_main; the old name will be "
        "removed in prefixkv 0.2",
        DeprecationWarning,
        stacklevel=2,
    )
    return importlib.import_module("prefixkv.apps.cli").analyze_main
