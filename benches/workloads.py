"""Prompt streams shaped like what inference engines see, for the overhead benchmark.

Each generator returns a `Workload`: the prompts in arrival order (int64 numpy arrays, as an
engine holding torch tensors would pass them; the benchmark also passes them as lists), the pool
size, and how many leading requests only warm the cache and are not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

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
