"""Speed on a real model, against transformers on the same weights, prompts and thread count.

    python benches/real_model.py --model SmolLM2-135M-Instruct.Q4_1.gguf [--threads 1] [--quick]

`--model` is a GGUF file or a Hugging Face directory (`prefixkv.models.checkpoint.load_checkpoint`).
Both sides compute in float32 from the same weights: ours as loaded (a GGUF is dequantized),
transformers' from a directory our loader writes (`save_pretrained`), so the comparison is of
the two forward paths, not of two quantizations. Prompts are real text (the demo's agent
prompt, repeated and cut) through the checkpoint's own tokenizer.

Sections, each timed ours / theirs interleaved repetition by repetition, medians:

1. **Prefill tokens/s, uncached**, prompts of 512 to 4,096 tokens. Ours: `LlamaModel.prefill`
   into fresh pages. Theirs: one forward with ``use_cache=True`` (what `generate` does first).
2. **Time to first token at 0 / 50 / 90% cached**, a 2,048-token prompt. Ours: `Engine.generate`
   of the prompt (``max_new_tokens=1``) after another request sharing the cached part. Theirs:
   the full prefill (transformers shares nothing between requests by default), and its own
   prefix reuse: a copy of the prefix's ``DynamicCache`` (copy included in the time) plus a
   forward of the suffix.
3. **Decode tokens/s** at batch 1 and 8 (prompts of 256 tokens, 32 steps). Ours:
   `LlamaModel.decode_step` over paged KV. Theirs: a forward of ``[batch, 1]`` with
   ``past_key_values``.

Clock: with one CPU thread, the CPU time of the calling thread (`benches.common.now`), which
leaves out other processes' time slices on a shared machine; with more threads, or on CUDA,
wall time (CUDA synchronised). The figures are written to ``benches/results/real_model.json``
and printed as the table `docs/real_model.md` shows.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixkv.apps.demo_workload import build_workload
from prefixkv.engine.facade import Engine
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.checkpoint import load_checkpoint
from prefixkv.models.decoder import DecodeRequest, LlamaModel, PrefillRequest

RESULTS = Path(__file__).resolve().parent / "results" / "real_model.json"
BLOCK = 16


def _clock(device: torch.device, threads: int) -> tuple[str, Callable[[], float]]:
    if device.type == "cuda":

        def cuda_now() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return "wall (CUDA synchronised)", cuda_now
    if threads == 1:
        return "CPU time of the calling thread", time.thread_time
    return "wall", time.perf_counter


def _prompt_ids(tokenizer: Any, template: Any, length: int, salt: int = 0) -> list[int]:
    """`length` token ids of real text: the demo's agent prompts, one after another."""
    ids: list[int] = []
    seed = salt
    while len(ids) < length:
        for request in build_workload(4, seed, stable_first=True, tools_in_system_prompt=True):
            text = template.render(request["messages"]) if template else str(request)
            ids += tokenizer.encode(text)
        seed += 1
    return ids[:length]


def _pages(model: LlamaModel, tokens: int) -> tuple[PagedKVCache, list[int]]:
    config = model.config
    blocks = -(-tokens // BLOCK) + 1
    kv = PagedKVCache(
        config.num_layers,
        blocks,
        BLOCK,
        config.num_kv_heads,
        config.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    return kv, list(range(blocks))


def _median_pair(
    ours: Callable[[], None], theirs: Callable[[], None], now: Callable[[], float], repeats: int
) -> tuple[float, float]:
    """Median seconds of each, interleaved so drift in the machine's load hits both alike."""
    ours()  # warm-up: first allocations at this size
    theirs()
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, samples[0]), (theirs, samples[1])):
            start = now()
            fn()
            out.append(now() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])


@torch.no_grad()
def bench_prefill(
    model: LlamaModel, hf: Any, prompt: list[int], lengths: list[int], now: Any, repeats: int
) -> list[dict[str, Any]]:
    rows = []
    for length in lengths:
        ids = prompt[:length]
        tensor = torch.tensor([ids], device=model.device)

        def ours(ids: list[int] = ids) -> None:
            kv, table = _pages(model, len(ids))
            model.prefill(kv, [PrefillRequest(ids, table)])

        def theirs(tensor: torch.Tensor = tensor) -> None:
            hf(tensor, use_cache=True)

        ours_s, theirs_s = _median_pair(ours, theirs, now, repeats)
        rows.append(
            {
                "tokens": length,
                "ours_tok_s": length / ours_s,
                "transformers_tok_s": length / theirs_s,
                "ratio": theirs_s / ours_s,
            }
        )
        print(
            f"  prefill {length:>5}: ours {length / ours_s:8.0f} tok/s, transformers {length / theirs_s:8.0f} tok/s",
            file=sys.stderr,
        )
    return rows


def bench_ttft(
    model: LlamaModel, hf: Any, prompt: list[int], other: list[int], now: Any, repeats: int
) -> list[dict[str, Any]]:
    """`prompt` and `other` differ from their first token on (the 0% case)."""
    return [_ttft_row(model, hf, prompt, other, f, now, repeats) for f in (0.0, 0.5, 0.9)]


@torch.no_grad()
def _ttft_row(
    model: LlamaModel,
    hf: Any,
    prompt: list[int],
    other: list[int],
    fraction: float,
    now: Any,
    repeats: int,
) -> dict[str, Any]:
    length = len(prompt)
    tensor = torch.tensor([prompt], device=model.device)
    shared = int(length * fraction) // BLOCK * BLOCK
    warm = prompt[:shared] + other[shared:length]
    if warm[shared] == prompt[shared]:
        warm[shared] = (warm[shared] + 1) % model.config.vocab_size
    engines: list[Engine] = []
    results: list[Any] = []

    def fresh_engine() -> None:
        engine = Engine(model, num_blocks=2 * length // BLOCK + 8, block_size=BLOCK)
        engine.generate([warm], 1)  # untimed: puts the shared part in the cache
        engines.append(engine)

    def ours() -> None:
        results.append(engines[-1].generate([prompt], 1)[0])

    prefix = torch.tensor([prompt[:shared]], device=model.device)
    prefix_cache = hf(prefix, use_cache=True).past_key_values if shared else None
    suffix = tensor[:, shared:]

    def theirs_reuse() -> None:
        cache = copy.deepcopy(prefix_cache) if prefix_cache is not None else None
        hf(suffix, past_key_values=cache, use_cache=True)

    def theirs_full() -> None:
        hf(tensor, use_cache=True)

    samples: dict[str, list[float]] = {"ours": [], "reuse": [], "full": []}
    fresh_engine()
    ours()  # warm-up
    theirs_reuse()
    for _ in range(repeats):
        fresh_engine()
        for name, fn in (("ours", ours), ("reuse", theirs_reuse), ("full", theirs_full)):
            start = now()
            fn()
            samples[name].append(now() - start)
    row = {
        "prompt_tokens": length,
        "cached_tokens": results[-1].cached_tokens,
        "ours_ttft_s": statistics.median(samples["ours"]),
        "transformers_prefix_reuse_ttft_s": statistics.median(samples["reuse"]),
        "transformers_full_prefill_s": statistics.median(samples["full"]),
    }
    print(
        f"  ttft {row['cached_tokens']:>4}/{length} cached: ours {row['ours_ttft_s'] * 1e3:7.0f} ms, "
        f"transformers reuse {row['transformers_prefix_reuse_ttft_s'] * 1e3:7.0f} ms, "
        f"full {row['transformers_full_prefill_s'] * 1e3:7.0f} ms",
        file=sys.stderr,
    )
    return row


@torch.no_grad()
def bench_decode(
    model: LlamaModel, hf: Any, prompts: list[list[int]], steps: int, now: Any, repeats: int
) -> dict[str, Any]:
    batch = len(prompts)
    length = len(prompts[0])
    next_token = [p[-1] for p in prompts]

    def ours() -> None:
        kv, _ = _pages(model, batch * (length + steps))
        per = -(-(length + steps) // BLOCK)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
        sequences = [list(p) for p in prompts]
        model.prefill(kv, [PrefillRequest(s, t) for s, t in zip(sequences, tables, strict=True)])
        start = now()
        for _ in range(steps):
            for sequence, token in zip(sequences, next_token, strict=True):
                sequence.append(token)
            model.decode_step(
                kv, [DecodeRequest(s, t) for s, t in zip(sequences, tables, strict=True)]
            )
        timings.append(now() - start)

    def theirs() -> None:
        out = hf(torch.tensor(prompts, device=model.device), use_cache=True)
        cache = out.past_key_values
        tokens = torch.tensor([[t] for t in next_token], device=model.device)
        start = now()
        for _ in range(steps):
            cache = hf(tokens, past_key_values=cache, use_cache=True).past_key_values
        timings.append(now() - start)

    timings: list[float] = []
    ours()
    theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        timings.clear()
        ours()
        theirs()
        ours_s.append(timings[0])
        theirs_s.append(timings[1])
    row = {
        "batch": batch,
        "context_tokens": length,
        "steps": steps,
        "ours_tok_s": batch * steps / statistics.median(ours_s),
        "transformers_tok_s": batch * steps / statistics.median(theirs_s),
    }
    print(
        f"  decode batch {batch}: ours {row['ours_tok_s']:7.1f} tok/s, transformers {row['transformers_tok_s']:7.1f} tok/s",
        file=sys.stderr,
    )
    return row


def bench_threads_under_load(
    model: str, tokens: int, thread_counts: list[int], busy: list[int], timeout: float
) -> list[dict[str, Any]]:
    """One `tokens`-token prefill, in a fresh process per run, with each torch thread count,
    while `busy` other processes spin on the CPUs (started and stopped here). Wall time: what a
    user waits. A run past `timeout` seconds is stopped and reported as such."""
    import subprocess

    rows = []
    for hogs in busy:
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)
        ]
        try:
            time.sleep(1.0 if hogs else 0.0)
            for threads in thread_counts:
                command = [
                    sys.executable,
                    __file__,
                    "--model",
                    model,
                    "--prefill-once",
                    str(tokens),
                ]
                command += ["--threads", str(threads)]
                try:
                    done = subprocess.run(
                        command, capture_output=True, text=True, timeout=timeout, check=True
                    )
                    seconds: float | None = float(done.stdout.split()[-1])
                except subprocess.TimeoutExpired:
                    seconds = None
                rows.append(
                    {"other_busy_processes": hogs, "threads": threads, "prefill_s": seconds}
                )
                shown = (
                    f"{seconds:.1f} s" if seconds is not None else f"> {timeout:.0f} s (stopped)"
                )
                print(f"  {hogs} busy processes, {threads} thread(s): {shown}", file=sys.stderr)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    return rows


def _prefill_once(model_path: str, tokens: int) -> None:
    """Child of `bench_threads_under_load`: prints the wall seconds of one prefill."""
    checkpoint = load_checkpoint(model_path)
    ids = _prompt_ids(checkpoint.tokenizer, checkpoint.chat_template, tokens)
    kv, table = _pages(checkpoint.model, tokens)
    start = time.perf_counter()
    checkpoint.model.prefill(kv, [PrefillRequest(ids, table)])
    print(f"{time.perf_counter() - start:.3f}")


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"model: {result['model']}; {result['device']}, {result['threads']} thread(s), float32; clock: {result['clock']}",
        "",
        "| prefill, uncached | prefixkv | transformers | prefixkv / transformers |",
        "|---|---:|---:|---:|",
    ]
    for row in result["prefill"]:
        lines.append(
            f"| {row['tokens']:,} tokens | {row['ours_tok_s']:,.0f} tok/s | {row['transformers_tok_s']:,.0f} tok/s | {row['ratio']:.2f}x |"
        )
    lines += [
        "",
        "| time to first token, {:,}-token prompt | prefixkv | transformers, prefix reuse | transformers, full prefill |".format(
            result["ttft"][0]["prompt_tokens"]
        ),
        "|---|---:|---:|---:|",
    ]
    for row in result["ttft"]:
        share = row["cached_tokens"] / row["prompt_tokens"]
        lines.append(
            f"| {row['cached_tokens']:,} cached ({share:.0%}) | {row['ours_ttft_s'] * 1e3:,.0f} ms | {row['transformers_prefix_reuse_ttft_s'] * 1e3:,.0f} ms | {row['transformers_full_prefill_s'] * 1e3:,.0f} ms |"
        )
    lines += [
        "",
        "| decode | prefixkv | transformers | prefixkv / transformers |",
        "|---|---:|---:|---:|",
    ]
    for row in result["decode"]:
        lines.append(
            f"| batch {row['batch']} ({row['context_tokens']}-token context) | {row['ours_tok_s']:,.1f} tok/s | {row['transformers_tok_s']:,.1f} tok/s | {row['ours_tok_s'] / row['transformers_tok_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or a Hugging Face directory")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, both sides (default 1)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="512-2048 tokens, 1 repetition")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--only-threads",
        action="store_true",
        help="only the thread-count-under-load section (results/real_model_threads.json)",
    )
    parser.add_argument("--prefill-once", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prefill_once:
        torch.set_num_threads(args.threads)
        _prefill_once(args.model, args.prefill_once)
        return 0
    if args.only_threads:
        from prefixkv.engine.threads import available_cpus

        cpus = available_cpus()
        rows = bench_threads_under_load(args.model, 1487, sorted({1, cpus}), [0, cpus], 150.0)
        output = RESULTS.with_name("real_model_threads.json")
        output.write_text(
            json.dumps({"cpus": cpus, "prefill_tokens": 1487, "rows": rows}, indent=2) + "\n"
        )
        return 0

    import transformers

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock_name, now = _clock(device, args.threads)
    repeats = 1 if args.quick else args.repeats
    checkpoint = load_checkpoint(args.model, device=device)
    model = checkpoint.model
    with tempfile.TemporaryDirectory() as directory:
        model.to("cpu").save_pretrained(directory)
        hf = (
            transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            .to(device)
            .eval()
        )
    model = model.to(device)
    lengths = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096]
    prompt = _prompt_ids(checkpoint.tokenizer, checkpoint.chat_template, max(lengths))
    other = _prompt_ids(checkpoint.tokenizer, checkpoint.chat_template, 2048, salt=100)
    print(f"prefill ({clock_name})", file=sys.stderr)
    result: dict[str, Any] = {
        "model": checkpoint.describe(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": args.threads,
        "clock": clock_name,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": hf.config._attn_implementation,
    }
    result["prefill"] = bench_prefill(model, hf, prompt, lengths, now, repeats)
    result["ttft"] = bench_ttft(model, hf, prompt[:2048], other, now, repeats)
    decode_prompts = [
        _prompt_ids(checkpoint.tokenizer, checkpoint.chat_template, 256, salt=200 + i)
        for i in range(8)
    ]
    result["decode"] = [
        bench_decode(model, hf, decode_prompts[:batch], 32, now, repeats) for batch in (1, 8)
    ]
    result["machine_after"] = f"load average {os.getloadavg()[0]:.1f}"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
