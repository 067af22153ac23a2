"""Write a tiny random checkpoint with sliding-window attention for vLLM's end-to-end runs.

Usage: python scripts/prepare_tiny_windowed.py OUT_DIR --kind {sliding,hybrid} --tokenizer DIR

- ``sliding``: a two-layer Mistral, every layer with ``sliding_window=200``: vLLM serves one
  ``SlidingWindowSpec`` group shorter than the context.
- ``hybrid``: a two-layer Gemma 3 text model, one sliding layer (window 200) and one full one:
  vLLM makes two KV cache groups over one block pool.

transformers writes the weights (``save_pretrained`` of a random init, seeded), with query and
key projections scaled by 8 so attention is sharp and a block read from the wrong place changes
the output. Head size 64 (the CPU attention backend's). The tokenizer files are copied from
``--tokenizer`` (the SmolLM2 checkpoint ``prepare_smollm2.py`` writes), whose vocabulary size
the model takes. Idempotent: OUT_DIR/.ready marks a finished write.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

WINDOW = 200
CONTEXT = 2048


def _config(kind: str, vocab_size: int) -> object:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=WINDOW,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if kind == "sliding":
        from transformers import MistralConfig

        return MistralConfig(**common)
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**common, layer_types=["sliding_attention", "full_attention"])


def write(out: Path, kind: str, tokenizer: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    vocab_size = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(kind, vocab_size), torch_dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(out)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=["sliding", "hybrid"], required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    ready = args.out / ".ready"
    if ready.exists():
        print(f"{args.out}: ready")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out, args.kind, args.tokenizer)
    ready.touch()
    print(f"{args.out}: {args.kind} checkpoint written")


if __name__ == "__main__":
    main()
