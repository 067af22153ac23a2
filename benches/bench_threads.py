"""Section 2: a router thread probing while a scheduler thread allocates, on 1 and 2 threads.

The scenario (issue 24): in one process, a *router* thread probes prompts (`lookup`, lock-free)
while a *scheduler* thread runs requests through the cache (allocating, publishing, evicting,
under the core's mutex). Both tasks are first timed alone on one thread, then together on two;
the figure is the total throughput of the pair in units of each task's solo rate:

    speedup = router probes/s together ÷ router alone + scheduler requests/s together ÷ alone

1.0 means the second thread added nothing (the GIL, or the core's locks, serialised them); 2.0
means both ran at full speed side by side. The router probes fixed 4k-16k-token prompts,
fully or half cached; the scheduler runs 4k-16k-token requests sharing a 2k-token system prompt
with a fresh suffix each (a partial hit, then the suffix's blocks published, evicting old ones).
Two scheduler shapes: `begin` / `commit` / `finish` of the whole prompt, and vLLM's step calls
(`add_request`, `allocate_slots` and `commit` in 2,048-token chunks, then 16 decode steps of
`append_tokens` / `allocate_slots` / `commit`, `finish`), whose decode steps keep the GIL
(`rust/py/src/gil.rs`). The first shape also runs with its prompts built before the timed
loop (a ring of 256, each fresh again by the time it comes back: 256 requests evict the whole
cache many times over), as an engine's scheduler receives prompts already tokenized: built in
the loop, numpy's concatenation of each prompt holds the GIL for about half of what the
scheduler holds.

The router also runs *batched*: `lookup_many` probes 32 (or 128) prompts a call, releasing the
GIL once for the batch. One probe a call hands the GIL back and forth at every probe, and each
hand-off of a contended GIL wakes the other thread; a batch pays that once, so the router's
work runs beside the scheduler's Python instead of between it.

The machine has 2 cores shared with other processes, so "two threads on two idle cores" is
not something a run here can promise. Two controls run in the same rounds, through the same
harness, on the same pair of threads:

- *releases the GIL*: two threads each hashing 256 KiB buffers with `hashlib` (which releases
  the GIL for inputs over 2 KiB) and sharing nothing: what the machine's load lets two threads
  of this process reach. The cache's speedup divided by this one is reported beside it.
- *releases the GIL briefly*: the same with 8 KiB buffers, a call that releases the GIL for
  about as long as a router's lookup does (~5 µs here). Every release and retake of a contended
  GIL costs a wake-up of the other thread: at this grain, what the interpreter and the machine
  let two threads reach, whatever the calls do. The cache's speedup divided by this one is
  reported beside it.
- *holds the GIL*: two threads running a plain-Python loop: ~1.0, showing the harness tells a
  call that releases the GIL from one that does not.
- *each on its own cache*: the router and the scheduler of the first pair, but each thread with
  a cache of its own (same sizes, same prompts' shapes), so the two threads share no table, no
  pool and no lock, only the machine. What this pair reaches is what the machine's cores and
  memory let two threads doing this work reach; the gap between it and the shared pair is what
  sharing one cache costs.

Also recorded per phase: the CPU time the process got per wall second (how many cores it ran
on), and the 1-minute load average per round. The rounds alternate the phases, so load that
drifts over the run touches every figure alike; medians over rounds are reported with the range.

The same script runs on a free-threaded interpreter (CPython 3.13t and later, with prefixkv's
version-specific build: `docs/release.md`), where there is no GIL to hand over:
`python benches/run.py` runs this section there too, in a second process, when
`PREFIXKV_FREE_THREADED_PYTHON` names such an interpreter (`run_in`). The controls keep their
names, which say what their calls do on an interpreter with a GIL.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

from prefixkv import OutOfBlocksError, PrefixCache

BLOCK_SIZE = 16
SYSTEM_TOKENS = 2048
CHUNK_TOKENS = 2048
DECODE_STEPS = 16
PROBE_LENGTHS = (4096, 8192, 12288, 16384)
REQUEST_LENGTHS = (4096, 8192, 12288, 16384)
#: Prompts a router probes in one `lookup_many` call (the batched router of section 2), and
#: a larger batch beside it: the fewer hand-offs of the GIL, the less the scheduler waits.
PROBE_BATCH = 32
LARGE_PROBE_BATCH = 128
#: Prompts the scheduler's second form cycles through, built before the timed loop.
PREBUILT_PROMPTS = 256

#: A unit of work: called repeatedly by one thread; returns how many units it did.
Task = Callable[[], int]

#: The control whose calls release the GIL for about as long as a lookup's (see the module docs).
SHORT_CONTROL = "control: two threads releasing the GIL for ~5 µs a call (hashlib, 8 KiB)"


def _phase(tasks: list[Task], seconds: float) -> dict[str, Any]:
    """Runs each task on its own thread for `seconds` of wall time, all at once."""
    stop = threading.Event()
    counts = [0] * len(tasks)
    thread_cpu = [0.0] * len(tasks)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(tasks) + 1)

    def loop(index: int) -> None:
        task = tasks[index]
        barrier.wait()
        cpu_start = time.thread_time()
        n = 0
        try:
            while not stop.is_set():
                n += task()
        except BaseException as exc:  # surfaced below: a benchmark never hides a failure
            errors.append(exc)
        counts[index] = n
        thread_cpu[index] = time.thread_time() - cpu_start

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(tasks))]
    for t in threads:
        t.start()
    barrier.wait()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    if errors:
        raise errors[0]
    return {
        "rates": [c / wall for c in counts],
        "cores": cpu / wall,
        # Work per CPU-second of the thread that did it: unlike the rates, it does not depend on
        # how much CPU the machine's load left the process, only on how fast the work ran while
        # it had a core (a thread waiting for the GIL or a lock sleeps, and uses no CPU).
        "per_cpu_second": [c / max(t, 1e-9) for c, t in zip(counts, thread_cpu, strict=True)],
    }


class Workload:
    """The cache, the router's probes and the scheduler's requests."""

    def __init__(self, seed: int = 3, core: str = "blocks") -> None:
        rng = np.random.default_rng(seed)
        # Room for the pinned probes, a few live requests and a history that keeps evicting.
        self.cache = PrefixCache(12_000, block_size=BLOCK_SIZE, core=core)
        self.system = rng.integers(0, 128_000, SYSTEM_TOKENS, dtype=np.int64)
        # Suffixes are windows of one pool at random offsets: fresh content per request without
        # drawing random numbers in the timed loop.
        self.pool = rng.integers(0, 128_000, 1 << 20, dtype=np.int64)
        self.rng = np.random.default_rng(seed + 1)
        self.probes: list[np.ndarray] = []
        self.pins: list[Any] = []
        for i, n in enumerate(PROBE_LENGTHS * 2):
            tokens = rng.integers(0, 128_000, n, dtype=np.int64)
            if i % 2 == 0:  # fully cached and pinned
                self._serve(tokens)
                self.pins.append(self._pin(tokens))
                self.probes.append(tokens)
            else:  # its first half cached (pinned), the rest never seen
                self._serve(tokens[: n // 2])
                self.pins.append(self._pin(tokens[: n // 2]))
                self.probes.append(tokens)
        self.next_probe = 0
        self.probe_batch_prompts = [self.probes[k % len(self.probes)] for k in range(PROBE_BATCH)]
        self.next_request = 0
        # The prompts built before the timed loop (module docs), with their own random stream
        # so the in-loop prompts are the same as without them.
        ring_rng = np.random.default_rng(seed + 2)
        self.prebuilt = [self._prompt(i, ring_rng) for i in range(PREBUILT_PROMPTS)]
        self.next_prebuilt = 0
        self.requests_done = 0
        self.out_of_blocks = 0

    def _serve(self, tokens: np.ndarray) -> None:
        request = self.cache.begin(tokens)
        self.cache.commit(request, len(tokens))
        self.cache.finish(request)

    def _pin(self, tokens: np.ndarray) -> Any:
        return self.cache.pin(tokens)

    def close(self) -> None:
        for pin in self.pins:
            self.cache.unpin(pin)

    def _request_tokens(self) -> np.ndarray:
        self.next_request += 1
        return self._prompt(self.next_request - 1, self.rng)

    def _prompt(self, index: int, rng: np.random.Generator) -> np.ndarray:
        """Request `index`'s prompt: the system prompt, then a window of the pool at a random
        offset drawn from `rng`, `REQUEST_LENGTHS` tokens in all by turn."""
        n = REQUEST_LENGTHS[index % len(REQUEST_LENGTHS)]
        start = int(rng.integers(0, len(self.pool) - n))
        return np.concatenate([self.system, self.pool[start : start + n - SYSTEM_TOKENS]])

    def probe(self) -> int:
        tokens = self.probes[self.next_probe % len(self.probes)]
        self.next_probe += 1
        self.cache.lookup(tokens)
        return 1

    def probe_batch(self) -> int:
        """The router's probes `PROBE_BATCH` at a time (`lookup_many`): the GIL handed over
        once a batch instead of once a probe."""
        self.cache.lookup_many(self.probe_batch_prompts)
        return PROBE_BATCH

    def prober(self, size: int) -> Task:
        """A router task probing `size` prompts a `lookup_many` call."""
        prompts = [self.probes[k % len(self.probes)] for k in range(size)]

        def probe_many() -> int:
            self.cache.lookup_many(prompts)
            return size

        return probe_many

    def begin_commit_finish(self) -> int:
        return self._serve_request(self._request_tokens())

    def begin_commit_finish_prebuilt(self) -> int:
        tokens = self.prebuilt[self.next_prebuilt % PREBUILT_PROMPTS]
        self.next_prebuilt += 1
        return self._serve_request(tokens)

    def _serve_request(self, tokens: np.ndarray) -> int:
        try:
            request = self.cache.begin(tokens)
        except OutOfBlocksError:
            self.out_of_blocks += 1
            return 0
        self.cache.commit(request, len(tokens))
        self.cache.finish(request)
        self.requests_done += 1
        return 1

    def step_calls(self) -> int:
        cache = self.cache
        tokens = self._request_tokens()
        rid = f"s{self.next_request}"
        cache.add_request(rid, tokens)
        try:
            done = 0
            while done < len(tokens):
                chunk = min(CHUNK_TOKENS, len(tokens) - done)
                slots = cache.allocate_slots(rid, chunk)
                done = slots.num_computed_tokens + chunk
                cache.commit(rid, done)
            for step in range(DECODE_STEPS):
                cache.append_tokens(rid, [step])
                cache.allocate_slots(rid, 1)
                cache.commit(rid, done + step + 1)
        except OutOfBlocksError:
            self.out_of_blocks += 1
            return 0
        finally:
            cache.finish(rid)
        self.requests_done += 1
        return 1


def _gil_held_shares(work: Workload) -> dict[str, dict[str, float]]:
    """The part of each task that holds the GIL, on one thread's CPU clock (the machine's load
    does not enter). Held: the Python around the calls, the conversion of the token ids
    (`as_token_ids`: one `tobytes` copy) and each call's entry and exit, timed as the same calls
    on a one-block prompt, whose released work is one block's. Released: the rest of the task.
    An upper bound on the held share (the one-block calls' own work counts as held)."""
    from common import median_ns

    from prefixkv.cache import as_token_ids, key_extras

    NO_EXTRAS = key_extras()

    cache = work.cache
    core = cache._core
    one_block = work.pool[:BLOCK_SIZE]
    probe = work.probes[-1]  # half cached: a 16k-token prompt

    def small_cycle() -> None:
        request = cache.begin(one_block)
        cache.commit(request, BLOCK_SIZE)
        cache.finish(request)

    def request_python() -> None:
        as_token_ids(work._request_tokens())

    probe_list = probe.tolist()
    parts = {
        "router lookup (16k tokens, half cached)": (
            [lambda: as_token_ids(probe), lambda: cache.lookup(one_block)],
            lambda: cache.lookup(probe),
        ),
        # vLLM keeps token ids in lists: the core reads each int object, with the GIL held,
        # inside the call (`rust/py/src/convert.rs`): that read is the hash floor of the list
        # less the hash floor of the same ids as bytes.
        "router lookup of the same prompt as a list": (
            [
                lambda: core.hash_prompt(probe_list, NO_EXTRAS),
                lambda: cache.lookup(one_block),
            ],
            lambda: cache.lookup(probe_list),
        ),
        "scheduler begin/commit/finish (4k-16k tokens)": (
            [request_python, small_cycle],
            work.begin_commit_finish,
        ),
        "scheduler begin/commit/finish, prompts built before": (
            [lambda: as_token_ids(work.prebuilt[0]), small_cycle],
            work.begin_commit_finish_prebuilt,
        ),
    }
    unpacked = as_token_ids(probe)
    list_hashing = median_ns(lambda: core.hash_prompt(unpacked, NO_EXTRAS), repeats=15, number=5)
    out = {}
    for name, (held_parts, whole) in parts.items():
        held = sum(median_ns(part, repeats=15, number=5) for part in held_parts)
        if "as a list" in name:
            held -= list_hashing  # the released hashing in the list's floor call
        total = median_ns(whole, repeats=15, number=3)
        out[name] = {"held_us": held / 1000, "total_us": total / 1000, "share": held / total}
    return out


def _decode_step_ns() -> dict[str, float]:
    """What keeping the GIL protects: one decode step's calls on one thread (CPU time), which
    stay attached (`gil.rs`); `commit` asks the core how far the request had computed first."""
    from common import median_ns

    cache = PrefixCache(2048, block_size=BLOCK_SIZE, core="blocks")
    tokens = np.arange(4096, dtype=np.int64)
    cache.add_request("decode", tokens)
    cache.allocate_slots("decode", len(tokens))
    cache.commit("decode", len(tokens))
    position = [len(tokens)]

    def step() -> None:
        cache.append_tokens("decode", [position[0] % 1000])
        cache.allocate_slots("decode", 1)
        position[0] += 1
        cache.commit("decode", position[0])

    out = {
        "step_ns": median_ns(step, repeats=15, number=200),
        "commit_ns": median_ns(lambda: cache.commit("decode", position[0]), repeats=15, number=500),
    }
    cache.finish("decode")
    return out


def _holds_the_gil() -> int:
    x = 0
    for i in range(5000):
        x += i
    return 1


_BUFFER = bytes(256 * 1024)
#: About 5 µs of SHA-256 here: the GIL released for as long as a router's lookup releases it.
_SHORT_BUFFER = bytes(8 * 1024)


def _releases_the_gil() -> int:
    hashlib.sha256(_BUFFER).digest()
    return 1


def _releases_the_gil_briefly() -> int:
    hashlib.sha256(_SHORT_BUFFER).digest()
    return 1


def _pair_speedup(
    first: Task, second: Task, seconds: float
) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """(speedup, solo phases, together phase) of two tasks: each alone on one thread, then
    both at once; speedup = sum over the tasks of rate together ÷ rate alone."""
    alone = [_phase([task], seconds) for task in (first, second)]
    together = _phase([first, second], seconds)
    speedup = sum(
        both / solo["rates"][0] for both, solo in zip(together["rates"], alone, strict=True)
    )
    return speedup, {"first": alone[0], "second": alone[1]}, together


def run(quick: bool = False) -> dict[str, Any]:
    # Short phases, many rounds: the two solo phases and the together phase of a pair run back
    # to back, so load that changes over seconds touches all three alike.
    seconds = 0.3 if quick else 0.4
    rounds = 4 if quick else 15
    work = Workload()
    # The control's second cache: same shapes, nothing shared with `work`.
    other = Workload(seed=5)
    # The same on the cache on runs of blocks (lookups lock-free beside its writer's lock).
    runs = Workload(core="runs")
    pairs: dict[str, tuple[Task, Task]] = {
        "router lookup + scheduler begin/commit/finish": (work.probe, work.begin_commit_finish),
        "router lookup + scheduler begin/commit/finish, prompts built before": (
            work.probe,
            work.begin_commit_finish_prebuilt,
        ),
        "control: the same two tasks, each on its own cache": (
            work.probe,
            other.begin_commit_finish,
        ),
        "router lookup + scheduler step calls (vLLM-shaped)": (work.probe, work.step_calls),
        f"router lookup_many ({PROBE_BATCH} a call) + scheduler begin/commit/finish": (
            work.probe_batch,
            work.begin_commit_finish,
        ),
        f"router lookup_many ({PROBE_BATCH} a call) + scheduler begin/commit/finish, "
        "prompts built before": (work.probe_batch, work.begin_commit_finish_prebuilt),
        f"router lookup_many ({PROBE_BATCH} a call) + scheduler step calls (vLLM-shaped)": (
            work.probe_batch,
            work.step_calls,
        ),
        f"router lookup_many ({PROBE_BATCH} a call) + scheduler begin/commit/finish, prompts "
        'built before, core="runs"': (runs.probe_batch, runs.begin_commit_finish_prebuilt),
        f"router lookup_many ({LARGE_PROBE_BATCH} a call) + scheduler begin/commit/finish, "
        "prompts built before": (
            work.prober(LARGE_PROBE_BATCH),
            work.begin_commit_finish_prebuilt,
        ),
        'router lookup + scheduler begin/commit/finish, core="runs"': (
            runs.probe,
            runs.begin_commit_finish,
        ),
        'router lookup + scheduler step calls (vLLM-shaped), core="runs"': (
            runs.probe,
            runs.step_calls,
        ),
        "control: two threads releasing the GIL (hashlib, 256 KiB)": (
            _releases_the_gil,
            _releases_the_gil,
        ),
        SHORT_CONTROL: (_releases_the_gil_briefly, _releases_the_gil_briefly),
        "control: two threads holding the GIL (Python loop)": (_holds_the_gil, _holds_the_gil),
    }
    # Warm up: first-touch of the pool's pages and the table's growth are not throughput.
    for first, second in pairs.values():
        _phase([first, second], seconds / 2)
    per_round: list[dict[str, Any]] = []
    for r in range(rounds):
        load = os.getloadavg()[0]
        names = list(pairs)
        # Alternate the order so a load change within a round does not always hit the same pair.
        if r % 2:
            names.reverse()
        row: dict[str, Any] = {"load_average": load, "pairs": {}}
        for name in names:
            speedup, alone, together = _pair_speedup(*pairs[name], seconds)
            row["pairs"][name] = {"speedup": speedup, "alone": alone, "together": together}
        per_round.append(row)
        summary = ", ".join(f"{row['pairs'][name]['speedup']:.2f}×" for name in pairs)
        print(f"  threads round {r + 1}/{rounds} (load {load:.1f}): {summary}", flush=True)
    held = _gil_held_shares(work)
    decode = _decode_step_ns()
    work.close()
    other.close()
    runs.close()
    free = "control: two threads releasing the GIL (hashlib, 256 KiB)"
    configs: dict[str, Any] = {}
    for name in pairs:
        ratios = [row["pairs"][name]["speedup"] for row in per_round]
        normalised = [
            row["pairs"][name]["speedup"] / row["pairs"][free]["speedup"] for row in per_round
        ]
        over_short = [
            row["pairs"][name]["speedup"] / row["pairs"][SHORT_CONTROL]["speedup"]
            for row in per_round
        ]
        together = [row["pairs"][name]["together"] for row in per_round]
        alone = [row["pairs"][name]["alone"] for row in per_round]
        configs[name] = {
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratio_per_round": ratios,
            "ratio_over_free_control": statistics.median(normalised),
            "ratio_over_short_control": statistics.median(over_short),
            "cores_alone": statistics.median(
                (a["first"]["cores"] + a["second"]["cores"]) / 2 for a in alone
            ),
            "cores_together": statistics.median(t["cores"] for t in together),
            "first_alone_per_second": statistics.median(a["first"]["rates"][0] for a in alone),
            "second_alone_per_second": statistics.median(a["second"]["rates"][0] for a in alone),
            "first_together_per_second": statistics.median(t["rates"][0] for t in together),
            "second_together_per_second": statistics.median(t["rates"][1] for t in together),
            # Each thread's work per CPU-second together ÷ alone, in the same round: below 1.0
            # when the two threads slow each other down while both run (shared data, the
            # memory system, a lock's cache line), whatever CPU the load left them.
            "efficiency_together": [
                statistics.median(
                    row["pairs"][name]["together"]["per_cpu_second"][i]
                    / row["pairs"][name]["alone"][which]["per_cpu_second"][0]
                    for row in per_round
                )
                for i, which in enumerate(("first", "second"))
            ],
        }
    loads = [row["load_average"] for row in per_round]
    return {
        "interpreter": interpreter(),
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_per_round": loads,
        "load_average_before": loads[0],
        "load_average_after": os.getloadavg()[0],
        "scheduler_requests": work.requests_done,
        "scheduler_out_of_blocks": work.out_of_blocks,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "gil_held": held,
        "decode_step": decode,
        "configs": configs,
    }


def interpreter() -> dict[str, Any]:
    """This interpreter: its version and whether the GIL is off (a free-threaded build that
    kept it off after importing prefixkv and numpy)."""
    gil_enabled = getattr(sys, "_is_gil_enabled", lambda: True)()
    return {
        "implementation": platform.python_implementation(),
        "version": platform.python_version(),
        "free_threaded": not gil_enabled,
    }


def interpreter_name(info: dict[str, Any]) -> str:
    """'CPython 3.13.5, free-threaded (no GIL)' or 'CPython 3.11.7, with the GIL'."""
    mode = "free-threaded (no GIL)" if info["free_threaded"] else "with the GIL"
    return f"{info['implementation']} {info['version']}, {mode}"


class InterpreterFailed(RuntimeError):
    """The section's run in another interpreter exited with an error (its stderr's end is in
    the message)."""


def check_interpreter(python: str) -> str:
    """The absolute path of `python` (a relative one is read from the current directory), once
    it is shown to be a free-threaded interpreter whose GIL stays off with prefixkv and numpy
    imported (an extension built for the GIL turns it back on); `InterpreterFailed`, naming
    it, otherwise. `python benches/run.py` calls this before its first section, so that a bad
    `PREFIXKV_FREE_THREADED_PYTHON` costs no run."""
    python = os.path.abspath(python)
    try:
        probe = subprocess.run(
            [python, "-c", _GIL_PROBE], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError as exc:
        raise InterpreterFailed(f"{python} cannot be run: {exc}") from exc
    if probe.returncode != 0 or probe.stdout.strip() != "off":
        said = probe.stdout.strip() or probe.stderr.strip()[-500:]
        raise InterpreterFailed(
            f"{python} is not a free-threaded interpreter whose GIL stays off with prefixkv and "
            f"numpy imported ({said}); build one as docs/release.md says"
        )
    return python


def run_in(python: str, quick: bool = False) -> dict[str, Any]:
    """`run` in the interpreter at `python` (its own process, its own prefixkv and numpy): what
    `python benches/run.py` calls for `PREFIXKV_FREE_THREADED_PYTHON`. Checked first
    (`check_interpreter`), before any benchmark runs."""
    python = check_interpreter(python)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "threads.json"
        command = [python, str(Path(__file__).resolve()), "--json", str(out)]
        if quick:
            command.append("--quick")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise InterpreterFailed(
                f"{python} benches/bench_threads.py exited with {done.returncode}: "
                f"{done.stderr[-2000:].strip()}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    if not result["interpreter"]["free_threaded"]:
        raise InterpreterFailed(f"{python} turned its GIL on during the run")
    return result


#: Prints "off" when this interpreter's GIL stays off with what the section imports (this
#: module imports numpy and prefixkv; run in benches/, where it is found).
_GIL_PROBE = (
    "import bench_threads; print('off' if bench_threads.interpreter()['free_threaded'] else 'on')"
)


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, c in result["configs"].items():
        rows.append(
            [
                name,
                f"{c['first_alone_per_second']:,.0f} / {c['second_alone_per_second']:,.0f}",
                f"{c['first_together_per_second']:,.0f} / {c['second_together_per_second']:,.0f}",
                f"{c['ratio']:.2f}× ({c['ratio_min']:.2f}–{c['ratio_max']:.2f})",
                f"{c['ratio_over_free_control']:.2f}",
                f"{c['ratio_over_short_control']:.2f}" if "ratio_over_short_control" in c else "–",
                f"{c['cores_alone']:.2f} → {c['cores_together']:.2f}",
                " / ".join(f"{e:.2f}" for e in c["efficiency_together"]),
            ]
        )
    loads = result["load_average_per_round"]
    # Runs saved before the interpreter was recorded ran on the GIL build.
    info = result.get("interpreter")
    note = f"Interpreter: {interpreter_name(info)}. " if info else ""
    note += (
        f"{result['rounds']} rounds × {result['seconds_per_phase']} s per phase, alternating; "
        f"{result['cpus']} CPUs shared with other processes; 1-minute load average "
        f"{min(loads):.1f}–{max(loads):.1f} over the rounds (median {statistics.median(loads):.1f}); "
        f"OMP_NUM_THREADS={result['omp_num_threads']}. *speedup*: rate together ÷ rate alone, "
        "summed over the two threads (2.0: both at full speed; median over rounds, range in "
        "brackets). *÷ control*: the speedup divided by the GIL-releasing control's in the same "
        "round (what the machine's load let two threads reach), median over rounds; *÷ 5 µs "
        "control*: the same against the control whose calls release the GIL for ~5 µs, as long "
        "as a lookup does (what the interpreter lets two threads reach at that grain). *cores*: "
        "CPU seconds the process got per wall second, one thread alone (mean of the two) → both "
        "threads together; with two idle cores it would go from 1 to 2. *work per CPU-second*: "
        "each thread's work per second of its own CPU time together ÷ alone (median over "
        "rounds): 1.00 when running beside the other thread did not slow it while it had a "
        "core; it does not depend on how much CPU the load left the process.\n"
    )
    held = (
        "Python-side part (the GIL-held part on a GIL build)"
        if info and info["free_threaded"]
        else "GIL held"
    )
    for name, g in result["gil_held"].items():
        note += (
            f"\n{held} of one {name}, single thread, thread CPU time: {g['held_us']:.1f} of "
            f"{g['total_us']:.1f} µs ({g['share']:.0%}, an upper bound)."
        )
    if "decode_step" in result:
        d = result["decode_step"]
        note += (
            f"\nOne decode step (append_tokens + allocate_slots + commit of one token, GIL kept): "
            f"{d['step_ns']:,.0f} ns; a commit that publishes nothing: {d['commit_ns']:,.0f} ns "
            "(thread CPU time)."
        )
    note += "\n"
    return (
        note
        + "\n"
        + md_table(
            [
                "thread pair",
                "alone /s (each)",
                "together /s (each)",
                "speedup",
                "÷ control",
                "÷ 5 µs control",
                "cores alone → together",
                "work per CPU-second together ÷ alone (each)",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.quick)
    if args.json:
        from common import write_json

        write_json(args.json, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
