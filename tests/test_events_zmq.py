"""Two engine processes, one index, over loopback ZMQ (ports chosen at run time).

Requests sharing a prefix are routed to the engine holding it and hit there; a subscriber that
is stopped while the engines keep serving, then started again, loses nothing (replay); a fresh
index fed from scratch by replay agrees too.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec  # noqa: F401  (the test extra installs the events extra: a missing one fails)
import pytest
import torch  # noqa: F401
import zmq  # noqa: F401

from prefixkv.apps.route_demo import WorkerHandle, start_workers
from prefixkv.events import EventSubscriber, PrefixIndex, prompt_hashes

CONFIG = {
    "model_size": "tiny",
    "seed": 0,
    "block_size": 16,
    "num_blocks": 48,
    "max_new_tokens": 2,
}


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerHandle]]:
    handles = start_workers(2, CONFIG)
    yield handles
    for handle in handles:
        handle.close()


def agree(index: PrefixIndex, workers: list[WorkerHandle]) -> None:
    for worker in workers:
        assert index.blocks_of(worker.name) == worker.call("cached_hashes"), worker.name


@pytest.mark.timeout(120)
def test_prefix_routing_replay_and_restart(workers: list[WorkerHandle]) -> None:
    names = [w.name for w in workers]
    by_name = dict(zip(names, workers, strict=True))
    endpoints = {w.name: w.endpoint for w in workers}
    fingerprint, block_size = workers[0].info["fingerprint"], workers[0].info["block_size"]
    index = PrefixIndex(names)
    shared = "System: you are a careful assistant for prefix routing tests. " * 4
    encode = workers[0].call

    def route(prompt: str, subscriber: EventSubscriber) -> tuple[str, int, int]:
        tokens = encode("encode", prompt)
        target, matched = index.best(prompt_hashes(fingerprint, tokens, block_size=block_size))
        if matched == 0:
            target = names[1]  # cold: the second engine, so the holder is not the default
        reply = by_name[target].call("generate", tokens)
        assert subscriber.wait_for(target, reply["seq"])
        return target, matched, reply["cached_tokens"]

    with EventSubscriber(index, endpoints) as subscriber:
        target, matched, cached = route(shared + "Question one?", subscriber)
        assert (target, matched, cached) == ("engine1", 0, 0)
        target, matched, cached = route(shared + "Another question?", subscriber)
        assert target == "engine1" and matched >= len(shared) // block_size
        assert cached >= matched * block_size
        agree(index, workers)

    # The subscriber is gone while both engines keep changing (stores, evictions, a clear).
    for n in range(4):
        workers[0].call("generate", encode("encode", f"Engine zero, topic {n}: " * 12))
    workers[1].call("clear")
    workers[1].call("generate", encode("encode", shared + "After the clear?"))

    with EventSubscriber(index, endpoints) as subscriber:
        for worker in workers:
            seq = worker.call("clear") if worker.name == "engine0" else None
            if seq is not None:
                assert subscriber.wait_for(worker.name, seq)
        workers[0].call("generate", encode("encode", shared + "Engine zero again?"))
        last = {w.name: w.call("generate", encode("encode", "x" * 40))["seq"] for w in workers}
        for name, seq in last.items():
            assert subscriber.wait_for(name, seq)
        assert subscriber.replayed_batches > 0
        agree(index, workers)

    # A new router, started last, rebuilds the same view from the replay buffers alone.
    fresh = PrefixIndex(names)
    with EventSubscriber(fresh, endpoints) as subscriber:
        for name, seq in last.items():
            assert subscriber.wait_for(name, seq)
        agree(fresh, workers)
        assert subscriber.unrecoverable_gaps == 0
