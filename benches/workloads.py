"""Prompt streams shaped like what inference engines see, for the overhead benchmark.

Each generator returns a `Workload`: the prompts in arrival order (int64 numpy arrays, as an
engine holding torch tensors would pass them; the benchmark also passes them as lists), the pool
size, and how many leading requests only warm the cache and are not timed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

VOCAB = 128_000
BLOCK_SIZE = 16


@dataclass
class Workload:
    name: str
    description: str
    prompt_tokens: int
    prompts: list[np.ndarray]
    num_blocks: int
    warmup: int


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n, dtype=np.int64)


def _blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def _shared_tokens(length: int, shared_fraction: float) -> int:
    """Tokens in a block-aligned prefix covering `shared_fraction` of the prompt's blocks."""
    return round(shared_fraction * length / BLOCK_SIZE) * BLOCK_SIZE


def agent(length: int, requests: int, seed: int = 0, shared_fraction: float = 0.95) -> Workload:
    """A long shared system prompt + tool schemas + examples, then a different query each time."""
    rng = np.random.default_rng(seed)
    shared = _shared_tokens(length, shared_fraction)
    prefix = _tokens(rng, shared)
    prompts = [np.concatenate([prefix, _tokens(rng, length - shared)]) for _ in range(requests + 1)]
    return Workload(
        "agent",
        f"shared prefix of {shared_fraction:.0%} of the blocks, then a fresh query",
        length,
        prompts,
        _blocks(length) * (requests + 2),
        warmup=1,
    )


def query_first(
    length: int, requests: int, seed: int = 0, shared_fraction: float = 0.95
) -> Workload:
    """The agent prompt with the query placed first: the shared text follows a unique block, so
    nothing is reusable (every request is a miss; the layout mistake prefix caches punish)."""
    rng = np.random.default_rng(seed)
    shared = _shared_tokens(length, shared_fraction)
    suffix = _tokens(rng, shared)
    prompts = [np.concatenate([_tokens(rng, length - shared), suffix]) for _ in range(requests + 1)]
    return Workload(
        "query_first",
        "the same prompt with the query first: every request misses",
        length,
        prompts,
        _blocks(length) * (requests + 2),
        warmup=1,
    )


def chat(length: int, requests: int, seed: int = 0, turns: int = 8) -> Workload:
    """Conversations that resend their whole history each turn; the last turn is `length` long.

    Conversations are interleaved round robin, as concurrent users would be. Turn t hits the
    blocks cached by turn t-1 (the history), then misses on the new message.
    """
    rng = np.random.default_rng(seed)
    conversations = max(1, -(-requests // turns))
    histories = [_tokens(rng, length) for _ in range(conversations)]
    step = length // turns
    prompts = [histories[c][: step * t] for t in range(1, turns + 1) for c in range(conversations)]
    return Workload(
        "chat",
        f"{turns}-turn chats resending their history (prompts {step} to {length})",
        length,
        prompts,
        _blocks(length) * turns * conversations + _blocks(length),
        warmup=0,
    )


def unrelated(length: int, requests: int, seed: int = 0) -> Workload:
    """Independent prompts: every block is a miss, hashed, allocated and published."""
    rng = np.random.default_rng(seed)
    prompts = [_tokens(rng, length) for _ in range(requests + 1)]
    return Workload(
        "unrelated",
        "independent prompts: every request misses",
        length,
        prompts,
        _blocks(length) * (requests + 2),
        warmup=1,
    )


def pressure(
    length: int,
    requests: int,
    seed: int = 0,
    prefixes: int = 16,
    resident: int = 4,
    shared_fraction: float = 0.9,
) -> Workload:
    """More distinct prefixes than the cache holds: `prefixes` shared prompts drawn uniformly,
    a pool with room for about `resident` of them, so most requests evict to make room."""
    rng = np.random.default_rng(seed)
    shared = _shared_tokens(length, shared_fraction)
    heads = [_tokens(rng, shared) for _ in range(prefixes)]
    picks = rng.integers(0, prefixes, requests + resident)
    prompts = [np.concatenate([heads[p], _tokens(rng, length - shared)]) for p in picks]
    return Workload(
        "pressure",
        f"{prefixes} prefixes drawn uniformly, room for ~{resident}: eviction",
        length,
        prompts,
        _blocks(length) * (resident + 1),
        warmup=resident,
    )


GENERATORS = {
    "agent": agent,
    "query_first": query_first,
    "chat": chat,
    "unrelated": unrelated,
    "pressure": pressure,
}

#: The synthetic traces replayed beside the peers (`bench_synthetic_peers.py`): workload,
#: prompt length, timed requests. Fewer requests for longer prompts keep each pass under a
#: second or two for the slowest peer.
PEER_GRID = [
    (name, length, requests)
    for name in GENERATORS
    for length, requests in ((1_024, 300), (4_096, 200), (16_384, 60))
]


def peer_grid(quick: bool) -> list[tuple[str, int, int]]:
    """`PEER_GRID`, or a quarter of its requests (at least 16) with `quick`."""
    return [(n, length, max(16, r // 4) if quick else r) for n, length, r in PEER_GRID]


class HitMismatch(AssertionError):
    """Two replays that must agree (two passes of one cache over one trace, or prefixkv and a
    peer that caches exactly as it does) cached different tokens on a request."""


class TraceRequest(Protocol):
    @property
    def tokens(self) -> np.ndarray: ...


class TraceLimits(Protocol):
    @property
    def max_prompt_tokens(self) -> int: ...


class Trace(Protocol):
    """What the peers' replays read of a trace: `production_workload.ProductionTrace`, or a
    synthetic workload through `SyntheticTrace`."""

    @property
    def num_requests(self) -> int: ...

    @property
    def params(self) -> TraceLimits: ...

    def requests(self) -> Iterable[TraceRequest]: ...

    def num_blocks(self) -> int: ...


@dataclass(frozen=True)
class _Prompt:
    tokens: np.ndarray


@dataclass(frozen=True)
class _Limits:
    max_prompt_tokens: int


class SyntheticTrace:
    """A `Workload` as a `Trace`, the form in which the peers' replays read the production
    trace."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.num_requests = len(workload.prompts)
        self.params = _Limits(max(len(p) for p in workload.prompts))

    def requests(self) -> Iterator[_Prompt]:
        return (_Prompt(p) for p in self.workload.prompts)

    def num_blocks(self) -> int:
        return self.workload.num_blocks


def synthetic_trace(name: str, length: int, requests: int, seed: int = 0) -> SyntheticTrace:
    """Workload `name` of `GENERATORS` as a `SyntheticTrace`."""
    return SyntheticTrace(GENERATORS[name](length, requests, seed=seed))


def least_over_passes(runs: list[dict[str, np.ndarray]], what: str) -> dict[str, np.ndarray]:
    """Replays of one trace (each from a fresh cache) as one: per request, the least of each
    `*_ns` series over them (the same request in the same cache state each time, so the least is
    the one the machine's other load touched least); every other series must agree, the cached
    tokens first (`HitMismatch` naming `what` otherwise)."""
    if not runs:
        raise ValueError(f"{what}: no replay to take the least of")
    out: dict[str, np.ndarray] = {}
    for key in runs[0]:
        series = [run[key] for run in runs]
        if key.endswith("_ns"):
            out[key] = np.min(series, axis=0)
        elif any(not np.array_equal(s, series[0]) for s in series[1:]):
            raise HitMismatch(f"{what}: two passes cached different tokens ({key})")
        else:
            out[key] = series[0]
    return out


def replay_grid(
    replay: Callable[[SyntheticTrace], dict[str, np.ndarray]],
    grid: list[tuple[str, int, int]],
    seed: int,
    passes: int,
) -> dict[str, np.ndarray]:
    """Every trace of `grid` through `replay` (a fresh cache each call) `passes` times, as
    `least_over_passes` combines them. Keys are ``name__length__key``."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, not {passes}")
    out: dict[str, np.ndarray] = {}
    for name, length, requests in grid:
        runs = [replay(synthetic_trace(name, length, requests, seed)) for _ in range(passes)]
        for key, value in least_over_passes(runs, f"{name} {length}").items():
            out[f"{name}__{length}__{key}"] = value
    return out
