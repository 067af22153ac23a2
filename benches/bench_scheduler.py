"""Engine-grade allocation: what a scheduler pays per request per step, and what cache-aware
ordering buys over first-come-first-served.

    python benches/bench_scheduler.py            # ~2 minutes on 2 cores; writes
                                                 # results/scheduler.json, RESULTS-scheduler.md
    python benches/bench_scheduler.py --quick

1. Step cost. 64 live requests decoding, each step through the step API: `append_tokens` of
   the sampled token, `allocate_slots` for it, `commit`. Also the speculative-decoding step
   (append 4 drafts, slots for them, commit, `accept_drafts` of 2: the other 2 truncated) and
   the whole-prompt API's step (`append` + `commit`). Per request per step, CPU time of the
   calling thread, against the cheapest binding call (`num_tokens`) timed in the same run.
2. Ordering. The Engine (a tiny random model, torch on one thread) serves an agent workload:
   several agents, each with its own long system prompt, their requests arriving interleaved,
   through a pool that holds about two agents' prefixes. Hit rate and mean time to first token
   under cache-aware ordering and under FCFS, in the same run, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, RESULTS_DIR, gc_paused, machine, md_table, median_ns, write_json

from prefixkv import PrefixCache

REQUESTS = 64
PROMPT = 512
BLOCK = 16


def step_costs(quick: bool) -> dict[str, float]:
    """Nanoseconds per request per decode step, by API."""
    steps = 64 if quick else 256

    def fresh() -> tuple[PrefixCache, list[str]]:
        cache = PrefixCache(
            REQUESTS * (PROMPT // BLOCK + 2 * steps // BLOCK + 8), block_size=BLOCK, core="blocks"
        )
        ids = [f"req-{i}" for i in range(REQUESTS)]
        for i, rid in enumerate(ids):
            cache.add_request(rid, [i + 1] * PROMPT)
            cache.allocate_slots(rid, PROMPT)
            cache.commit(rid, PROMPT)
        return cache, ids

    results: dict[str, float] = {}
    cache, ids = fresh()
    results["floor: num_tokens (one binding call)"] = (
        median_ns(lambda: [cache.num_tokens(rid) for rid in ids], repeats=9) / REQUESTS
    )

    def decode(cache: PrefixCache, ids: list[str]) -> None:
        for step in range(steps):
            for rid in ids:
                cache.append_tokens(rid, [step % 1000])
                cache.allocate_slots(rid, 1)
                cache.commit(rid, PROMPT + step + 1)

    def speculative(cache: PrefixCache, ids: list[str]) -> None:
        for step in range(steps // 4):
            for rid in ids:
                cache.append_tokens(rid, [step % 1000])
                cache.allocate_slots(rid, 1, num_lookahead_tokens=4)
                cache.append_tokens(rid, [1, 2, 3, 4], draft=True)
                cache.commit(rid, cache.num_tokens(rid))
                cache.accept_drafts(rid, 2)

    def whole_prompt(cache: PrefixCache, requests: list[Any]) -> None:
        for step in range(steps):
            for request in requests:
                cache.append(request, [step % 1000])
                cache.commit(request, PROMPT + step + 1)

    for name, run, per in (
        ("append_tokens + allocate_slots + commit", decode, steps),
        ("speculative: 4 drafts, accept 2 (5 calls)", speculative, steps // 4),
    ):
        samples = []
        for _ in range(5):
            cache, ids = fresh()
            with gc_paused():
                start = time.thread_time_ns()
                run(cache, ids)
                samples.append((time.thread_time_ns() - start) / (per * REQUESTS))
        results[name] = statistics.median(samples)
    samples = []
    for _ in range(5):
        cache = PrefixCache(
            REQUESTS * (PROMPT // BLOCK + steps // BLOCK + 8), block_size=BLOCK, core="blocks"
        )
        requests = []
        for i in range(REQUESTS):
            request = cache.begin([i + 1] * PROMPT)
            cache.commit(request, PROMPT)
            requests.append(request)
        with gc_paused():
            start = time.thread_time_ns()
            whole_prompt(cache, requests)
            samples.append((time.thread_time_ns() - start) / (steps * REQUESTS))
    results["whole-prompt API: append + commit"] = statistics.median(samples)
    return results


def ordering(quick: bool) -> dict[str, dict[str, float]]:
    import torch

    from prefixkv.engine.facade import Engine
    from prefixkv.models.decoder import LlamaModel, ModelConfig
    from prefixkv.text.tokenizers import ByteTokenizer

    torch.set_num_threads(1)
    model = LlamaModel.random(ModelConfig(vocab_size=ByteTokenizer().vocab_size), seed=0)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    agents = 4
    per_agent = 4 if quick else 8
    systems = [tokens(192) for _ in range(agents)]
    # Interleaved arrivals: agent 0, 1, 2, 3, 0, 1, ... as concurrent users would send them.
    prompts = [systems[i % agents] + tokens(32) for i in range(agents * per_agent)]
    figures: dict[str, dict[str, list[float]]] = {
        policy: {"hit_rate": [], "mean_ttft_ms": [], "p90_ttft_ms": []}
        for policy in ("cache_aware", "fcfs")
    }
    for _ in range(2 if quick else 3):
        for policy in ("cache_aware", "fcfs"):
            engine = Engine(
                model,
                num_blocks=40,  # ~2.5 agents' prefixes (12 blocks each) plus running requests
                block_size=BLOCK,
                max_batch_size=4,
                max_num_batched_tokens=256,
                scheduling=policy,
            )
            results = engine.generate(prompts, max_new_tokens=4)
            ttfts = sorted(r.time_to_first_token * 1e3 for r in results)
            figures[policy]["hit_rate"].append(engine.last_stats.hit_rate)
            figures[policy]["mean_ttft_ms"].append(statistics.mean(ttfts))
            figures[policy]["p90_ttft_ms"].append(ttfts[int(0.9 * (len(ttfts) - 1))])
    return {
        policy: {name: statistics.median(values) for name, values in values_by_name.items()}
        for policy, values_by_name in figures.items()
    }


def markdown(costs: dict[str, float], orders: dict[str, dict[str, float]]) -> str:
    floor = costs["floor: num_tokens (one binding call)"]
    rows = [[name, f"{ns / 1000:.2f}", f"{ns / floor:.1f}×"] for name, ns in costs.items()]
    aware, fcfs = orders["cache_aware"], orders["fcfs"]
    order_rows = [
        [
            name,
            f"{aware[key]:.3f}" if key == "hit_rate" else f"{aware[key]:.0f}",
            f"{fcfs[key]:.3f}" if key == "hit_rate" else f"{fcfs[key]:.0f}",
            f"{(aware[key] / fcfs[key]) if fcfs[key] else float('nan'):.2f}×",
        ]
        for name, key in (
            ("hit rate (prompt tokens read from cache)", "hit_rate"),
            ("mean time to first token (ms)", "mean_ttft_ms"),
            ("p90 time to first token (ms)", "p90_ttft_ms"),
        )
    ]
    return "\n".join(
        [
            "# Scheduler benchmarks (`benches/bench_scheduler.py`)",
            "",
            f"Machine: {machine()['cpu']}, {machine()['usable_cpus']} usable CPUs (shared).",
            "",
            "## 1. Step cost per request per decode step (µs, CPU time of the calling thread)",
            "",
            md_table(["step", "µs per request", "vs one binding call"], rows),
            "",
            "## 2. Cache-aware ordering vs first-come-first-served (Engine, torch 1 thread)",
            "",
            "4 agents × their own 192-token system prompt, requests interleaved, a pool of 40",
            "blocks of 16 (about 2.5 prefixes), batches of 4, 256 tokens per step.",
            "",
            md_table(["figure", "cache-aware", "FCFS", "ratio"], order_rows),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    costs = step_costs(args.quick)
    orders = ordering(args.quick)
    write_json(RESULTS_DIR / "scheduler.json", {"step_ns": costs, "ordering": orders})
    text = markdown(costs, orders)
    (BENCH_DIR / "RESULTS-scheduler.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
