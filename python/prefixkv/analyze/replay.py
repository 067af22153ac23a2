"""Replaying a trace: requests are tokenized and run through a real `PrefixCache`.

This stage is the only place that talks to the cache. Every what-if is the same replay on a
rewritten trace, so a predicted gain is measured, never estimated. `Replayer` holds what a replay
needs (tokenizer, chat template, block size, capacity, cache context); `replay` runs one.

A chat template may refuse a request (Hugging Face templates raise on roles they do not expect).
In the trace itself that request is a malformed line like any other; in a what-if, a rewritten
request the template refuses is replayed as it was, so a rewrite can only be judged on what it
could change.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.cache import PrefixCache
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.text.tokenizers import ChatTemplate, Segment, Tokenizer, segment_at

from .read import SkippedLine, TraceRequest

__all__ = [
    "DEFAULT_DTYPE_BYTES",
    "DEFAULT_MODEL_SHAPE",
    "DEFAULT_PREFILL_TOKENS_PER_SECOND",
    "Prepared",
    "Replay",
    "Replayer",
    "blocks_needed",
    "bytes_per_block",
    "prepare",
    "replay",
]

DEFAULT_PREFILL_TOKENS_PER_SECOND = 10_000.0
DEFAULT_MODEL_SHAPE = (32, 8, 128)  # layers, KV heads, head dim: Llama-3-8B-like
DEFAULT_DTYPE_BYTES = 2


def bytes_per_block(
    block_size: int,
    model_shape: tuple[int, int, int] = DEFAULT_MODEL_SHAPE,
    dtype_bytes: int = DEFAULT_DTYPE_BYTES,
) -> int:
    """KV bytes one block holds: K and V, for every layer and KV head."""
    layers, kv_heads, head_dim = model_shape
    return 2 * layers * kv_heads * head_dim * dtype_bytes * block_size


@dataclass
class Prepared:
    """A request as the cache sees it, with what is needed to explain a divergence."""

    request: TraceRequest
    tokens: list[int]
    text: str | None = None
    # Per token, the character position in `text` where it starts. An array, not the
    # tokenizer's list of (start, end) tuples: that list costs ~100 bytes a token, and the
    # analysis keeps every request prepared.
    starts: array[int] | None = None
    segments: list[Segment] | None = None

    def char_at(self, token: int) -> int | None:
        """Character position in `text` where token `token` starts (len(text) past the end)."""
        if self.text is None or self.starts is None:
            return None
        if token >= len(self.starts):
            return len(self.text)
        return self.starts[token]

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


def prepare(request: TraceRequest, tokenizer: Tokenizer, template: ChatTemplate) -> Prepared:
    """Render (messages) and tokenize (messages, text) one request. Raises `InvalidInputError`
    when the chat template refuses it."""
    if request.tokens is not None:
        return Prepared(request, list(request.tokens))
    segments: list[Segment] | None = None
    if request.messages is not None:
        text, segments = template.render_with_segments(request.messages, True, request.tools)
    else:
        text = request.text or ""
    encode_with_starts = getattr(tokenizer, "encode_with_starts", None)
    if encode_with_starts is not None:  # prefixkv's tokenizers: no tuple per token, even briefly
        tokens, starts = encode_with_starts(text)
    else:
        tokens, offsets = tokenizer.encode_with_offsets(text)
        starts = array("q", (start for start, _ in offsets))
        del offsets
    return Prepared(request, tokens, text, starts, segments)


@dataclass
class Replay:
    prepared: list[Prepared] = field(repr=False)  # what was replayed, in order
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


def blocks_needed(prepared: Sequence[Prepared], block_size: int) -> int:
    return sum(-(-len(p.tokens) // block_size) for p in prepared) + 1


def replay(
    prepared: Sequence[Prepared],
    *,
    capacity_blocks: int,
    context: CacheContext,
) -> Replay:
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
    return Replay(
        prepared=list(prepared),
        capacity_blocks=capacity_blocks,
        cached=cached,
        prompt_tokens=sum(len(p.tokens) for p in prepared),
        hit_tokens=sum(cached),
        evictions=stats.evictions,
        peak_blocks=peak,
        out_of_blocks=out_of_blocks,
    )


@dataclass
class Replayer:
    """Everything a replay needs; `capacity_blocks=None` sizes the cache to hold the whole
    trace, so only the layout limits reuse."""

    tokenizer: Tokenizer
    template: ChatTemplate
    block_size: int
    capacity_blocks: int | None
    context: CacheContext

    def prepare_trace(
        self, requests: Sequence[TraceRequest]
    ) -> tuple[list[Prepared], list[SkippedLine]]:
        """The requests the template accepts, prepared; the others as malformed lines."""
        prepared: list[Prepared] = []
        refused: list[SkippedLine] = []
        for request in requests:
            try:
                prepared.append(prepare(request, self.tokenizer, self.template))
            except InvalidInputError as exc:
                refused.append(SkippedLine(request.line, str(exc)))
        return prepared, refused

    def prepare(
        self, requests: Sequence[TraceRequest], fallback: Sequence[Prepared]
    ) -> list[Prepared]:
        """Rewritten requests, prepared; one the rewrite left alone, or the template refuses,
        is `fallback[i]`, the same request as the original trace had it (rewrites keep the
        number and order)."""
        out: list[Prepared] = []
        for request, original in zip(requests, fallback, strict=True):
            if request is original.request:  # not rewritten: no need to render it again
                out.append(original)
                continue
            try:
                out.append(prepare(request, self.tokenizer, self.template))
            except InvalidInputError:
                out.append(original)
        return out

    def run(self, prepared: Sequence[Prepared]) -> Replay:
        capacity = self.capacity_blocks or blocks_needed(prepared, self.block_size)
        return replay(prepared, capacity_blocks=capacity, context=self.context)
