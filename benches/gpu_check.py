"""CUDA correctness checks and timings; run by `gpu.sh` (needs a CUDA GPU).

1. Correctness on the device:
   - Triton paged prefill (and the torch backend) against the float64 reference backend, on
     batches with cached prefixes, GQA, a sliding window, float32/float16/bfloat16;
   - the paged model with a cached prefix (Triton backend) against full recompute;
   - `PagedKVCache` on CUDA: write, copy_blocks, swap out to pinned host and back, bit-exact.
2. Timings (CUDA events, medians):
   - Triton paged prefill vs torch SDPA on K/V gathered from the pages (gather included, and
     SDPA alone on pre-gathered contiguous K/V), and flash-attn's paged kernel if installed;
   - page copies vs a device-to-device / device-host ``copy_`` of the same bytes (section 4's
     code on the GPU).
Prints a short table last; exits 1 if a correctness check failed.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv.prefill import paged_prefill_attention
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest

DEVICE = torch.device("cuda")
# Error bound per unit of the largest |value| (the output is a convex combination of value
# rows): 4 roundings of the input dtype for Triton (as tests/test_attention.py argues), and a
# float32 floor.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


def _case(
    batch: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, Any]:
    """Pages holding each request's K/V, shuffled block tables; (cached, total) per request."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per = [-(-n // block) for _, n in batch]
    num_blocks = sum(blocks_per) + 3
    keys = torch.randn(num_blocks, block, kv_heads, dim, generator=generator, device=DEVICE).to(
        dtype
    )
    values = torch.randn(num_blocks, block, kv_heads, dim, generator=generator, device=DEVICE).to(
        dtype
    )
    order = torch.randperm(num_blocks, generator=generator, device=DEVICE)
    tables = torch.zeros(len(batch), max(blocks_per), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, count in enumerate(blocks_per):
        tables[i, :count] = order[used : used + count].to(torch.int32)
        used += count
        # Poison the slots past the request's last token: reading them turns the output NaN.
        tail = batch[i][1] - (count - 1) * block
        last = int(tables[i, count - 1])
        keys[last, tail:] = float("nan")
        values[last, tail:] = float("nan")
    for spare in order[used:].tolist():
        keys[spare] = float("nan")
        values[spare] = float("nan")
    query_lens = [n - cached for cached, n in batch]
    # Queries scaled up so attention is sharp: a mask or position bug moves the output.
    query = 3 * torch.randn(sum(query_lens), heads, dim, generator=generator, device=DEVICE).to(
        dtype
    )
    return {
        "query": query,
        "key_pages": keys,
        "value_pages": values,
        "block_tables": tables,
        "query_lens": query_lens,
        "seq_lens": [n for _, n in batch],
    }


def check_attention() -> list[str]:
    failures = []
    shapes = [
        ([(0, 37), (16, 100), (99, 100), (64, 64 + 1)], 8, 2, 64, 16, None),
        ([(0, 300), (128, 513)], 4, 4, 128, 16, None),
        ([(40, 200), (0, 77)], 8, 2, 64, 32, 50),
    ]
    for index, (batch, heads, kv_heads, dim, block, window) in enumerate(shapes):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            case = _case(batch, heads, kv_heads, dim, block, dtype, seed=index)
            oracle_inputs = dict(
                case,
                query=case["query"].double(),
                key_pages=case["key_pages"].double(),
                value_pages=case["value_pages"].double(),
            )
            oracle = paged_prefill_attention(
                **oracle_inputs, sliding_window=window, backend="reference"
            )
            for backend in ("triton", "torch"):
                out = paged_prefill_attention(**case, sliding_window=window, backend=backend)
                error = (out.double() - oracle).abs().max().item()
                largest = case["value_pages"].double().nan_to_num(0.0).abs().max().item()
                if not error <= TOLERANCE[dtype] * largest:
                    failures.append(
                        f"attention {backend} case {index} {dtype}: max error {error:.3g}"
                    )
    return failures


def check_model() -> list[str]:
    config = ModelConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=4096,
    )
    model = LlamaModel.random(config, seed=0).to(DEVICE)
    tokens = torch.randint(0, config.vocab_size, (300,)).tolist()
    expected = model.forward_full(tokens)[-1]
    failures = []
    for cached in (0, 160, 288):
        kv = PagedKVCache(2, 32, 16, 2, 32, device=DEVICE)
        table = list(range(31, 31 - 19, -1))  # reversed: pages are not in position order
        if cached:
            model.prefill(
                kv, [PrefillRequest(tokens[:cached], table, 0)], attention_backend="triton"
            )
        logits = model.prefill(
            kv, [PrefillRequest(tokens, table, cached)], attention_backend="triton"
        )
        error = (logits[0] - expected).abs().max().item()
        if not error <= 1e-3 * max(1.0, expected.abs().max().item()):
            failures.append(
                f"model prefill with {cached} cached tokens: max logit error {error:.3g}"
            )
    return failures


def check_pages() -> list[str]:
    failures = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cache = PagedKVCache(2, 8, 4, 2, 8, dtype=dtype, device=DEVICE)
        key = torch.randn(10, 2, 8, device=DEVICE).to(dtype)
        value = torch.randn(10, 2, 8, device=DEVICE).to(dtype)
        slots = torch.randperm(32, device=DEVICE)[:10]
        cache.write(1, key, value, slots)
        if not torch.equal(cache.storage[0, 1].view(32, 2, 8)[slots], key):
            failures.append(f"write {dtype}")
        before = cache.storage.clone()
        cache.copy_blocks([0, 1], [5, 6])
        if not torch.equal(cache.storage[:, :, [5, 6]], before[:, :, [0, 1]]):
            failures.append(f"copy_blocks {dtype}")
        host = PagedKVCache(2, 8, 4, 2, 8, dtype=dtype, device="cpu", pin_memory=True)
        cache.swap_out([5, 6], host, [2, 3])
        cache.swap_in(host, [2, 3], [7, 4])
        torch.cuda.synchronize()
        if not torch.equal(cache.storage[:, :, [7, 4]], before[:, :, [0, 1]]):
            failures.append(f"swap round trip {dtype}")
    return failures


def _time_ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_attention() -> list[list[str]]:
    """4 requests of 4,096 tokens, half cached: 32 query heads, 8 KV heads, dim 128, fp16."""
    batch = [(2048, 4096)] * 4
    heads, kv_heads, dim, block = 32, 8, 128, 16
    case = _case(batch, heads, kv_heads, dim, block, torch.float16, seed=9)
    scale = dim**-0.5
    triton_ms = _time_ms(lambda: paged_prefill_attention(**case, backend="triton"))

    group = heads // kv_heads
    starts = [0]
    for q in case["query_lens"]:
        starts.append(starts[-1] + q)

    def gathered() -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for b, n in enumerate(case["seq_lens"]):
            ids = case["block_tables"][b, : -(-n // block)].long()
            k = case["key_pages"].index_select(0, ids).flatten(0, 1)[:n]
            v = case["value_pages"].index_select(0, ids).flatten(0, 1)[:n]
            out.append((k.transpose(0, 1), v.transpose(0, 1)))
        return out

    pre = gathered()
    masks = []
    for b, n in enumerate(case["seq_lens"]):
        q_len = case["query_lens"][b]
        positions = torch.arange(n - q_len, n, device=DEVICE)[:, None]
        masks.append(torch.arange(n, device=DEVICE)[None, :] <= positions)

    def sdpa(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for b, (k, v) in enumerate(kv):
            q = case["query"][starts[b] : starts[b + 1]].transpose(0, 1)
            F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(group, 0),
                v.repeat_interleave(group, 0),
                attn_mask=masks[b],
                scale=scale,
            )

    rows = [["Triton paged prefill", f"{triton_ms:.3f}", "1.00×"]]
    gather_sdpa = _time_ms(lambda: sdpa(gathered()))
    sdpa_only = _time_ms(lambda: sdpa(pre))
    rows.append(
        ["gather pages + torch SDPA", f"{gather_sdpa:.3f}", f"{gather_sdpa / triton_ms:.2f}×"]
    )
    rows.append(
        [
            "torch SDPA on contiguous K/V (no gather)",
            f"{sdpa_only:.3f}",
            f"{sdpa_only / triton_ms:.2f}×",
        ]
    )
    try:
        from flash_attn import flash_attn_func

        # flash-attn's paged KV cache needs pages of 256 tokens; with 16-token pages it can only
        # run on the pre-gathered contiguous K/V (its causal mask is bottom-right aligned, the
        # semantics of a query suffix over a cached prefix).
        contiguous = [
            (k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous())
            for k, v in pre
        ]

        def flash() -> None:
            for b, (k, v) in enumerate(contiguous):
                q = case["query"][starts[b] : starts[b + 1]][None]
                flash_attn_func(q, k, v, softmax_scale=scale, causal=True)

        flash_ms = _time_ms(flash)
        rows.append(
            [
                "flash-attn on contiguous K/V (no gather)",
                f"{flash_ms:.3f}",
                f"{flash_ms / triton_ms:.2f}×",
            ]
        )
    except ImportError:
        rows.append(["flash-attn", "not installed", "–"])
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device visible to torch; nothing to check.", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    failures = []
    for name, check in (
        ("attention", check_attention),
        ("model", check_model),
        ("pages", check_pages),
    ):
        found = check()
        print(f"check {name}: {'ok' if not found else 'FAILED'}", flush=True)
        failures += found
    attention_rows = time_attention()

    import bench_copies
    from common import md_table

    copies = bench_copies.run(quick=False, device="cuda")
    print()
    print(
        "## Paged prefill attention, 4 × 4,096 tokens (half cached), 32/8 heads × 128, fp16 (ms; × = time ÷ Triton)"
    )
    print(md_table(["kernel", "ms", "÷ Triton"], attention_rows))
    print()
    print("## Page copies on the GPU (vs copy_ of the same bytes)")
    print(bench_copies.markdown(copies))
    print()
    if failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
        return 1
    print("all CUDA correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
