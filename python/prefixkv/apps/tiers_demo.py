"""A demo of the tiers: one prompt served by recompute, a device hit, a host hit and a remote
hit, with the time to first token of each.

    python -m prefixkv.apps.tiers_demo                       # starts a redis-server on loopback
    python -m prefixkv.apps.tiers_demo --redis-url redis://host:6379/0

The remote hit is served to a second, fresh engine (as another process sharing the store would
be); every output is checked against a full recompute.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import subprocess
import time

import torch

from prefixkv import Engine
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.tiers.remote import RedisStore


def _start_server() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "no redis-server on PATH: pass --redis-url, or apt-get install redis-server"
        )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("redis-server did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixkv.apps.tiers_demo", description=__doc__)
    parser.add_argument("--redis-url", help="a running Valkey/Redis (default: start one)")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    server = None
    url = args.redis_url
    if url is None:
        server, url = _start_server()
    try:
        config = ModelConfig(
            vocab_size=259, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, intermediate_size=256,
            max_position_embeddings=max(2048, 2 * args.prompt_tokens),
        )  # fmt: skip
        model = LlamaModel.random(config, seed=0)
        rng = random.Random(0)
        prompts = [[rng.randrange(259) for _ in range(args.prompt_tokens)] for _ in range(3)]
        num_blocks = args.prompt_tokens // args.block_size + 4
        namespace = f"prefixkv-demo-{time.time_ns()}"

        def engine(host: bool) -> Engine:
            per_block = 2 * config.num_layers * args.block_size * config.num_kv_heads * 32 * 4
            return Engine(
                model, num_blocks=num_blocks, block_size=args.block_size,
                max_num_batched_tokens=args.prompt_tokens,
                host_tier_bytes=3 * num_blocks * per_block if host else None,
                remote_store=RedisStore(url, timeout=0.5), remote_namespace=namespace,
            )  # fmt: skip

        first = engine(host=True)
        rows = []

        def serve(name: str, on: Engine, prompt: list[int]) -> None:
            assert on.tiers is not None
            before = (on.tiers.stats.host_hit_blocks, on.tiers.stats.remote_hit_blocks)
            result = on.generate([prompt], max_new_tokens=4, check_exactness=True)[0]
            host = on.tiers.stats.host_hit_blocks - before[0]
            remote = on.tiers.stats.remote_hit_blocks - before[1]
            device = result.cached_tokens // args.block_size - host - remote
            rows.append((name, result, device, host, remote))

        serve("recompute", first, prompts[0])
        serve("device hit", first, prompts[0])
        first.generate(prompts[1:], max_new_tokens=1)  # evicts prompt 0 to the host tier
        serve("host hit", first, prompts[0])
        assert first.tiers is not None and first.tiers.remote is not None
        first.tiers.remote.flush(timeout=30)
        second = engine(host=False)
        serve("remote hit (fresh engine)", second, prompts[0])
        print(f"{args.prompt_tokens}-token prompt, block size {args.block_size}, store {url}")
        print(f"{'served by':28} {'TTFT':>10} {'device':>7} {'host':>6} {'remote':>7}  exact")
        for name, result, device, host, remote in rows:
            print(
                f"{name:28} {result.time_to_first_token * 1e3:8.1f}ms {device:7} {host:6} "
                f"{remote:7}  {result.tokens_match}"
            )
        for on in (first, second):
            if on.tiers is not None:
                on.tiers.close()
        return 0 if all(r.tokens_match for _, r, *_ in rows) else 1
    finally:
        if server is not None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    raise SystemExit(main())
