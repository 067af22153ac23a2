"""`BackgroundQueue`: work a step hands off so that it never waits for it, done by one thread.

The tiers take the slow part of a save off the step: the remote tier's writes to the store
(`remote`), the vLLM connector's digests of host slots (`integrations.vllm.connector_host`).
Both need the same life:

* Bounded: a full queue refuses the item at once (`offer` returns False), and the owner drops
  it and counts it; a step never blocks on a slow store or a slow digest.
* One daemon thread drains the queue, up to `max_batch` items per call of `handle` (the remote
  tier batches its writes into one round trip; digests go one at a time).
* The thread holds the queue and `handle`, never the queue's owner, so an owner nobody holds is
  collected; this object's finalizer then stops the thread after the items queued before it
  (also at interpreter exit: the thread must not be inside torch while Python tears down).
  `handle` must therefore not hold the owner either: pass the owner's parts (its counters, its
  lock), not a bound method.
* `handle` keeps its own errors: the owner knows which ones a batch may raise and what to count.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from prefixkv.errors import InvalidInputError

__all__ = ["BackgroundQueue"]

T = TypeVar("T")


class BackgroundQueue(Generic[T]):
    """A queue of at most `queue_size` items that a daemon thread named `name` hands to
    `handle`, in batches of up to `max_batch`, until `close`."""

    def __init__(
        self,
        handle: Callable[[list[T]], None],
        *,
        queue_size: int,
        name: str,
        max_batch: int = 1,
    ) -> None:
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise InvalidInputError(f"queue_size must be an int >= 1, got {queue_size!r}")
        self._queue: queue.Queue[T | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(
            target=_drain, args=(self._queue, handle, max_batch), name=name, daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._queue, self._thread)

    def offer(self, item: T) -> bool:
        """Queue `item`; False (and nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def pending(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued item was handled; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.001)
        return False

    def close(self) -> None:
        """Stop the thread once the items queued before this call are handled."""
        self._finalizer()


def _stop(pending: queue.Queue[T | None], thread: threading.Thread) -> None:
    pending.put(None)
    if thread is not threading.current_thread():
        thread.join()


def _drain(
    pending: queue.Queue[T | None], handle: Callable[[list[T]], None], max_batch: int
) -> None:
    """Hands the queue's items to `handle`, up to `max_batch` at once, until None."""
    while True:
        item = pending.get()
        batch = [item]
        while item is not None and len(batch) < max_batch:
            try:
                item = pending.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
        stop = batch[-1] is None
        items = [entry for entry in batch if entry is not None]
        try:
            if items:
                handle(items)
        finally:
            for _ in batch:
                pending.task_done()
        if stop:
            return
