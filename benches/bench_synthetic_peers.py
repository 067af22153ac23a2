"""Section 1d: the synthetic traces (issue 24) through prefixkv and through the peers' block managers.

Section 1 times the synthetic workloads of `workloads.py` against plain Python and the hash
floor; issue 24 also reads them against the fastest peer per request. Here every trace of
`workloads.PEER_GRID` (agent, query first, chat, unrelated, pressure; 1k, 4k and 16k-token
prompts) is replayed, with the same seed, through:

- ``prefixkv``: ``PrefixCache.begin`` + ``commit(all prompt tokens)`` + ``finish`` (numpy ids),
  as in sections 1 and 1c; and the same through ``PrefixCache(core="runs")``, the cache on runs
  of blocks, which must cache the same tokens on every request;
- SGLang (``--sglang-python`` or $PREFIXKV_SGLANG_PYTHON; `peer_sglang.py --synthetic`): its
  radix cache on its compiled tree core, the whole request as its scheduler runs it, and the
  compiled core's calls alone (a second replay with the binding timed, less what the timing
  itself adds: `peer_sglang.TimedBinding`);
- vLLM (``--vllm-python`` or $PREFIXKV_VLLM_PYTHON; `peer_vllm.py --synthetic`): its
  `KVCacheManager`, the request with its block hashes and the manager's calls.

Each replay starts from a fresh cache, and each is run `PASSES` times, in every process alike
(prefixkv's passes before and after the peers'); a request's figure is its least time over the
passes (the same request in the same cache state each time, so the least is the one the
machine's other load touched least). The first requests
of a workload that only warm the cache are not reported. vLLM must cache the same tokens as
prefixkv on every request (the run fails otherwise); SGLang evicts whole radix nodes, so its
hits are reported beside prefixkv's, with the share of requests that agree.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import clock_name, md_table, peer_npz, replay_alone, replay_runs, stats_us, write_json
from workloads import (
    HitMismatch,
    least_over_passes,
    peer_grid,
    replay_grid,
    synthetic_trace,
)

#: Replays of every trace, in every process: a request's figure is its least time over them.
PASSES = 3
#: The aim issue 24 sets on the synthetic traces: this many times the fastest peer.
AIM = 10.0


def _peer(python: str, script: str, quick: bool, seed: int) -> dict[str, np.ndarray]:
    extra = ["--quick"] * quick
    return peer_npz(python, script, "--seed", str(seed), *extra, "--synthetic", str(PASSES))


def run(
    quick: bool = False,
    seed: int = 0,
    vllm_python: str | None = None,
    sglang_python: str | None = None,
) -> dict[str, Any]:
    """`vllm_python` / `sglang_python`: a Python with vLLM / SGLang (default:
    $PREFIXKV_VLLM_PYTHON / $PREFIXKV_SGLANG_PYTHON; a peer without one is left out)."""
    grid = peer_grid(quick)
    load = os.getloadavg()[0]
    # prefixkv's passes before and after the peers' (which run theirs in a row in their own
    # process), so a slow stretch of the shared machine cannot fall on its side alone.
    before = replay_grid(replay_alone, grid, seed, PASSES - 1)
    runs_before = replay_grid(replay_runs, grid, seed, PASSES - 1)
    vllm_python = vllm_python or os.environ.get("PREFIXKV_VLLM_PYTHON")
    sglang_python = sglang_python or os.environ.get("PREFIXKV_SGLANG_PYTHON")
    vllm = _peer(vllm_python, "peer_vllm.py", quick, seed) if vllm_python else None
    sglang = _peer(sglang_python, "peer_sglang.py", quick, seed) if sglang_python else None
    after = replay_grid(replay_alone, grid, seed, 1)
    runs_after = replay_grid(replay_runs, grid, seed, 1)
    ours = least_over_passes([before, after], "prefixkv's passes")
    runs = least_over_passes([runs_before, runs_after], 'core="runs" passes')
    rows = []
    for name, length, requests in grid:
        key = f"{name}__{length}__"
        workload = synthetic_trace(name, length, requests, seed).workload
        warmup = workload.warmup
        lengths = np.array([len(p) for p in workload.prompts])
        hit = ours[key + "cached"]
        row: dict[str, Any] = {
            "workload": name,
            "length": length,
            "requests": int(len(hit) - warmup),
            "hit_rate": float(hit[warmup:].sum() / lengths[warmup:].sum()),
            "prefixkv_us": stats_us(ours[key + "total_ns"][warmup:]),
            "runs_us": stats_us(runs[key + "total_ns"][warmup:]),
        }
        if not np.array_equal(runs[key + "cached"], hit):
            raise HitMismatch(f"{name} {length}: the two cores cached different tokens")
        peers: dict[str, dict[str, float]] = {}
        if vllm is not None:
            if not np.array_equal(vllm[key + "cached"], hit):
                raise HitMismatch(f"{name} {length}: vLLM and prefixkv cached different tokens")
            peers["vllm"] = stats_us(vllm[key + "total_ns"][warmup:])
        if sglang is not None:
            theirs = sglang[key + "cached"]
            if len(theirs) != len(hit):
                raise HitMismatch(f"{name} {length}: SGLang replayed {len(theirs)} requests")
            if not np.array_equal(sglang[key + "cached_core_split"], theirs):
                raise HitMismatch(f"{name} {length}: SGLang's two replays cached differently")
            peers["sglang"] = stats_us(sglang[key + "total_ns"][warmup:])
            peers["sglang_core"] = stats_us(sglang[key + "core_ns"][warmup:])
            row["sglang_requests_equal"] = float((theirs[warmup:] == hit[warmup:]).mean())
        row["peers_us"] = peers
        row["peer_vs_prefixkv"] = {
            peer: {stat: us[stat] / row["prefixkv_us"][stat] for stat in us}
            for peer, us in peers.items()
        }
        row["peer_vs_runs"] = {
            peer: {stat: us[stat] / row["runs_us"][stat] for stat in us}
            for peer, us in peers.items()
        }
        rows.append(row)
    return {
        "quick": quick,
        "seed": seed,
        "passes": PASSES,
        "clock": clock_name(),
        "rows": rows,
        "vllm_version": str(vllm["version"]) if vllm is not None else None,
        "sglang_version": str(sglang["version"]) if sglang is not None else None,
        "load_average_before": load,
        "load_average_after": os.getloadavg()[0],
    }


#: The peers' columns: key in a row's ``peers_us``, label.
PEER_LABELS = {
    "sglang": "SGLang, whole request",
    "sglang_core": "SGLang, its compiled core's calls alone",
    "vllm": "vLLM KVCacheManager, whole request",
}


def worst(
    result: dict[str, Any], peer: str, stat: str, ours: str = "prefixkv"
) -> tuple[float, str] | None:
    """The lowest peer ÷ prefixkv over the traces, and which trace, for `peer` and `stat`
    (`ours`: ``"runs"`` for ``PrefixCache(core="runs")``)."""
    key = f"peer_vs_{ours}"
    found = [
        (row[key][peer][stat], f"{row['workload']} {row['length']:,}")
        for row in result["rows"]
        if peer in row.get(key, {})
    ]
    return min(found) if found else None


def markdown(result: dict[str, Any]) -> str:
    peers = [p for p in PEER_LABELS if any(p in r["peers_us"] for r in result["rows"])]
    versions = []
    if result["sglang_version"]:
        versions.append(f"SGLang {result['sglang_version']} (compiled tree core)")
    if result["vllm_version"]:
        versions.append(f"vLLM {result['vllm_version']}")
    out = [
        f"Seed {result['seed']}; each trace replayed {result['passes']} times from a fresh cache "
        "in every process, a request's figure its least time over the passes; µs of "
        f"{result['clock']} time per request, warm-up requests left out. Peers: "
        f"{', '.join(versions) or 'none'}. vLLM cached the same tokens as prefixkv on every "
        "request where it ran; *SGLang agrees* is the share of requests on which SGLang's hit "
        f"equals prefixkv's. Load average {result['load_average_before']:.1f} before, "
        f"{result['load_average_after']:.1f} after. *prefixkv* is the block core "
        '(`core="blocks"`); *core="runs"* the run core, `PrefixCache()`\'s default '
        '(`core="auto"`) since round 29.\n',
    ]
    headers = ["trace", "prompt", "requests", "hit", "prefixkv µs (mean / p99)"]
    headers.append('core="runs" µs (mean / p99)')
    for peer in peers:
        headers += [f"{PEER_LABELS[peer]} µs (mean / p99)", "÷ prefixkv (mean / p99)"]
    if "sglang" in peers:
        headers += ['SGLang whole ÷ core="runs" (mean / p99)', "SGLang agrees"]
    rows = []
    for row in result["rows"]:
        ours = row["prefixkv_us"]
        line = [
            row["workload"],
            f"{row['length']:,}",
            row["requests"],
            f"{row['hit_rate']:.0%}",
            f"{ours['mean']:,.1f} / {ours['p99']:,.1f}",
        ]
        runs = row.get("runs_us")
        line.append(f"{runs['mean']:,.1f} / {runs['p99']:,.1f}" if runs else "–")
        for peer in peers:
            us = row["peers_us"].get(peer)
            ratio = row["peer_vs_prefixkv"].get(peer)
            line += (
                [
                    f"{us['mean']:,.1f} / {us['p99']:,.1f}",
                    f"{ratio['mean']:.1f}× / {ratio['p99']:.1f}×",
                ]
                if us and ratio
                else ["–", "–"]
            )
        if "sglang" in peers:
            ratio = row.get("peer_vs_runs", {}).get("sglang")
            line.append(f"{ratio['mean']:.1f}× / {ratio['p99']:.1f}×" if ratio else "–")
            line.append(f"{row.get('sglang_requests_equal', 0):.0%}")
        rows.append(line)
    out.append(md_table(headers, rows))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", help="a Python with vLLM (default $PREFIXKV_VLLM_PYTHON)")
    parser.add_argument(
        "--sglang-python", help="a Python with SGLang (default $PREFIXKV_SGLANG_PYTHON)"
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.quick, args.seed, args.vllm_python, args.sglang_python)
    if args.json:
        write_json(args.json, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
