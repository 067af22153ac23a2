"""Hybrid models: KV blocks a request holds today, and what per-group release would hold.

Measured: a `PrefixCache` pool of `POOL_BLOCKS` blocks of `BLOCK_SIZE` tokens; one request per
prompt length is admitted through the step API (`add_request`, `allocate_slots`) and its block
table read back; then distinct requests are admitted until the pool refuses one, which counts
the requests that fit at once. The cache keeps every block of every request whatever the
model's attention pattern (docs/hybrid.md), so a hybrid or sliding-window model measures the
same as a full-attention one: that is the point of the figure.

Modelled, not measured (nothing here releases a block): what a request would hold if the
blocks out of every sliding layer's window were released, per layer group. A sliding layer
needs the last W positions, at most ``ceil((W - 1) / B) + 1`` blocks; a full layer needs all
of them. With one pool whose blocks carry every layer, only a model with no full layer
(Mistral-style, all sliding) could release anything; with one pool per group, the bytes are
the group-weighted sum (`per_group_block_equivalents`).

Run: ``python benches/bench_hybrid.py`` (a few seconds, CPU only). Prints a markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

from prefixkv import PrefixCache
from prefixkv.errors import OutOfBlocksError

BLOCK_SIZE = 16
POOL_BLOCKS = 65_536  # 1M tokens of KV
PROMPTS = (2_048, 8_192, 32_768)
WINDOWS = (128, 512, 1_024, 4_096)
#: (name, sliding layers per full layer); None: every layer slides.
PATTERNS = (("Mistral (all sliding)", None), ("gpt-oss / Gemma 2 (1:1)", 1), ("Gemma 3 (5:1)", 5))


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def window_blocks(window: int, prompt: int) -> int:
    """Blocks the last `window` positions of `prompt` can span (the block of the next token's
    position included)."""
    return min(blocks_for(prompt), (window - 2) // BLOCK_SIZE + 2)


def per_group_block_equivalents(prompt: int, window: int, sliding_per_full: int | None) -> float:
    """Bytes held with one pool per group, in units of today's all-layer blocks."""
    if sliding_per_full is None:
        return float(window_blocks(window, prompt))
    full_share = 1 / (sliding_per_full + 1)
    return full_share * blocks_for(prompt) + (1 - full_share) * window_blocks(window, prompt)


def measure_held(prompt: int) -> tuple[int, int]:
    """(blocks one request holds after its prefill, requests that fit in the pool at once)."""
    cache = PrefixCache(POOL_BLOCKS, block_size=BLOCK_SIZE)
    fitted = 0
    held = 0
    while True:
        # Distinct first tokens, so nothing is shared: the worst case the pool must hold.
        tokens = [fitted % 250 + 1] * prompt
        cache.add_request(fitted, tokens)
        try:
            cache.allocate_slots(fitted, prompt)
        except OutOfBlocksError:
            break
        held = held or len(cache.block_table(fitted))
        fitted += 1
    return held, fitted


def main() -> None:
    rows = []
    for prompt in PROMPTS:
        held, fitted = measure_held(prompt)
        for window in WINDOWS:
            if window >= prompt:
                continue
            row = [f"{prompt:,}", f"{window:,}", str(held), str(fitted)]
            for _, ratio in PATTERNS:
                per_group = per_group_block_equivalents(prompt, window, ratio)
                row.append(f"{per_group:,.0f} ({int(POOL_BLOCKS // per_group):,})")
            rows.append(row)
    headers = ["prompt", "window", "held today", "fit today"]
    headers += [f"{name}: held (fit), modelled" for name, _ in PATTERNS]
    print(f"block size {BLOCK_SIZE}, pool {POOL_BLOCKS:,} blocks\n")
    print(md_table(headers, rows))


if __name__ == "__main__":
    main()
