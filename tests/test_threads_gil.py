"""Which calls release the GIL (`rust/py/src/gil.rs`), checked without timing.

With the switch interval set far beyond the test's length, a thread holding the GIL keeps it
until it blocks or a C call releases it. A second thread that only counts and sleeps can then
run during a call of the main thread *only if that call released the GIL*: "the counter moved
during the call" is impossible for a call that keeps it, whatever the machine's load. A call
that releases it may still see no progress in one try (the counting thread asleep, or without a
core), so each is tried until it shows some, within a generous deadline; one that keeps the GIL
is tried a fixed number of times and must never show any.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from prefixkv import PrefixCache, Request
from prefixkv.events import PrefixIndex, prompt_hashes

BS = 16
#: Long enough (4,096 blocks) that a released call lasts a good fraction of a millisecond.
PROMPT = 65_536
DEADLINE_S = 30.0


@contextmanager
def _counting_thread() -> Iterator[list[int]]:
    """A thread that counts, releasing the GIL only to sleep 0.1 ms, under a switch interval
    that never takes the GIL from the main thread."""
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1
            time.sleep(1e-4)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=count)
    thread.start()
    try:
        yield counter
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


#: The call to watch, and what to do after it (cleanup, unwatched).
Watched = tuple[Callable[[], object], Callable[[], object]]


def _other_thread_ran(prepare: Callable[[], Watched], tries: int | None) -> bool:
    """Whether the counting thread ran during one of the calls `prepare()` sets up. Stops at
    the first call that shows progress; `tries` None: keeps trying until the deadline."""
    with _counting_thread() as counter:
        deadline = time.monotonic() + DEADLINE_S
        attempt = 0
        while (attempt < tries) if tries is not None else (time.monotonic() < deadline):
            attempt += 1
            call, after = prepare()
            before = counter[0]
            call()
            ran = counter[0] != before
            after()
            if ran:
                return True
    return False


def _prompt(seed: int, n: int = PROMPT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, n, dtype=np.int64)


@pytest.fixture
def cache() -> PrefixCache:
    # Room for a few long requests at once; each call below starts from a fresh request.
    return PrefixCache(4 * PROMPT // BS, block_size=BS)


def _fresh_request(cache: PrefixCache, seed: int) -> Request:
    return cache.begin(_prompt(seed))


# Each case: prepare(cache, seed) -> (call, after). Setting up and cleaning up may release the
# GIL themselves (begin, finish); only the call is watched.


def _prefill_commit(cache: PrefixCache, seed: int) -> Watched:
    request = _fresh_request(cache, seed)
    return lambda: cache.commit(request, PROMPT), lambda: cache.finish(request)


def _prefill_allocate_slots(cache: PrefixCache, seed: int) -> Watched:
    # A waiting request: its first allocate_slots matches the prefix (cached when `seed` is odd).
    tokens = _prompt(seed % 2)
    if seed < 2:
        warm = cache.begin(tokens)
        cache.commit(warm, PROMPT)
        cache.finish(warm)
    cache.add_request(f"r{seed}", tokens)
    return lambda: cache.allocate_slots(f"r{seed}", PROMPT), lambda: cache.finish(f"r{seed}")


def _full_hit_allocate_slots(cache: PrefixCache, seed: int) -> Watched:
    # A waiting request whose whole prompt is cached asks for its last block only, yet its first
    # allocate_slots matches all 4,096 blocks.
    tokens = _prompt(0)
    if seed == 0:
        warm = cache.begin(tokens)
        cache.commit(warm, PROMPT)
        cache.finish(warm)
    cache.add_request(f"r{seed}", tokens)
    return lambda: cache.allocate_slots(f"r{seed}", BS), lambda: cache.finish(f"r{seed}")


def _can_allocate_slots(cache: PrefixCache, seed: int) -> Watched:
    cache.add_request(f"r{seed}", _prompt(seed))
    return (
        lambda: cache.can_allocate_slots(f"r{seed}", PROMPT),
        lambda: cache.finish(f"r{seed}"),
    )


def _preempt(cache: PrefixCache, seed: int) -> Watched:
    request = _fresh_request(cache, seed)
    cache.commit(request, PROMPT)
    return lambda: cache.preempt(request), lambda: cache.finish(request)


def _request_block_keys(cache: PrefixCache, seed: int) -> Watched:
    request = _fresh_request(cache, seed)
    cache.commit(request, PROMPT)
    return lambda: cache.request_block_keys(request), lambda: cache.finish(request)


def _append_tokens(cache: PrefixCache, seed: int) -> Watched:
    request = cache.begin(_prompt(seed, BS))
    tokens = _prompt(seed + 1)
    return lambda: cache.append_tokens(request, tokens), lambda: cache.finish(request)


def _lookup(cache: PrefixCache, seed: int) -> Watched:
    tokens = _prompt(0)
    if seed == 0:
        warm = cache.begin(tokens)
        cache.commit(warm, PROMPT)
        cache.finish(warm)
    return lambda: cache.lookup(tokens), lambda: None


def _lookup_many(cache: PrefixCache, seed: int) -> Watched:
    prompts = [_prompt(seed + k, PROMPT // 8) for k in range(8)]
    return lambda: cache.lookup_many(prompts), lambda: None


def _begin(cache: PrefixCache, seed: int) -> Watched:
    tokens = _prompt(seed)
    requests = []
    return lambda: requests.append(cache.begin(tokens)), lambda: cache.finish(requests[0])


def _finish(cache: PrefixCache, seed: int) -> Watched:
    request = _fresh_request(cache, seed)
    cache.commit(request, PROMPT)
    return lambda: cache.finish(request), lambda: None


def _index_score(cache: PrefixCache, seed: int) -> Watched:
    index = PrefixIndex(["a", "b"])
    hashes = prompt_hashes(cache, _prompt(seed))
    index.store("a", hashes)
    return lambda: index.score(hashes), lambda: None


RELEASED = {
    "commit of a prefill": _prefill_commit,
    "allocate_slots of a prefill": _prefill_allocate_slots,
    "can_allocate_slots of a prefill": _can_allocate_slots,
    "allocate_slots of a full hit (one block asked)": _full_hit_allocate_slots,
    "preempt": _preempt,
    "request_block_keys": _request_block_keys,
    "append_tokens of many tokens": _append_tokens,
    "lookup": _lookup,
    "lookup_many": _lookup_many,
    "begin": _begin,
    "finish": _finish,
    "PrefixIndex.score": _index_score,
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_whole_prompt_work_releases_the_gil(cache: PrefixCache, name: str) -> None:
    seeds = iter(range(1_000_000))
    assert _other_thread_ran(lambda: RELEASED[name](cache, next(seeds)), tries=None), (
        f"{name}: no other thread ran during {DEADLINE_S:.0f} s of calls"
    )


def test_a_decode_step_keeps_the_gil(cache: PrefixCache) -> None:
    """Releasing costs a wait to take the GIL back: a one-token step must not pay it."""
    request = cache.begin(_prompt(0, 4 * BS))
    cache.commit(request, 4 * BS)
    steps = iter(range(1_000_000))

    def prepare() -> Watched:
        step = next(steps)

        def call() -> object:
            cache.append_tokens(request, [step % 1000])
            slots = cache.allocate_slots(request, 1)
            return slots, cache.commit(request, 4 * BS + step + 1)

        return call, lambda: None

    assert not _other_thread_ran(prepare, tries=2000)
    cache.finish(request)
