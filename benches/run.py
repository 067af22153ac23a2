"""Runs the prefixkv benchmarks; writes results/latest.json, RESULTS.md and PNG plots.

    python benches/run.py                 # everything (~10 minutes on 2 cores)
    python benches/run.py --quick         # a ~1-minute pass with smaller sizes
    python benches/run.py --only overhead # one section (overhead, threads, compute, copies,
                                          # memory, core); repeatable

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
import bench_threads
from common import BENCH_DIR, RESULTS_DIR, machine, md_table, set_clock, write_json

SECTIONS = ["overhead", "threads", "compute", "copies", "memory", "core"]
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


def core_markdown(result: dict[str, Any] | None) -> str:
    if result is None:
        return "cargo not found: skipped."
    if "error" in result:
        return f"build failed:\n```\n{result['error']}\n```"
    rows = []
    for line in result["lines"]:
        if "ns_per_block" in line:
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
    ax.barh(range(len(names)), ratios, color=["C0", "C1", "C7"][: len(names)])
    ax.set_yticks(range(len(names)), [n.replace(" (holds the GIL)", "") for n in names], fontsize=7)
    ax.axvline(1.6, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("2-thread ÷ 1-thread lookups/s")
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
            "within 2× of the hash-only floor (every workload)",
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
    if "threads" in results:
        t = results["threads"]["configs"]
        for name, c in t.items():
            if name.startswith("lookup"):
                add(
                    f"2-thread ÷ 1-thread lookups ≥1.6 ({name})",
                    f"{c['ratio']:.2f}×",
                    c["ratio"] >= 1.6,
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


def write_markdown(path: Path, data: dict[str, Any]) -> None:
    m = data["machine"]
    results = data["results"]
    parts = [
        "# prefixkv benchmark results",
        "",
        f"Generated by `python benches/run.py{' --quick' if data['quick'] else ''}` on {data['date']} "
        f"in {data['seconds']:.0f} s. Every figure is a ratio against a baseline timed in the same run.",
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
    sections = [
        (
            "overhead",
            "1. Block-manager overhead per request",
            bench_overhead.markdown,
            "overhead.png",
        ),
        ("core", "1b. The core alone, without Python (cargo)", core_markdown, None),
        ("threads", "2. Lookup throughput from threads", bench_threads.markdown, "threads.png"),
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
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, about a minute")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this section")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="clock of single-thread timings: CPU time of the calling thread (default; robust on "
        "a loaded machine) or wall time",
    )
    args = parser.parse_args()
    sections = args.only or SECTIONS
    set_clock(args.clock)
    info = machine()
    if info["prefixkv_core_build"] != "release":
        print(
            f"warning: prefixkv._core build is {info['prefixkv_core_build']!r}; timings need a release build",
            file=sys.stderr,
        )
    started = time.time()
    load_start = os.getloadavg()[0]
    results: dict[str, Any] = {}
    runners = {
        "overhead": bench_overhead.run,
        "threads": bench_threads.run,
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
