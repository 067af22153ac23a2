"""Runs the prefixkv benchmarks; writes results/latest.json, RESULTS.md and PNG plots.

    python benches/run.py                 # everything (~10 minutes on 2 cores)
    python benches/run.py --quick         # a ~1-minute pass with smaller sizes
    python benches/run.py --only overhead # one section (overhead, production, synthetic,
                                          # threads, compute, copies, memory, core); repeatable

Every figure is a ratio against a baseline timed in the same run (see README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_compute
import bench_copies
import bench_memory
import bench_overhead
import bench_production
import bench_synthetic_peers
import bench_threads
from common import BENCH_DIR, RESULTS_DIR, machine, md_table, set_clock, write_json

SECTIONS = ["overhead", "production", "synthetic", "threads", "compute", "copies", "memory", "core"]
PROFILE_DIR = BENCH_DIR / "core_profile"


def run_core_profile(quick: bool) -> dict[str, Any] | None:
    """The pure-Rust profile (no Python): builds it offline if cargo is here, else skipped."""
    if shutil.which("cargo") is None:
        return None
    built = PROFILE_DIR / "target" / "release" / "prefixkv-core-profile"
    build = subprocess.run(
        ["cargo", "build", "--release", "--offline", "-q"],
        cwd=PROFILE_DIR,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0 or not built.exists():
        return {"error": build.stderr[-2000:]}
    out = subprocess.run([str(built)], capture_output=True, text=True, check=True)
    return {"lines": [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]}


#: A free-threaded interpreter (with prefixkv's version-specific build and numpy installed) to
#: run section 2 in as well (`bench_threads.run_in`); unset: section 2 runs only here.
FREE_THREADED_PYTHON = "PREFIXKV_FREE_THREADED_PYTHON"


def run_threads(quick: bool) -> dict[str, Any]:
    """Section 2 here, and again on the free-threaded interpreter that `FREE_THREADED_PYTHON`
    names, if any (under `free_threaded`)."""
    result = bench_threads.run(quick)
    python = os.environ.get(FREE_THREADED_PYTHON)
    if python:
        result["free_threaded"] = bench_threads.run_in(python, quick)
    return result


def threads_markdown(result: dict[str, Any]) -> str:
    """Section 2, then the same pairs on the free-threaded interpreter if it ran there."""
    text = bench_threads.markdown(result)
    other = result.get("free_threaded")
    if other:
        text += (
            "\n### The same pairs on a free-threaded interpreter\n\n"
            "The same script in a second process, on an interpreter without a GIL "
            f"(`{FREE_THREADED_PYTHON}`; prefixkv's version-specific build, `docs/release.md`), "
            "right after the rounds above.\n\n" + bench_threads.markdown(other)
        )
    return text


def core_markdown(result: dict[str, Any] | None) -> str:
    if result is None:
        return "cargo not found: skipped."
    if "error" in result:
        return f"build failed:\n```\n{result['error']}\n```"
    rows = []
    for line in result["lines"]:
        if line.get("pressure"):
            rows.append(
                [
                    line["what"],
                    f"pressure mean {line['pressure_mean_ns'] / 1e3:.0f} µs, p99 "
                    f"{line['pressure_p99_ns'] / 1e3:.0f} µs; without pressure mean "
                    f"{line['no_pressure_mean_ns'] / 1e3:.0f} µs, p99 "
                    f"{line['no_pressure_p99_ns'] / 1e3:.0f} µs; table-hash floor mean "
                    f"{line['floor_mean_ns'] / 1e3:.0f} µs, p99 {line['floor_p99_ns'] / 1e3:.0f} µs; "
                    f"{line['evictions_per_request']:.0f} evictions and "
                    f"{line['blocks_per_request']:.0f} blocks per request, hit rate "
                    f"{line['hit_rate_pressure']:.1%} in both",
                ]
            )
        elif "ns_per_block" in line:
            rows.append([line["what"], f"{line['ns_per_block']:.0f} ns per block"])
        else:
            parts = [f"{line['ns'] / 1000:.1f} µs"]
            parts += [
                f"{k[:-3]} {line[k] / 1000:.1f}"
                for k in ("begin_ns", "commit_ns", "finish_ns")
                if k in line
            ]
            rows.append([line["what"], ", ".join(parts)])
    return md_table(["pure Rust (no binding)", "median"], rows)


def plot_threads(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.8), dpi=80)
    names = list(result["configs"])
    ratios = [result["configs"][n]["ratio"] for n in names]
    # The cache's pairs in colours of their own, every control in grey.
    colours = ["C7" if n.startswith("control") else f"C{i}" for i, n in enumerate(names)]
    ax.barh(range(len(names)), ratios, color=colours)
    ax.set_yticks(range(len(names)), [n.split(" (")[0] for n in names], fontsize=7)
    ax.axvline(1.8, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("2-thread ÷ 1-thread throughput (median over rounds)")
    ax.set_xlim(0, 2)
    fig.tight_layout()
    path = out_dir / "threads.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def plot_copies(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6), dpi=80)
    names = [r["operation"].split(" (")[0] for r in result["rows"]]
    ax.barh(range(len(names)), [100 * r["ratio"] for r in result["rows"]])
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.axvline(70, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel(f"% of contiguous copy_ bandwidth ({result['device']})")
    fig.tight_layout()
    path = out_dir / "copies.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def targets(results: dict[str, Any]) -> list[list[str]]:
    """The aims of the foundation issue, each with the measured figure and a verdict."""
    rows = []

    def add(aim: str, measured: str, ok: bool | None) -> None:
        rows.append([aim, measured, "–" if ok is None else ("met" if ok else "**missed**")])

    if "overhead" in results:
        o = results["overhead"]
        for key, label in [
            ("shared_95", "4k prompt sharing 95%"),
            ("shared_none", "4k prompt sharing nothing"),
        ]:
            c = o["issue_cases"][key]
            best = min(c["us"]["prefixkv_numpy"], c["us"]["prefixkv_list"])
            add(
                f"{label}: ≥20× faster than 650 µs (≤32.5 µs)",
                f"{c['us']['prefixkv_numpy']:.0f} µs numpy / {c['us']['prefixkv_list']:.0f} µs list "
                f"({650 / best:.1f}× faster)",
                best <= 32.5,
            )
        worst_floor = max(max(r["vs_floor_numpy"], r["vs_floor_list"]) for r in o["rows"])
        add(
            "within 2× of the hash-only floor (every workload; floor = `_core.hash_prompt`, "
            "the XXH3-128 table keys of the prompt's blocks, same input form)",
            f"worst {worst_floor:.2f}× (numpy {min(r['vs_floor_numpy'] for r in o['rows']):.2f}–"
            f"{max(r['vs_floor_numpy'] for r in o['rows']):.2f}×)",
            worst_floor <= 2.0,
        )
        worst_py = min(
            min(r["speedup_vs_python_numpy"], r["speedup_vs_python_list"]) for r in o["rows"]
        )
        add(
            "≥15× faster than plain Python (every workload)",
            f"worst {worst_py:.2f}×, best {max(max(r['speedup_vs_python_numpy'], r['speedup_vs_python_list']) for r in o['rows']):.2f}×",
            worst_py >= 15,
        )
    if "production" in results:
        p = results["production"]
        ratio = p["ratios"]
        add(
            'production-shaped replay, core="blocks" (issue 24): within 3× of the table-hash floor, '
            "mean and p99",
            f"mean {ratio['mean']['prefixkv_vs_floor']:.2f}×, p99 "
            f"{ratio['p99']['prefixkv_vs_floor']:.2f}× (hit rate {p['hit_rate']:.1%}, "
            f"{p['evictions_per_request']:.0f} evictions/request)",
            max(ratio["mean"]["prefixkv_vs_floor"], ratio["p99"]["prefixkv_vs_floor"]) <= 3.0,
        )
        if "runs_vs_floor" in ratio["mean"]:
            add(
                'production-shaped replay, core="runs", the default (issue 24): within 3× of the '
                "table-hash floor, mean and p99",
                f"mean {ratio['mean']['runs_vs_floor']:.2f}×, p99 "
                f"{ratio['p99']['runs_vs_floor']:.2f}×",
                max(ratio["mean"]["runs_vs_floor"], ratio["p99"]["runs_vs_floor"]) <= 3.0,
            )
        add(
            "production-shaped replay: list input within 1.5× of numpy, mean",
            f"mean {ratio['mean']['list_vs_numpy']:.2f}×, p99 {ratio['p99']['list_vs_numpy']:.2f}×",
            ratio["mean"]["list_vs_numpy"] <= 1.5,
        )
        # Each peer that ran: the aim is against the fastest, which is SGLang's compiled tree
        # core when SGLang ran (RESULTS-production.md), so every peer is listed.
        peers = []
        if "vllm" in p:
            peers.append(
                (f"vLLM {p['vllm']['version']} KVCacheManager", p["vllm"]["vllm_vs_prefixkv"])
            )
        if "sglang" in p:
            sglang = p["sglang"]
            peers.append(
                (f"SGLang {sglang['version']}, whole request", sglang["sglang_vs_prefixkv"])
            )
            peers.append(
                (
                    f"SGLang {sglang['version']}, its compiled core's calls alone",
                    sglang["core_vs_prefixkv"],
                )
            )
            least = sglang.get("least")
            if least:
                peers.append(
                    (
                        f"SGLang {sglang['version']}, whole request, least of "
                        f"{least['passes']} passes each",
                        least["sglang_vs_prefixkv"],
                    )
                )
                peers.append(
                    (
                        f"SGLang {sglang['version']}, its compiled core's calls alone, least of "
                        f"{least['passes']} passes each",
                        least["core_vs_prefixkv"],
                    )
                )
            peers.append(
                (
                    f"SGLang {sglang['version']} on its Python tree core",
                    sglang["python_core_vs_prefixkv"],
                )
            )
        # The block core's rows so far; the same aims for the run core, `PrefixCache`'s
        # default ("auto") since round 29, follow.
        peers = [(f'{name}; prefixkv core="blocks"', peer) for name, peer in peers]
        if "vllm" in p and "vllm_vs_runs" in p["vllm"]:
            peers.append(
                (
                    f'vLLM {p["vllm"]["version"]} KVCacheManager; prefixkv core="runs", the default',
                    p["vllm"]["vllm_vs_runs"],
                )
            )
        if "sglang" in p and "sglang_vs_runs" in p["sglang"]:
            sglang = p["sglang"]
            peers.append(
                (
                    f'SGLang {sglang["version"]}, whole request; prefixkv core="runs", the default',
                    sglang["sglang_vs_runs"],
                )
            )
            peers.append(
                (
                    f"SGLang {sglang['version']}, its compiled core's calls alone; prefixkv "
                    'core="runs"',
                    sglang["core_vs_runs"],
                )
            )
            least = sglang.get("least")
            if least and "core_vs_runs" in least:
                peers.append(
                    (
                        f"SGLang {sglang['version']}, whole request, least of "
                        f'{least["passes"]} passes each; prefixkv core="runs", the default',
                        least["sglang_vs_runs"],
                    )
                )
                peers.append(
                    (
                        f"SGLang {sglang['version']}, its compiled core's calls alone, least of "
                        f'{least["passes"]} passes each; prefixkv core="runs", the default',
                        least["core_vs_runs"],
                    )
                )
        for name, peer in peers:
            add(
                f"production-shaped replay: ≥5× the fastest peer per request ({name}), mean and p99",
                f"mean {peer['mean']:.2f}×, p99 {peer['p99']:.2f}×",
                min(peer["mean"], peer["p99"]) >= 5.0,
            )
    if "synthetic" in results:
        synthetic = results["synthetic"]
        for (peer, label), ours in [
            (item, ours)
            for ours in ("prefixkv", "runs")
            for item in bench_synthetic_peers.PEER_LABELS.items()
        ]:
            mean = bench_synthetic_peers.worst(synthetic, peer, "mean", ours)
            p99 = bench_synthetic_peers.worst(synthetic, peer, "p99", ours)
            if mean is None or p99 is None:
                continue
            label += (
                '; prefixkv core="runs", the default'
                if ours == "runs"
                else ('; prefixkv core="blocks"')
            )
            add(
                f"synthetic traces (1d): ≥{bench_synthetic_peers.AIM:.0f}× the peer per request "
                f"({label}), every trace, mean and p99",
                f"worst mean {mean[0]:.2f}× ({mean[1]}), worst p99 {p99[0]:.2f}× ({p99[1]})",
                min(mean[0], p99[0]) >= bench_synthetic_peers.AIM,
            )
    core_lines = (results.get("core") or {}).get("lines", [])
    for line in core_lines:
        if line.get("pressure"):
            mean = line["pressure_mean_ns"] / line["no_pressure_mean_ns"]
            p99 = line["pressure_p99_ns"] / line["no_pressure_p99_ns"]
            add(
                "eviction pressure (1k–128k prompts, cache far smaller than the working set): "
                "≤1.5× the same requests without pressure, mean and p99 (pure Rust, 1b)",
                f"mean {mean:.2f}×, p99 {p99:.2f}× ({line['evictions_per_request']:.0f} "
                "evictions/request)",
                max(mean, p99) <= 1.5,
            )
        elif line["what"].startswith("decode step"):
            add(
                "decode step (append 1 token + commit) < 1 µs (pure Rust, 1b)",
                f"{line['ns']:.0f} ns",
                line["ns"] < 1000,
            )
    runs = [results["threads"]] if "threads" in results else []
    runs += [r["free_threaded"] for r in runs if "free_threaded" in r]
    for threads in runs:
        info = threads.get("interpreter")
        where = (
            "; " + bench_threads.interpreter_name(info) if info and info["free_threaded"] else ""
        )
        for name, c in threads["configs"].items():
            if name.startswith("router"):
                short = c.get("ratio_over_short_control")
                add(
                    f"two threads ≥1.8× one ({name}{where}; ÷ the GIL-releasing control"
                    + (
                        ", and ÷ the one releasing it for ~5 µs a call,"
                        if short is not None
                        else ""
                    )
                    + " in brackets)",
                    f"{c['ratio']:.2f}× ({c['ratio_over_free_control']:.2f}"
                    + (f"; {short:.2f}" if short is not None else "")
                    + ")",
                    c["ratio"] >= 1.8,
                )
    if "compute" in results:
        rows_c = [r for r in results["compute"]["rows"] if 0 < r["fraction_cached"] <= 0.9]
        if rows_c:
            worst = max(r["vs_work"] for r in rows_c)
            worst_suffix = max(r["vs_suffix_call"] for r in rows_c)
            add(
                "prefill measured ÷ ideal ≤1.2 for f ≤ 90% (work ideal)",
                f"worst {worst:.2f}×",
                worst <= 1.2,
            )
            add(
                "… against a suffix-only call (excludes attention to the prefix)",
                f"worst {worst_suffix:.2f}×",
                worst_suffix <= 1.2,
            )
    if "copies" in results:
        for r in results["copies"]["rows"]:
            add(f"{r['operation']} ≥70% of copy_", f"{r['ratio']:.0%}", r["ratio"] >= 0.7)
    if "memory" in results:
        m = results["memory"]
        add(
            "metadata bytes per cached block (no aim set)",
            f"{m['results']['prefixkv']['cached_bytes_per_block']:.0f} B → {m['blocks_per_gib'] / 1e6:.1f} M blocks/GiB",
            None,
        )
    return rows


def _controls(configs: dict[str, Any]) -> str:
    """Section 2's controls and their speedups, for a sentence."""
    return ", ".join(
        f"{name.removeprefix('control: ')} {c['ratio']:.2f}×"
        for name, c in configs.items()
        if name.startswith("control")
    )


def obstacles(results: dict[str, Any]) -> list[str]:
    """What stands in the way of the missed aims, as measured in this run (bullet lines)."""
    lines: list[str] = []
    o = results.get("overhead")
    core = {}
    if results.get("core") and "lines" in results["core"]:
        core = {line["what"]: line for line in results["core"]["lines"]}

    def core_ns(prefix: str, field: str = "ns") -> float | None:
        for what, line in core.items():
            if what.startswith(prefix):
                return line.get(field)
        return None

    if o:
        b = o["breakdown"]["ns"]
        none = o["issue_cases"]["shared_none"]
        hit = o["issue_cases"]["shared_95"]
        table_keys = b["_core.hash_prompt(bytes): 250 table keys (XXH3-128), nothing else"] / 1e3
        commit = b["miss: _core.commit: 250 table inserts (a fresh run, no keys)"] / 1e3
        line = (
            f"- **Misses** (4k prompt sharing nothing: {none['us']['prefixkv_numpy']:.0f} µs numpy, "
            f"aim 32.5 µs; its table-hash floor {none['us']['floor_numpy']:.1f} µs). Through "
            f"`_core` on fresh prompts: begin {b['miss: _core.begin(bytes): 1 table key, allocate 250 blocks'] / 1e3:.1f} µs, "
            f"commit {commit:.1f} µs, finish {b['miss: _core.finish: release 250 blocks'] / 1e3:.1f} µs. "
            "The commit publishes 250 entries as a fresh run, each its parent's linked child, "
            f"with no key hashed (`table/runs.rs`); the floor's 250 table keys take "
            f"{table_keys:.1f} µs, of which prefixkv computes the first block's."
        )
        inserts = core_ns("table try_insert")
        rust_commit = core_ns("begin+commit+finish, 4000 tokens, shares nothing", "commit_ns")
        if inserts is not None and rust_commit is not None:
            line += (
                f" In pure Rust (1b, a 200,000-block cache), 250 bare inserts of the core's "
                f"`Entry` into its table (each block's old entry removed first) take "
                f"{inserts / 1e3:.1f} µs ({inserts / 250:.0f} ns each) of the core's "
                f"{rust_commit / 1e3:.1f} µs commit: writing the block's slot and an index "
                "word in tables of several MiB, i.e. cache misses (benches/PROFILE.md), not "
                "hashing, is what a miss costs."
            )
        lines.append(line)
        ph = hit["prefixkv_numpy_phases_us"]
        list_conversion = (
            b["_core.hash_prompt(list): the list read in the call + 250 table keys"]
            - b["_core.hash_prompt(bytes): 250 table keys (XXH3-128), nothing else"]
        )
        lookup_all = b["_core.lookup(bytes), all cached: 1 table key + table walk + verify"]
        conversion = b["as_token_ids(numpy int64) -> bytes"]
        lines.append(
            f"- **Hits** (4k prompt sharing 95%: {hit['us']['prefixkv_numpy']:.1f} µs numpy, "
            f"floor {hit['us']['floor_numpy']:.1f} µs): begin {ph['begin']:.1f}, commit "
            f"{ph['commit']:.1f}, finish {ph['finish']:.1f} µs (medians). Of begin, roughly: "
            f"conversion {conversion / 1e3:.1f} µs (`as_token_ids`, numpy; the core's read of a list "
            f"{list_conversion / 1e3:.1f} µs), the lookup's work {lookup_all / 1e3:.1f} µs (a fully cached "
            "`_core.lookup(bytes)`: the first block's key, then the walk down the run's links "
            "verifying each block, with no key hashed; the floor's 250 keys alone take "
            f"{table_keys:.1f} µs), and the remaining "
            f"{max(ph['begin'] * 1e3 - conversion - lookup_all, 0) / 1e3:.1f} µs taking references, "
            "allocating the suffix, recording the request and returning its block table as a "
            "list of Python ints."
        )
        best = max(r["us"]["python_numpy"] / r["us"]["floor_numpy"] for r in o["rows"])
        worst = min(r["us"]["python_numpy"] / r["us"]["floor_numpy"] for r in o["rows"])
        below = sum(r["us"]["python_numpy"] / r["us"]["floor_numpy"] < 15 for r in o["rows"])
        lines.append(
            "- **≥15× vs plain Python**: even a block manager whose table work were free could "
            "not beat the plain-Python one by more than plain-Python time ÷ table-hash floor, "
            f"which is {worst:.1f}–{best:.1f}× over these workloads (numpy), below 15× in "
            f"{below} of {len(o['rows'])} rows: there the aim is out of reach of any table. The "
            "baseline is dict + hashlib SHA-256 + verification; its hashing loop alone is in the "
            "JSON (`python_hash_numpy`)."
        )
    t = results.get("threads")
    if t:
        shares = ", ".join(f"{name} {g['share']:.0%}" for name, g in t["gil_held"].items())
        controls = _controls(t["configs"])
        loads = t["load_average_per_round"]
        cores = " and ".join(
            f"{c['cores_together']:.2f}"
            for name, c in t["configs"].items()
            if name.startswith("router")
        )
        lines.append(
            f"- **Threads**: the GIL-held share of each task (one thread, CPU time, upper "
            f"bounds): {shares}. Load average {min(loads):.1f}–{max(loads):.1f} on "
            f"{t['cpus']} CPUs over the rounds; in the same rounds the controls reached "
            f"{controls}, and with both threads running the process got {cores} cores."
        )
        ft = t.get("free_threaded")
        if ft:
            pairs = [c["ratio"] for name, c in ft["configs"].items() if name.startswith("router")]
            lines.append(
                f"- **Threads without a GIL** ({bench_threads.interpreter_name(ft['interpreter'])}, "
                f"the same script in a second process): the router and scheduler pairs reached "
                f"{min(pairs):.3f}–{max(pairs):.3f}×, {sum(p >= 1.8 for p in pairs)} of "
                f"{len(pairs)} at 1.8× or more; the controls {_controls(ft['configs'])}."
            )
    c = results.get("copies")
    if c and "diagnosis_ms" in c:
        d = c["diagnosis_ms"]
        fresh = next(v for k, v in d.items() if "fresh output" in k)
        reused = next(v for k, v in d.items() if "reused output" in k)
        touch = next(v for k, v in d.items() if k.startswith("first touch"))
        scatter = next(v for k, v in d.items() if k.startswith("scatter"))
        contiguous = next(v for k, v in d.items() if k.startswith("contiguous"))
        lines.append(
            f"- **Copies**: `copy_blocks_to`'s gather into a fresh staging tensor takes "
            f"{fresh:.1f} ms, into a reused one {reused:.1f} ms; first touch of a fresh buffer "
            f"that size alone costs {touch:.1f} ms (page faults of a new allocation of that "
            f"size), and the scatter (`index_copy_`) {scatter:.1f} ms, against {contiguous:.1f} ms "
            "for a contiguous copy of the same bytes."
        )
    return lines


def write_markdown(path: Path, data: dict[str, Any]) -> None:
    m = data["machine"]
    results = data["results"]
    parts = [
        "# prefixkv benchmark results",
        "",
        f"Generated by `python benches/run.py{' --quick' if data['quick'] else ''}` on {data['date']} "
        f"in {data['seconds']:.0f} s. Every figure is a ratio against a baseline timed in the same run.",
        *(
            [
                "",
                f"Section 2 (threads) is from a separate `run.py --only threads` on "
                f"{data['threads_from']['date']} (load average {data['threads_from']['load_start']:.1f} "
                f"/ {data['threads_from']['load_end']:.1f}), run apart from the rest.",
            ]
            if "threads_from" in data
            else []
        ),
        "",
        md_table(
            ["machine", ""],
            [
                [
                    "CPU",
                    f"{m['cpu']} ({m['logical_cpus']} logical CPUs, {m['usable_cpus']} usable; "
                    f"SHA extensions: {'yes' if m['sha_extensions'] else 'no'}, AVX-512: {'yes' if m['avx512'] else 'no'})",
                ],
                [
                    "load average at start / end",
                    f"{data['load_start']:.1f} / {data['load_end']:.1f} (shared machine)",
                ],
                ["Python / numpy / torch", f"{m['python']} / {m['numpy']} / {m.get('torch')}"],
                ["prefixkv._core build", m["prefixkv_core_build"]],
                [
                    "clock (sections 1, 3, 4)",
                    f"{data['clock']} time of the calling thread (see common.py)",
                ],
                ["CUDA", m.get("cuda") or "none"],
            ],
        ),
        "",
        "## Targets",
        "",
        md_table(["aim", "measured", ""], targets(results)),
    ]
    found = obstacles(results)
    if found:
        parts += ["", "### What stands in the way (measured in this run)", "", *found]
    sections = [
        (
            "overhead",
            "1. Block-manager overhead per request",
            bench_overhead.markdown,
            "overhead.png",
        ),
        ("core", "1b. The core alone, without Python (cargo)", core_markdown, None),
        (
            "production",
            "1c. Production-shaped replay (issue 24)",
            bench_production.markdown,
            None,
        ),
        (
            "synthetic",
            "1d. Synthetic traces beside the peers (issue 24)",
            bench_synthetic_peers.markdown,
            None,
        ),
        (
            "threads",
            "2. A router and a scheduler on two threads",
            threads_markdown,
            "threads.png",
        ),
        ("compute", "3. Prefill compute saved", bench_compute.markdown, "compute.png"),
        ("copies", "4. Page copies", bench_copies.markdown, "copies.png"),
        ("memory", "5. Metadata memory", bench_memory.markdown, None),
    ]
    for key, title, render, image in sections:
        if key not in results:
            continue
        parts += ["", f"## {title}", "", render(results[key])]
        if image and (RESULTS_DIR / image).exists():
            parts += ["", f"![{key}](results/{image})"]
    # Build-against-build comparisons, which one run cannot make, are kept by hand.
    history = BENCH_DIR / "RESULTS-history.md"
    if history.exists():
        body = history.read_text().split("\n", 1)[1].replace("\n## ", "\n### ")
        parts += ["", "## 6. Before and after (from RESULTS-history.md)", body.rstrip()]
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, about a minute")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="only rewrite RESULTS.md from a saved results JSON (no benchmarks run)",
    )
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="clock of single-thread timings: CPU time of the calling thread (default; robust on "
        "a loaded machine) or wall time",
    )
    parser.add_argument(
        "--threads-from",
        type=Path,
        metavar="JSON",
        help="with --render: take section 2 from this saved `--only threads` run (a quiet window)",
    )
    args = parser.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        if args.threads_from:
            threads = json.loads(args.threads_from.read_text())
            saved["results"]["threads"] = threads["results"]["threads"]
            saved["threads_from"] = {k: threads[k] for k in ("date", "load_start", "load_end")}
        write_markdown(BENCH_DIR / "RESULTS.md", saved)
        print(md_table(["aim", "measured", ""], targets(saved["results"])))
        return
    sections = args.only or SECTIONS
    set_clock(args.clock)
    info = machine()
    if info["prefixkv_core_build"] != "release":
        print(
            f"warning: prefixkv._core build is {info['prefixkv_core_build']!r}; timings need a release build",
            file=sys.stderr,
        )
    free_threaded = os.environ.get(FREE_THREADED_PYTHON)
    if free_threaded and "threads" in sections:
        # Refused now, by name, rather than after the sections before it have run.
        bench_threads.check_interpreter(free_threaded)
    started = time.time()
    load_start = os.getloadavg()[0]
    results: dict[str, Any] = {}
    runners = {
        "overhead": bench_overhead.run,
        "production": bench_production.run,
        "synthetic": bench_synthetic_peers.run,
        "threads": run_threads,
        "compute": bench_compute.run,
        "copies": bench_copies.run,
        "memory": bench_memory.run,
        "core": run_core_profile,
    }
    for section in SECTIONS:
        if section in sections:
            print(f"[{section}]", flush=True)
            section_start = time.time()
            results[section] = runners[section](args.quick)
            print(f"[{section}] {time.time() - section_start:.0f} s", flush=True)
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "clock": args.clock,
        "seconds": time.time() - started,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "machine": info,
        "results": results,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        plotters = {
            "overhead": bench_overhead.plot,
            "threads": plot_threads,
            "compute": bench_compute.plot,
            "copies": plot_copies,
        }
        for key, plotter in plotters.items():
            if key in results:
                plotter(results[key], RESULTS_DIR)
    name = "latest.json" if sections == SECTIONS else f"latest-{'-'.join(sections)}.json"
    if args.quick:
        name = name.replace("latest", "quick")
    write_json(RESULTS_DIR / name, data)
    markdown_path = BENCH_DIR / (
        "RESULTS.md" if sections == SECTIONS and not args.quick else "RESULTS-partial.md"
    )
    write_markdown(markdown_path, data)
    print(f"wrote {RESULTS_DIR / name} and {markdown_path}")
    print()
    print(md_table(["aim", "measured", ""], targets(results)))


if __name__ == "__main__":
    main()
