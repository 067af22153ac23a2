"""The Engine's scheduling policy: what runs in the next step, in which order, and who yields.

One step is one model call over a token budget (`max_num_batched_tokens`), as in vLLM's
scheduler:

1. *Running* requests first, in admission order: a decode token (plus its draft tokens under
   speculative decoding), or the next chunk of a prompt that did not fit in one step. Each gets
   its slots with `PrefixCache.allocate_slots`; when the pool is short, the most recently
   admitted running request is *preempted* (`PrefixCache.preempt`: its references dropped, its
   committed blocks left cached) and goes back to the front of the queue, until the request
   fits or is itself the one preempted.
2. *Waiting* requests fill what is left of the budget, in the order `order_waiting` gives,
   each admitted with a watermark of free blocks kept back for the running ones. A prompt
   longer than the budget is prefilled in chunks over several steps.

`order_waiting` is where the cache comes in. First-come-first-served takes the queue as it
arrived. Cache-aware ordering (the default) puts first the requests with the longest cached
prefix, and defers a request whose next uncached block another request is computing right now
(the block is a hit one step later instead of being computed twice). To stay fair, a request
passed over `max_passes` times by later arrivals goes first, in arrival order: no request
waits forever behind a stream of luckier ones.

This module holds the parts of the policy that need no cache (the waiting order, the draft
proposals, the counters); `prefixkv.engine.loop.GenerateRun` applies it step by step, with the
cache calls that go with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SCHEDULING_POLICIES", "SchedulerStats", "ngram_drafts", "order_waiting"]

#: The waiting-queue orders `Engine` accepts.
SCHEDULING_POLICIES = ("cache_aware", "fcfs")


@dataclass
class SchedulerStats:
    """What one `Engine.generate` call did, step by step."""

    steps: int = 0
    #: Prompt chunks computed (a prompt that fit in one step counts one).
    prefill_chunks: int = 0
    preemptions: int = 0
    #: Prompt tokens of admitted requests, and those read from the cache at admission
    #: (a preempted request counts again when it resumes).
    admitted_tokens: int = 0
    cached_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    #: Tokens computed per step (prefill and decode), for the budget's use.
    tokens_per_step: list[int] = field(default_factory=list)
    #: KV bytes the running requests held at the start of the busiest model step: per KV
    #: group, its blocks in use x its layers x the bytes of one block of one layer (K and V).
    peak_kv_bytes: int = 0
    #: What those steps would hold if every layer kept every block, as a full-attention layer
    #: does (the full-attention group's blocks in use x all layers): the KV groups' saving is
    #: the ratio of the two. None when no group is full attention.
    peak_kv_bytes_all_full: int | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.admitted_tokens if self.admitted_tokens else 0.0

    @property
    def draft_acceptance(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class WaitingCandidate:
    """What the ordering needs to know of one waiting request."""

    arrival: int
    cached_tokens: int
    #: Its next uncached block is being computed by a running request this step.
    next_block_in_flight: bool
    passes: int


def order_waiting(
    candidates: Sequence[WaitingCandidate], policy: str, max_passes: int
) -> list[int]:
    """Indices of `candidates` in the order to try admitting them.

    ``"fcfs"``: arrival order. ``"cache_aware"``: requests passed over `max_passes` times
    first (arrival order), then those whose next block is not in flight by cached prefix
    length (longest first, ties by arrival), then those whose next block is in flight.
    """
    indices = list(range(len(candidates)))
    if policy == "fcfs":
        return sorted(indices, key=lambda i: candidates[i].arrival)

    def rank(i: int) -> tuple[int, int, int]:
        c = candidates[i]
        if c.passes >= max_passes:
            return (0, 0, c.arrival)
        if c.next_block_in_flight:
            return (2, 0, c.arrival)
        return (1, -c.cached_tokens, c.arrival)

    return sorted(indices, key=rank)


def ngram_drafts(
    tokens: Sequence[int], num_drafts: int, max_ngram: int = 3, window: int = 1024
) -> list[int]:
    """Prompt-lookup drafts: find the longest suffix n-gram (``max_ngram`` down to 1) that
    occurred earlier in the last `window` tokens, and propose the (up to) `num_drafts` tokens
    that followed its most recent earlier occurrence. Empty when nothing matches. Cheap,
    model-free, and right surprisingly often on chat and code, where answers quote their
    context. The window bounds the work of a decode step whatever the sequence's length."""
    recent = list(tokens[-window:])
    n_tokens = len(recent)
    if num_drafts <= 0 or n_tokens < 2:
        return []
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        suffix = recent[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):
            if recent[start] == suffix[0] and recent[start : start + n] == suffix:
                follow = recent[start + n : start + n + num_drafts]
                if follow:
                    return follow
    return []
