"""Section 5: host memory of the block manager's metadata, per cached block.

A fresh child process (so no earlier allocation is reused) reads its resident set size, builds
a `PrefixCache` of N blocks (block size 16), reads it again (the pool's fixed cost per block),
then fills every block with cached, evictable content from 16k-token prompts and reads it a
third time. Per block = growth ÷ N, nothing subtracted: the table, the entries with their token
copies, refcounts, eviction order, all of it. The plain-Python baseline is measured the same way
for scale. From the per-block figure follows the largest cache the core can index in a RAM
budget (per GiB of host memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

BLOCK_SIZE = 16
PROMPT_TOKENS = 16_384


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(kind: str, num_blocks: int) -> dict[str, Any]:
    if kind == "prefixkv":
        from prefixkv import PrefixCache

        make = lambda: PrefixCache(num_blocks, block_size=BLOCK_SIZE, core="blocks")  # noqa: E731
    else:
        from python_baseline import PyPrefixCache

        make = lambda: PyPrefixCache(num_blocks, BLOCK_SIZE)  # noqa: E731
    rng = np.random.default_rng(5)
    prompt = np.empty(PROMPT_TOKENS, dtype=np.uint32)
    base = _rss()
    cache = make()
    empty = _rss()
    filled_blocks = 0
    while filled_blocks + PROMPT_TOKENS // BLOCK_SIZE <= num_blocks:
        prompt[:] = rng.integers(0, 128_000, PROMPT_TOKENS, dtype=np.uint32)
        request = cache.begin(prompt)
        cache.commit(request, PROMPT_TOKENS)
        cache.finish(request)
        filled_blocks += PROMPT_TOKENS // BLOCK_SIZE
    full = _rss()
    if kind == "prefixkv":
        assert cache.stats().blocks_cached == filled_blocks
    return {
        "kind": kind,
        "num_blocks": num_blocks,
        "cached_blocks": filled_blocks,
        "empty_bytes_per_block": (empty - base) / num_blocks,
        "cached_bytes_per_block": (full - base) / filled_blocks,
    }


def run(quick: bool = False) -> dict[str, Any]:
    num_blocks = 262_144 if quick else 1_048_576
    results = {}
    for kind in ("prefixkv", "python"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", kind, str(num_blocks)],
            capture_output=True,
            text=True,
            check=True,
        )
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"  memory {kind}: {results[kind]['cached_bytes_per_block']:.0f} B per cached block",
            flush=True,
        )
    per_block = results["prefixkv"]["cached_bytes_per_block"]
    return {
        "block_size": BLOCK_SIZE,
        "num_blocks": num_blocks,
        "results": results,
        "blocks_per_gib": 2**30 / per_block,
        "tokens_per_gib": 2**30 / per_block * BLOCK_SIZE,
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for kind, r in result["results"].items():
        rows.append(
            [
                kind,
                f"{r['cached_blocks']:,}",
                f"{r['empty_bytes_per_block']:.0f}",
                f"{r['cached_bytes_per_block']:.0f}",
                f"{2**30 / r['cached_bytes_per_block'] / 1e6:.2f} M",
            ]
        )
    return (
        md_table(
            [
                "block manager",
                "cached blocks",
                "bytes/block, empty pool",
                "bytes/block, all cached",
                "blocks per GiB",
            ],
            rows,
        )
        + f"\n\nprefixkv indexes about {result['blocks_per_gib'] / 1e6:.1f} M blocks "
        f"({result['tokens_per_gib'] / 1e6:.0f} M tokens at block size {result['block_size']}) per GiB of host RAM."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "NUM_BLOCKS"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]))))
        return
    print(markdown(run(args.quick)))


if __name__ == "__main__":
    main()
