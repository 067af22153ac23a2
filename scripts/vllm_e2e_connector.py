"""End-to-end check of PrefixKVConnector: vLLM offline (CPU backend, SmolLM2), two processes
sharing one redis-server on loopback, and one process over the host tier alone.

Usage (in the vLLM venv, from the repository root; `make vllm-test` runs it)::

    python scripts/vllm_e2e_connector.py [--model /work/models/smollm2-hf]

Every engine runs in its own fresh process (a new vLLM, an empty device prefix cache), so a
hit can only come from the store:

1. baseline: no connector, prompt B -> the reference output.
2. A (connector) serves prompt A; it shares a long prefix with prompt B.
3. B (connector, fresh process) serves prompt B: num_cached_tokens > 0 (from the store), and
   the output equals the baseline.
4. One stored value corrupted: with the default probe ("verify") B claims only the blocks
   before it; with probe="length" B claims it, the worker's verification fails, vLLM
   recomputes (kv_load_failure_policy="recompute"). Both outputs equal the baseline.
5. Another dtype, another model fingerprint: no hit.
6. Control: every stored value's KV replaced by noise under a valid header and checksum; B
   loads it (a hit) and its output must change, which shows the loaded KV is what B reads.
7. Host tier alone (no redis_url), one engine with vLLM's prefix caching off, so a hit can
   only come from the connector's host tier; the engine core runs in the script's process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the check can reach the worker's host pool. A
   then B in the same engine: B's shared prefix is loaded from the host (num_cached_tokens
   and the worker's counters) with output equal to the baseline; one host slot's bytes
   corrupted: a load error, recomputed, output equal to the baseline; every slot's bytes
   replaced by noise under valid digests: loaded, and the output changes.

Exits non-zero, naming the failed check, if any check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 128
MAX_TOKENS = 12
CHECKS = ("share", "corrupt", "isolation", "noise", "host")


def prompts() -> tuple[list[int], list[int]]:
    """Token ids (fixed, no tokenizer involved): a 5.5-block shared prefix, two suffixes."""
    shared = [(i * 7919) % 40000 + 100 for i in range(5 * BLOCK_SIZE + 64)]
    return [*shared, 17, 23, 99, 4021, 311], [*shared, 512, 77, 1999, 6, 820, 13]


# -- one engine, in a child process -----------------------------------------------------------


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Child process: one vLLM engine, one prompt; its output and what it counted cached."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("connector"):
        transfer = KVTransferConfig(
            kv_connector="PrefixKVConnector",
            kv_connector_module_path="prefixkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=transfer,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    [output] = llm.generate(TokensPrompt(prompt_token_ids=spec["prompt"]), params)
    return {
        "tokens": list(output.outputs[0].token_ids),
        "num_cached_tokens": int(output.num_cached_tokens or 0),
    }


def run_host_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Child process: the host-tier checks (7.) in one engine whose core runs here."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from prefixkv.integrations.vllm.connector_host import _digest

    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PrefixKVConnector",
            kv_connector_module_path="prefixkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"host_tier_bytes": spec["host_tier_bytes"]},
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    worker = get_kv_transfer_group().worker_side
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    pool = worker.host

    def generate(prompt: list[int]) -> dict[str, Any]:
        before = (worker.stats.host_loaded_blocks, worker.stats.load_error_blocks)
        [output] = llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)
        assert pool.flush(30), "host digests did not finish"
        return {
            "tokens": list(output.outputs[0].token_ids),
            "num_cached_tokens": int(output.num_cached_tokens or 0),
            "host_loaded_blocks": worker.stats.host_loaded_blocks - before[0],
            "load_error_blocks": worker.stats.load_error_blocks - before[1],
        }

    result: dict[str, Any] = {"A": generate(spec["prompt_a"]), "B": generate(spec["prompt_b"])}
    # One slot of B's chain: a bit of its KV flipped, the digest left as it was.
    records = scheduler.keys_per_rank[0].records(spec["prompt_b"], 5)
    slots = scheduler.host.match(records)
    result["slots_of_b"] = len(slots)
    pool.slots[slots[2].slot].view(torch.uint8).view(-1)[1000] ^= 0x01
    result["corrupt"] = generate(spec["prompt_b"])
    # Control: noise on the scale of the real KV, under digests that match it.
    generator = torch.Generator().manual_seed(0)
    for slot in scheduler.host.match(records):
        real = pool.slots[slot.slot].float()
        noise = torch.randn(real.shape, generator=generator) * real.abs().max()
        pool.slots[slot.slot] = noise.to(pool.slots.dtype)
        content = pool._contents[slot.slot]
        pool._contents[slot.slot] = type(content)(
            content.generation, content.record, _digest(pool.slots[slot.slot])
        )
    result["noise"] = generate(spec["prompt_b"])
    return result


def in_fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "python"), env.get("PYTHONPATH", "")]
    )
    if spec.get("host_checks"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"engine process failed ({proc.returncode}): {spec.get('name')}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    # The worker logs each load error (connector_worker); the engine core may be another
    # process, so its log is the evidence the parent can read.
    result["load_errors_logged"] = "could not be loaded" in proc.stderr
    return result


# -- store surgery ----------------------------------------------------------------------------


def split_value(value: bytes) -> tuple[bytes, bytes]:
    """(header, payload) of a prefixkv block value (layout in prefixkv/tiers/format.py)."""
    ndim = value[7]
    offset = 8 + 4 * ndim + 3 * 32
    (num_tokens,) = struct.unpack_from("<I", value, offset)
    offset += 4 + 4 * num_tokens
    (payload_len,) = struct.unpack_from("<Q", value, offset)
    header_len = offset + 8
    assert len(value) == header_len + 16 + payload_len, "not a prefixkv block value"
    return value[:header_len], value[header_len + 16 :]


def with_payload(header: bytes, payload: bytes) -> bytes:
    checksum = hashlib.blake2b(header, digest_size=16)
    checksum.update(payload)
    return header + checksum.digest() + payload


def chain_keys(client: Any, namespace: str) -> list[bytes]:
    """The stored keys in prefix order (a value's parent is the previous block's key)."""
    keys = client.keys(f"{namespace}:*")
    parents: dict[bytes, bytes] = {}
    for key in keys:
        header, _ = split_value(client.get(key))
        ndim = header[7]
        parent = header[8 + 4 * ndim + 32 : 8 + 4 * ndim + 64]
        parents[key] = parent
    by_parent = {parent: key for key, parent in parents.items()}
    chain, parent = [], bytes(32)
    while parent in by_parent:
        key = by_parent[parent]
        chain.append(key)
        parent = bytes.fromhex(key.decode().split(":")[1])
    return chain


# -- the checks -------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/work/models/smollm2-hf")
    parser.add_argument(
        "--checks",
        nargs="+",
        choices=CHECKS,
        default=list(CHECKS),
        help="which checks to run after the baseline and A (default: all)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        run = run_host_engine if spec.get("host_checks") else run_engine
        print(json.dumps(run(spec)), flush=True)
        return 0

    import redis

    sys.path.insert(0, str(REPO))
    from tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    client = redis.Redis.from_url(server.url)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            failures.append(what)

    try:
        prompt_a, prompt_b = prompts()
        shared_blocks = (5 * BLOCK_SIZE + 64) // BLOCK_SIZE
        base = {"model": args.model}
        connector = {"redis_url": server.url, "namespace": "e2e"}

        baseline = in_fresh_process({**base, "name": "baseline", "prompt": prompt_b})
        print("baseline:", baseline, flush=True)
        check(baseline["num_cached_tokens"] == 0, "baseline computes everything")

        a = in_fresh_process({**base, "name": "A", "prompt": prompt_a, "connector": connector})
        stored = chain_keys(client, "e2e")
        check(len(stored) == (len(prompt_a) // BLOCK_SIZE), f"A stored {len(stored)} blocks")
        check(a["num_cached_tokens"] == 0, "A starts from an empty store")

        if "share" in args.checks:
            b = in_fresh_process({**base, "name": "B", "prompt": prompt_b, "connector": connector})
            print("B:", b, flush=True)
            check(b["num_cached_tokens"] == shared_blocks * BLOCK_SIZE, "B loads the shared prefix")
            check(b["tokens"] == baseline["tokens"], "B's output equals the baseline")

        if "corrupt" in args.checks:
            # One stored value corrupted (a bit of its KV flipped, checksum left as it was).
            victim = stored[2]
            original = client.get(victim)
            assert original is not None
            corrupted = bytearray(original)
            corrupted[-100] ^= 0x01
            client.set(victim, bytes(corrupted))
            verify = in_fresh_process(
                {**base, "name": "B-verify", "prompt": prompt_b, "connector": connector}
            )
            check(
                verify["num_cached_tokens"] == 2 * BLOCK_SIZE, "verify probe stops at the bad block"
            )
            check(not verify["load_errors_logged"], "verify probe: no load error")
            check(
                verify["tokens"] == baseline["tokens"], "verify probe: output equals the baseline"
            )
            client.set(victim, bytes(corrupted))  # B-verify re-saved the recomputed block
            length = in_fresh_process(
                {
                    **base,
                    "name": "B-length",
                    "prompt": prompt_b,
                    "connector": {**connector, "probe": "length"},
                }
            )
            print("B-length:", length, flush=True)
            check(length["load_errors_logged"], "length probe: the bad block is a load error")
            check(
                length["tokens"] == baseline["tokens"], "length probe: output equals the baseline"
            )
            client.set(victim, original)

        if "isolation" in args.checks:
            other_dtype = in_fresh_process(
                {
                    **base,
                    "name": "B-fp32",
                    "dtype": "float32",
                    "prompt": prompt_b,
                    "connector": connector,
                }
            )
            check(other_dtype["num_cached_tokens"] == 0, "another dtype: no hit")
            other_model = in_fresh_process(
                {
                    **base,
                    "name": "B-other-model",
                    "prompt": prompt_b,
                    "connector": {**connector, "model_fingerprint": "another-model"},
                }
            )
            check(other_model["num_cached_tokens"] == 0, "another model: no hit")

        if "noise" in args.checks:
            # Control: noise under valid headers and checksums must change B's output.
            import torch

            # Noise on the scale of the real KV: keys of a trained model have large channels,
            # and unit-scale noise keys would get little attention weight.
            generator = torch.Generator().manual_seed(0)
            # Every stored value, not one chain: the fp32 and other-model runs above stored
            # chains of their own from the same root, and which of them `chain_keys` would
            # follow depends on the server's key order (a CI run once noised the fp32 chain and
            # left B's intact).
            for key in sorted(client.keys("e2e:*")):
                header, payload = split_value(client.get(key))
                real = torch.frombuffer(bytearray(payload), dtype=torch.bfloat16).float()
                noise = torch.randn(real.numel(), generator=generator) * real.abs().max()
                raw = noise.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
                client.set(key, with_payload(header, raw))
            noisy = in_fresh_process(
                {**base, "name": "B-noise", "prompt": prompt_b, "connector": connector}
            )
            print("B-noise:", noisy, flush=True)
            check(noisy["num_cached_tokens"] == shared_blocks * BLOCK_SIZE, "noise is loaded")
            check(noisy["tokens"] != baseline["tokens"], "loaded noise changes the output")

        if "host" in args.checks:
            host = in_fresh_process(
                {
                    **base,
                    "name": "host",
                    "host_checks": True,
                    "host_tier_bytes": 256 << 20,
                    "prompt_a": prompt_a,
                    "prompt_b": prompt_b,
                }
            )
            print("host:", host, flush=True)
            shared = shared_blocks * BLOCK_SIZE
            check(host["A"]["num_cached_tokens"] == 0, "host: A starts from an empty host tier")
            check(host["B"]["num_cached_tokens"] == shared, "host: B loads the shared prefix")
            check(host["B"]["host_loaded_blocks"] == shared_blocks, "host: from the host pool")
            check(host["B"]["tokens"] == baseline["tokens"], "host: B's output equals the baseline")
            check(host["slots_of_b"] == shared_blocks, "host: B's blocks are in the host tier")
            corrupt = host["corrupt"]
            check(corrupt["load_error_blocks"] == shared_blocks - 2, "host: bad slot, load error")
            check(corrupt["tokens"] == baseline["tokens"], "host: corrupt, output equals baseline")
            noise = host["noise"]
            check(noise["num_cached_tokens"] == shared, "host: noise is loaded")
            check(noise["tokens"] != baseline["tokens"], "host: loaded noise changes the output")
    finally:
        client.close()
        server.stop()
    print(f"{len(failures)} failed" if failures else "all checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
