"""Time to first token of a fresh vLLM process for a long prompt another process served:
recompute against PrefixKVConnector on a loopback redis-server (both probes), and vLLM's own
CPU offloading connectors where they start on the CPU backend; and of a prompt the same
process served before, from PrefixKVConnector's host tier.

Usage (in the vLLM venv, from the repository root)::

    python benches/bench_vllm_connector.py [--model /work/models/smollm2-hf] [--prompts 3]
        [--tokens 1920] [--rows recompute verify length host offloading simple]
        [--out benches/RESULTS-vllm-connector.md]

Process A (connector on) serves `--prompts` distinct prompts of `--tokens` tokens, which fills
the store. Then each configuration runs in its own fresh process B: a short warm-up request
(so one-time start-up costs are not counted), then each long prompt once with
``max_tokens=1``, timed around ``LLM.generate`` (scheduling, the store round trips, prefill of
what is left, sampling). Every prompt is new to B's device cache, so a hit can only come from
the connector. The host-tier row cannot share a process with A (the pool is in the worker's
memory): its process serves each prompt once untimed, then times each again, with vLLM's own
prefix caching off so that the second pass can only hit the host tier. Prints a Markdown table
and writes it to `--out` with the machine line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 128


def prompt(index: int, tokens: int) -> list[int]:
    return [(i * 7919 + index * 104729) % 40000 + 100 for i in range(tokens)]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("kv_transfer"):
        transfer = KVTransferConfig(**spec["kv_transfer"])
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=spec["tokens"] + 64,
        max_num_batched_tokens=spec["tokens"] + 64,
        seed=0,
        kv_transfer_config=transfer,
        enable_prefix_caching=not spec.get("host_rerun"),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8] * 40), params, use_tqdm=False)
    if spec.get("host_rerun"):  # the first pass computes and saves into the host tier
        for index in range(spec["prompts"]):
            ids = prompt(index, spec["tokens"])
            llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
    seconds, cached = [], []
    for index in range(spec["prompts"]):
        ids = prompt(index, spec["tokens"])
        start = time.perf_counter()
        [out] = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        cached.append(int(out.num_cached_tokens or 0))
    return {"seconds": seconds, "cached": cached}


def run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "python"), env.get("PYTHONPATH", "")]
    )
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if proc.returncode != 0:
        # The engine core's own error names the cause; the front end's only says it failed.
        lines = proc.stderr.splitlines()
        causes = [line for line in lines if "Worker failed with error" in line]
        causes = causes or [line for line in lines if "Error" in line]
        cause = causes[-1] if causes else proc.stderr[-300:]
        return {"error": cause.split("RuntimeError: ")[-1].strip()[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def prefixkv(url: str, probe: str) -> dict[str, Any]:
    return {
        "kv_connector": "PrefixKVConnector",
        "kv_connector_module_path": "prefixkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"redis_url": url, "probe": probe, "timeout": 2.0},
    }


def prefixkv_host() -> dict[str, Any]:
    return {
        "kv_connector": "PrefixKVConnector",
        "kv_connector_module_path": "prefixkv.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_tier_bytes": 1 << 30},
    }


ROWS = ("recompute", "verify", "length", "host", "offloading", "simple")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/smollm2-hf")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1920)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--out", default=str(REPO / "benches" / "RESULTS-vllm-connector.md"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    sys.path.insert(0, str(REPO))
    from tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    base = {"model": args.model, "prompts": args.prompts, "tokens": args.tokens}
    rows: list[tuple[str, dict[str, Any]]] = []
    try:
        if {"verify", "length"} & set(args.rows):
            filled = run({**base, "kv_transfer": prefixkv(server.url, "verify")}, 1800)
            if "error" in filled:
                raise SystemExit(f"process A failed: {filled['error']}")
            rows.append(("process A: computes and saves (PrefixKVConnector)", filled))
        configs: list[tuple[str, str, dict[str, Any] | None]] = [
            ("recompute", "recompute (no connector)", None),
            ("verify", "PrefixKVConnector, Redis, probe=verify", prefixkv(server.url, "verify")),
            ("length", "PrefixKVConnector, Redis, probe=length", prefixkv(server.url, "length")),
            (
                "host",
                "PrefixKVConnector, host tier (same process, second pass, vLLM prefix caching off)",
                prefixkv_host(),
            ),
            (
                "offloading",
                "OffloadingConnector (CPU offload)",
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
                },
            ),
            (
                "simple",
                "SimpleCPUOffloadConnector",
                {
                    "kv_connector": "SimpleCPUOffloadConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
                },
            ),
        ]
        for row, name, transfer in configs:
            if row not in args.rows:
                continue
            spec = {**base, "kv_transfer": transfer, "host_rerun": row == "host"}
            result = run(spec, 1800)
            print(name, result, flush=True)
            rows.append((name, result))
    finally:
        server.stop()

    lines = [
        f"# PrefixKVConnector: time to first token of a fresh vLLM process ({args.tokens}-token "
        "prompt)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average at the end {os.getloadavg()[0]:.1f}); vLLM CPU backend, "
        f"{Path(args.model).name} bfloat16, block size {BLOCK_SIZE}, enforce_eager.",
        f"Command: `python benches/bench_vllm_connector.py --prompts {args.prompts} "
        f"--tokens {args.tokens} --rows {' '.join(args.rows)}`. Each row is one fresh process; "
        f"each of its {args.prompts} prompts was served by another process first (through the "
        "store for the connectors), except in the host-tier row, where the same process served "
        "it first (the host tier is per process).",
        "",
        "| configuration | TTFT median (s) | TTFT per prompt (s) | tokens from cache |",
        "| --- | --- | --- | --- |",
    ]
    for name, result in rows:
        if "error" in result:
            lines.append(f"| {name} | did not run | {result['error']} | |")
            continue
        seconds = result["seconds"]
        per = ", ".join(f"{s:.3f}" for s in seconds)
        cached = ", ".join(str(c) for c in result["cached"])
        lines.append(f"| {name} | {statistics.median(seconds):.3f} | {per} | {cached} |")
    lines += [
        "",
        "LMCache (`lmcache` 0.5.6 on PyPI) was not run: it requires `cupy-cuda13x`, ships CUDA "
        "ops (`lmcache/cuda_ops.so`) and pins `numpy<=2.2.6` against vLLM 0.32's numpy 2.3.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
