"""A seeded synthetic trace shaped like production serving traffic (issue 24).

What it imitates, from a public trace of a serving system: multi-turn conversations and agent
calls; prompts from about 1k to about 190k tokens with a mean near 12k; long shared contexts;
a prefix-cache hit rate of 8-30% through a cache far smaller than the working set.

Two kinds of session, interleaved in time:

- **chat**: one of many shared system prompts (popularity Zipf-distributed: a few are hot, most
  are cold), then a first user message (sometimes a pasted
  document); every later turn resends the whole conversation: previous prompt + the model's
  previous answer + the new user text. Users think for minutes between turns.
- **agent**: one of a few long shared system prefixes (tool schemas, instructions), a task, then
  calls about a minute apart (a model call and a tool run); each call's prompt is the previous
  one + the model's tool call + the tool's output (often thousands of tokens).

A session ends after its drawn number of turns or when its next prompt would pass the context
window (`max_prompt_tokens`). Sessions start as a Poisson process; each turn arrives after a
drawn think time; all turns of all sessions are merged by arrival time, so many sessions are in
flight at once and a session's next turn competes with everything that arrived in between.

Only prompts are replayed (an engine that caches its generated tokens as well would see more
hits on the answers; the benchmark's begin / commit(prompt) / finish cycle does not). Tokens are
random ids, so nothing is shared except what the session structure shares.

The cache is sized from the trace: `cache_fraction` (1/10 by default) of its *working set*, the
number of distinct full blocks over all prompts (what a cache that never evicts would end up
holding), so a turn hits its previous turn only if not too much else arrived in between.

Everything is drawn from `seed`: the plan (session kinds, lengths, times) up front, each
session's tokens when its first turn is requested (`requests()` is a generator; a session's
token array lives while the session does, and each prompt is a prefix view of it).
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

VOCAB = 128_000
BLOCK_SIZE = 16


@dataclass(frozen=True)
class TraceParams:
    """The knobs of the trace; the defaults give the issue's shape (see RESULTS-production.md)."""

    sessions: int = 3_000
    agent_share: float = 0.06
    max_prompt_tokens: int = 190_000
    cache_fraction: float = 0.1
    # chat
    chat_system_prompts: int = 300
    chat_system_tokens: tuple[int, int] = (800, 4_000)
    chat_turns_mean: float = 4.0
    chat_think_s: float = 150.0
    user_median: int = 250
    answer_median: int = 450
    doc_probability: float = 0.2
    doc_tokens: tuple[int, int] = (2_000, 120_000)
    # agent
    agent_prefixes: int = 20
    agent_prefix_tokens: tuple[int, int] = (2_000, 14_000)
    # popularity of the shared prefixes: Zipf weights 1 / rank**prefix_zipf
    prefix_zipf: float = 1.1
    agent_calls_mean: float = 16.0
    agent_think_s: float = 60.0
    tool_call_median: int = 120
    tool_output_median: int = 800
    # arrivals: seconds between session starts (mean)
    session_gap_s: float = 0.15

    def scaled(self, fraction: float) -> TraceParams:
        """The same shape with `fraction` of the sessions: think times shrink with the trace's
        window, so a turn's previous turn is as far back in the trace, and the cache (a fraction
        of the working set) shrinks with it; the hit rate stays about the same."""
        return replace(
            self,
            sessions=max(1, round(self.sessions * fraction)),
            chat_think_s=self.chat_think_s * fraction,
            agent_think_s=self.agent_think_s * fraction,
        )


@dataclass(frozen=True)
class Session:
    """One session's plan: its shared prefix, how long each turn's prompt is, when it arrives."""

    index: int
    kind: str  # "chat" or "agent"
    prefix: int  # index into the trace's shared prefixes of this kind
    prompt_tokens: tuple[int, ...]  # per turn, increasing
    times: tuple[float, ...]  # arrival time of each turn


@dataclass(frozen=True)
class TraceRequest:
    session: int
    kind: str
    turn: int
    time: float
    tokens: np.ndarray  # int64, a prefix view of the session's content


@dataclass
class ProductionTrace:
    params: TraceParams
    seed: int
    sessions: list[Session]
    shared_prefixes: dict[str, list[np.ndarray]]
    #: (time, session, turn) of every request in arrival order.
    order: list[tuple[float, int, int]] = field(repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.order)

    def working_set_blocks(self) -> int:
        """Distinct full blocks over all prompts: each shared prefix some session uses, once,
        then each session's own blocks (its longest prompt's blocks past the prefix's full ones)."""
        used = {(s.kind, s.prefix) for s in self.sessions}
        shared = sum(len(self.shared_prefixes[kind][p]) // BLOCK_SIZE for kind, p in used)
        own = 0
        for s in self.sessions:
            prefix_blocks = len(self.shared_prefixes[s.kind][s.prefix]) // BLOCK_SIZE
            own += s.prompt_tokens[-1] // BLOCK_SIZE - prefix_blocks
        return shared + own

    def num_blocks(self) -> int:
        """The cache's size: `cache_fraction` of the working set, and room for the longest
        prompt twice over (a request must always fit)."""
        longest = max(s.prompt_tokens[-1] for s in self.sessions)
        return max(
            round(self.params.cache_fraction * self.working_set_blocks()),
            2 * -(-longest // BLOCK_SIZE),
        )

    def prompt_lengths(self) -> np.ndarray:
        """Prompt length of every request, in arrival order (without building any tokens)."""
        by_session = {s.index: s.prompt_tokens for s in self.sessions}
        return np.array([by_session[i][t] for _, i, t in self.order], dtype=np.int64)

    def _content(self, session: Session) -> np.ndarray:
        prefix = self.shared_prefixes[session.kind][session.prefix]
        rng = np.random.default_rng([self.seed, 1, session.index])
        own = rng.integers(0, VOCAB, session.prompt_tokens[-1] - len(prefix), dtype=np.int64)
        return np.concatenate([prefix, own])

    def requests(self) -> Iterator[TraceRequest]:
        """Every request in arrival order; a session's tokens are built at its first turn and
        dropped after its last."""
        live: dict[int, np.ndarray] = {}
        for time, index, turn in self.order:
            session = self.sessions[index]
            if turn == 0:
                live[index] = self._content(session)
            content = live[index]
            if turn == len(session.prompt_tokens) - 1:
                del live[index]
            yield TraceRequest(
                index, session.kind, turn, time, content[: session.prompt_tokens[turn]]
            )

    def digest(self) -> str:
        """SHA-256 over every request's session, turn and token bytes: equal iff equal traces."""
        h = hashlib.sha256()
        for r in self.requests():
            h.update(f"{r.session}:{r.turn}:{len(r.tokens)};".encode())
            h.update(r.tokens.tobytes())
        return h.hexdigest()


def _log_uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return round(float(np.exp(rng.uniform(np.log(low), np.log(high)))))


def _lognormal(rng: np.random.Generator, median: int, low: int, high: int) -> int:
    """A heavy-ish tail around `median` (sigma 1), clipped to [low, high]."""
    return int(np.clip(round(median * rng.lognormal(0.0, 1.0)), low, high))


def _chat_growth(rng: np.random.Generator, p: TraceParams, first: bool) -> int:
    """Tokens a chat turn adds: the previous answer (not on the first turn) and the user's text."""
    added = 0 if first else _lognormal(rng, p.answer_median, 20, 4_000)
    added += _lognormal(rng, p.user_median, 5, 6_000)
    if rng.random() < p.doc_probability:
        added += _log_uniform(rng, p.doc_tokens)
    return added


def _agent_growth(rng: np.random.Generator, p: TraceParams, first: bool) -> int:
    """Tokens an agent call adds: the task (first call), else the tool call and its output."""
    if first:
        return _lognormal(rng, 600, 50, 8_000)
    return _lognormal(rng, p.tool_call_median, 10, 2_000) + _lognormal(
        rng, p.tool_output_median, 10, 40_000
    )


def _plan_session(
    rng: np.random.Generator,
    p: TraceParams,
    index: int,
    start: float,
    prefix_lengths: dict[str, list[int]],
) -> Session:
    kind = "agent" if rng.random() < p.agent_share else "chat"
    count = len(prefix_lengths[kind])
    weights = 1.0 / np.arange(1, count + 1) ** p.prefix_zipf
    prefix = int(rng.choice(count, p=weights / weights.sum()))
    turns_mean = p.agent_calls_mean if kind == "agent" else p.chat_turns_mean
    think = p.agent_think_s if kind == "agent" else p.chat_think_s
    grow = _agent_growth if kind == "agent" else _chat_growth
    turns = int(rng.geometric(1.0 / turns_mean))
    lengths: list[int] = []
    times: list[float] = []
    length = prefix_lengths[kind][prefix]
    time = start
    for turn in range(turns):
        length += grow(rng, p, turn == 0)
        if length > p.max_prompt_tokens:
            break  # the context window is full: the session ends
        lengths.append(length)
        times.append(time)
        time += float(rng.exponential(think))
    if not lengths:  # a first message past the window: truncated to it, as a client would
        lengths, times = [p.max_prompt_tokens], [start]
    return Session(index, kind, prefix, tuple(lengths), tuple(times))


def _clip(session: Session, end: float) -> Session:
    kept = sum(t <= end for t in session.times)
    return Session(
        session.index,
        session.kind,
        session.prefix,
        session.prompt_tokens[:kept],
        session.times[:kept],
    )


def production_trace(params: TraceParams | None = None, seed: int = 0) -> ProductionTrace:
    """Plans the trace (lengths and times of every request); tokens are built on demand."""
    p = params or TraceParams()
    rng = np.random.default_rng([seed, 0])
    prefix_rng = np.random.default_rng([seed, 2])
    shared = {
        "chat": [
            prefix_rng.integers(0, VOCAB, _log_uniform(rng, p.chat_system_tokens), dtype=np.int64)
            for _ in range(p.chat_system_prompts)
        ],
        "agent": [
            prefix_rng.integers(0, VOCAB, _log_uniform(rng, p.agent_prefix_tokens), dtype=np.int64)
            for _ in range(p.agent_prefixes)
        ],
    }
    prefix_lengths = {kind: [len(x) for x in prefixes] for kind, prefixes in shared.items()}
    sessions = []
    start = 0.0
    for index in range(p.sessions):
        sessions.append(_plan_session(rng, p, index, start, prefix_lengths))
        start += float(rng.exponential(p.session_gap_s))
    # The trace's window closes when the last session starts: later turns are not in it (as in
    # a recorded window of a live service), so the load stays steady to the end instead of
    # draining into a tail of continuations with nothing new arriving.
    sessions = [_clip(s, start) for s in sessions]
    order = list(
        heapq.merge(*[[(t, s.index, turn) for turn, t in enumerate(s.times)] for s in sessions])
    )
    return ProductionTrace(p, seed, sessions, shared, order)


def dump(trace: ProductionTrace, path: str) -> None:
    """Writes `trace`'s prompts for `benches/core_profile`'s `replay` mode (pure-Rust A/B runs
    and `perf record` without Python in the samples). Little-endian u32 words: the cache's
    blocks, the warm-up requests (not timed), the request count, then per request its length
    and its token ids."""
    warmup = int(0.1 * trace.num_requests)  # bench_production.WARMUP_FRACTION
    with open(path, "wb") as out:
        out.write(np.array([trace.num_blocks(), warmup, trace.num_requests], "<u4").tobytes())
        for request in trace.requests():
            out.write(np.array([len(request.tokens)], "<u4").tobytes())
            out.write(request.tokens.astype("<u4").tobytes())


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="dump the trace for core_profile's replay mode")
    parser.add_argument("path")
    parser.add_argument("--quick", action="store_true", help="a fifth of the trace")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = TraceParams().scaled(0.2) if args.quick else TraceParams()
    dump(production_trace(params, args.seed), args.path)
