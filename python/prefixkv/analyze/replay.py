"""Replaying a trace: requests are tokenized and run through a real `PrefixCache`.

This stage is the only place that talks to the cache. Every what-if is the same replay on a
rewritten trace, so a predicted gain is measured, never estimated. `Replayer` holds what a replay
needs (tokenizer, chat template, block size, capacity, cache context); `replay` runs one.

A chat template may refuse a request (Hugging Face templates raise on roles they do not expect).
In the trace itself that request is a malformed line like any other; in a what-if, a rewritten
request the template refuses is replayed as it was, so a rewrite can only be judged on what it
could change.

How big a cache. "Large enough for the whole trace" (`capacity_blocks=None`) is, as reported,
one block per block of every prompt (`blocks_needed`); and a given capacity may be larger than
the trace can use. The core allocates a few hundred bytes of metadata per block up front, used
or not, so a replay allocates no more than the trace can occupy at once
(`blocks_occupied_at_most`: the distinct full blocks of the requests so far and the spare copies
full hits leave, plus the blocks of the request being admitted). A cache that never has to evict or refuse behaves the same
whatever its size, so every figure is the one the larger cache would give; should the bound
ever be short (an eviction, a refusal), the replay is run again at the full size.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from prefixkv.cache import PrefixCache
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.text.segments import Segments
from prefixkv.text.tokenizers import ChatTemplate, Segment, Tokenizer, segment_at

from .match import RadixTrie
from .read import SkippedLine, TraceRequest, token_array

__all__ = [
    "DEFAULT_DTYPE_BYTES",
    "DEFAULT_MODEL_SHAPE",
    "DEFAULT_PREFILL_TOKENS_PER_SECOND",
    "Prepared",
    "Replay",
    "Replayer",
    "blocks_needed",
    "blocks_occupied_at_most",
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
    tokens: array[int]  # array("I"): 4 bytes a token, where a list costs 8 and more
    text: str | None = None
    # Per token, the character position in `text` where it starts. An array, not the
    # tokenizer's list of (start, end) tuples: that list costs ~100 bytes a token, and the
    # analysis keeps every request prepared.
    starts: array[int] | None = None
    segments: Sequence[Segment] | None = None  # `Segments`: in columns

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
        return Prepared(request, request.tokens)  # already an array("I"); shared, not copied
    segments: Sequence[Segment] | None = None
    if request.messages is not None:
        # Decoded for the template and dropped once rendered: the messages as Python objects
        # are many times the size of their text. Segments are kept in columns, whatever the
        # template gave.
        text, segments = template.render_with_segments(
            request.messages.decode(),
            True,
            None if request.tools is None else request.tools.decode(),
        )
        if not isinstance(segments, Segments):
            segments = Segments(segments)
    else:
        text = request.text or ""
    encode_with_starts = getattr(tokenizer, "encode_with_starts", None)
    if encode_with_starts is not None:  # prefixkv's tokenizers: no tuple per token, even briefly
        ids, starts = encode_with_starts(text)
    else:
        ids, offsets = tokenizer.encode_with_offsets(text)
        starts = array("q", (start for start, _ in offsets))
        del offsets
    tokens = token_array(ids, f"the ids {tokenizer.name} gives")
    del ids
    return Prepared(request, tokens, text, starts, segments)


@dataclass
class Replay:
    prepared: list[Prepared] = field(repr=False)  # what was replayed, in order
    capacity_blocks: int  # the cache's size as reported (see the module's note)
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
    """Blocks of every prompt of the trace, plus one: the cache "large enough for the whole
    trace" the report names."""
    return sum(-(-len(p.tokens) // block_size) for p in prepared) + 1


def blocks_occupied_at_most(prepared: Sequence[Prepared], block_size: int) -> int:
    """The most blocks a replay of `prepared` can occupy at once, when nothing is evicted.

    Between requests the cache holds the distinct full blocks committed so far: a request's
    full blocks past its longest token prefix shared with an earlier request of its isolation
    group are new, the others are already cached (a block's key is its whole prefix and the
    group's salt). While a request runs it holds, besides those, at most the blocks of its
    prompt past the shared full blocks, plus one: a full hit recomputes its last block into a
    private one, which stays cached after it as a spare copy (the core keeps duplicates as vLLM
    keeps its copies: rust/core/src/pool.rs), so each full hit occupies one block more for good.
    Linear in the tokens: one radix trie per group, as `diagnose_all` builds."""
    tries: dict[str | None, RadixTrie] = defaultdict(RadixTrie)
    occupied = peak = 0
    for index, item in enumerate(prepared):
        trie = tries[item.request.isolation]
        shared, _ = trie.longest_match(item.tokens)
        trie.insert(item.tokens, index)
        length = len(item.tokens)
        peak = max(peak, occupied + -(-length // block_size) - shared // block_size + 1)
        occupied += length // block_size - shared // block_size
        if length and length % block_size == 0 and shared >= length:
            occupied += 1  # a full hit's recomputed last block, kept as a spare
    return peak


def replay(
    prepared: Sequence[Prepared],
    *,
    capacity_blocks: int,
    context: CacheContext,
    cache_blocks: int | None = None,
) -> Replay:
    """Run every request through a fresh `PrefixCache`: begin, commit the whole prompt, finish.

    A request the cache cannot admit (`OutOfBlocksError`) counts as all-miss and is noted.
    `cache_blocks` (at most `capacity_blocks`): blocks to allocate, when the replay is known
    not to need all of `capacity_blocks`; if it evicts or refuses a request all the same, it
    is run again with all of them, so the result is always that of `capacity_blocks`."""
    size = capacity_blocks if cache_blocks is None else min(cache_blocks, capacity_blocks)
    cache = PrefixCache(size, context=context)
    cached: list[int] = []
    out_of_blocks: list[int] = []
    peak = 0
    for index, item in enumerate(prepared):
        try:
            # A view of the array, no copy: the cache reads its buffer.
            tokens = np.frombuffer(item.tokens, dtype=np.uint32)
            request = cache.begin(tokens, salt=item.request.isolation)
        except OutOfBlocksError:
            cached.append(0)
            out_of_blocks.append(index)
            continue
        cached.append(request.num_cached_tokens)
        cache.commit(request, len(item.tokens))
        peak = max(peak, size - cache.stats().blocks_free)
        cache.finish(request)
    stats = cache.stats()
    if size < capacity_blocks and (stats.evictions or out_of_blocks):
        del cache
        return replay(prepared, capacity_blocks=capacity_blocks, context=context)
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
        return replay(
            prepared,
            capacity_blocks=capacity,
            context=self.context,
            cache_blocks=blocks_occupied_at_most(prepared, self.block_size),
        )
