"""Section 2: lookup throughput from 1 and 2 Python threads, with and without a writer thread.

`PrefixCache.lookup` converts the token ids with the GIL held (a numpy cast and one buffer
copy), then releases the GIL for the hashing and the lock-free table walk. Two reader threads
therefore overlap almost entirely, if two cores are free for them.

The machine has 2 cores, so a writer thread competing for CPU would cap any two-reader figure
below 2 by construction. The design keeps that honest:

- *no writer*: readers alone, 1 then 2 threads: the GIL-release question on its own;
- *writer at a fixed modest rate*: another thread begins, commits and finishes 4k-token
  requests at `WRITER_RATE` per second (a few % of one core), sleeping between them, so the
  readers see a live, changing table (inserts and evictions) without the writer eating a core;
- *control*: the same harness on a call that holds the GIL throughout (the plain-Python
  baseline's hash loop: hashlib keeps the GIL for inputs under 2 KiB), whose ratio should be
  ~1.0. It shows the harness can tell released from held.

Each configuration runs for a fixed wall time; lookups are counted per thread. The load average
of the machine is recorded, because other processes take cores from the readers too.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table
from python_baseline import PyPrefixCache

from prefixkv import PrefixCache
from prefixkv.cache import key_extras

#: The key extras of a request with no salt, adapter or multimodal items (low-level calls).
NO_EXTRAS = key_extras()

PROMPT_TOKENS = 8192
WRITER_RATE = 100.0  # requests per second
BLOCK_SIZE = 16


def _throughput(
    call: Any, prompts: list[np.ndarray], threads: int, seconds: float, writer: Any | None
) -> dict[str, float]:
    stop = threading.Event()
    counts = [0] * threads
    barrier = threading.Barrier(threads + 1 + (writer is not None))

    def reader(index: int) -> None:
        prompt = prompts[index % len(prompts)]
        barrier.wait()
        n = 0
        while not stop.is_set():
            call(prompt)
            n += 1
        counts[index] = n

    written = [0]

    def write_loop() -> None:
        barrier.wait()
        period = 1.0 / WRITER_RATE
        next_at = time.perf_counter()
        while not stop.is_set():
            writer()
            written[0] += 1
            next_at += period
            delay = next_at - time.perf_counter()
            if delay > 0:
                stop.wait(delay)

    workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    if writer is not None:
        workers.append(threading.Thread(target=write_loop))
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    return {"per_second": sum(counts) / elapsed, "writer_per_second": written[0] / elapsed}


def _gil_held_share(
    cache: PrefixCache, prompt: np.ndarray, rng: np.random.Generator
) -> dict[str, float]:
    """The part of one single-thread lookup that holds the GIL, and the 2-thread bound it implies.

    Independent of the machine's load: every term is the calling thread's CPU time, one thread
    running. If every held section had to wait for the other thread's, two threads would reach
    2 / (1 + share) of one thread's rate: the bound reported.

    Held: the array's metadata checks and its one `tobytes` copy (`as_token_ids`; the values
    are checked and narrowed later, with the GIL released); the call itself (argument
    parsing, detach/attach, the result tuple), timed as a `_core.lookup` of a one-block prompt
    that misses, whose released part is one block's unpack and hash (the call also builds the
    `PrefixMatch`, which keeps the block ids as a Rust vector: no per-block work held).
    Released: the rest of the lookup (checking and narrowing the token buffer, every table key, the table
    walk and verification, packing the block ids) = the whole lookup minus the held terms.
    An upper bound on the held share: numpy drops the GIL inside some of its own loops.
    """
    from common import median_ns

    from prefixkv.cache import as_token_ids

    one_block = as_token_ids(rng.integers(0, 128_000, BLOCK_SIZE, dtype=np.int64))
    conversion = median_ns(lambda: as_token_ids(prompt), repeats=21, number=10)
    call = median_ns(lambda: cache._core.lookup(one_block, NO_EXTRAS), repeats=21, number=20)
    total = median_ns(lambda: cache.lookup(prompt), repeats=21, number=3)
    held = conversion + call
    share = held / total
    return {
        "held_us": held / 1000,
        "held_parts_us": {
            "as_token_ids": conversion / 1000,
            "call": call / 1000,
        },
        "released_us": (total - held) / 1000,
        "lookup_us": total / 1000,
        "share": share,
        "two_thread_bound": 2.0 / (1.0 + share),
    }


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 0.8 if quick else 3.0
    rng = np.random.default_rng(3)
    num_blocks = 40_000
    cache = PrefixCache(num_blocks, block_size=BLOCK_SIZE)
    # Readers probe prompts that are fully cached: the longest walk a lookup does.
    prompts = [rng.integers(0, 128_000, PROMPT_TOKENS, dtype=np.int64) for _ in range(2)]
    for prompt in prompts:
        request = cache.begin(prompt)
        cache.commit(request, len(prompt))
        cache.finish(request)
    pin = cache.pin(prompts[0]), cache.pin(prompts[1])  # the writer's evictions must not take them
    shared = rng.integers(0, 128_000, 3800, dtype=np.int64)

    def writer() -> None:
        tokens = np.concatenate([shared, rng.integers(0, 128_000, 296, dtype=np.int64)])
        request = cache.begin(tokens)
        cache.commit(request, len(tokens))
        cache.finish(request)

    baseline = PyPrefixCache(16, BLOCK_SIZE)
    load_before = os.getloadavg()[0]
    configs: dict[str, Any] = {}
    for name, call, with_writer in [
        ("lookup, no writer", cache.lookup, False),
        ("lookup, writer at 100 req/s", cache.lookup, True),
        ("control: plain-Python hash loop (holds the GIL)", baseline.block_keys, False),
    ]:
        one = _throughput(call, prompts, 1, seconds, writer if with_writer else None)
        two = _throughput(call, prompts, 2, seconds, writer if with_writer else None)
        configs[name] = {
            "one_thread_per_second": one["per_second"],
            "two_threads_per_second": two["per_second"],
            "ratio": two["per_second"] / one["per_second"],
            "writer_per_second": (one["writer_per_second"] + two["writer_per_second"]) / 2
            if with_writer
            else None,
        }
        print(f"  threads {name}: {configs[name]['ratio']:.2f}×", flush=True)
    gil = _gil_held_share(cache, prompts[0], rng)
    for p in pin:
        cache.unpin(p)
    return {
        "gil_held": gil,
        "prompt_tokens": PROMPT_TOKENS,
        "seconds_per_config": seconds,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "configs": configs,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, c in result["configs"].items():
        rows.append(
            [
                name,
                f"{c['one_thread_per_second']:,.0f}",
                f"{c['two_threads_per_second']:,.0f}",
                f"{c['ratio']:.2f}×",
                "–" if c["writer_per_second"] is None else f"{c['writer_per_second']:.0f}",
            ]
        )
    note = (
        f"{result['prompt_tokens']:,}-token numpy prompts, fully cached; {result['seconds_per_config']} s per "
        f"measurement; {result['cpus']} CPUs; load average {result['load_average_before']:.1f} before, "
        f"{result['load_average_after']:.1f} after (other processes compete for the same 2 cores).\n"
    )
    if result["load_average_before"] >= result["cpus"]:
        note += (
            f"\nThe machine was loaded (load average {result['load_average_before']:.1f} on "
            f"{result['cpus']} CPUs): a second reader thread competes with other processes for a "
            "core, so the 2 ÷ 1 ratios below are capped by the load, not only by the cache. The "
            "GIL-held share next is measured on one thread's CPU clock and does not depend on it.\n"
        )
    gil = result["gil_held"]
    parts = gil.get("held_parts_us", {})
    detail = (
        f" (as_token_ids {parts['as_token_ids']:.1f}, call and result {parts['call']:.1f})"
        if parts
        else ""
    )
    note += (
        f"\nSingle-thread GIL-held share of one lookup (thread CPU time): held "
        f"{gil['held_us']:.1f} µs{detail}, released {gil.get('released_us', 0):.1f} µs, of "
        f"{gil['lookup_us']:.1f} µs = {gil['share']:.1%} held (an upper bound: numpy drops the GIL "
        f"inside some of its loops), so two threads reach about {gil['two_thread_bound']:.2f}× "
        "or more when two cores are free.\n"
    )
    return (
        note
        + "\n"
        + md_table(["calls", "1 thread /s", "2 threads /s", "2 ÷ 1", "writer req/s"], rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(markdown(run(args.quick)))


if __name__ == "__main__":
    main()
