"""`BackgroundQueue`, the bounded queue and thread behind the remote tier's writes and the vLLM
connector's host digests: batches, a full queue refuses, close handles what was queued first,
and an owner nobody holds stops its thread."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from prefixkv.errors import InvalidInputError
from prefixkv.tiers.background import BackgroundQueue


def _threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def test_items_are_handled_in_order_in_batches_of_at_most_max_batch() -> None:
    gate = threading.Event()
    batches: list[list[int]] = []

    def handle(items: list[int]) -> None:
        gate.wait(5)
        batches.append(items)

    work = BackgroundQueue(handle, queue_size=16, name="test-batches", max_batch=3)
    try:
        for i in range(8):
            assert work.offer(i)
        gate.set()
        assert work.flush(5)
        assert [i for batch in batches for i in batch] == list(range(8))
        assert all(1 <= len(batch) <= 3 for batch in batches)
        assert any(len(batch) == 3 for batch in batches)  # the thread drains more than one
        assert work.pending() == 0
    finally:
        work.close()


def test_a_full_queue_refuses_at_once_and_close_handles_what_was_queued() -> None:
    gate = threading.Event()
    handled: list[int] = []

    def handle(items: list[int]) -> None:
        gate.wait(5)
        handled.extend(items)

    work = BackgroundQueue(handle, queue_size=2, name="test-full")
    assert work.offer(0)
    deadline = time.monotonic() + 5
    while work.pending() and time.monotonic() < deadline:  # the thread holds item 0
        time.sleep(0.001)
    assert work.offer(1) and work.offer(2)
    start = time.monotonic()
    assert not work.offer(3)
    assert time.monotonic() - start < 1.0
    assert not work.flush(0.05)
    gate.set()
    work.close()
    assert handled == [0, 1, 2]
    assert _threads("test-full") == 0


def test_an_owner_nobody_holds_stops_its_thread() -> None:
    handled: list[int] = []

    class Owner:
        def __init__(self) -> None:
            self.work = BackgroundQueue(handled.extend, queue_size=4, name="test-owner")

    gc.collect()
    owner = Owner()
    assert owner.work.offer(7)
    assert _threads("test-owner") == 1
    del owner
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads("test-owner") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads("test-owner") == 0
    assert handled == [7]  # queued before the owner went: handled before the thread stopped


@pytest.mark.parametrize("queue_size", [0, -1, 1.5, True, "4"])
def test_a_bad_queue_size_is_refused_by_name(queue_size: object) -> None:
    with pytest.raises(InvalidInputError, match="queue_size"):
        BackgroundQueue(list, queue_size=queue_size, name="test-bad")  # type: ignore[arg-type]
    assert _threads("test-bad") == 0
