"""Section 4: page-copy bandwidth of `PagedKVCache` against a plain contiguous copy.

Each operation is timed next to ``dst.copy_(src)`` of the same number of bytes between two
contiguous tensors on the same device (the best a copy can do there), interleaved, medians of
several repeats; the figure is our bandwidth ÷ that bandwidth.

- `write`: one layer's K and V for 4,096 tokens scattered to shuffled slots (prefill's store);
- `copy_blocks`: 64 whole blocks (K and V of every layer) to other blocks of the same cache;
- `copy_blocks_to` (swap out / in): 64 blocks to another cache, host to host here; on a CUDA
  machine `gpu.sh` times device <-> pinned host.

Runs on CUDA when available (``--device cuda``), else on the CPU with one torch thread on each
side (a shared 2-core machine makes multi-threaded copies erratic).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import clock_name, md_table, now

from prefixkv.kv.pages import PagedKVCache

GEOMETRY = dict(num_layers=8, block_size=16, num_kv_heads=8, head_dim=128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pair(ours: Any, reference: Any, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median seconds of `ours` and `reference`, interleaved (wall time on CUDA, where the host
    thread only launches; the selected clock on the CPU, see common.py)."""
    clock = time.perf_counter_ns if device.type == "cuda" else now
    ours(), reference()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((ours, a), (reference, b)):
            _sync(device)
            start = clock()
            fn()
            _sync(device)
            out.append((clock() - start) / 1e9)
    return statistics.median(a), statistics.median(b)


def run(
    quick: bool = False, device: str | None = None, host_device: str | None = None
) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        dtype = torch.float16
        repeats = 5 if quick else 15
        num_blocks = 256 if quick else 512
        g = GEOMETRY
        cache = PagedKVCache(
            g["num_layers"],
            num_blocks,
            g["block_size"],
            g["num_kv_heads"],
            g["head_dim"],
            dtype=dtype,
            device=dev,
        )
        generator = torch.Generator().manual_seed(0)
        rows = []

        # write: 4,096 tokens of one layer to shuffled slots.
        tokens = 4096
        key = torch.randn(tokens, g["num_kv_heads"], g["head_dim"], generator=generator).to(
            dev, dtype
        )
        value = torch.randn_like(key)
        slots = torch.randperm(cache.num_slots, generator=generator)[:tokens].to(dev)
        src = torch.cat([key.flatten(), value.flatten()])
        dst = torch.empty_like(src)
        t_ours, t_ref = _pair(
            lambda: cache.write(0, key, value, slots), lambda: dst.copy_(src), dev, repeats
        )
        rows.append(
            _row(
                "write (4,096 tokens, one layer, shuffled slots)",
                src.numel() * src.element_size(),
                t_ours,
                t_ref,
            )
        )

        # copy_blocks: 64 blocks, all layers, K and V.
        count = 64
        perm = torch.randperm(num_blocks, generator=generator)
        src_ids, dst_ids = perm[:count].tolist(), perm[count : 2 * count].tolist()
        nbytes = count * cache.bytes_per_block
        a = torch.empty(nbytes // 2, dtype=dtype, device=dev)
        b = torch.empty_like(a)
        t_ours, t_ref = _pair(
            lambda: cache.copy_blocks(src_ids, dst_ids), lambda: b.copy_(a), dev, repeats
        )
        rows.append(_row("copy_blocks (64 blocks, all layers)", nbytes, t_ours, t_ref))

        # Moves to another cache: device <-> host (host <-> host without CUDA).
        host = torch.device(host_device or "cpu")
        pinned = dev.type == "cuda"
        other = PagedKVCache(
            g["num_layers"],
            num_blocks,
            g["block_size"],
            g["num_kv_heads"],
            g["head_dim"],
            dtype=dtype,
            device=host,
            pin_memory=pinned,
        )
        host_buffer = torch.empty(nbytes // 2, dtype=dtype, device=host, pin_memory=pinned)
        where = f"{dev.type} -> {host.type}{' pinned' if pinned else ''}"
        t_ours, t_ref = _pair(
            lambda: cache.swap_out(src_ids, other, dst_ids),
            lambda: host_buffer.copy_(a),
            dev,
            repeats,
        )
        rows.append(_row(f"swap_out (64 blocks, {where})", nbytes, t_ours, t_ref))
        t_ours, t_ref = _pair(
            lambda: cache.swap_in(other, dst_ids, src_ids),
            lambda: a.copy_(host_buffer),
            dev,
            repeats,
        )
        rows.append(_row(f"swap_in (64 blocks, {host.type} -> {dev.type})", nbytes, t_ours, t_ref))
        diagnosis = _diagnose(cache, src_ids, dev, repeats)
        for r in rows:
            print(f"  copies {r['operation']}: {r['ratio']:.0%} of a contiguous copy", flush=True)
        return {
            "device": str(dev),
            "dtype": str(dtype),
            "geometry": g,
            "rows": rows,
            "diagnosis_ms": diagnosis,
            "torch_threads": torch.get_num_threads(),
            "clock": "wall" if dev.type == "cuda" else clock_name(),
        }
    finally:
        torch.set_num_threads(threads)


def _diagnose(
    cache: PagedKVCache, ids: list[int], dev: torch.device, repeats: int
) -> dict[str, float]:
    """Where a whole-block copy's time goes, piece by piece on the same 64 blocks: the gather
    `copy_blocks_to` does (dim 1 of the 3-D ``[K/V x layer, block, elements]`` view) into a
    fresh output as it does, and into a reused one; first touch of a fresh buffer that size; the
    scatter half (`index_copy_` along dim 1); the 6-D block-axis gather it did before d609949;
    and a contiguous copy of the same bytes."""
    index = torch.tensor(ids, device=dev)
    dst_index = torch.tensor(list(reversed(ids)), device=dev)
    storage = cache.storage
    slabs = storage.view(2 * cache.num_layers, cache.num_blocks, -1)
    out = torch.empty(slabs.shape[0], len(ids), slabs.shape[2], dtype=storage.dtype, device=dev)
    flat = out.flatten()
    copy_target = torch.empty_like(flat)
    fresh_gather, reused_gather = _pair(
        lambda: slabs.index_select(1, index),
        lambda: torch.index_select(slabs, 1, index, out=out),
        dev,
        repeats,
    )
    first_touch, scatter = _pair(
        lambda: torch.empty_like(out).fill_(0),
        lambda: slabs.index_copy_(1, dst_index, out),
        dev,
        repeats,
    )
    old_gather, contiguous = _pair(
        lambda: storage.index_select(2, index), lambda: copy_target.copy_(flat), dev, repeats
    )
    return {
        "gather: index_select(dim 1) of the 3-D view, fresh output (what copy_blocks_to did before reusing its staging buffer)": fresh_gather
        * 1e3,
        "gather: the same into a reused output buffer": reused_gather * 1e3,
        "first touch of a fresh buffer of that size (empty + fill_)": first_touch * 1e3,
        "scatter: index_copy_(dim 1) of the 3-D view": scatter * 1e3,
        "gather: index_select(block axis) of the 6-D storage (before d609949)": old_gather * 1e3,
        "contiguous copy_ of the same bytes": contiguous * 1e3,
    }


def _row(operation: str, nbytes: int, t_ours: float, t_ref: float) -> dict[str, Any]:
    return {
        "operation": operation,
        "bytes": nbytes,
        "ours_gb_s": nbytes / t_ours / 1e9,
        "contiguous_gb_s": nbytes / t_ref / 1e9,
        "ratio": t_ref / t_ours,
    }


def markdown(result: dict[str, Any]) -> str:
    g = result["geometry"]
    head = (
        f"Device {result['device']}, {result['dtype']}, {g['num_layers']} layers, block {g['block_size']}, "
        f"{g['num_kv_heads']} KV heads × {g['head_dim']}; {result['torch_threads']} torch thread(s); {result.get('clock', 'wall')} time. "
        "Bandwidth counts the bytes moved once (read + write of them).\n\n"
    )
    rows = [
        [
            r["operation"],
            f"{r['bytes'] / 2**20:.0f} MiB",
            f"{r['ours_gb_s']:.2f}",
            f"{r['contiguous_gb_s']:.2f}",
            f"{r['ratio']:.0%}",
        ]
        for r in result["rows"]
    ]
    table = md_table(
        ["operation", "bytes", "ours GB/s", "contiguous copy_ GB/s", "ours ÷ copy_"], rows
    )
    probe = md_table(
        ["piece of `copy_blocks_to` on the 64 blocks (all layers, K and V)", "ms"],
        [[k, f"{v:.2f}"] for k, v in result["diagnosis_ms"].items()],
    )
    return (
        head
        + table
        + "\n\nPieces of the gather-and-scatter path `copy_blocks_to` takes when a block is both "
        "read and written, or across devices (on CPU, disjoint copies go block by block, in one "
        "pass):\n\n" + probe
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    print(markdown(run(args.quick, args.device)))


if __name__ == "__main__":
    main()
