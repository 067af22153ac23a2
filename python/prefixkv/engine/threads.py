"""How many CPU threads torch should use for a model that shares its machine:
`default_torch_threads`, and `configure_torch_threads` for an engine to call once.

Why not torch's default (one thread per core): torch's CPU kernels split each operation across
an OpenMP team that meets at a barrier when the operation ends, thousands of times per forward
pass. When other processes keep the cores busy, one thread of the team is often descheduled,
and the others wait (spinning, then sleeping) for it at every barrier: the forward pass then
runs at the pace of the slowest time slice, not of the cores. On a shared 2-core machine, one
1,487-token prefill of SmolLM2-135M took 272 s with the default 2 threads instead of about
2.6 s with 1 (docs/real_model.md has the measurement). One thread cannot be hurt this way; it
only gives up the speedup of cores that are idle.

So the default counts the cores that are idle: the CPUs this process may run on (its affinity
mask and its cgroup's CPU quota) minus how many are busy, rounded, at least 1. Busy is the
larger of the 1-minute load average (slow: it lags by a minute) and the CPU time other
processes used over the last 0.1 s (``/proc/stat``; quick, but one sample). A busy small
machine gets 1 thread; an idle 16-core machine gets 16. The choice is made once, when the
first engine starts. It only ever lowers torch's count (a smaller
`torch.set_num_threads` made before is kept), and the environment wins: ``OMP_NUM_THREADS``
leaves torch alone, ``PREFIXKV_TORCH_THREADS=N`` sets N (also to use more threads than idle
cores).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = [
    "available_cpus",
    "busy_cpus_now",
    "configure_torch_threads",
    "default_torch_threads",
]

#: Environment variables that fix the thread count (prefixkv's own first).
THREAD_ENV_VARS = ("PREFIXKV_TORCH_THREADS", "OMP_NUM_THREADS")

_configured = False


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota
    (``cpu.max``, what a container's ``--cpus`` sets)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_torch_threads(*, cpus: int | None = None, load: float | None = None) -> int:
    """The idle cores: ``round(cpus - load)``, between 1 and `cpus`.

    `cpus` defaults to `available_cpus`; `load` (busy CPUs) to the larger of the 1-minute
    load average and `busy_cpus_now` (0 where the platform has neither).
    """
    if cpus is None:
        cpus = available_cpus()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
        load = max(load, busy_cpus_now())
    if not math.isfinite(load) or load < 0:
        load = 0.0
    return max(1, min(cpus, math.floor(cpus - load + 0.5)))


def busy_cpus_now(interval: float = 0.1) -> float:
    """CPUs kept busy by all processes over the next `interval` seconds (this one sleeps
    meanwhile), from two reads of ``/proc/stat``; 0 where it cannot be read."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle  # user..steal; guest time is already in user

    try:
        total_before, idle_before = sample()
        time.sleep(interval)
        total_after, idle_after = sample()
        cpus = os.cpu_count() or 1
    except (OSError, ValueError, IndexError):
        return 0.0
    total = total_after - total_before
    if total <= 0:
        return 0.0
    return cpus * (total - (idle_after - idle_before)) / total


def configure_torch_threads() -> int:
    """Lower torch's CPU threads to `default_torch_threads` (never raise them), unless the
    environment fixes the count (`THREAD_ENV_VARS`; ``PREFIXKV_TORCH_THREADS`` is applied).
    Only the first call in a process acts. Returns the thread count torch now uses."""
    global _configured
    import torch

    if not _configured:
        _configured = True
        fixed = os.environ.get("PREFIXKV_TORCH_THREADS")
        if fixed:
            torch.set_num_threads(max(1, int(fixed)))
        elif not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(min(torch.get_num_threads(), default_torch_threads()))
    return int(torch.get_num_threads())
