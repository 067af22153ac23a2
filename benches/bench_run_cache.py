"""The cache on runs of blocks (issue 24, experimental) through the binding, on the production trace.

`prefixkv_core::run_cache` is the writer's half of the table whose unit is a run of blocks
(`benches/PROFILE.md`, rounds 18-20); the cache does not use it yet. `_core.CoreRunCache` binds
it with `CoreCache`'s conversions, so this replay times, through Python, what the request path
would cost on runs, where rounds 18-19 could only project it from the Rust replay.

Every request of `production_workload.py`'s trace (numpy int64 ids) goes, in alternating
order, through ``PrefixCache`` (begin + commit(all prompt tokens) + finish, as
`bench_production.py` times it) and through ``CoreRunCache`` behind the same Python steps
(`as_token_ids`, the key extras); both must return the same cached tokens and the same block
table on every request, or the run fails. With ``--sglang-python`` SGLang's radix cache replays
the same trace (`peer_sglang.py`, one pass whole and one with its compiled core's calls timed
alone), so the ratios to the peer come from one run. Figures: mean, p50 and p99 of each side's
CPU time per request, after the warm-up tenth.

    python benches/bench_run_cache.py [--quick] [--sglang-python PY] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt_ratio, gc_paused, machine, md_table, peer_npz, stats_us, write_json
from common import now as clock
from production_workload import BLOCK_SIZE, TraceParams, production_trace
from workloads import HitMismatch

from prefixkv import CacheContext, PrefixCache, _core
from prefixkv.cache import as_token_ids, key_extras

WARMUP_FRACTION = 0.1


class RunCache:
    """`_core.CoreRunCache` behind `PrefixCache.begin`'s Python steps, for a like-for-like time."""

    def __init__(self, num_blocks: int) -> None:
        context = CacheContext(block_size=BLOCK_SIZE)
        self._core = _core.CoreRunCache(num_blocks, BLOCK_SIZE, context.fingerprint())

    def begin(self, tokens: Any) -> _core.Request:
        return self._core.begin(as_token_ids(tokens), key_extras(), 0)

    def commit(self, request: _core.Request, num_computed_tokens: int) -> None:
        self._core.commit(request, num_computed_tokens)

    def finish(self, request: _core.Request) -> None:
        self._core.finish(request)


def _request(cache: Any, tokens: np.ndarray) -> tuple[int, _core.Request]:
    start = clock()
    request = cache.begin(tokens)
    cache.commit(request, request.num_prompt_tokens)
    cache.finish(request)
    return clock() - start, request


def replay(quick: bool, seed: int) -> dict[str, Any]:
    params = TraceParams().scaled(0.2) if quick else TraceParams()
    trace = production_trace(params, seed=seed)
    num_blocks = trace.num_blocks()
    sides = {
        "prefixkv": PrefixCache(num_blocks, block_size=BLOCK_SIZE),
        "runs": RunCache(num_blocks),
    }
    names = list(sides)
    ns: dict[str, list[int]] = {name: [] for name in names}
    warmup = int(WARMUP_FRACTION * trace.num_requests)
    with gc_paused():
        for index, request in enumerate(trace.requests()):
            results = {}
            for k in range(len(names)):
                name = names[(index + k) % len(names)]
                results[name] = _request(sides[name], request.tokens)
            ours, runs = results["prefixkv"][1], results["runs"][1]
            if (ours.num_cached_tokens, ours.block_table) != (
                runs.num_cached_tokens,
                runs.block_table,
            ):
                raise HitMismatch(
                    f"request {index}: PrefixCache cached {ours.num_cached_tokens} tokens, the "
                    f"run cache {runs.num_cached_tokens}, or their block tables differ"
                )
            if index >= warmup:
                for name in names:
                    ns[name].append(results[name][0])
    return {
        "trace": trace,
        "warmup": warmup,
        "us": {name: stats_us(np.array(v, dtype=np.int64)) for name, v in ns.items()},
    }


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
    us = result["us"]
    rows = [
        ["prefixkv `PrefixCache` (numpy ids)", us["prefixkv"]],
        ["the run cache `_core.CoreRunCache` (numpy ids, experimental)", us["runs"]],
    ]
    peer = result.get("sglang")
    if peer:
        rows += [
            [f"SGLang {peer['version']} radix cache, whole request", peer["total"]],
            ["SGLang's compiled tree core alone", peer["core"]],
        ]
    table = [[label, *(f"{s[k]:,.1f}" for k in ("mean", "p50", "p99"))] for label, s in rows]
    ratios = [["PrefixCache ÷ run cache", us["prefixkv"], us["runs"]]]
    if peer:
        ratios += [
            ["SGLang whole ÷ run cache", peer["total"], us["runs"]],
            ["SGLang's core ÷ run cache", peer["core"], us["runs"]],
            ["SGLang whole ÷ PrefixCache", peer["total"], us["prefixkv"]],
            ["SGLang's core ÷ PrefixCache", peer["core"], us["prefixkv"]],
        ]
    table += [
        [label, *(fmt_ratio(a[k] / b[k]) for k in ("mean", "p50", "p99"))] for label, a, b in ratios
    ]
    return (
        f"{result['requests']:,} requests, seed {result['seed']}, the first {result['warmup']:,} "
        f"untimed; the same cached tokens and block tables on every request; CPU time; load "
        f"average {result['load_before']:.2f} before, {result['load_after']:.2f} after.\n\n"
        + md_table(["per request", "mean µs", "p50 µs", "p99 µs"], table)
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
    raw = replay(args.quick, args.seed)
    result: dict[str, Any] = {
        "seed": args.seed,
        "quick": args.quick,
        "requests": raw["trace"].num_requests,
        "warmup": raw["warmup"],
        "us": raw["us"],
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
