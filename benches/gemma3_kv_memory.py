"""KV memory a Gemma 3 pattern holds through the Engine, against the same model with every
layer full attention (issue 23; docs/real_model.md, "Gemma 3").

A tiny random Gemma 3 text checkpoint is written by transformers' ``save_pretrained`` (its
default 5:1 sliding/full pattern, 12 layers), loaded by `Engine.from_pretrained` and served
as any checkpoint: prompts prefilled in chunks, then greedy decode. The engine's own
scheduler allocates and releases the blocks; this script only observes: before every model
step it reads each KV group's ``blocks_in_use`` (`GroupedPrefixCache.stats`) and turns it into
bytes (blocks x block_size x the group's layers x K and V x kv_heads x head_dim x 4 bytes).
The comparison runs the same weights with ``layer_types`` / ``sliding_window`` cleared (every
layer full: one KV group), the same requests and step budget.

    python benches/gemma3_kv_memory.py [--prompt-tokens 2048 --window 128 ...]

Deterministic (block counts, not times): the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def write_checkpoint(directory: Path, window: int, layers: int) -> None:
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
        max_position_embeddings=32768, query_pre_attn_scalar=32,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(directory)


def peak_kv_bytes(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """Serve `prompts`; return the most bytes of KV the engine's groups held at the start of
    a model step, and how many steps it took."""
    config = engine.model.config
    per_block_layer = 2 * engine.kv_cache.block_size * config.num_kv_heads * config.head_dim * 4
    groups = engine.kv_groups
    peak, steps = 0, 0
    model = engine.model
    prefill = model.prefill

    def observed_prefill(*args: Any, **kwargs: Any) -> Any:
        nonlocal peak, steps
        stats = engine.cache.stats()
        per_group = getattr(stats, "groups", (stats,))
        held = sum(
            int(group_stats.blocks_in_use) * len(spec.layers) * per_block_layer
            for group_stats, spec in zip(per_group, groups, strict=True)
        )
        peak, steps = max(peak, held), steps + 1
        return prefill(*args, **kwargs)

    model.prefill = observed_prefill
    try:
        engine.generate(prompts, max_new_tokens=new_tokens)
    finally:
        del model.prefill
    return peak, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from prefixkv.engine.facade import Engine
    from prefixkv.models.decoder import LlamaModel

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        write_checkpoint(directory, args.window, args.layers)
        blocks = args.requests * (-(-(args.prompt_tokens + args.new_tokens) // args.block_size) + 2)
        options = {"num_blocks": blocks, "block_size": args.block_size,
                   "max_num_batched_tokens": args.chunk}  # fmt: skip
        hybrid = Engine.from_pretrained(directory, dtype=torch.float32, **options)
        full_model = LlamaModel.from_pretrained(
            directory, dtype=torch.float32, layer_types=None, sliding_window=None
        )
        full = Engine(model=full_model, **options)
    # Distinct prompts (no shared prefix), so every request holds its own blocks.
    prompts = [
        [(7 * index + 31 * position + 3) % 256 for position in range(args.prompt_tokens)]
        for index in range(args.requests)
    ]
    config = hybrid.model.config
    pattern = "".join("S" if window else "F" for window in config.layer_sliding_windows)
    hybrid_peak, hybrid_steps = peak_kv_bytes(hybrid, prompts, args.new_tokens)
    full_peak, full_steps = peak_kv_bytes(full, prompts, args.new_tokens)
    print(
        f"Gemma 3 text, {config.num_layers} layers ({pattern}), window {args.window}, "
        f"{config.num_kv_heads} KV heads x {config.head_dim}, float32, block size "
        f"{args.block_size}; {args.requests} requests of {args.prompt_tokens} prompt tokens, "
        f"{args.new_tokens} new tokens, prefill chunks of {args.chunk} tokens"
    )
    print(f"KV groups: {[(spec.kind, len(spec.layers)) for spec in hybrid.kv_groups]}")
    print(f"peak KV held, sliding groups ({hybrid_steps} steps): {hybrid_peak:,} bytes")
    print(f"peak KV held, every layer full ({full_steps} steps):  {full_peak:,} bytes")
    print(f"saving: {full_peak / hybrid_peak:.2f}x less KV memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
