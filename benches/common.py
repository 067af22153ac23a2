"""Helpers shared by the benchmark sections: timing, the machine's description, the build check.

Every figure a section reports is a ratio against a baseline timed in the same run, because
absolute times on a shared machine drift by tens of percent between runs.

The clock: timed regions where only the calling thread works (sections 1, 3 and 4 on the CPU)
read `now()`, by default the CPU time of the calling thread (`time.thread_time_ns`). On a shared
machine whose load average is 4× its core count, wall time (`time.perf_counter_ns`) counts the
time slices other processes take in the middle of a timed call, which inflated single samples 2-5×
in our runs; CPU time does not. `run.py --clock wall` switches back (and is what to use on an idle
machine, where the two agree). Thread scaling (section 2) and CUDA timings are wall time by nature.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from workloads import BLOCK_SIZE

from prefixkv import PrefixCache

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent


_CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
_clock_name = "cpu"


def set_clock(name: str) -> None:
    global _clock_name
    if name not in _CLOCKS:
        raise ValueError(f"clock must be one of {sorted(_CLOCKS)}")
    _clock_name = name


def clock_name() -> str:
    return _clock_name


def now() -> int:
    """Nanoseconds on the selected clock (see the module docstring)."""
    return _CLOCKS[_clock_name]()


def time_request(cache: Any, tokens: Any) -> tuple[int, int]:
    """One request's begin + commit(all prompt tokens) + finish on `cache` (prefixkv's or the
    plain-Python baseline's): the time, and its cached tokens. No clock read inside: a read of
    the CPU clock is a system call (~0.6 µs here) that the total would carry."""
    start = now()
    request = cache.begin(tokens)
    cache.commit(request, request.num_prompt_tokens)
    cache.finish(request)
    return now() - start, request.num_cached_tokens


def time_request_phases(cache: Any, tokens: Any) -> tuple[int, int, int, int]:
    """`time_request` with begin, commit and finish timed apart (three durations, then the
    cached tokens). Run it on its own cache fed the same requests: its clock reads would
    inflate a total."""
    t0 = now()
    request = cache.begin(tokens)
    t1 = now()
    cache.commit(request, request.num_prompt_tokens)
    t2 = now()
    cache.finish(request)
    t3 = now()
    return t1 - t0, t2 - t1, t3 - t2, request.num_cached_tokens


def replay_alone(trace: Any, core: str = "blocks") -> dict[str, np.ndarray]:
    """Every request of `trace` (a `workloads.Trace`) through a fresh `PrefixCache` of the
    trace's size and the given `core` (`time_request`, numpy ids), the collector paused and
    nothing else run between requests: per request, the time (``total_ns``) and the cached
    tokens (``cached``), the series `workloads.least_over_passes` combines."""
    cache = PrefixCache(trace.num_blocks(), block_size=BLOCK_SIZE, core=core)
    ns, hits = [], []
    with gc_paused():
        for request in trace.requests():
            # A fresh array, built outside the timed calls as the peers' replays build theirs
            # (`peer_sglang.py`'s `array("q")`): every side reads its prompt warm.
            took, hit = time_request(cache, request.tokens.copy())
            ns.append(took)
            hits.append(hit)
    return {"total_ns": np.array(ns, dtype=np.int64), "cached": np.array(hits, dtype=np.int64)}


def replay_runs(trace: Any) -> dict[str, np.ndarray]:
    """`replay_alone` through ``PrefixCache(core="runs")`` (the cache on runs of blocks)."""
    return replay_alone(trace, core="runs")


def stats_us(samples: np.ndarray) -> dict[str, float]:
    """Mean, p50 and p99 of per-request samples in ns, in µs."""
    return {
        "mean": float(samples.mean()) / 1e3,
        "p50": float(np.percentile(samples, 50)) / 1e3,
        "p99": float(np.percentile(samples, 99)) / 1e3,
    }


class PeerFailed(RuntimeError):
    """A peer's replay (its own process and Python) exited with an error; its stderr's end is
    in the message."""


def peer_npz(python: str, script: str, *args: str) -> dict[str, np.ndarray]:
    """Runs `benches/<script>` in the Python at `python` (a peer's own environment) with `args`
    and ``--out FILE``, and returns the arrays it saved there."""
    if clock_name() != "cpu":
        # The peers time with the thread's CPU clock: a wall-clock run would compare two clocks.
        raise ValueError("the peers time CPU time: run the sections with peers with --clock cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.npz"
        command = [python, str(BENCH_DIR / script), *args, "--out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise PeerFailed(
                f"{script} exited with {done.returncode}: {done.stderr[-2000:].strip()}"
            )
        with np.load(out) as peer:
            return {key: peer[key] for key in peer.files}


def median_ns(
    fn: Callable[[], Any], *, repeats: int = 7, warmup: int = 2, number: int = 1
) -> float:
    """Median over `repeats` of the time of `number` calls of `fn`, per call, in ns."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = now()
        for _ in range(number):
            fn()
        samples.append((now() - start) / number)
    return statistics.median(samples)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic GC pauses inside a timed region (every implementation gets the same)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def core_build() -> str:
    """Which Cargo profile built the imported `prefixkv._core` (benchmarks need release)."""
    import prefixkv._core as core

    loaded = Path(core.__file__)
    digest = hashlib.sha256(loaded.read_bytes()).hexdigest()
    for profile in ("release", "debug"):
        candidate = REPO_ROOT / "target" / profile / "lib_core.so"
        if candidate.exists() and hashlib.sha256(candidate.read_bytes()).hexdigest() == digest:
            return profile
    return "unknown (no byte-identical target/*/lib_core.so; check it is a release build)"


def machine() -> dict[str, Any]:
    import numpy

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "sha_extensions": "sha_ni" in cpu_flags(),
        "avx512": "avx512f" in cpu_flags(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "prefixkv_core_build": core_build(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def fmt_us(ns: float) -> str:
    us = ns / 1000
    if us >= 100:
        return f"{us:,.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.2f}"


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×" if x < 10 else f"{x:.1f}×"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
