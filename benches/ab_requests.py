"""Median µs per 4k-token request (begin + commit + finish) through the installed prefixkv.

For before/after comparisons across builds: run it with each build's interpreter, alternating,
pinned to one CPU (`taskset -c 1 python benches/ab_requests.py`); see benches/PROFILE.md.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from prefixkv import CacheContext, PrefixCache

RNG = np.random.default_rng(1)
SHARED = RNG.integers(0, 128_000, 3808)


def run(kind: str, form: str, requests: int = 120) -> float:
    cache = PrefixCache(
        num_blocks=(requests + 4) * 256, context=CacheContext(model_id="m"), core="blocks"
    )
    times = []
    for _ in range(requests):
        if kind == "hit":
            prompt: Any = np.concatenate([SHARED, RNG.integers(0, 128_000, 192)])
        else:
            prompt = RNG.integers(0, 128_000, 4000)
        if form == "list":
            prompt = prompt.tolist()
        start = time.thread_time_ns()
        request = cache.begin(prompt)
        cache.commit(request, len(prompt))
        cache.finish(request)
        times.append(time.thread_time_ns() - start)
    times = sorted(times[4:])
    return times[len(times) // 2] / 1e3


if __name__ == "__main__":
    for kind in ("hit", "miss"):
        for form in ("numpy", "list"):
            print(f"{kind:4s} {form:5s} {run(kind, form):7.1f} µs")
