"""vLLM's own block manager on the production-shaped trace: the peer of `bench_production.py`.

Runs in a Python environment with vLLM (it does not import prefixkv), replays the same seeded
trace (`production_workload.py`) through vLLM's stock `KVCacheManager` (block pool, free queue,
hash table) and writes, per request, its CPU time and cached tokens to an `.npz` file, which
`bench_production.py --vllm-python PATH` reads and compares hit for hit with prefixkv's.

Per request, as vLLM's scheduler does it for a prompt scheduled whole:

- ``Request(...)``: vLLM computes the request's block hashes when the request is built (its
  ``block_hasher``: SHA-256 over each full block, vLLM's default ``sha256`` algorithm); timed as
  ``hash_ns``;
- ``get_computed_blocks`` + ``allocate_slots(all uncached tokens)`` (which publishes the full
  blocks) + ``free``: timed as ``manager_ns``.

The pool has one block more than prefixkv's, because vLLM keeps block 0 as its null block.

    /work/venvs/vllm/bin/python benches/peer_vllm.py [--quick] [--seed 0] --out peer.npz
    /work/venvs/vllm/bin/python benches/peer_vllm.py [--quick] [--seed 0] --synthetic PASSES \\
        --out peer.npz                         # the synthetic traces (bench_synthetic_peers.py)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from production_workload import BLOCK_SIZE, TraceParams, production_trace
from workloads import SyntheticTrace, Trace, peer_grid, replay_grid

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request


def replay(trace: Trace) -> dict[str, np.ndarray]:
    """Every request of `trace` through a fresh `KVCacheManager`: per-request times and hits."""
    params = trace.params
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = KVCacheConfig(
        num_blocks=trace.num_blocks() + 1,  # + vLLM's null block
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    manager = KVCacheManager(
        kv_cache_config=config,
        max_model_len=params.max_prompt_tokens + BLOCK_SIZE,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    sampling = SamplingParams(max_tokens=1)
    clock = time.thread_time_ns
    hash_ns, manager_ns, cached = [], [], []
    # The collector paused, as prefixkv's and SGLang's replays run (`common.gc_paused`).
    gc.collect()
    gc.disable()
    try:
        for index, request in enumerate(trace.requests()):
            prompt = request.tokens.tolist()  # vLLM holds prompts as lists of ints
            t0 = clock()
            vllm_request = Request(
                request_id=str(index),
                prompt_token_ids=prompt,
                sampling_params=sampling,
                pooling_params=None,
                block_hasher=hasher,
            )
            t1 = clock()
            blocks, num_computed, _ = manager.get_computed_blocks(vllm_request)
            allocated = manager.allocate_slots(
                vllm_request,
                len(prompt) - num_computed,
                num_new_computed_tokens=num_computed,
                new_computed_blocks=blocks,
            )
            if allocated is None:
                raise MemoryError(f"request {index}: vLLM's pool cannot fit {len(prompt)} tokens")
            manager.free(vllm_request)
            t2 = clock()
            hash_ns.append(t1 - t0)
            manager_ns.append(t2 - t1)
            cached.append(num_computed)
    finally:
        gc.enable()
    return {
        "hash_ns": np.array(hash_ns, dtype=np.int64),
        "manager_ns": np.array(manager_ns, dtype=np.int64),
        "cached": np.array(cached, dtype=np.int64),
        "version": np.array(vllm.__version__),
    }


def synthetic(quick: bool, seed: int, passes: int) -> dict[str, np.ndarray]:
    """The synthetic traces of `workloads.PEER_GRID` (`bench_synthetic_peers.py`), each replayed
    `passes` times: per request, the least whole time (``total_ns``: the request with its
    block hashes, then the manager's calls) and the cached tokens."""

    def whole(trace: SyntheticTrace) -> dict[str, np.ndarray]:
        run = replay(trace)
        return {"total_ns": run["hash_ns"] + run["manager_ns"], "cached": run["cached"]}

    return {
        **replay_grid(whole, peer_grid(quick), seed, passes),
        "version": np.array(vllm.__version__),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--synthetic",
        type=int,
        metavar="PASSES",
        help="replay the synthetic traces of workloads.PEER_GRID (bench_synthetic_peers.py), "
        "each PASSES times, instead of the production trace",
    )
    args = parser.parse_args()
    if args.synthetic is not None:
        if args.synthetic < 1:
            parser.error("--synthetic PASSES must be at least 1")
        np.savez(args.out, **synthetic(args.quick, args.seed, args.synthetic))
        return
    params = TraceParams().scaled(0.2) if args.quick else TraceParams()
    np.savez(args.out, **replay(production_trace(params, seed=args.seed)))


if __name__ == "__main__":
    main()
