"""The KV tiers (docs/tiers.md): what a host or remote hit saves, what the copies cost, and
what a dead remote store costs the scheduler.

    python benches/bench_tiers.py          # ~1 minute on 2 cores; needs redis-server on PATH
                                           # writes results/tiers.json, RESULTS-tiers.md

1. Time to first token of one 4,096-token prompt (a random Llama-shaped model, torch on one
   thread, block size 16) served by recompute, a device hit, a host hit (the prompt was evicted
   to the host tier by another one) and a remote hit (a fresh engine, the blocks in a
   redis-server on loopback, written by another engine). Median of 3. The engine runs with its
   default step budget (2,048 tokens), shorter than the prompt: a tier hit is loaded whole at
   admission all the same, and only the last block is computed.
2. Host copy bandwidth: the host tier's save (device pages -> host pool, blocks scattered in
   both) and load, against one plain `copy_` of the same number of contiguous bytes, same run.
3. Remote fetch: `RemoteTier.fetch` of runs of 16 blocks (one MGET, verified), throughput and
   p99 latency.
4. Stall while the remote store is down: a full `generate` against a server that accepts
   connections and never answers (the worst case: every call waits its timeout), against the
   same call without a remote tier, with the store's timeout beside it.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from common import BENCH_DIR, RESULTS_DIR, machine, md_table, write_json
from tests.redis_server import RedisServer

from prefixkv import Engine
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.tiers import RedisStore

torch.set_num_threads(1)

CONFIG = ModelConfig(
    vocab_size=259, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
    intermediate_size=512, max_position_embeddings=8192,
)  # fmt: skip
BLOCK = 16


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 259, (length,), generator=generator).tolist()


def ttft(engine: Engine, tokens: list[int]) -> tuple[float, int]:
    result = engine.generate([tokens], max_new_tokens=1)[0]
    return result.time_to_first_token, result.cached_tokens


def bench_ttft(model: LlamaModel, url: str, length: int, repeats: int) -> list[list[Any]]:
    blocks = length // BLOCK + 8
    per_block = 2 * CONFIG.num_layers * BLOCK * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    rows: dict[str, list[tuple[float, int]]] = {
        "recompute": [],
        "device": [],
        "host": [],
        "remote": [],
    }
    for r in range(repeats):
        a, b = prompt(100 + r, length), prompt(200 + r, length)
        namespace = f"bench-{time.time_ns()}"
        engine = Engine(
            model, num_blocks=blocks, block_size=BLOCK,
            host_tier_bytes=3 * blocks * per_block, remote_store=RedisStore(url, timeout=1.0),
            remote_namespace=namespace,
        )  # fmt: skip
        rows["recompute"].append(ttft(engine, a))
        rows["device"].append(ttft(engine, a))
        ttft(engine, b)  # evict a to the host tier, all of it:
        ttft(engine, prompt(400 + r, length))
        assert engine.tiers is not None and engine.tiers.remote is not None
        rows["host"].append(ttft(engine, a))
        assert engine.tiers.stats.host_hit_blocks == (length - 1) // BLOCK, engine.tiers.stats
        assert engine.tiers.stats.remote_hit_blocks == 0
        engine.tiers.remote.flush(timeout=60)
        fresh = Engine(
            model, num_blocks=blocks, block_size=BLOCK,
            remote_store=RedisStore(url, timeout=1.0), remote_namespace=namespace,
        )  # fmt: skip
        rows["remote"].append(ttft(fresh, a))
        assert fresh.tiers is not None
        assert fresh.tiers.stats.remote_hit_blocks == (length - 1) // BLOCK, fresh.tiers.stats
        engine.tiers.close()
        assert fresh.tiers is not None
        fresh.tiers.close()
    out = []
    base = statistics.median(t for t, _ in rows["recompute"])
    for name, samples in rows.items():
        median = statistics.median(t for t, _ in samples)
        out.append([name, f"{median * 1e3:.1f} ms", samples[-1][1], f"{base / median:.1f}x"])
    return out


def bench_host_copy(repeats: int) -> list[list[Any]]:
    from prefixkv.kv.pages import PagedKVCache
    from prefixkv.tiers.host import BlockRecord, HostTier

    num_blocks, moved = 512, 256
    device = PagedKVCache(8, num_blocks, BLOCK, 8, 64, dtype=torch.float16)
    device.storage.normal_()
    host = HostTier(device, moved * device.bytes_per_block)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randperm(num_blocks, generator=generator)[:moved].tolist()
    records = [(b, BlockRecord(i.to_bytes(32, "little"), None, ())) for i, b in enumerate(ids)]
    nbytes = moved * device.bytes_per_block
    source = torch.empty(nbytes // 2, dtype=torch.float16).normal_()
    target = torch.empty_like(source)
    times: dict[str, list[float]] = {
        "plain copy_": [],
        "host save (scattered device blocks)": [],
        "host load (scattered device blocks)": [],
        "host load (consecutive device blocks)": [],
    }
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times["plain copy_"].append(time.perf_counter() - start)
        host.clear()
        start = time.perf_counter()
        host.save(device, records)
        times["host save (scattered device blocks)"].append(time.perf_counter() - start)
        start = time.perf_counter()
        host.load(device, [r for _, r in records], ids)
        times["host load (scattered device blocks)"].append(time.perf_counter() - start)
        host.save(device, records)
        start = time.perf_counter()
        host.load(device, [r for _, r in records], list(range(moved)))
        times["host load (consecutive device blocks)"].append(time.perf_counter() - start)
    plain = statistics.median(times["plain copy_"])
    return [
        [
            name,
            f"{nbytes / statistics.median(t) / 1e9:.2f} GB/s",
            f"{plain / statistics.median(t):.0%}",
        ]
        for name, t in times.items()
    ]


def bench_remote_fetch(model: LlamaModel, url: str, length: int, repeats: int) -> list[list[Any]]:
    engine = Engine(
        model, num_blocks=length // BLOCK + 8, block_size=BLOCK,
        remote_store=RedisStore(url, timeout=1.0), remote_namespace="bench-fetch",
    )  # fmt: skip
    tokens = prompt(7, length)
    engine.generate([tokens], max_new_tokens=1)
    assert engine.tiers is not None and engine.tiers.remote is not None
    remote = engine.tiers.remote
    remote.flush(timeout=60)
    from prefixkv.tiers.host import BlockRecord

    keys = engine.cache.block_keys(tokens)
    records = [
        BlockRecord(keys[j], keys[j - 1] if j else None, tuple(tokens[j * BLOCK : (j + 1) * BLOCK]))
        for j in range(len(keys))
    ]
    context = engine.cache.context.fingerprint()
    run = 16
    latencies = []
    for i in range(repeats):
        j = (i * run) % (len(records) - run)
        start = time.perf_counter()
        served = remote.fetch(
            records[j : j + run], context, torch.float32, engine.tiers.block_shape
        )
        latencies.append(time.perf_counter() - start)
        assert len(served) == run
    per_block = engine.kv_cache.bytes_per_block
    engine.tiers.close()
    latencies.sort()
    p50 = latencies[len(latencies) // 2]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return [[
        f"{run} blocks x {per_block // 1024} KiB", f"{run * per_block / statistics.mean(latencies) / 1e6:.0f} MB/s",
        f"{p50 * 1e3:.2f} ms", f"{p99 * 1e3:.2f} ms",
    ]]  # fmt: skip


def bench_stall(model: LlamaModel, timeout: float) -> list[list[Any]]:
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(64)  # accepts into the backlog, never answers
    url = f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0"
    prompts = [prompt(300 + i, 256) for i in range(8)]
    rows = []
    try:
        for name, store in (
            ("no remote tier", None),
            ("remote down", RedisStore(url, timeout=timeout)),
        ):
            engine = Engine(model, num_blocks=256, block_size=BLOCK, remote_store=store)
            start = time.perf_counter()
            engine.generate(prompts, max_new_tokens=8)
            elapsed = time.perf_counter() - start
            stats = engine.tiers.remote.stats if engine.tiers and engine.tiers.remote else None
            if engine.tiers is not None:
                engine.tiers.close()
            rows.append([
                name, f"{elapsed * 1e3:.0f} ms",
                "-" if stats is None else f"{stats.errors} failed, {stats.skipped} skipped",
            ])  # fmt: skip
    finally:
        blackhole.close()
    base = float(rows[0][1].split()[0])
    rows[1].append(
        f"+{float(rows[1][1].split()[0]) - base:.0f} ms (timeout {timeout * 1e3:.0f} ms)"
    )
    rows[0].append("")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    length = 3077 if args.quick else 4096  # both longer than one step's budget
    repeats = 1 if args.quick else 3
    model = LlamaModel.random(CONFIG, seed=0)
    server = RedisServer()
    server.start()
    try:
        ttft_rows = bench_ttft(model, server.url, length, repeats)
        fetch_rows = bench_remote_fetch(model, server.url, length, 50 if args.quick else 400)
    finally:
        server.stop()
    copy_rows = bench_host_copy(3 if args.quick else 10)
    stall_rows = bench_stall(model, timeout=0.1)
    info = machine()
    results = {
        "machine": info,
        "ttft": ttft_rows,
        "host_copy": copy_rows,
        "remote_fetch": fetch_rows,
        "stall": stall_rows,
    }
    write_json(RESULTS_DIR / "tiers.json", results)
    text = "\n\n".join([
        "# KV tiers (`python benches/bench_tiers.py`)",
        f"Machine: {info['cpu']}, {info['usable_cpus']} usable CPUs, torch {info['torch']} "
        f"({info['torch_threads']} thread), CUDA: {info['cuda']}; redis-server on loopback.",
        f"## Time to first token, {length}-token prompt\n\n"
        + md_table(["served by", "TTFT (median)", "cached tokens", "vs recompute"], ttft_rows),
        "## Host copy bandwidth (256 scattered blocks of 256 KiB, fp16)\n\n"
        + md_table(["copy", "bandwidth", "of plain copy_"], copy_rows),
        "## Remote fetch (one verified MGET per run)\n\n"
        + md_table(["run", "throughput", "p50", "p99"], fetch_rows),
        "## Scheduler stall while the remote store is down (8 requests x 256 tokens, 8 new)\n\n"
        + md_table(["remote", "generate", "remote calls", "extra"], stall_rows),
    ]) + "\n"  # fmt: skip
    if not args.quick:
        (BENCH_DIR / "RESULTS-tiers.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
