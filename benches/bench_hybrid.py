"""Hybrid models: KV blocks a request holds, and requests that fit in a fixed memory budget.

Everything in the table is measured through the real block managers (`GroupedPrefixCache`,
one `PrefixCache` per KV group; a sliding group releases the blocks its window passed), driven
as an engine drives them: a prompt is prefilled in chunks of `CHUNK` tokens (`allocate_slots`,
then `commit`), then one token is decoded. No model runs: the figures are block counts.

- **held per request**: the most blocks one request held in each group at any point.
- **fit**: requests admitted, all live at once, into a budget of `BUDGET_BLOCKS` blocks of
  *every* layer (what a full-attention model's pool would be). For a hybrid model the memory
  is split between the groups in proportion to what one request held in each (a full group's
  block carries only its layers, so it costs its share of the layers), the groups are built
  with those pools, and distinct requests are admitted until one is refused.

Patterns: Mistral (every layer slides), gpt-oss / Gemma 2 (1 sliding : 1 full), Gemma 3
(5 sliding : 1 full). Run: ``python benches/bench_hybrid.py`` (CPU only, about a minute).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table

from prefixkv.context import CacheContext
from prefixkv.errors import OutOfBlocksError
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv_groups import KVGroupSpec

BLOCK_SIZE = 16
CHUNK = 2_048
BUDGET_BLOCKS = 65_536  # 1M tokens of every layer's KV
PROMPTS = (2_048, 8_192, 32_768)
WINDOWS = (128, 512, 1_024, 4_096)
#: (name, sliding layers per full layer); None: every layer slides; 0: full attention only.
PATTERNS = (
    ("full attention", 0),
    ("Mistral (all sliding)", None),
    ("gpt-oss / Gemma 2 (1:1)", 1),
    ("Gemma 3 (5:1)", 5),
)


def specs_for(pattern: int | None, window: int) -> tuple[tuple[KVGroupSpec, ...], list[float]]:
    """The KV groups of a 6-layer model of this pattern, and each group's share of the layers."""
    if pattern == 0:
        return (KVGroupSpec(0, None, tuple(range(6))),), [1.0]
    if pattern is None:
        return (KVGroupSpec(0, window, tuple(range(6))),), [1.0]
    full_layers = tuple(range(0, 6, pattern + 1))
    sliding = tuple(layer for layer in range(6) if layer not in full_layers)
    specs = (KVGroupSpec(0, None, full_layers), KVGroupSpec(1, window, sliding))
    return specs, [len(full_layers) / 6, len(sliding) / 6]


def serve(cache: GroupedPrefixCache, request: str, prompt: np.ndarray) -> list[int]:
    """Prefill `prompt` in chunks and decode one token; the most blocks held per group."""
    before = [stats.blocks_in_use for stats in cache.stats().groups]
    peak = [0] * len(before)
    cache.add_request(request, prompt)

    def note_peak() -> None:
        for group, stats in enumerate(cache.stats().groups):
            peak[group] = max(peak[group], stats.blocks_in_use - before[group])

    done = 0
    while done < len(prompt):
        step = min(CHUNK, len(prompt) - done)
        cache.allocate_slots(request, step)
        note_peak()
        done += step
        cache.commit(request, done)
    cache.append_tokens(request, [1])
    cache.allocate_slots(request, 1)
    note_peak()
    cache.commit(request, done + 1)
    note_peak()
    return peak


def distinct_prompt(body: np.ndarray, index: int) -> np.ndarray:
    prompt = body.copy()
    prompt[:4] = (index, index >> 16, 7, 7)  # its own first block: nothing is shared
    return prompt


def measure(prompt_len: int, window: int, pattern: int | None) -> tuple[list[int], int, float]:
    specs, shares = specs_for(pattern, window)
    context = CacheContext(block_size=BLOCK_SIZE)
    body = np.random.default_rng(0).integers(0, 50_000, prompt_len, dtype=np.uint32)
    probe = GroupedPrefixCache(specs, [BUDGET_BLOCKS] * len(specs), context=context)
    held = serve(probe, "probe", distinct_prompt(body, 0))
    # The budget split in proportion to one request's bytes in each group.
    bytes_per_request = sum(h * s for h, s in zip(held, shares, strict=True))
    pools = [max(1, int(BUDGET_BLOCKS * h / bytes_per_request)) for h in held]
    cache = GroupedPrefixCache(specs, pools, context=context)
    fit = 0
    started = time.perf_counter()
    while True:
        try:
            serve(cache, f"r{fit}", distinct_prompt(body, fit + 1))
        except OutOfBlocksError:
            break
        fit += 1
    return held, fit, time.perf_counter() - started


def main() -> None:
    rows = []
    for prompt_len in PROMPTS:
        # Full attention does not depend on the window: measured once per prompt length.
        full_held, full_fit, _ = measure(prompt_len, WINDOWS[0], 0)
        for window in WINDOWS:
            if window >= prompt_len:
                continue
            row = [f"{prompt_len:,}", f"{window:,}", f"{full_held[0]} ({full_fit:,})"]
            for _, pattern in PATTERNS[1:]:
                held, fit, _ = measure(prompt_len, window, pattern)
                row.append(f"{' + '.join(str(h) for h in held)} ({fit:,})")
            rows.append(row)
            print(" | ".join(row), file=sys.stderr)
    print(
        f"block size {BLOCK_SIZE}, prefill chunk {CHUNK}, budget {BUDGET_BLOCKS:,} all-layer blocks\n"
    )
    print(
        md_table(
            ["prompt", "window", *(f"{name}: held (fit)" for name, _ in PATTERNS)],
            rows,
        )
    )


if __name__ == "__main__":
    main()
