"""Hybrid models: KV blocks a request holds, and requests that fit in a fixed memory budget.

Everything in the table is measured through the real block managers (`GroupedPrefixCache`,
one `PrefixCache` per KV group; a sliding group releases the blocks its window passed), driven
as an engine drives them: a prompt is prefilled in chunks of `CHUNK` tokens (`allocate_slots`,
then `commit`), then one token is decoded. No model runs: the figures are block counts.

- **held**: blocks one request holds in each group while it decodes (after its prefill), and
  in brackets the most it held during its prefill (a whole chunk of a sliding group's blocks
  is live until the chunk is committed).
- **fit**: requests admitted, all live at once, into a budget of `BUDGET_BLOCKS` blocks of
  *every* layer (what a full-attention model's pool would be). A group's block carries only
  its layers, so it costs its share of them. The memory is split between the groups in
  proportion to what a decoding request holds in each, plus, in a sliding group, room for one
  chunk in prefill (the step budget bounds the chunks in flight, whatever the number of
  requests); the groups are built with those pools and distinct requests are admitted one
  after the other (each prefilled, then decoding) until one is refused.

Patterns: Mistral (every layer slides), gpt-oss / Gemma 2 (1 sliding : 1 full), Gemma 3
(5 sliding : 1 full).

Then the agent workload of `bench_scheduler.py` (4 agents, each with its own 192-token system
prompt, 32 requests interleaved, blocks of 16, batches of 4, cache-aware scheduling) through
the Engine on a tiny random 4-layer model (torch on one thread), full attention vs hybrid
patterns with a 64-token window, in the same KV memory: the bench's pool of 40 blocks, and a
tight one of 20. `Engine`'s default gives every group the pool's block count;
`kv_group_blocks` moves memory from the sliding group to the full one.

Last, the block managers' own cost: one decode step (``append_tokens``, ``allocate_slots``,
``commit``) per request, CPU time of the calling thread, 256 live requests of 500 tokens, steps
back to back (warm caches): a plain `PrefixCache`, a sliding one, and a `GroupedPrefixCache` of
a full and a sliding group (the old Python coordinator took 7.0 µs here, the plain cache 0.9).

Run: ``python benches/bench_hybrid.py`` (CPU only, under a minute).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import gc_paused, machine, md_table

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


def serve(
    cache: GroupedPrefixCache, request: str, prompt: np.ndarray
) -> tuple[list[int], list[int]]:
    """Prefill `prompt` in chunks and decode one token; the blocks held per group while
    decoding, and the most held at any point."""
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
    decoding = [s.blocks_in_use - b for s, b in zip(cache.stats().groups, before, strict=True)]
    return decoding, peak


def distinct_prompt(body: np.ndarray, index: int) -> np.ndarray:
    prompt = body.copy()
    prompt[:4] = (index, index >> 16, 7, 7)  # its own first block: nothing is shared
    return prompt


def measure(
    prompt_len: int, window: int, pattern: int | None
) -> tuple[list[int], list[int], int, float]:
    specs, shares = specs_for(pattern, window)
    context = CacheContext(block_size=BLOCK_SIZE)
    body = np.random.default_rng(0).integers(0, 50_000, prompt_len, dtype=np.uint32)
    probe = GroupedPrefixCache(specs, [BUDGET_BLOCKS] * len(specs), context=context)
    held, peak = serve(probe, "probe", distinct_prompt(body, 0))
    # Room for one prefill chunk above the decoding requests, in each sliding group.
    reserve = [p - h for h, p in zip(held, peak, strict=True)]
    reserve_bytes = sum(r * s for r, s in zip(reserve, shares, strict=True))
    bytes_per_request = sum(h * s for h, s in zip(held, shares, strict=True))
    scale = (BUDGET_BLOCKS - reserve_bytes) / bytes_per_request
    pools = [max(1, int(h * scale) + r) for h, r in zip(held, reserve, strict=True)]
    cache = GroupedPrefixCache(specs, pools, context=context)
    fit = 0
    started = time.perf_counter()
    while True:
        try:
            serve(cache, f"r{fit}", distinct_prompt(body, fit + 1))
        except OutOfBlocksError:
            break
        fit += 1
    return held, peak, fit, time.perf_counter() - started


def agent_hit_rates() -> list[list[str]]:
    import torch

    from prefixkv.engine.facade import Engine
    from prefixkv.models.decoder import LlamaModel, ModelConfig
    from prefixkv.text.tokenizers import ByteTokenizer

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    systems = [tokens(192) for _ in range(4)]
    prompts = [systems[i % 4] + tokens(32) for i in range(32)]
    full, sliding = "full_attention", "sliding_attention"
    alternating = (sliding, full) * 2
    # (name, layer types, window, num_blocks, kv_group_blocks, memory in all-layer blocks):
    # a 1:1 model's group block holds half the layers, so (a, b) costs (a + b) / 2.
    setups: list[tuple[str, tuple[str, ...] | None, int | None, int | None, Any, float]] = []
    for memory, split in ((40, (64, 16)), (20, (24, 16))):
        setups += [
            ("full attention", None, None, memory, None, memory),
            ("1:1 alternating, default pools", alternating, 64, memory, None, memory),
            (
                f"1:1 alternating, pools {split[0]} + {split[1]}",
                alternating,
                64,
                None,
                split,
                memory,
            ),
            ("all sliding", (sliding,) * 4, 64, memory, None, memory),
        ]
    # One throwaway run first: torch's first calls pay for its warm-up, not the first setup.
    warm = ModelConfig(vocab_size=ByteTokenizer().vocab_size, num_layers=4)
    Engine(LlamaModel.random(warm, seed=0), num_blocks=40, block_size=BLOCK_SIZE).generate(
        prompts[:4], max_new_tokens=2
    )
    rows = []
    for name, layer_types, window, num_blocks, group_blocks, memory in setups:
        config = ModelConfig(
            vocab_size=ByteTokenizer().vocab_size,
            num_layers=4,
            sliding_window=window,
            layer_types=layer_types if layer_types and len(set(layer_types)) > 1 else None,
        )
        engine = Engine(
            LlamaModel.random(config, seed=0),
            num_blocks=num_blocks,
            kv_group_blocks=group_blocks,
            block_size=BLOCK_SIZE,
            max_batch_size=4,
            max_num_batched_tokens=256,
        )
        results = engine.generate(prompts, max_new_tokens=4)
        mean_ttft = sum(r.time_to_first_token for r in results) / len(results)
        rows.append(
            [
                name,
                f"{memory:g}",
                f"{engine.last_stats.hit_rate:.3f}",
                f"{engine.last_stats.preemptions}",
                f"{mean_ttft * 1e3:.0f}",
            ]
        )
        print(" | ".join(rows[-1]), file=sys.stderr)
    return rows


STEPS_PER_ROUND = 8


def decode_step_costs(requests: int = 256, rounds: int = 9) -> list[list[str]]:
    """µs per request per decode step through each kind of block manager. The managers take
    turns, `STEPS_PER_ROUND` steps each per round (the median step counts), so a noisy
    neighbour slows them alike; the median round is reported."""
    from prefixkv import PrefixCache

    context = CacheContext(block_size=BLOCK_SIZE)
    specs = (KVGroupSpec(0, None, (0,)), KVGroupSpec(1, 128, (1,)))
    managers: list[tuple[str, Any]] = [
        ("PrefixCache (full attention)", PrefixCache(40_000, context=context)),
        (
            "PrefixCache(sliding_window=128)",
            PrefixCache(40_000, context=context, sliding_window=128),
        ),
        (
            "GroupedPrefixCache (full + sliding 128)",
            GroupedPrefixCache(specs, (40_000,) * 2, context=context),
        ),
    ]
    for _, cache in managers:
        for i in range(requests):
            cache.add_request(f"r{i}", [i % 50_000] * 100 + list(range(400)))
            cache.allocate_slots(f"r{i}", 500)
            cache.commit(f"r{i}", 500)
    ids = [f"r{i}" for i in range(requests)]
    samples: list[list[float]] = [[] for _ in managers]
    computed = 500
    for _ in range(rounds):
        for index, (_, cache) in enumerate(managers):
            steps = []
            with gc_paused():
                for step in range(STEPS_PER_ROUND):
                    start = time.thread_time_ns()
                    for request in ids:
                        cache.append_tokens(request, [5])
                        cache.allocate_slots(request, 1)
                        cache.commit(request, computed + step + 1)
                    steps.append((time.thread_time_ns() - start) / requests / 1000)
            samples[index].append(statistics.median(steps))
        computed += STEPS_PER_ROUND
    costs = [statistics.median(values) for values in samples]
    rows = [
        [name, f"{cost:.2f}", f"{cost / costs[0]:.1f}×"]
        for (name, _), cost in zip(managers, costs, strict=True)
    ]
    for row in rows:
        print(" | ".join(row), file=sys.stderr)
    return rows


def main() -> None:
    rows = []
    for prompt_len in PROMPTS:
        # Full attention does not depend on the window: measured once per prompt length.
        full_held, _, full_fit, _ = measure(prompt_len, WINDOWS[0], 0)
        for window in WINDOWS:
            if window >= prompt_len:
                continue
            row = [f"{prompt_len:,}", f"{window:,}", f"{full_held[0]}", f"{full_fit:,}"]
            for _, pattern in PATTERNS[1:]:
                held, peak, fit, _ = measure(prompt_len, window, pattern)
                shown = " + ".join(
                    f"{h} [{p}]" if h != p else f"{h}" for h, p in zip(held, peak, strict=True)
                )
                row += [shown, f"{fit:,} ({fit / full_fit:.1f}×)"]
            rows.append(row)
            print(" | ".join(row), file=sys.stderr)
    print(
        f"block size {BLOCK_SIZE}, prefill chunk {CHUNK}, budget {BUDGET_BLOCKS:,} all-layer blocks\n"
    )
    print(
        md_table(
            [
                "prompt",
                "window",
                *(f"{name}: {what}" for name, _ in PATTERNS for what in ("held", "fit")),
            ],
            rows,
        )
    )
    print("\n## Agent workload through the Engine: hit rate, same KV memory\n")
    print(
        md_table(
            [
                "model (4 layers, W=64)",
                "KV memory (all-layer blocks)",
                "hit rate",
                "preemptions",
                "mean TTFT (ms)",
            ],
            agent_hit_rates(),
        )
    )
    print(f"\n## Decode step cost per request ({machine()['cpu']})\n")
    print(md_table(["block manager", "µs per request", "vs plain"], decode_step_costs()))


if __name__ == "__main__":
    main()
