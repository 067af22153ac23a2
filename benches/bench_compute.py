"""Section 3: prefill compute saved by a cached prefix, against what an ideal cache would save.

The reference decoder (`prefixkv.models.decoder.LlamaModel`, random weights, a config where matrix work
dominates Python overhead) prefills one prompt with a fraction f of it cached: the pages hold
the prefix's KV, and `prefill` computes positions m .. n-1 only, reading keys 0 .. n-1 from the
pages. Three ideals, all from measurements of the same run:

- *linear*: ``(1 - f) × T(full prompt)``: the naive expectation;
- *suffix call*: a prefill of just the ``n - m`` suffix tokens with no cache. This is less work
  than the cached prefill must do, since the suffix's queries attend over all n keys, so the
  ratio grows with f and n wherever attention matters;
- *work*: the work any exact cache must still do, priced by the uncached path itself. Each
  no-cache call (the full prompt and every suffix call) is fitted as ``T = a·tokens + b·pairs``
  (per-token linear layers, per (query, key <= query) pair attention; least squares over this
  run's calls), and the ideal of the cached call is ``a·(n - m) + b·pairs(m, n)``. Measured ÷
  work-ideal is then the overhead of the cached path over the uncached one doing the same work
  (gathering pages, longer key ranges), free of any assumption on FLOP rates.

torch runs with one thread: on a shared 2-core machine, two OpenMP threads spinning against
other processes make times erratic by 10× or more; one thread keeps the ratios stable.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import clock_name, md_table, now

from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest

BLOCK_SIZE = 16
CONFIG = dict(
    vocab_size=32_000,
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=65_536,
)
FRACTIONS = [0.0, 0.25, 0.5, 0.75, 0.9, 0.99]


def pairs(start: int, end: int) -> int:
    """Causal (query, key) pairs when computing positions start .. end-1."""
    return (end * (end + 1) - start * (start + 1)) // 2


def fit_costs(calls: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of ``T = a·n + b·pairs(0, n)`` over uncached calls (n tokens, T seconds)."""
    import numpy as np

    design = np.array([[n, pairs(0, n)] for n, _ in calls], dtype=float)
    times = np.array([t for _, t in calls])
    (a, b), *_ = np.linalg.lstsq(design, times, rcond=None)
    return float(a), float(b)


def _timed_prefill(
    model: LlamaModel, kv: PagedKVCache, tokens: list[int], table: list[int], cached: int
) -> float:
    start = now()
    model.prefill(kv, [PrefillRequest(tokens, table, cached)], attention_backend="torch")
    return (now() - start) / 1e9


def run(quick: bool = False) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = ModelConfig(**CONFIG)
        model = LlamaModel.random(config, seed=0)
        lengths = [4096] if quick else [4096, 16384]
        fractions = [0.0, 0.5, 0.9] if quick else FRACTIONS
        rows = []
        for length in lengths:
            rounds = 1 if length > 4096 else (2 if quick else 3)
            num_blocks = length // BLOCK_SIZE + 1
            kv = PagedKVCache(
                config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim
            )
            generator = torch.Generator().manual_seed(length)
            tokens = torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()
            table = list(range(num_blocks))
            model.prefill(kv, [PrefillRequest(tokens[:512], table, 0)], attention_backend="torch")
            cached_of = {f: int(f * length) // BLOCK_SIZE * BLOCK_SIZE for f in fractions}
            # Rounds: the full prompt first (it also writes every page, so the cached calls read
            # the prefix's true KV), then each fraction's cached call and its suffix-only call.
            samples: dict[str, list[float]] = {"full": []}
            for _ in range(rounds):
                samples["full"].append(_timed_prefill(model, kv, tokens, table, 0))
                for f, cached in cached_of.items():
                    if cached == 0:
                        continue
                    samples.setdefault(f"measured {f}", []).append(
                        _timed_prefill(model, kv, tokens, table, cached)
                    )
                    samples.setdefault(f"suffix {f}", []).append(
                        _timed_prefill(model, kv, tokens[: length - cached], table, 0)
                    )
            full = statistics.median(samples["full"])
            for f, cached in cached_of.items():
                measured = full if cached == 0 else statistics.median(samples[f"measured {f}"])
                suffix = full if cached == 0 else statistics.median(samples[f"suffix {f}"])
                rows.append(
                    {
                        "prompt_tokens": length,
                        "fraction_cached": f,
                        "cached_tokens": cached,
                        "rounds": rounds,
                        "measured_s": measured,
                        "full_s": full,
                        "suffix_call_s": suffix,
                        "ideal_linear_s": full * (length - cached) / length,
                        "vs_linear": measured / (full * (length - cached) / length),
                        "vs_suffix_call": measured / suffix,
                    }
                )
                print(
                    f"  compute {length:6d} f={f:.2f}: {measured:7.3f} s, "
                    f"÷suffix call {rows[-1]['vs_suffix_call']:.2f}",
                    flush=True,
                )
        # Price tokens and attention pairs from the uncached calls, then the ideal of each row.
        a, b = fit_costs(
            [(r["prompt_tokens"] - r["cached_tokens"], r["suffix_call_s"]) for r in rows]
        )
        for r in rows:
            r["ideal_work_s"] = a * (r["prompt_tokens"] - r["cached_tokens"]) + b * pairs(
                r["cached_tokens"], r["prompt_tokens"]
            )
            r["vs_work"] = r["measured_s"] / r["ideal_work_s"]
        return {
            "config": dict(CONFIG),
            "torch_threads": 1,
            "fitted_s_per_token": a,
            "fitted_s_per_pair": b,
            "attention_backend": "torch",
            "clock": clock_name(),
            "rows": rows,
        }
    finally:
        torch.set_num_threads(threads)


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    head = (
        f"Reference decoder: hidden {c['hidden_size']}, {c['num_layers']} layers, {c['num_heads']} "
        f"heads × {c['head_dim']} ({c['num_kv_heads']} KV heads), MLP {c['intermediate_size']}, float32, "
        f"torch attention backend, 1 torch thread; seconds of {result.get('clock', 'wall')} time.\n\n"
    )
    rows = [
        [
            f"{r['prompt_tokens']:,}",
            f"{r['fraction_cached']:.0%}",
            f"{r['measured_s']:.3f}",
            f"{r['ideal_linear_s']:.3f}",
            f"{r['suffix_call_s']:.3f}",
            f"{r['ideal_work_s']:.3f}",
            f"{r['vs_linear']:.2f}×",
            f"{r['vs_suffix_call']:.2f}×",
            f"{r['vs_work']:.2f}×",
        ]
        for r in result["rows"]
    ]
    return head + md_table(
        [
            "prompt",
            "cached",
            "measured s",
            "(1-f)·full s",
            "suffix call s",
            "work ideal s",
            "÷(1-f)·full",
            "÷suffix call",
            "÷work",
        ],
        rows,
    )


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in result["rows"]})
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(4.5 * len(lengths), 3.2), dpi=80, squeeze=False
    )
    for ax, length in zip(axes[0], lengths, strict=True):
        rows = [r for r in result["rows"] if r["prompt_tokens"] == length]
        x = [100 * r["fraction_cached"] for r in rows]
        ax.plot(x, [r["measured_s"] for r in rows], marker="o", label="measured")
        ax.plot(x, [r["ideal_work_s"] for r in rows], linestyle="--", label="work ideal")
        ax.plot(x, [r["suffix_call_s"] for r in rows], linestyle=":", label="suffix-only call")
        ax.plot(x, [r["ideal_linear_s"] for r in rows], linestyle="-.", label="(1-f)·full")
        ax.set_title(f"prefill, {length:,} tokens")
        ax.set_xlabel("% of prompt cached")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "compute.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(markdown(run(args.quick)))


if __name__ == "__main__":
    main()
