"""The cache on runs of blocks (issue 24, `PrefixCache(core="runs")`) on the production trace.

`prefixkv_core::run_cache` is the cache whose unit is a run of blocks (`benches/PROFILE.md`,
rounds 18-21). ``PrefixCache(core="runs")`` serves it through the public API; this replay times
it beside the default core on the same requests, two ways:

- *request*: every request of `production_workload.py`'s trace (numpy int64 ids) as
  ``begin`` + ``commit(all prompt tokens)`` + ``finish``, as `bench_production.py` times it;
- *steps*: the same requests as a vLLM-style scheduler drives them, under its own ids:
  ``add_request``, ``start_position``, ``allocate_slots`` + ``commit`` per chunk of
  `CHUNK` tokens (a chunked prefill), then `DECODE` decode steps (``append_tokens`` of one
  token, ``allocate_slots(1)``, ``commit``), ``finish``.

In alternating order; both cores must give the same cached tokens and the same block table on
every request, or the run fails. With ``--sglang-python`` SGLang's radix cache replays the same
trace (`peer_sglang.py`, one pass whole and one with its compiled core's calls timed alone), so
the ratios to the peer come from one run. Figures: mean, p50 and p99 of each side's CPU time
per request, after the warm-up tenth.

    python benches/bench_run_cache.py [--quick] [--sglang-python PY] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_ratio, gc_paused, machine, md_table, peer_npz, stats_us, write_json
from common import now as clock
from production_workload import BLOCK_SIZE, TraceParams, production_trace
from workloads import HitMismatch

from prefixkv import PrefixCache

WARMUP_FRACTION = 0.1


#: Prefill chunk and decode steps of the step-shaped replay.
CHUNK = 2048
DECODE = 8


def _request(cache: PrefixCache, tokens: np.ndarray, _rid: str) -> tuple[int, Any]:
    start = clock()
    request = cache.begin(tokens)
    cache.commit(request, request.num_prompt_tokens)
    cache.finish(request)
    return clock() - start, (request.num_cached_tokens, request.block_table)


def _steps(cache: PrefixCache, tokens: np.ndarray, rid: str) -> tuple[int, Any]:
    start = clock()
    cache.add_request(rid, tokens)
    n = len(tokens)
    computed = cache.start_position(rid)
    cached = None
    while computed < n:
        slots = cache.allocate_slots(rid, min(CHUNK, n - computed))
        if cached is None:
            cached = slots.num_cached_tokens
        computed = slots.num_computed_tokens + min(CHUNK, n - slots.num_computed_tokens)
        cache.commit(rid, computed)
    for step in range(DECODE):
        cache.append_tokens(rid, [step])
        cache.allocate_slots(rid, 1)
        computed += 1
        cache.commit(rid, computed)
    table = cache.block_table(rid)
    cache.finish(rid)
    return clock() - start, (cached, table)


def replay(quick: bool, seed: int, shape: str) -> dict[str, Any]:
    params = TraceParams().scaled(0.2) if quick else TraceParams()
    trace = production_trace(params, seed=seed)
    num_blocks = trace.num_blocks()
    run = _request if shape == "request" else _steps
    sides = {
        "prefixkv": PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="blocks"),
        "runs": PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="runs"),
    }
    names = list(sides)
    ns: dict[str, list[int]] = {name: [] for name in names}
    warmup = int(WARMUP_FRACTION * trace.num_requests)
    with gc_paused():
        for index, request in enumerate(trace.requests()):
            results = {}
            for k in range(len(names)):
                name = names[(index + k) % len(names)]
                # Each side gets the prompt as a fresh array built outside its timed calls,
                # as SGLang's replay gets a fresh `array("q")` (`peer_sglang.py`): read from
                # the session's array, last touched thousands of requests before, the first
                # side to run would pay its DRAM reads (~6 µs for 12k tokens) and the other not.
                results[name] = run(sides[name], request.tokens.copy(), f"r{index}")
            ours, runs = results["prefixkv"][1], results["runs"][1]
            if ours != runs:
                raise HitMismatch(
                    f"request {index} ({shape}): the default core cached {ours[0]} tokens, "
                    f"core='runs' {runs[0]}, or their block tables differ"
                )
            if index >= warmup:
                for name in names:
                    ns[name].append(results[name][0])
    return {
        "trace": trace,
        "warmup": warmup,
        "us": {name: stats_us(np.array(v, dtype=np.int64)) for name, v in ns.items()},
    }


#: The hot prompt's pools (blocks): its cost per request must not grow with the pool.
HOT_POOLS = (8192, 65536)
HOT_TOKENS = 32


def hot_prompt(quick: bool) -> dict[str, dict[str, float]]:
    """One short prompt served again and again, each time a full hit whose last block is
    recomputed: its copy stays a spare after the request, taken only once the free list is
    empty, so a pool of N blocks ends up holding ~N spares of one block (`PROFILE.md`, round
    22). Mean µs a request (wall clock, begin + commit + finish) over the requests after the
    free list ran out, per core and pool size."""
    out: dict[str, dict[str, float]] = {}
    prompt = np.arange(HOT_TOKENS, dtype=np.int64)
    for core in ("blocks", "runs"):
        for pool in HOT_POOLS:
            pool = pool // 8 if quick else pool
            cache = PrefixCache(pool, block_size=BLOCK_SIZE, core=core)
            with gc_paused():
                for _ in range(pool):  # every free block taken once: spares from here on
                    request = cache.begin(prompt)
                    cache.commit(request, HOT_TOKENS)
                    cache.finish(request)
                timed = pool // 2
                start = time.perf_counter_ns()
                for _ in range(timed):
                    request = cache.begin(prompt)
                    cache.commit(request, HOT_TOKENS)
                    cache.finish(request)
                took = time.perf_counter_ns() - start
            out.setdefault(core, {})[str(pool)] = took / timed / 1e3
    return out


def sglang(sglang_python: str, quick: bool, seed: int, warmup: int) -> dict[str, Any]:
    """SGLang's whole request and its compiled core's calls alone, one pass each."""
    args = ["--seed", str(seed), *["--quick"] * quick, "--passes", "1"]
    data = peer_npz(sglang_python, "peer_sglang.py", *args)
    split = peer_npz(sglang_python, "peer_sglang.py", *args, "--core-split")
    total = sum(data[f"{phase}_ns"][warmup:] for phase in ("match", "alloc", "insert", "release"))
    return {
        "version": str(data["version"]),
        "total": stats_us(total),
        "core": stats_us(split["core_ns"][warmup:]),
    }


def markdown(result: dict[str, Any]) -> str:
    us, steps = result["us"], result["steps_us"]
    rows = [
        ["prefixkv `PrefixCache` (numpy ids), begin + commit + finish", us["prefixkv"]],
        ['`PrefixCache(core="runs")`, begin + commit + finish', us["runs"]],
        [f"`PrefixCache`, steps (chunks of {CHUNK:,}, {DECODE} decode steps)", steps["prefixkv"]],
        ['`PrefixCache(core="runs")`, steps', steps["runs"]],
    ]
    peer = result.get("sglang")
    if peer:
        rows += [
            [f"SGLang {peer['version']} radix cache, whole request", peer["total"]],
            ["SGLang's compiled tree core alone", peer["core"]],
        ]
    table = [[label, *(f"{s[k]:,.1f}" for k in ("mean", "p50", "p99"))] for label, s in rows]
    ratios = [
        ['default ÷ core="runs", begin + commit + finish', us["prefixkv"], us["runs"]],
        ['default ÷ core="runs", steps', steps["prefixkv"], steps["runs"]],
    ]
    if peer:
        ratios += [
            ['SGLang whole ÷ core="runs"', peer["total"], us["runs"]],
            ['SGLang\'s core ÷ core="runs"', peer["core"], us["runs"]],
            ["SGLang whole ÷ default core", peer["total"], us["prefixkv"]],
            ["SGLang's core ÷ default core", peer["core"], us["prefixkv"]],
        ]
    table += [
        [label, *(fmt_ratio(a[k] / b[k]) for k in ("mean", "p50", "p99"))] for label, a, b in ratios
    ]
    hot = result["hot_prompt"]
    pools = list(hot["blocks"])
    hot_table = [[f'core="{core}"', *(f"{hot[core][pool]:,.2f}" for pool in pools)] for core in hot]
    return (
        f"{result['requests']:,} requests, seed {result['seed']}, the first {result['warmup']:,} "
        f"untimed; the same cached tokens and block tables on every request, both ways; CPU "
        f"time; load average {result['load_before']:.2f} before, {result['load_after']:.2f} "
        "after.\n\n"
        + md_table(["per request", "mean µs", "p50 µs", "p99 µs"], table)
        + f"\n\nA hot {HOT_TOKENS}-token prompt served again and again once the free list is "
        "empty (each request's recomputed last block left as a spare), mean µs a request, wall "
        "clock:\n\n"
        + md_table(["core", *(f"pool of {int(pool):,} blocks" for pool in pools)], hot_table)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sglang-python",
        help="a Python with SGLang (default $PREFIXKV_SGLANG_PYTHON): its replay beside",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    raw = replay(args.quick, args.seed, "request")
    steps = replay(args.quick, args.seed, "steps")
    result: dict[str, Any] = {
        "seed": args.seed,
        "quick": args.quick,
        "requests": raw["trace"].num_requests,
        "warmup": raw["warmup"],
        "us": raw["us"],
        "steps": {"chunk": CHUNK, "decode": DECODE},
        "steps_us": steps["us"],
        "hot_prompt": hot_prompt(args.quick),
    }
    sglang_python = args.sglang_python or os.environ.get("PREFIXKV_SGLANG_PYTHON")
    if sglang_python:
        result["sglang"] = sglang(sglang_python, args.quick, args.seed, raw["warmup"])
    result["load_before"] = load_before
    result["load_after"] = os.getloadavg()[0]
    if args.json:
        write_json(args.json, {"machine": machine(), "result": result})
    print(markdown(result))


if __name__ == "__main__":
    main()
