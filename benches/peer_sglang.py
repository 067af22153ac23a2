"""SGLang's radix cache on the production-shaped trace: a peer of `bench_production.py`.

Runs in a Python environment with SGLang (it does not import prefixkv), replays the same seeded
trace (`production_workload.py`) through SGLang's default prefix cache, `UnifiedRadixCache` with
its compiled Rust tree core (`RustUnifiedTreeCore`, SGLang's default backend), over SGLang's own
paged KV-slot allocator (`PagedTokenToKVPoolAllocator`, page size 16 = prefixkv's block size, as
many pages as prefixkv has blocks), and writes, per request, its CPU time (by phase) and cached
tokens to an `.npz` file, which `bench_production.py --sglang-python PATH` reads.

Per request, as SGLang's scheduler does it for a prompt prefilled whole and then finished
(`schedule_batch.init_next_round_input` → `schedule_policy` admission → `allocation` →
`UnifiedRadixCache.checkpoint_into_tree` → `common.release_kv_cache`), with the prompt held as
SGLang holds it (an ``array('q')``, built outside the timed calls):

- ``match``: ``match_prefix`` on the prompt capped at ``len - 1`` tokens (SGLang, like vLLM and
  prefixkv, always computes the last token) + ``lock`` of the matched node;
- ``alloc``: ``allocator.evict_to_free_tokens`` for ``alloc_paged_token_slots_extend``'s demand
  (the uncached tokens + one page; evicts LRU leaves, leaf-first, node by node, through the tree
  core's stepped ``evict_device_*`` walk, until that many slots are free) + ``alloc`` of the
  pages for the uncached tokens (the hit is page-aligned, so these are whole new pages: what
  ``alloc_extend`` hands out too, without its torch-native per-token index arithmetic, which on
  a GPU is one Triton kernel);
- ``insert``: ``insert`` of the page-aligned prompt with the request's KV indices (the matched
  path's indices, read off the tree, then the new ones), ``prev_prefix_len`` = the hit; the
  tree-side ``path_device_indices`` of the new last node and the lock moved onto it;
- ``release``: the pages past the page-aligned prompt (the partial last page) freed, the lock
  released.

What is not SGLang's code here: the request row (``req_to_token_pool``) is a plain tensor held by
this script, since no ``Req`` object is built; no model, no KV bytes (``kvcache=None``: the
allocator only hands out indices).

Hits are SGLang's own: it evicts whole radix nodes (leaf-first LRU, a node being a run of pages)
where prefixkv evicts block by block, so a request's hit may differ; `bench_production.py`
reports the agreement and never fails on it.

Environment (not a prefixkv dependency; an opt-in peer like vLLM). SGLang 0.5.23's wheel pins
torch 2.14.1 and its Rust tree core refuses any other torch, so the venv gets torch 2.14.1 over
the system's packages, and only what ``import`` needs (the full install pulls CUDA kernels):

    python3 -m venv --system-site-packages /work/venvs/sglang
    /work/venvs/sglang/bin/pip install --no-deps sglang==0.5.23 torch==2.14.1 \\
        torchvision==0.29.2 "nvidia-curand>=10.4,<11" apache-tvm-ffi==0.1.11
    /work/venvs/sglang/bin/pip install --no-deps psutil pybase64 starlette dill \\
        sentencepiece compressed-tensors loguru openai partial-json-parser
    /work/venvs/sglang/bin/pip install aiohttp

    /work/venvs/sglang/bin/python benches/peer_sglang.py [--quick] [--seed 0] [--core-split] \\
        [--tree-core rust|python] [--passes N] --out peer.npz
    /work/venvs/sglang/bin/python benches/peer_sglang.py [--quick] [--seed 0] \\
        --synthetic PASSES --out peer.npz      # the synthetic traces (bench_synthetic_peers.py)

``--core-split`` also times the compiled tree core's calls alone (`TimedBinding`);
``--tree-core python`` runs SGLang's pure-Python tree core instead (the same tree: it cached the
same tokens on every request in our runs).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
import warnings
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from production_workload import BLOCK_SIZE, TraceParams, production_trace
from workloads import SyntheticTrace, Trace, least_over_passes, peer_grid, replay_grid

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.version import __version__ as SGLANG_VERSION

PHASES = ("match", "alloc", "insert", "release")


class PeerError(RuntimeError):
    """SGLang's cache did something this replay does not allow (an allocation failing, pages
    leaking): the figures would not be of a working cache."""


#: SGLang's tree core backends: the compiled one (its default) and the pure-Python one.
TREE_CORES = {"rust": "RustUnifiedTreeCore", "python": "UnifiedTreeCore"}


def make_cache(
    num_blocks: int, tree_core: str = "rust"
) -> tuple[UnifiedRadixCache, PagedTokenToKVPoolAllocator]:
    """SGLang's default prefix cache for a full-attention model, as its registry builds it
    (`create_unified_radix_cache`: one FULL component, LRU eviction), on the `tree_core`
    backend, over `num_blocks` pages of `BLOCK_SIZE` tokens. SGLang quietly falls back to the
    Python core where the compiled one cannot load (another torch, say): refused here."""
    allocator = PagedTokenToKVPoolAllocator(
        size=num_blocks * BLOCK_SIZE,
        page_size=BLOCK_SIZE,
        dtype=torch.float16,
        device="cpu",
        kvcache=None,
        need_sort=False,  # SGLang's value outside prefill/decode disaggregation
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=BLOCK_SIZE,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=tree_core,
    )
    cache = UnifiedRadixCache(params)
    built = type(cache.tree_core).__name__
    if built != TREE_CORES[tree_core]:
        raise PeerError(f"asked SGLang for its {tree_core} tree core, it built {built}")
    return cache, allocator


class TimedBinding:
    """Stands in for the tree core's compiled binding and adds up the CPU time spent in its
    calls (argument and result conversion included): how much of a request is the compiled
    core and how much SGLang's Python around it. Costs a Python call per binding call, so a
    replay measuring it is not the one whose totals are reported.

    Each timed call also carries part of its own two clock reads (a system call of ~0.6 µs
    here) and of the wrapper: `overhead_ns`, measured on a call that does nothing, is what one
    timed call adds, and the replay subtracts it once per call (`calls`), so that the core's
    figure is not inflated by the timing itself."""

    def __init__(self, binding: object) -> None:
        self._binding = binding
        self.ns = 0
        self.calls = 0
        self.overhead_ns = self._calibrate()

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._binding, name)
        if not callable(attr):
            return attr
        return self._timed(attr)

    def _timed(self, attr: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object, **kwargs: object) -> object:
            self.calls += 1
            start = time.thread_time_ns()
            try:
                return attr(*args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - start

        return timed

    def _calibrate(self, batches: int = 9, calls: int = 2_000) -> float:
        """What one timed call adds to `ns` around a call that does nothing (a C method, like
        the binding's): the median over `batches` of `calls` calls each."""
        timed = self._timed(().__len__)
        per_call = []
        for _ in range(batches):
            before = self.ns
            for _ in range(calls):
                timed()
            per_call.append((self.ns - before) / calls)
        self.ns = self.calls = 0
        return float(np.median(per_call))


def replay(
    trace: Trace,
    num_blocks: int | None = None,
    core_split: bool = False,
    tree_core: str = "rust",
) -> dict[str, np.ndarray]:
    """Every request of `trace` through a fresh cache of `num_blocks` pages (default: the trace's
    cache size, as prefixkv's): per-request times by phase, hits and evicted slots; with
    `core_split`, also the time inside the compiled tree core per request, less what its own
    timing adds (`TimedBinding`), and the core calls per request."""
    num_blocks = num_blocks or trace.num_blocks()
    cache, allocator = make_cache(num_blocks, tree_core)
    timed_binding = None
    if core_split:
        timed_binding = TimedBinding(cache.tree_core._binding)
        cache.tree_core._binding = timed_binding
    core: list[int] = []
    core_calls: list[int] = []
    backend = type(cache.tree_core).__name__
    clock = time.thread_time_ns
    page = BLOCK_SIZE
    ns = {phase: [] for phase in PHASES}
    cached: list[int] = []
    evicted: list[int] = []  # slots freed by eviction, per request
    gc.collect()
    gc.disable()
    try:
        for index, request in enumerate(trace.requests()):
            tokens = array("q", request.tokens.tobytes())  # SGLang's form for a prompt
            length = len(tokens)
            core_before = (timed_binding.ns, timed_binding.calls) if timed_binding else (0, 0)
            t0 = clock()
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, limit=length - 1)))
            hit = match.device_prefix_len
            lock = cache.lock(match.last_device_node)
            t1 = clock()
            # alloc_paged_token_slots_extend's demand: the extend tokens plus a page per request
            # (its conservative bound, which may evict one page more than the allocation needs).
            before = allocator.available_size()
            allocator.evict_to_free_tokens(cache, length - hit + page)
            need = -(-(length - hit) // page) * page
            evicted.append(allocator.available_size() - before)
            new_slots = allocator.alloc(need)
            if new_slots is None:
                raise PeerError(f"request {index}: SGLang's pool cannot fit {length} tokens")
            t2 = clock()
            # The request's KV row: the matched path's slots, then the new ones.
            row = torch.cat((cache.path_device_indices(match.last_device_node)[:hit], new_slots))
            key = RadixKey(tokens).page_aligned(page)
            aligned = len(key)
            values = row[:aligned].to(dtype=torch.int64, copy=True)
            result = cache.insert(
                InsertParams(key=key, value=values, prev_prefix_len=hit, priority=0)
            )
            new_last = result.last_device_node
            new_indices = cache.path_device_indices(new_last)
            row[hit : len(new_indices)] = new_indices[hit:]
            cache.unlock(lock)
            lock = cache.lock(new_last)
            t3 = clock()
            # release_kv_cache: the slots past the tree's page-aligned copy go back, the lock too.
            if aligned < len(row):
                allocator.free_segment(row[aligned:], start_pos=aligned)
            cache.unlock(lock)
            t4 = clock()
            for phase, start, end in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
                ns[phase].append(end - start)
            cached.append(hit)
            if timed_binding:
                calls = timed_binding.calls - core_before[1]
                timing = calls * timed_binding.overhead_ns
                core.append(max(0, round(timed_binding.ns - core_before[0] - timing)))
                core_calls.append(calls)
    finally:
        gc.enable()
    # Every page is either free or held by the tree, and nothing is locked: no leak, no lock left.
    held = cache.full_evictable_size() + cache.full_protected_size()
    if cache.full_protected_size() != 0 or allocator.available_size() + held != num_blocks * page:
        raise PeerError(
            f"pages leaked or locked: {allocator.available_size()} free + {held} in the tree "
            f"({cache.full_protected_size()} locked) != {num_blocks * page}"
        )
    extra = {}
    if timed_binding:
        extra = {
            "core_ns": np.array(core, dtype=np.int64),
            "core_calls": np.array(core_calls, dtype=np.int64),
            "timer_overhead_ns": np.array(timed_binding.overhead_ns),
        }
    return {
        **extra,
        **{f"{phase}_ns": np.array(v, dtype=np.int64) for phase, v in ns.items()},
        "cached": np.array(cached, dtype=np.int64),
        "evicted_tokens": np.array(evicted, dtype=np.int64),
        "version": np.array(SGLANG_VERSION),
        "backend": np.array(backend),
        "torch": np.array(torch.__version__),
    }


def request_ns(run: dict[str, np.ndarray]) -> np.ndarray:
    """Per request, the whole request's time: the sum of a replay's phases."""
    return sum(run[f"{phase}_ns"] for phase in PHASES)


def synthetic(quick: bool, seed: int, passes: int) -> dict[str, np.ndarray]:
    """The synthetic traces of `workloads.PEER_GRID` (`bench_synthetic_peers.py`), each replayed
    `passes` times whole and `passes` times with the compiled core's calls timed apart: per
    request, the least whole time (``total_ns``) and the least core time (``core_ns``)."""
    grid = peer_grid(quick)

    def whole(trace: SyntheticTrace) -> dict[str, np.ndarray]:
        run = replay(trace)
        return {"total_ns": request_ns(run), "cached": run["cached"]}

    def core(trace: SyntheticTrace) -> dict[str, np.ndarray]:
        run = replay(trace, core_split=True)
        return {"core_ns": run["core_ns"], "cached_core_split": run["cached"]}

    return {
        **replay_grid(whole, grid, seed, passes),
        **replay_grid(core, grid, seed, passes),
        "version": np.array(SGLANG_VERSION),
        "backend": np.array(TREE_CORES["rust"]),
    }


def least_of(runs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per request, the least whole-request time (``least_total_ns``) and, when timed, the least
    core time (``least_core_ns``) over replays of one trace, which must have cached the same
    tokens (`workloads.least_over_passes`); `bench_production.py` compares them with
    prefixkv's."""
    timed = "core_ns" in runs[0]
    least = least_over_passes(
        [
            {
                "total_ns": request_ns(run),
                **({"core_ns": run["core_ns"]} if timed else {}),
                "cached": run["cached"],
            }
            for run in runs
        ],
        "SGLang's production replays",
    )
    out = {"least_total_ns": least["total_ns"]}
    if timed:
        out["least_core_ns"] = least["core_ns"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--core-split",
        action="store_true",
        help="also time the compiled tree core's calls (adds a Python call per binding call)",
    )
    parser.add_argument(
        "--tree-core",
        choices=sorted(TREE_CORES),
        default="rust",
        help="SGLang's tree core backend (default: rust, SGLang's own default)",
    )
    parser.add_argument(
        "--synthetic",
        type=int,
        metavar="PASSES",
        help="replay the synthetic traces of workloads.PEER_GRID (bench_synthetic_peers.py), "
        "each PASSES times whole and PASSES times with the core split, instead of the production "
        "trace",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="replay the trace this many times, each from a fresh cache; the first replay's "
        "figures, and per request the least time over all of them (least_total_ns, least_core_ns)",
    )
    args = parser.parse_args()
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    if args.synthetic is not None and (
        args.synthetic < 1 or args.core_split or args.tree_core != "rust" or args.passes != 1
    ):
        parser.error(
            "--synthetic PASSES (at least 1) times both ways on the compiled core by itself: "
            "without --core-split, --tree-core or --passes"
        )
    if args.core_split and args.tree_core != "rust":
        parser.error("--core-split times the compiled core's binding: --tree-core rust only")
    torch.set_num_threads(1)  # one thread, as prefixkv; run with OMP_NUM_THREADS=1 too
    if args.synthetic is not None:
        np.savez(args.out, **synthetic(args.quick, args.seed, args.synthetic))
        return
    params = TraceParams().scaled(0.2) if args.quick else TraceParams()
    trace = production_trace(params, seed=args.seed)
    runs = [
        replay(trace, core_split=args.core_split, tree_core=args.tree_core)
        for _ in range(args.passes)
    ]
    np.savez(args.out, **runs[0], **least_of(runs))


if __name__ == "__main__":
    main()
