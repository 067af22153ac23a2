"""Section 1c: a production-shaped replay (issue 24), prefixkv beside the plain-Python baseline.

The trace (`production_workload.py`): interleaved multi-turn chats and agent sessions whose
prompts grow turn by turn, shared system prefixes, prompts of a few hundred to ~190k tokens
(mean ~12k), through a cache of 1/10 of the trace's working set, so most requests evict.

Every request (numpy int64 token ids) goes, in a rotating order, through:

- ``prefixkv``: ``PrefixCache.begin`` + ``commit(all prompt tokens)`` + ``finish``, as in
  `bench_overhead.py`; and the same through a second cache with the prompt as a list of ints
  (built outside the timed calls); and once more through a third cache that times begin, commit
  and finish apart (its total is not used: each clock read is a ~0.6 µs system call, which the
  totals must not carry);
- the plain-Python block manager of `python_baseline.py` (same cycle, same pool size);
- the table-hash floor: ``as_token_ids`` + ``_core.hash_prompt``, the XXH3-128 table key of every
  full block and nothing else (see `bench_overhead.py`).

The caches must report the same cached-token count on every request (the run fails
otherwise): under this pressure that also checks that they evict the same blocks, since a
different victim changes a later hit. Figures are per request: mean, p50 and p99 of each
variant's CPU time (common.py's clock), the ratios prefixkv ÷ floor and Python ÷ prefixkv, and the
same by prompt length.

Peers, each replaying the same seeded trace in its own Python environment (a separate process):
``--vllm-python`` (`peer_vllm.py`: vLLM's `KVCacheManager`, which must cache the same tokens on
every request, or the run fails) and ``--sglang-python`` (`peer_sglang.py`: SGLang's
`UnifiedRadixCache` on its compiled tree core, which evicts whole radix nodes, so its hits are
reported beside prefixkv's with the share of requests that agree, never required equal).
SGLang replays the trace `PEER_PASSES` times (whole, and again with its core's calls timed),
and prefixkv alone as often (before and after SGLang's): beside the first pass's figures, each side's per-request least
time over its passes is compared too, so a few requests slowed in one pass (by the machine's
other load, or inside the peer) do not make the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    clock_name,
    fmt_ratio,
    gc_paused,
    machine,
    md_table,
    now,
    peer_npz,
    replay_alone,
    stats_us,
    time_request,
    time_request_phases,
    write_json,
)
from production_workload import BLOCK_SIZE, ProductionTrace, TraceParams, production_trace
from python_baseline import PyPrefixCache
from workloads import HitMismatch, least_over_passes

from prefixkv import PrefixCache
from prefixkv.cache import as_token_ids, key_extras

NO_EXTRAS = key_extras()
VARIANTS = ["prefixkv", "prefixkv_runs", "prefixkv_list", "python", "floor"]
#: Prompt-length bands of the per-length table (tokens, upper bounds).
BANDS = [4_096, 16_384, 65_536, 262_144]
#: The leading share of requests that fill the cold cache and are not timed.
WARMUP_FRACTION = 0.1
#: Replays of the trace, each from a fresh cache, for the least-of-passes comparison with
#: SGLang: a request's least time over them, on both sides.
PEER_PASSES = 3


def replay(trace: ProductionTrace) -> dict[str, Any]:
    """Replays `trace` through every variant; per-request samples, hits and evictions."""
    num_blocks = trace.num_blocks()
    ours = PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="blocks")
    ours_list = PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="blocks")
    # The cache on runs of blocks (issue 24): the same public calls, the same blocks.
    ours_runs = PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="runs")
    # The phases are timed on a third cache fed the same requests (so in the same state): a
    # clock read costs ~0.6 µs here (`thread_time_ns` is a system call), and two of them inside
    # `run_ours` would be charged to prefixkv's total and to nothing else.
    ours_phases = PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="blocks")
    theirs = PyPrefixCache(num_blocks, BLOCK_SIZE)
    floor_core = PrefixCache(16, block_size=BLOCK_SIZE, core="blocks")._core

    def run_ours(tokens: np.ndarray) -> tuple[int, int]:
        return time_request(ours, tokens)

    def run_phases(tokens: np.ndarray) -> tuple[int, int, int, int]:
        return time_request_phases(ours_phases, tokens)

    def run_ours_runs(tokens: np.ndarray) -> tuple[int, int]:
        return time_request(ours_runs, tokens)

    def run_ours_list(tokens: list[int]) -> tuple[int, int]:
        return time_request(ours_list, tokens)

    def run_theirs(tokens: np.ndarray) -> tuple[int, int]:
        return time_request(theirs, tokens)

    def run_floor(tokens: np.ndarray) -> tuple[int]:
        t0 = now()
        floor_core.hash_prompt(as_token_ids(tokens), NO_EXTRAS)
        return (now() - t0,)

    runners: dict[str, Any] = {
        "prefixkv": run_ours,
        "prefixkv_runs": run_ours_runs,
        "prefixkv_list": run_ours_list,
        "python": run_theirs,
        "floor": run_floor,
        "phases": run_phases,
    }
    warmup = int(WARMUP_FRACTION * trace.num_requests)
    ns: dict[str, list[int]] = {v: [] for v in VARIANTS}
    phases: dict[str, list[int]] = {"begin": [], "commit": [], "finish": []}
    lengths: list[int] = []
    cached: list[int] = []
    every_hit: list[int] = []
    kinds: list[str] = []
    evictions_before = (0, 0)
    all_prompt = all_cached = 0
    with gc_paused():
        for index, request in enumerate(trace.requests()):
            if index == warmup:
                evictions_before = (ours.stats().evictions, theirs.evictions)
            # Both forms are built outside the timed calls, fresh, as the peers' replays build
            # theirs (`peer_sglang.py`'s `array("q")`): an engine holding lists has the list.
            forms = {"numpy": request.tokens.copy(), "list": request.tokens.tolist()}
            order = [*VARIANTS, "phases"]
            shift = index % len(order)
            results = {
                name: runners[name](forms["list" if name.endswith("_list") else "numpy"])
                for name in order[shift:] + order[:shift]
            }
            hit = results["prefixkv"][1]
            if (
                not hit
                == results["prefixkv_runs"][1]
                == results["prefixkv_list"][1]
                == results["python"][1]
                == results["phases"][3]
            ):
                raise HitMismatch(
                    f"request {index} (session {request.session}, turn {request.turn}, "
                    f"{len(request.tokens)} tokens): prefixkv cached {hit} (numpy), "
                    f'{results["prefixkv_runs"][1]} (core="runs"), '
                    f"{results['prefixkv_list'][1]} (list), {results['phases'][3]} (phases' "
                    f"cache), Python {results['python'][1]}"
                )
            all_prompt += len(request.tokens)
            all_cached += hit
            every_hit.append(hit)
            if index < warmup:
                continue
            for name in VARIANTS:
                ns[name].append(results[name][0])
            for phase, value in zip(
                ("begin", "commit", "finish"), results["phases"][:3], strict=True
            ):
                phases[phase].append(value)
            lengths.append(len(request.tokens))
            cached.append(hit)
            kinds.append(request.kind)
    timed = len(lengths)
    evictions = (
        ours.stats().evictions - evictions_before[0],
        theirs.evictions - evictions_before[1],
    )
    return {
        "num_blocks": num_blocks,
        "working_set_blocks": trace.working_set_blocks(),
        "requests": trace.num_requests,
        "requests_timed": timed,
        "warmup": warmup,
        "hit_rate_all": all_cached / all_prompt,
        "every_hit": np.array(every_hit, dtype=np.int64),
        "ns": {k: np.array(v, dtype=np.int64) for k, v in ns.items()},
        "phases_ns": {k: np.array(v, dtype=np.int64) for k, v in phases.items()},
        "lengths": np.array(lengths, dtype=np.int64),
        "cached": np.array(cached, dtype=np.int64),
        "kinds": kinds,
        "evictions": evictions,
    }


def least_prefixkv_ns(
    trace: ProductionTrace, passes: int, every_hit: np.ndarray, core: str = "blocks"
) -> np.ndarray:
    """Per request, prefixkv's least time over `passes` replays of `trace` alone on the given
    `core` (`common.replay_alone`, `workloads.least_over_passes`), which must cache what
    `replay` cached (`every_hit`)."""
    least = least_over_passes(
        [replay_alone(trace, core) for _ in range(passes)], f"prefixkv alone, core={core!r}"
    )
    if not np.array_equal(least["cached"], every_hit):
        raise HitMismatch("a replay of prefixkv alone cached other tokens than the first")
    return least["total_ns"]


def summarize(raw: dict[str, Any], trace: ProductionTrace) -> dict[str, Any]:
    """The JSON-able figures of one replay."""
    lengths = raw["lengths"]
    cached = raw["cached"]
    timed = raw["requests_timed"]
    us = {name: stats_us(samples) for name, samples in raw["ns"].items()}
    ratio = {
        stat: {
            "prefixkv_vs_floor": us["prefixkv"][stat] / us["floor"][stat],
            "python_vs_prefixkv": us["python"][stat] / us["prefixkv"][stat],
            "list_vs_numpy": us["prefixkv_list"][stat] / us["prefixkv"][stat],
            "runs_vs_floor": us["prefixkv_runs"][stat] / us["floor"][stat],
            "prefixkv_vs_runs": us["prefixkv"][stat] / us["prefixkv_runs"][stat],
        }
        for stat in ("mean", "p50", "p99")
    }
    bands = []
    low = 0
    for high in BANDS:
        mask = (lengths > low) & (lengths <= high)
        if mask.any():
            band_us = {name: stats_us(s[mask]) for name, s in raw["ns"].items()}
            bands.append(
                {
                    "tokens": [low, high],
                    "requests": int(mask.sum()),
                    "mean_tokens": float(lengths[mask].mean()),
                    "hit_rate": float(cached[mask].sum() / lengths[mask].sum()),
                    "us": band_us,
                    "prefixkv_vs_floor_mean": band_us["prefixkv"]["mean"]
                    / band_us["floor"]["mean"],
                    "python_vs_prefixkv_mean": band_us["python"]["mean"]
                    / band_us["prefixkv"]["mean"],
                }
            )
        low = high
    kinds = np.array(raw["kinds"])
    return {
        "clock": clock_name(),
        "seed": trace.seed,
        "params": {k: v for k, v in vars(trace.params).items()},
        "sessions": len(trace.sessions),
        "requests": raw["requests"],
        "requests_timed": timed,
        "agent_request_share": float((kinds == "agent").mean()),
        "prompt_tokens": {
            "mean": float(lengths.mean()),
            "p50": float(np.percentile(lengths, 50)),
            "p99": float(np.percentile(lengths, 99)),
            "min": int(lengths.min()),
            "max": int(lengths.max()),
        },
        "cache_tokens": raw["num_blocks"] * BLOCK_SIZE,
        "working_set_tokens": raw["working_set_blocks"] * BLOCK_SIZE,
        "hit_rate": float(cached.sum() / lengths.sum()),
        "hit_rate_all_requests": raw["hit_rate_all"],
        "hit_rate_per_request_mean": float((cached / lengths).mean()),
        "hit_rate_by_kind": {
            kind: float(cached[kinds == kind].sum() / lengths[kinds == kind].sum())
            for kind in ("chat", "agent")
            if (kinds == kind).any()
        },
        "evictions_per_request": raw["evictions"][0] / timed,
        "python_evictions_per_request": raw["evictions"][1] / timed,
        "hits_identical": True,  # replay() raises HitMismatch otherwise
        "us": us,
        "prefixkv_phases_us": {k: stats_us(v) for k, v in raw["phases_ns"].items()},
        "ratios": ratio,
        "bands": bands,
    }


def vllm_peer(vllm_python: str, quick: bool, seed: int, raw: dict[str, Any]) -> dict[str, Any]:
    """Replays the same trace through vLLM's `KVCacheManager` in `vllm_python` (peer_vllm.py,
    a separate process: vLLM lives in its own environment) and compares hits request by request."""
    data = peer_npz(vllm_python, "peer_vllm.py", "--seed", str(seed), *["--quick"] * quick)
    ours = raw["every_hit"]
    if len(data["cached"]) != len(ours):
        raise HitMismatch(f"vLLM replayed {len(data['cached'])} requests, prefixkv {len(ours)}")
    differ = np.flatnonzero(data["cached"] != ours)
    if len(differ):
        first = int(differ[0])
        raise HitMismatch(
            f"request {first}: prefixkv cached {ours[first]}, vLLM {data['cached'][first]} "
            f"({len(differ)} requests differ)"
        )
    warmup = raw["warmup"]
    hashing, manager = data["hash_ns"][warmup:], data["manager_ns"][warmup:]
    total = hashing + manager
    ours_us = stats_us(raw["ns"]["prefixkv"])
    runs_us = stats_us(raw["ns"]["prefixkv_runs"])
    total_us = stats_us(total)
    return {
        "version": str(data["version"]),
        "hits_identical": True,
        "us": {
            "request_and_hashes": stats_us(hashing),
            "manager": stats_us(manager),
            "total": total_us,
        },
        "vllm_vs_prefixkv": {stat: total_us[stat] / ours_us[stat] for stat in ours_us},
        "vllm_vs_runs": {stat: total_us[stat] / runs_us[stat] for stat in runs_us},
    }


def _sglang_replay(sglang_python: str, quick: bool, seed: int, *extra: str) -> dict[str, Any]:
    return peer_npz(
        sglang_python, "peer_sglang.py", "--seed", str(seed), *["--quick"] * quick, *extra
    )


def sglang_peer(
    sglang_python: str, quick: bool, seed: int, raw: dict[str, Any], trace: ProductionTrace
) -> dict[str, Any]:
    """Replays the same trace through SGLang's radix cache in `sglang_python` (peer_sglang.py,
    a separate process) and compares its hits with prefixkv's: SGLang evicts whole radix nodes
    where prefixkv evicts blocks, so the hits may differ; reported, not required equal.

    A second replay (`--core-split`) times the compiled tree core's calls alone; its wrapper
    costs a Python call per core call, so that pass gives the core's time, not the totals. A
    third runs SGLang's pure-Python tree core (`--tree-core python`) for comparison."""
    ours = raw["every_hit"]
    # prefixkv's passes alone come before and after SGLang's (which runs its own in a row), so
    # a slow stretch of the shared machine cannot fall on one side alone.
    ours_least = least_prefixkv_ns(trace, PEER_PASSES - 1, ours)
    runs_least = least_prefixkv_ns(trace, PEER_PASSES - 1, ours, core="runs")
    passes = ("--passes", str(PEER_PASSES))
    data = _sglang_replay(sglang_python, quick, seed, *passes)
    split = _sglang_replay(sglang_python, quick, seed, "--core-split", *passes)
    python_core = _sglang_replay(sglang_python, quick, seed, "--tree-core", "python")
    ours_least = np.minimum(ours_least, least_prefixkv_ns(trace, 1, ours))[raw["warmup"] :]
    runs_least = np.minimum(runs_least, least_prefixkv_ns(trace, 1, ours, core="runs"))[
        raw["warmup"] :
    ]
    theirs = data["cached"]
    if len(theirs) != len(ours):
        raise HitMismatch(f"SGLang replayed {len(theirs)} requests, prefixkv {len(ours)}")
    if not np.array_equal(split["cached"], theirs):
        raise HitMismatch("SGLang's two replays of one trace cached different tokens")
    warmup = raw["warmup"]
    lengths = trace.prompt_lengths()
    phases = {name: data[f"{name}_ns"][warmup:] for name in ("match", "alloc", "insert", "release")}
    total = phases["match"] + phases["alloc"] + phases["insert"] + phases["release"]
    core = split["core_ns"][warmup:]
    python_total = sum(python_core[f"{name}_ns"][warmup:] for name in phases)
    ours_ns = raw["ns"]["prefixkv"]
    ours_us = stats_us(ours_ns)
    runs_us = stats_us(raw["ns"]["prefixkv_runs"])
    total_us = stats_us(total)
    core_us = stats_us(core)
    python_us = stats_us(python_total)
    timed_lengths = lengths[warmup:]

    def hit_rates(cached: np.ndarray) -> dict[str, float]:
        return {
            "timed": float(cached[warmup:].sum() / timed_lengths.sum()),
            "all_requests": float(cached.sum() / lengths.sum()),
            "per_request_mean": float((cached[warmup:] / timed_lengths).mean()),
        }

    bands = []
    low = 0
    for high in BANDS:
        mask = (timed_lengths > low) & (timed_lengths <= high)
        if mask.any():
            bands.append(
                {
                    "tokens": [low, high],
                    "requests": int(mask.sum()),
                    "hit_rate": float(theirs[warmup:][mask].sum() / timed_lengths[mask].sum()),
                    "prefixkv_hit_rate": float(
                        ours[warmup:][mask].sum() / timed_lengths[mask].sum()
                    ),
                    "us_mean": float(total[mask].mean()) / 1e3,
                    "core_us_mean": float(core[mask].mean()) / 1e3,
                    "prefixkv_us_mean": float(ours_ns[mask].mean()) / 1e3,
                }
            )
        low = high
    # Least of PEER_PASSES replays on both sides: a few requests slowed by the machine's other
    # load (or a peer's own hiccup) can make one replay's mean (PROFILE.md, round 16).
    least_us = {
        "prefixkv": stats_us(ours_least),
        "runs": stats_us(runs_least),
        "total": stats_us(data["least_total_ns"][warmup:]),
        "core": stats_us(split["least_core_ns"][warmup:]),
    }
    least = {
        "passes": PEER_PASSES,
        "us": least_us,
        "sglang_vs_prefixkv": {
            stat: least_us["total"][stat] / value for stat, value in least_us["prefixkv"].items()
        },
        "core_vs_prefixkv": {
            stat: least_us["core"][stat] / value for stat, value in least_us["prefixkv"].items()
        },
        "sglang_vs_runs": {
            stat: least_us["total"][stat] / value for stat, value in least_us["runs"].items()
        },
        "core_vs_runs": {
            stat: least_us["core"][stat] / value for stat, value in least_us["runs"].items()
        },
    }
    return {
        "least": least,
        "version": str(data["version"]),
        "backend": str(data["backend"]),
        "torch": str(data["torch"]),
        "hit_rate": hit_rates(theirs),
        "prefixkv_hit_rate": hit_rates(ours),
        "requests_equal": float((theirs == ours).mean()),
        "requests_equal_timed": float((theirs[warmup:] == ours[warmup:]).mean()),
        "evicted_pages_per_request": float(data["evicted_tokens"][warmup:].mean()) / BLOCK_SIZE,
        "us": {
            "total": total_us,
            **{name: stats_us(v) for name, v in phases.items()},
            "core": core_us,
            "python_core": python_us,
        },
        "python_core_backend": str(python_core["backend"]),
        "python_core_same_hits": float((python_core["cached"] == theirs).mean()),
        "sglang_vs_prefixkv": {stat: total_us[stat] / ours_us[stat] for stat in ours_us},
        "core_vs_prefixkv": {stat: core_us[stat] / ours_us[stat] for stat in ours_us},
        "sglang_vs_runs": {stat: total_us[stat] / runs_us[stat] for stat in runs_us},
        "core_vs_runs": {stat: core_us[stat] / runs_us[stat] for stat in runs_us},
        "python_core_vs_prefixkv": {stat: python_us[stat] / ours_us[stat] for stat in ours_us},
        "bands": bands,
    }


def run(
    quick: bool = False,
    seed: int = 0,
    vllm_python: str | None = None,
    sglang_python: str | None = None,
) -> dict[str, Any]:
    """`vllm_python` / `sglang_python`: a Python with vLLM / SGLang for the peer replays
    (default: $PREFIXKV_VLLM_PYTHON / $PREFIXKV_SGLANG_PYTHON, else none)."""
    params = TraceParams().scaled(0.2) if quick else TraceParams()
    trace = production_trace(params, seed=seed)
    load = os.getloadavg()[0]
    raw = replay(trace)
    result = summarize(raw, trace)
    vllm_python = vllm_python or os.environ.get("PREFIXKV_VLLM_PYTHON")
    if vllm_python:
        result["vllm"] = vllm_peer(vllm_python, quick, seed, raw)
    sglang_python = sglang_python or os.environ.get("PREFIXKV_SGLANG_PYTHON")
    if sglang_python:
        result["sglang"] = sglang_peer(sglang_python, quick, seed, raw, trace)
    result["quick"] = quick
    result["load_average_before"] = load
    result["load_average_after"] = os.getloadavg()[0]
    return result


def markdown(result: dict[str, Any]) -> str:
    pt = result["prompt_tokens"]
    kinds = ", ".join(f"{k} {v:.1%}" for k, v in result["hit_rate_by_kind"].items())
    out = [
        f"{result['sessions']:,} sessions, {result['requests']:,} requests "
        f"({result['agent_request_share']:.0%} agent calls), seed {result['seed']}; the first "
        f"{result['requests'] - result['requests_timed']:,} fill the cache and are not timed. "
        f"Timed prompts: mean {pt['mean']:,.0f} tokens, p50 {pt['p50']:,.0f}, p99 "
        f"{pt['p99']:,.0f}, {pt['min']:,}–{pt['max']:,}. Cache {result['cache_tokens'] / 1e6:.2f}M "
        f"tokens, working set {result['working_set_tokens'] / 1e6:.1f}M. Hit rate (cached ÷ "
        f"prompt tokens) {result['hit_rate']:.1%} ({kinds}; mean per request "
        f"{result['hit_rate_per_request_mean']:.1%}); {result['evictions_per_request']:.0f} "
        f"evictions per request (Python baseline {result['python_evictions_per_request']:.0f}); "
        f"prefixkv{', the Python baseline and vLLM' if 'vllm' in result else ' and the Python baseline'} reported the "
        "same cached tokens on every request. "
        f"µs of {result['clock']} time per request; load average "
        f"{result['load_average_before']:.1f} before, {result['load_average_after']:.1f} after. "
        '*prefixkv* is the block core (`core="blocks"`); *core="runs"* the run core, which '
        '`PrefixCache()` runs on by default (`core="auto"`, round 29).\n',
    ]
    rows = []
    for name, label in [
        ("prefixkv", "prefixkv (numpy)"),
        ("prefixkv_runs", 'prefixkv core="runs" (numpy)'),
        ("prefixkv_list", "prefixkv (list)"),
        ("python", "Python baseline (numpy)"),
        ("floor", "table-hash floor (numpy)"),
    ]:
        s = result["us"][name]
        rows.append([label, f"{s['mean']:,.1f}", f"{s['p50']:,.1f}", f"{s['p99']:,.1f}"])
    for key, label in [
        ("prefixkv_vs_floor", "prefixkv ÷ floor"),
        ("python_vs_prefixkv", "Python ÷ prefixkv"),
        ("list_vs_numpy", "prefixkv list ÷ numpy"),
        ("runs_vs_floor", 'core="runs" ÷ floor'),
        ("prefixkv_vs_runs", 'prefixkv ÷ core="runs"'),
    ]:
        rows.append(
            [label, *(fmt_ratio(result["ratios"][stat][key]) for stat in ("mean", "p50", "p99"))]
        )
    peer = result.get("vllm")
    if peer:
        for key, label in [
            ("total", f"vLLM {peer['version']} KVCacheManager, whole request"),
            ("request_and_hashes", "… of which Request() with its block hashes"),
            ("manager", "… of which get_computed_blocks + allocate_slots + free"),
        ]:
            s = peer["us"][key]
            rows.append([label, f"{s['mean']:,.1f}", f"{s['p50']:,.1f}", f"{s['p99']:,.1f}"])
        for key, label in [
            ("vllm_vs_prefixkv", "vLLM ÷ prefixkv"),
            ("vllm_vs_runs", 'vLLM ÷ core="runs"'),
        ]:
            rows.append([label, *(fmt_ratio(peer[key][stat]) for stat in ("mean", "p50", "p99"))])
    sglang = result.get("sglang")
    if sglang:
        for key, label in [
            (
                "total",
                f"SGLang {sglang['version']} UnifiedRadixCache ({sglang['backend']}), whole request",
            ),
            ("match", "… of which match_prefix + lock"),
            ("alloc", "… of which evict + alloc"),
            ("insert", "… of which insert + relock"),
            ("release", "… of which free tail + unlock"),
            ("core", "SGLang's compiled tree core alone (its calls, second pass)"),
            (
                "python_core",
                f"SGLang on its Python tree core ({sglang['python_core_backend']}), whole request",
            ),
        ]:
            s = sglang["us"][key]
            rows.append([label, f"{s['mean']:,.1f}", f"{s['p50']:,.1f}", f"{s['p99']:,.1f}"])
        for key, label in [
            ("sglang_vs_prefixkv", "SGLang ÷ prefixkv"),
            ("core_vs_prefixkv", "SGLang's core alone ÷ prefixkv"),
            ("python_core_vs_prefixkv", "SGLang on its Python tree core ÷ prefixkv"),
            ("sglang_vs_runs", 'SGLang ÷ core="runs"'),
            ("core_vs_runs", 'SGLang\'s core alone ÷ core="runs"'),
        ]:
            rows.append([label, *(fmt_ratio(sglang[key][stat]) for stat in ("mean", "p50", "p99"))])
        least = sglang["least"]
        passes = least["passes"]
        for key, label in [
            ("prefixkv", f"prefixkv (numpy), least of {passes} passes"),
            ("runs", f'prefixkv core="runs" (numpy), least of {passes} passes'),
            ("total", f"SGLang, whole request, least of {passes} passes"),
            ("core", f"SGLang's compiled core alone, least of {passes} passes"),
        ]:
            us = least["us"][key]
            rows.append([label, f"{us['mean']:,.1f}", f"{us['p50']:,.1f}", f"{us['p99']:,.1f}"])
        for key, label in [
            ("sglang_vs_prefixkv", f"SGLang ÷ prefixkv, least of {passes} passes each"),
            ("core_vs_prefixkv", f"SGLang's core alone ÷ prefixkv, least of {passes} passes each"),
            ("sglang_vs_runs", f'SGLang ÷ core="runs", least of {passes} passes each'),
            ("core_vs_runs", f'SGLang\'s core alone ÷ core="runs", least of {passes} passes each'),
        ]:
            rows.append([label, *(fmt_ratio(least[key][stat]) for stat in ("mean", "p50", "p99"))])
    phases = result["prefixkv_phases_us"]
    for phase in ("begin", "commit", "finish"):
        s = phases[phase]
        rows.append(
            [f"prefixkv {phase}", f"{s['mean']:,.1f}", f"{s['p50']:,.1f}", f"{s['p99']:,.1f}"]
        )
    out.append(md_table(["per request", "mean µs", "p50 µs", "p99 µs"], rows))
    if sglang:
        ours, theirs = sglang["prefixkv_hit_rate"], sglang["hit_rate"]
        out.append(
            f"\nSGLang's hits (its own: it evicts whole radix nodes, prefixkv single blocks): "
            f"hit rate {theirs['timed']:.1%} timed, {theirs['all_requests']:.1%} all requests, "
            f"mean per request {theirs['per_request_mean']:.1%} (prefixkv {ours['timed']:.1%}, "
            f"{ours['all_requests']:.1%}, {ours['per_request_mean']:.1%}); the same cached "
            f"tokens on {sglang['requests_equal']:.1%} of requests ({sglang['requests_equal_timed']:.1%} "
            f"of the timed ones); {sglang['evicted_pages_per_request']:,.0f} pages "
            f"evicted per timed request (prefixkv {result['evictions_per_request']:,.0f} blocks); its Python tree "
            f"core cached the same tokens as the compiled one on {sglang['python_core_same_hits']:.1%} "
            f"of requests; torch {sglang['torch']}.\n"
        )
        rows = [
            [
                f"{band['tokens'][0] // 1024}k–{band['tokens'][1] // 1024}k",
                band["requests"],
                f"{band['hit_rate']:.1%}",
                f"{band['prefixkv_hit_rate']:.1%}",
                f"{band['us_mean']:,.1f}",
                f"{band['core_us_mean']:,.1f}",
                f"{band['prefixkv_us_mean']:,.1f}",
                fmt_ratio(band["us_mean"] / band["prefixkv_us_mean"]),
                fmt_ratio(band["core_us_mean"] / band["prefixkv_us_mean"]),
            ]
            for band in sglang["bands"]
        ]
        out.append(
            md_table(
                [
                    "prompt tokens",
                    "requests",
                    "SGLang hit",
                    "prefixkv hit",
                    "SGLang µs",
                    "its core µs",
                    "prefixkv µs",
                    "SGLang ÷ prefixkv",
                    "core ÷ prefixkv",
                ],
                rows,
            )
        )
    out.append("\nBy prompt length (means):\n")
    rows = []
    for band in result["bands"]:
        low, high = band["tokens"]
        rows.append(
            [
                f"{low // 1024}k–{high // 1024}k",
                band["requests"],
                f"{band['mean_tokens']:,.0f}",
                f"{band['hit_rate']:.1%}",
                f"{band['us']['prefixkv']['mean']:,.1f}",
                f"{band['us']['python']['mean']:,.1f}",
                f"{band['us']['floor']['mean']:,.1f}",
                fmt_ratio(band["prefixkv_vs_floor_mean"]),
                fmt_ratio(band["python_vs_prefixkv_mean"]),
            ]
        )
    out.append(
        md_table(
            [
                "prompt tokens",
                "requests",
                "mean tokens",
                "hit",
                "prefixkv µs",
                "Python µs",
                "floor µs",
                "prefixkv ÷ floor",
                "Python ÷ prefixkv",
            ],
            rows,
        )
    )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the trace (~1 minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm-python",
        help="a Python with vLLM: replay the trace through vLLM's KVCacheManager too "
        "(default $PREFIXKV_VLLM_PYTHON)",
    )
    parser.add_argument(
        "--sglang-python",
        help="a Python with SGLang: replay the trace through SGLang's radix cache too "
        "(peer_sglang.py; default $PREFIXKV_SGLANG_PYTHON)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args()
    result = run(args.quick, args.seed, args.vllm_python, args.sglang_python)
    if args.json:
        write_json(args.json, {"machine": machine(), "result": result})
    print(markdown(result))


if __name__ == "__main__":
    main()
