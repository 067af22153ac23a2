"""End to end: vLLM offline on SmolLM2 with prefixkv's scheduler gives vLLM's own results.

Usage: python scripts/vllm_e2e_scheduler.py [--model DIR] [--mp] [--prompt-repeats N]
                                            [--expect {full,sliding,hybrid}]
                                            [--core {auto,blocks,runs}]

Runs the same prompts (one long shared system prompt, several questions, in two rounds so the
second round hits what the first cached, plus a batch that shares prefixes within one step)
through vLLM's `LLM` twice, in separate processes: once with the stock scheduler and once with
``scheduler_cls="prefixkv.integrations.vllm.Scheduler"``, like for like (same settings, same
multiprocessing mode, greedy sampling), and requires identical token ids and identical
``num_cached_tokens`` for every request. ``--prompt-repeats`` lengthens every prompt's shared
preamble N times, so that a sliding-window model's window slides (a tiny Mistral checkpoint with
``sliding_window`` below the prompts, written by transformers' ``save_pretrained``: its blocks
then leave the window and later prompts hit past them; ``scripts/prepare_tiny_windowed.py``
writes one, and a hybrid Gemma 3 one). ``--expect`` fails the run unless prefixkv served the
model with that layout (full attention, a sliding-window cache, the hybrid manager).
``--core blocks`` or ``--core runs`` serves prefixkv's side on that core (``additional_config=
{"prefixkv": {"core": ...}}``; without it, the default "auto" picks the run core for full
attention, the block core otherwise), and ``--expect`` then also checks it ran there. CPU
backend: ``enforce_eager=True``, a small ``VLLM_CPU_KVCACHE_SPACE``, block size 128 (the CPU
attention backend's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "/work/models/smollm2-hf"
SCHEDULER = "prefixkv.integrations.vllm.Scheduler"

SYSTEM = (
    "You are a careful assistant for a team that maintains a prefix cache for language model "
    "inference. Answer briefly and precisely. The cache stores key and value tensors of "
    "prompt prefixes in fixed-size blocks, shares them between requests whose tokens match, "
    "evicts the least recently used blocks that no request holds, and must never serve a "
    "block computed under a different model, adapter or tenant salt. "
) * 3
QUESTIONS = [
    "What is a block?",
    "When may a block be evicted?",
    "Why does a tenant salt matter?",
    "What happens on preemption?",
    "Name one risk of reusing KV across models.",
    "How is a full prompt hit served?",
]


def run_one(kind: str, model: str, out: Path, repeats: int = 1, core: str = "auto") -> None:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, object] = {
        "model": model,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": 128,
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "dtype": "float32",
        "seed": 0,
    }
    if kind == "prefixkv":
        kwargs["scheduler_cls"] = SCHEDULER
        if core != "auto":
            kwargs["additional_config"] = {"prefixkv": {"core": core}}
    llm = LLM(**kwargs)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    tokenizer = llm.get_tokenizer()
    # Round 1 caches the system prompt; round 2 hits it (and round 1's own questions);
    # round 3 sends prompts that share a fresh prefix in one batch.
    fresh = (
        "A different preamble about block tables and refcounts, long enough to fill blocks. " * 8
    )
    rounds = [
        [SYSTEM * repeats + q for q in QUESTIONS[:3]],
        [SYSTEM * repeats + q for q in QUESTIONS],
        [fresh * repeats + q for q in QUESTIONS[:4]],
    ]
    results = []
    started = time.perf_counter()
    for prompts in rounds:
        for output in llm.generate(prompts, params, use_tqdm=False):
            results.append(
                {
                    "prompt_tokens": len(tokenizer.encode(output.prompt or "")),
                    "token_ids": list(output.outputs[0].token_ids),
                    "text": output.outputs[0].text,
                    "num_cached_tokens": output.num_cached_tokens,
                }
            )
    elapsed = time.perf_counter() - started
    manager = (
        llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager if not _mp() else None
    )
    out.write_text(
        json.dumps(
            {
                "kind": kind,
                "results": results,
                "seconds": elapsed,
                "manager": None if manager is None else type(manager).__name__,
                "core": getattr(getattr(manager, "prefix_cache", None), "core", None),
                # A sliding-window model served with a shorter window than its context gets a
                # sliding core cache (docs/vllm.md); None for full attention and hybrid layouts
                # (whose lanes carry their own windows).
                "window": None
                if manager is None
                or not hasattr(manager, "prefix_cache")
                or type(manager).__name__ == "HybridPrefixKVCacheManager"
                else manager.prefix_cache.sliding_window,
            }
        )
    )


def _mp() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--mp",
        action="store_true",
        help="run vLLM's engine core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1); "
        "by default both runs keep it in-process, which lets the script check which block "
        "manager ran",
    )
    parser.add_argument(
        "--prompt-repeats",
        type=int,
        default=1,
        help="repeat each prompt's shared preamble this many times (longer prompts)",
    )
    parser.add_argument(
        "--expect",
        choices=["full", "sliding", "hybrid"],
        help="fail unless prefixkv served the model with this layout (in-process runs only)",
    )
    parser.add_argument(
        "--core",
        choices=["auto", "blocks", "runs"],
        default="auto",
        help='prefixkv\'s core, through additional_config={"prefixkv": {"core": ...}} '
        "(auto, the default, gives none)",
    )
    parser.add_argument("--kind", choices=["stock", "prefixkv"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind is not None:
        run_one(args.kind, args.model, args.out, args.prompt_repeats, args.core)
        return

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: small, the machine is shared
    env.setdefault("OMP_NUM_THREADS", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"
    # The engine (and, with --mp, its core process) must import this checkout's prefixkv.
    python_dir = str(Path(__file__).resolve().parent.parent / "python")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir, env.get("PYTHONPATH")) if p)
    runs = {}
    for kind in ("stock", "prefixkv"):
        out = Path(f"/tmp/vllm_e2e_{kind}_{os.getpid()}.json")
        subprocess.run(
            [
                *(sys.executable, __file__, "--kind", kind, "--model", args.model),
                *("--out", str(out), "--prompt-repeats", str(args.prompt_repeats)),
                *("--core", args.core),
            ],
            env=env,
            check=True,
        )
        runs[kind] = json.loads(out.read_text())
        out.unlink()
    stock, ours = runs["stock"]["results"], runs["prefixkv"]["results"]
    # A layout of several KV cache groups (Gemma 3: full + sliding) gets the hybrid subclass.
    managers = ("PrefixKVCacheManager", "HybridPrefixKVCacheManager")
    if not args.mp and runs["prefixkv"]["manager"] not in managers:
        raise SystemExit(f"the prefixkv run used {runs['prefixkv']['manager']}, not prefixkv's")
    failures = []
    if args.expect is not None:
        if args.mp:
            raise SystemExit("--expect needs the engine core in-process (no --mp)")
        served = runs["prefixkv"]
        layout = (
            "hybrid"
            if served["manager"] == "HybridPrefixKVCacheManager"
            else "sliding"
            if served.get("window") is not None
            else "full"
        )
        if layout != args.expect:
            failures.append(f"prefixkv served a {layout} layout, not {args.expect}")
        # What "auto" picks: the run core for one full-attention group, else the block core.
        core = args.core if args.core != "auto" else "runs" if layout == "full" else "blocks"
        if served.get("core") != core:
            failures.append(f"prefixkv served core={served.get('core')!r}, not {core!r}")
    for i, (want, got) in enumerate(zip(stock, ours, strict=True)):
        for field in ("token_ids", "num_cached_tokens"):
            if want[field] != got[field]:
                failures.append(f"request {i}: {field} stock={want[field]} prefixkv={got[field]}")
    hits = [r["num_cached_tokens"] for r in ours]
    print(f"requests: {len(ours)}; num_cached_tokens: {hits}")
    print(f"prompt tokens: {[r['prompt_tokens'] for r in ours]}")
    if runs["prefixkv"].get("core"):
        print(f"served on prefixkv's core={runs['prefixkv']['core']!r}")
    if runs["prefixkv"]["manager"] == "HybridPrefixKVCacheManager":
        print("served with prefixkv's hybrid manager (one lane per KV cache group)")
    if runs["prefixkv"].get("window") is not None:
        print(f"served with prefixkv's sliding-window cache, window {runs['prefixkv']['window']}")
    print(
        f"seconds: stock {runs['stock']['seconds']:.1f}, prefixkv {runs['prefixkv']['seconds']:.1f}"
        f" (multiprocessing: {'on' if args.mp else 'off'})"
    )
    if not any(hits):
        failures.append("no request hit the cache: the workload does not test prefix caching")
    if failures:
        raise SystemExit("vllm_e2e_scheduler: FAILED\n" + "\n".join(failures))
    print("vllm_e2e_scheduler: identical outputs and num_cached_tokens")


if __name__ == "__main__":
    main()
