"""Per-step cost of vLLM's scheduler with prefixkv's block manager, against vLLM's own.

Usage (in a venv with vLLM, see scripts/install_vllm.sh):
    PYTHONPATH=python python benches/bench_vllm_scheduler.py [--sizes 64 256 1024] [--steps 30]

For each number of running requests, vLLM's real `Scheduler` (the unit tests' harness,
`tests/vllm/harness.py`: a mocked KV cache config and a fake model runner) runs the same
workload with the stock `KVCacheManager` and with `PrefixKVCacheManager`, on prefixkv's block
core (``additional_config={"prefixkv": {"core": "blocks"}}``) and on its run core (``"runs"``,
what "auto", the default, picks for this full-attention layout): every request shares a
64-token system prompt and adds its own 32 tokens, all are admitted and prefilled, then
`--steps` decode steps are timed, each `schedule()` plus `update_from_output()`, the engine
core's whole scheduler work per step. The two managers alternate within one run (stock,
prefixkv, stock, ...) and the ratio is of medians from that run: the machine is shared, so
absolute times move between runs more than the ratio does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from tests.vllm.harness import (
        RequestSpec,
        SchedulerSetup,
        make_request,
        make_scheduler,
        runner_output_for,
        tiny_model_dir,
    )

BLOCK_SIZE = 16
SYSTEM = tuple(range(64))


def _setup(num_requests: int, steps: int) -> SchedulerSetup:
    per_request = -(-(len(SYSTEM) + 32 + steps + 8) // BLOCK_SIZE)
    return SchedulerSetup(
        num_blocks=num_requests * per_request + 16,
        block_size=BLOCK_SIZE,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * (len(SYSTEM) + 32),
        max_model_len=1024,
    )


#: The sides: (vLLM's block manager or prefixkv's, prefixkv's core).
SIDES = {
    "stock": ("stock", "blocks"),
    "prefixkv": ("prefixkv", "blocks"),
    "runs": ("prefixkv", "runs"),
}


def step_times(model_dir: Path, side: str, num_requests: int, steps: int) -> list[float]:
    """Seconds of each timed decode step (schedule + update_from_output)."""
    kind, core = SIDES[side]
    setup = dataclasses.replace(_setup(num_requests, steps), core=core)
    scheduler = make_scheduler(model_dir, setup, kind)
    for i in range(num_requests):
        suffix = tuple(1000 + (i * 32 + j) % 50_000 for j in range(32))
        spec = RequestSpec(f"r{i}", SYSTEM + suffix, max_tokens=steps + 8)
        scheduler.add_request(make_request(spec, BLOCK_SIZE))
    # Admit and prefill everything (untimed).
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values()):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output_for(scheduler, out))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output_for(scheduler, out))
        times.append(time.perf_counter() - start)
        if len(out.num_scheduled_tokens) != num_requests:
            raise RuntimeError(f"{side}: a step ran {len(out.num_scheduled_tokens)} requests")
    return times


def prefill_seconds(
    model_dir: Path, side: str, num_requests: int, prompt_tokens: int, rounds: int
) -> float:
    """Seconds of scheduler work (schedule + update_from_output) to prefill `rounds` waves of
    `num_requests` prompts of `prompt_tokens` tokens, each half a shared prefix and half its
    own, in chunks of 8,192 batched tokens, in a pool of about two waves: the block manager
    matches, allocates, publishes and (from the third wave on) evicts thousands of blocks a
    step, where a decode step touches one."""
    shared = tuple(range(prompt_tokens // 2))
    per_request = -(-prompt_tokens // BLOCK_SIZE) + 2
    setup = dataclasses.replace(
        SchedulerSetup(
            num_blocks=2 * num_requests * per_request + 16,
            block_size=BLOCK_SIZE,
            max_num_seqs=num_requests,
            max_num_batched_tokens=8192,
            max_model_len=prompt_tokens + 64,
        ),
        core=SIDES[side][1],
    )
    scheduler = make_scheduler(model_dir, setup, SIDES[side][0])
    took = 0.0
    for wave in range(rounds):
        for i in range(num_requests):
            own = tuple(
                1000 + (wave * num_requests + i) * 7919 % 50_000 + j
                for j in range(prompt_tokens - len(shared))
            )
            spec = RequestSpec(f"w{wave}r{i}", shared + own, max_tokens=1)
            scheduler.add_request(make_request(spec, BLOCK_SIZE))
        while scheduler.requests:
            start = time.perf_counter()
            out = scheduler.schedule()
            scheduler.update_from_output(out, runner_output_for(scheduler, out))
            took += time.perf_counter() - start
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="stock/prefixkv alternations")
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="*",
        default=[],
        metavar="TOKENS",
        help="also time prefilling waves of 16 prompts of these lengths (e.g. 4096 16384)",
    )
    args = parser.parse_args()
    # The harness's tiny config says 4,096 positions; the fake runner computes nothing, so longer
    # prompts only exercise the scheduler and the block manager.
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    import vllm

    print(
        f"vLLM {vllm.__version__}, Python {platform.python_version()}, {platform.machine()}; "
        "shared machine: compare the ratio, not the absolute times"
    )
    print(
        "| running requests | stock ms/step | prefixkv ms/step | prefixkv / stock "
        '| core="runs" ms/step | core="runs" / stock |'
    )
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(Path(tmp))
        for size in args.sizes:
            samples: dict[str, list[float]] = {side: [] for side in SIDES}
            for _ in range(args.rounds):
                for side in SIDES:
                    samples[side] += step_times(model_dir, side, size, args.steps)
            ms = {side: statistics.median(samples[side]) * 1e3 for side in SIDES}
            print(
                f"| {size} | {ms['stock']:.2f} | {ms['prefixkv']:.2f} | "
                f"{ms['prefixkv'] / ms['stock']:.2f} | {ms['runs']:.2f} | "
                f"{ms['runs'] / ms['stock']:.2f} |",
                flush=True,
            )
        if args.prefill:
            print()
            print(
                "| prompt tokens (16 a wave, 4 waves) | stock ms | prefixkv ms | prefixkv / stock "
                '| core="runs" ms | core="runs" / stock |'
            )
            print("|---:|---:|---:|---:|---:|---:|")
        for tokens in args.prefill:
            runs: dict[str, list[float]] = {side: [] for side in SIDES}
            for _ in range(args.rounds):
                for side in SIDES:
                    runs[side].append(prefill_seconds(model_dir, side, 16, tokens, 4))
            ms = {side: min(runs[side]) * 1e3 for side in SIDES}
            print(
                f"| {tokens:,} | {ms['stock']:.1f} | {ms['prefixkv']:.1f} | "
                f"{ms['prefixkv'] / ms['stock']:.2f} | {ms['runs']:.1f} | "
                f"{ms['runs'] / ms['stock']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
