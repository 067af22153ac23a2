"""`prefixkv demo`: what prompt layout does to a prefix cache, measured on a real engine.

The workload is an agent: every request carries the same long system prompt, the same tool
schemas and the same few-shot examples, then a varying user query and a timestamp line. It is
served twice by `prefixkv.Engine` over a seeded random Llama-style model, with a fresh cache
each time:

* **stable-first**: shared content first, query and timestamp last (what a cache-friendly agent
  framework does). After the first request, only the tail of each prompt is computed.
* **query-first**: the same content, with the timestamp and the query at the top of the
  system prompt (and a one-line user turn pointing at them). Every prompt diverges within its
  first blocks, so nearly everything is recomputed.

``--model PATH`` serves a real checkpoint instead (a Hugging Face directory or a GGUF file,
`prefixkv.models.checkpoint.load_checkpoint`), rendered with its own chat template and stopped at its
own end-of-turn tokens, and shows its first answers.

Requests arrive one at a time (as turns of independent agent sessions), so a request's time to
first token is the latency of its own prefill. Every figure is measured, none is modelled: hit
rate and prefill tokens come from the cache's answers, times from the wall clock, and the logit
difference from a full recompute of each request without any cache (`LlamaModel.forward_full`).

The result also shows why the cache context matters: the logit error of reusing KV that was
computed under a different RoPE theta (the `CacheContext` of such a model has another
fingerprint, so the cache refuses the reuse).

JSON output (``--json``), one object:

``workload``: requests, max_new_tokens, seed, mean_prompt_tokens, shared_prefix_tokens,
checked_requests (indices of the requests compared with a full recompute, in both layouts),
tools_in_system_prompt (the model's template cannot render tools, so the schemas are text at
the end of the system prompt).
``model``: name, size (built-in) or path (``--model``), parameters, layers, hidden size, heads,
KV heads, head dim, dtype, device, block size, torch threads.
``layouts.stable_first`` / ``layouts.query_first``: ``hit_rate`` (cached / total prompt tokens),
``prefill_tokens_computed``, ``prefill_tokens_total``, ``ttft_median_s``, ``ttft_s`` (per
request, in order), ``max_logit_diff`` (largest |logit difference| against full recompute over
the checked requests' prefill and every generated token; null when none is checked),
``tokens_match`` (greedy outputs equal the full recompute's), ``wall_s``.
``speedup``: query-first median TTFT / stable-first median TTFT.
``max_logit_diff``: the larger of the two layouts'.
``wrong_context``: ``rope_theta`` and ``other_rope_theta``, ``max_logit_diff`` of reusing KV
across them, ``fingerprints_differ`` (the cache would refuse the reuse).
``answers``: with ``--model``, the first stable-first requests' ``query`` and greedy
``answer`` (decoded, without the stop token); empty for the built-in model.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefixkv.apps.demo_workload import FEW_SHOT, MODEL_SIZES, TOOLS, build_workload
from prefixkv.engine.facade import Engine, RequestResult
from prefixkv.kv.pages import PagedKVCache
from prefixkv.models.decoder import LlamaModel, PrefillRequest
from prefixkv.text.tokenizers import ByteTokenizer

__all__ = ["MODEL_SIZES", "DemoResult", "build_workload", "format_table", "run_demo", "save_plot"]


@dataclass
class LayoutResult:
    """One layout's measurements."""

    results: list[RequestResult]
    wall_s: float
    #: The most KV bytes running requests held at a model step (`SchedulerStats.peak_kv_bytes`),
    #: and what the same steps would hold if every layer kept every block (None: no
    #: full-attention layer to count from). They differ only for models with sliding layers.
    peak_kv_bytes: int = 0
    peak_kv_bytes_all_full: int | None = None

    @property
    def prefill_tokens_total(self) -> int:
        return sum(r.prompt_tokens for r in self.results)

    @property
    def prefill_tokens_computed(self) -> int:
        return sum(r.computed_tokens for r in self.results)

    @property
    def hit_rate(self) -> float:
        return sum(r.cached_tokens for r in self.results) / max(1, self.prefill_tokens_total)

    @property
    def ttft_s(self) -> list[float]:
        return [r.time_to_first_token for r in self.results]

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def max_logit_diff(self) -> float | None:
        diffs = [r.max_logit_diff for r in self.results if r.max_logit_diff is not None]
        return max(diffs) if diffs else None

    @property
    def tokens_match(self) -> bool | None:
        matches = [r.tokens_match for r in self.results if r.tokens_match is not None]
        return all(matches) if matches else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hit_rate": self.hit_rate,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "prefill_tokens_total": self.prefill_tokens_total,
            "ttft_median_s": self.ttft_median_s,
            "ttft_s": self.ttft_s,
            "max_logit_diff": self.max_logit_diff,
            "tokens_match": self.tokens_match,
            "wall_s": self.wall_s,
            "peak_kv_bytes": self.peak_kv_bytes,
            "peak_kv_bytes_all_full": self.peak_kv_bytes_all_full,
        }


@dataclass
class DemoResult:
    """Everything `prefixkv demo` reports (see the module docstring for the JSON fields)."""

    workload: dict[str, Any]
    model: dict[str, Any]
    stable_first: LayoutResult
    query_first: LayoutResult
    wrong_context: dict[str, Any] | None
    #: With a real model: the first stable-first requests' queries and greedy answers.
    answers: list[dict[str, str]] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.query_first.ttft_median_s / self.stable_first.ttft_median_s

    @property
    def max_logit_diff(self) -> float | None:
        diffs = [
            d
            for d in (self.stable_first.max_logit_diff, self.query_first.max_logit_diff)
            if d is not None
        ]
        return max(diffs) if diffs else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "model": self.model,
            "layouts": {
                "stable_first": self.stable_first.to_dict(),
                "query_first": self.query_first.to_dict(),
            },
            "speedup": self.speedup,
            "max_logit_diff": self.max_logit_diff,
            "wrong_context": self.wrong_context,
            "answers": self.answers,
        }


def _checked_indices(num_requests: int, num_checked: int | None) -> set[int]:
    """Which requests are compared with a full recompute: all (None), or `num_checked` spread
    evenly from the first (a miss, in both layouts) to the last (a hit, when the layout
    allows one)."""
    if num_checked is None or num_checked >= num_requests:
        return set(range(num_requests))
    if num_checked <= 0:
        return set()
    if num_checked == 1:
        return {num_requests - 1}
    step = (num_requests - 1) / (num_checked - 1)
    return {round(i * step) for i in range(num_checked)}


def _serve(
    engine: Engine,
    requests: Sequence[dict[str, Any]],
    max_new_tokens: int,
    checked: set[int],
    advance: Callable[[], None],
) -> LayoutResult:
    start = time.perf_counter()
    results = []
    peak, peak_all_full = 0, None
    for index, request in enumerate(requests):
        # One arrival at a time: a request's TTFT is the latency of its own prefill.
        results.extend(engine.generate([request], max_new_tokens, check_exactness=index in checked))
        stats = engine.last_stats
        peak = max(peak, stats.peak_kv_bytes)
        if stats.peak_kv_bytes_all_full is not None:
            peak_all_full = max(peak_all_full or 0, stats.peak_kv_bytes_all_full)
        advance()
    return LayoutResult(results, time.perf_counter() - start, peak, peak_all_full)


def _wrong_theta_error(model: LlamaModel, prompt: list[int], block_size: int) -> dict[str, Any]:
    """Logit error of reusing KV computed under one RoPE theta by a model using another."""
    theta = model.config.rope_theta
    other_theta = theta * 50.0
    other = model.with_config(rope_theta=other_theta)
    config = model.config
    prompt = prompt[: 8 * block_size]
    cached = len(prompt) - block_size
    kv = PagedKVCache(
        config.num_layers,
        -(-len(prompt) // block_size),
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    table = list(range(kv.num_blocks))
    model.prefill(kv, [PrefillRequest(prompt[:cached], table)])  # KV under theta
    reused = other.prefill(
        kv, [PrefillRequest(prompt, table, num_cached_tokens=cached)], return_all_logits=True
    )[0]
    reference = other.forward_full(prompt)[cached:]
    fingerprints = [
        Engine(m, num_blocks=1, block_size=block_size).context.fingerprint() for m in (model, other)
    ]
    return {
        "rope_theta": theta,
        "other_rope_theta": other_theta,
        "max_logit_diff": float((reused - reference).abs().max()),
        "fingerprints_differ": fingerprints[0] != fingerprints[1],
    }


@dataclass
class _Served:
    """The model a demo serves, and how its engines are built."""

    model: LlamaModel
    name: str
    engine_options: dict[str, Any]
    encode: Callable[[dict[str, Any]], list[int]]
    tools_in_system_prompt: bool


def _random_model(model_size: str, seed: int) -> _Served:
    if model_size not in MODEL_SIZES:
        raise ValueError(f"model size must be one of {sorted(MODEL_SIZES)}, got {model_size!r}")
    model = LlamaModel.random(MODEL_SIZES[model_size], seed=seed)
    return _Served(
        model=model,
        name=f"random Llama ({model_size})",
        engine_options={"model_id": f"prefixkv-demo-{model_size}"},
        encode=lambda request: ByteTokenizer().encode(_render(request)),
        tools_in_system_prompt=False,
    )


def _checkpoint_model(path: str | Path) -> _Served:
    """A real checkpoint (HF directory or GGUF file), served with its own tokenizer, chat
    template and stop tokens; refused when it lacks a tokenizer or a template, since the
    demo's requests are chats and another template would be a wrong prompt."""
    from prefixkv.errors import ChatTemplateError, InvalidInputError
    from prefixkv.models.checkpoint import CHECKPOINT_TEMPLATE_SOURCES, load_checkpoint

    checkpoint = load_checkpoint(path)
    if checkpoint.tokenizer is None:
        raise InvalidInputError(f"prefixkv demo --model: {path} has no tokenizer.json")
    template, tokenizer = checkpoint.chat_template, checkpoint.tokenizer
    if template is None:
        where = (
            "tokenizer.chat_template"
            if checkpoint.format == "gguf"
            else (", ".join(CHECKPOINT_TEMPLATE_SOURCES))
        )
        raise ChatTemplateError(
            f"prefixkv demo --model: {path} has no chat template (looked for {where}); the "
            "demo serves chats and will not render them with another model's template"
        )
    probe = [{"role": "user", "content": "hi"}]
    tools_rendered = template.render(probe, tools=TOOLS) != template.render(probe)
    return _Served(
        model=checkpoint.model,
        name=checkpoint.describe(),
        engine_options={
            key: value for key, value in checkpoint.engine_options().items() if key != "model"
        },
        encode=lambda request: tokenizer.encode(
            template.render(request["messages"], tools=request.get("tools"))
        ),
        tools_in_system_prompt=not tools_rendered,
    )


def run_demo(
    *,
    num_requests: int = 12,
    max_new_tokens: int = 4,
    seed: int = 0,
    model_size: str = "small",
    model_path: str | Path | None = None,
    block_size: int = 16,
    checked_requests: int | None = None,
    wrong_context: bool = True,
    progress: bool = True,
    answers_shown: int = 3,
    max_num_batched_tokens: int | None = None,
) -> DemoResult:
    """Serve the agent workload in both layouts and measure it.

    `model_path` (a Hugging Face directory or a GGUF file) serves that checkpoint with its own
    chat template instead of the random reference model of `model_size`; its first
    `answers_shown` stable-first answers are reported. `checked_requests` requests of each
    layout (None: all) are compared with a full recompute. The oracle recomputes the whole
    sequence with dense attention, about as costly as an uncached prefill, so a sample keeps a
    large run short.
    """
    from tqdm import tqdm

    served = _checkpoint_model(model_path) if model_path else _random_model(model_size, seed)
    model = served.model
    config = model.config
    layouts = {
        name: build_workload(
            num_requests,
            seed,
            stable_first=name == "stable-first",
            tools_in_system_prompt=served.tools_in_system_prompt,
        )
        for name in ("stable-first", "query-first")
    }
    # Room for every prompt of a layout plus its output, so no layout is measured with eviction.
    query_first_ids = [served.encode(request) for request in layouts["query-first"]]
    tokens_per_layout = sum(len(ids) + max_new_tokens for ids in query_first_ids)
    num_blocks = tokens_per_layout // block_size + 2 * num_requests + 8

    # Warm up torch (thread pools, first allocations of prompt-sized buffers) on a throwaway
    # engine and a prompt of the workload's length, so the first measured request is not
    # charged for them.
    warm_up = query_first_ids[0]
    Engine(model, num_blocks=(len(warm_up) + 2) // block_size + 4, block_size=block_size).generate(
        [warm_up], 2
    )

    checked = _checked_indices(num_requests, checked_requests)
    measured: dict[str, LayoutResult] = {}
    with tqdm(
        total=2 * num_requests, desc="serving", unit="req", file=sys.stderr, disable=not progress
    ) as bar:
        for name, requests in layouts.items():
            bar.set_postfix_str(name)
            # A smaller step budget prefills in chunks, which is when sliding-window layers
            # let go of blocks mid-prompt (the KV groups line of the report).
            budget: dict[str, Any] = (
                {}
                if max_num_batched_tokens is None
                else {"max_num_batched_tokens": max_num_batched_tokens}
            )
            engine = Engine(
                model,
                num_blocks=num_blocks,
                block_size=block_size,
                **served.engine_options,
                **budget,
            )
            measured[name] = _serve(
                engine, requests, max_new_tokens, checked, lambda: bar.update(1)
            )

    stable = measured["stable-first"]
    answers = []
    if model_path:
        pairs = zip(layouts["stable-first"], stable.results, strict=True)
        for request, result in list(pairs)[:answers_shown]:
            query = str(request["messages"][-1]["content"]).split("\n")[0]
            answers.append({"query": query, "answer": _answer_text(result, served)})
    prompts = [r.prompt_token_ids for r in stable.results]
    shared = _common_prefix(prompts) if len(prompts) > 1 else len(prompts[0])
    return DemoResult(
        workload={
            "requests": num_requests,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "mean_prompt_tokens": statistics.mean(len(p) for p in prompts),
            "shared_prefix_tokens": shared,
            "checked_requests": sorted(checked),
            "tools_in_system_prompt": served.tools_in_system_prompt,
        },
        model={
            "name": served.name,
            "size": None if model_path else model_size,
            "path": str(model_path) if model_path else None,
            "parameters": _parameter_count(model),
            "layers": config.num_layers,
            "hidden_size": config.hidden_size,
            "heads": config.num_heads,
            "kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "block_size": block_size,
            "torch_threads": torch.get_num_threads(),
        },
        stable_first=stable,
        query_first=measured["query-first"],
        wrong_context=_wrong_theta_error(model, prompts[0], block_size) if wrong_context else None,
        answers=answers,
    )


def _parameter_count(model: LlamaModel) -> int:
    """Distinct parameters (a tied head is the embedding, counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _answer_text(result: RequestResult, served: _Served) -> str:
    """The decoded answer without its stop token, on one line."""
    ids = list(result.output_token_ids)
    stops = set(served.engine_options.get("stop_token_ids", ()))
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    tokenizer = served.engine_options.get("tokenizer")
    text = tokenizer.decode(ids) if tokenizer is not None else str(ids)
    return " ".join(text.split())


def _render(request: dict[str, Any]) -> str:
    from prefixkv.text.tokenizers import SimpleChatTemplate

    return SimpleChatTemplate().render(request["messages"], tools=request.get("tools"))


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    first = prompts[0]
    length = min(len(p) for p in prompts)
    for i in range(length):
        if any(p[i] != first[i] for p in prompts):
            return i
    return length


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _diff(value: float | None) -> str:
    return "not checked" if value is None else f"{value:.1e}"


def format_table(result: DemoResult) -> str:
    """The human-readable report."""
    stable, query = result.stable_first, result.query_first
    workload, model = result.workload, result.model
    rows = [
        ("prefix cache hit rate", f"{stable.hit_rate:.1%}", f"{query.hit_rate:.1%}"),
        (
            "prefill tokens computed",
            f"{stable.prefill_tokens_computed:,} / {stable.prefill_tokens_total:,}",
            f"{query.prefill_tokens_computed:,} / {query.prefill_tokens_total:,}",
        ),
        ("median time to first token", _ms(stable.ttft_median_s), _ms(query.ttft_median_s)),
        (
            f"max |logit diff| vs recompute ({len(workload['checked_requests'])} req.)",
            _diff(stable.max_logit_diff),
            _diff(query.max_logit_diff),
        ),
        ("wall time", f"{stable.wall_s:.1f} s", f"{query.wall_s:.1f} s"),
    ]
    label_width = max(len(r[0]) for r in rows)
    widths = [max(len(r[i]) for r in [*rows, ("", "stable-first", "query-first")]) for i in (1, 2)]
    lines = [
        f"prefixkv demo: {workload['requests']} agent requests, "
        f"{workload['mean_prompt_tokens']:.0f} prompt tokens each on average "
        f"({workload['shared_prefix_tokens']} shared: system prompt, "
        f"{len(TOOLS)} tool schemas{' in it' if workload.get('tools_in_system_prompt') else ''}, "
        f"{_plural(len(FEW_SHOT) // 2, 'few-shot example')}), "
        f"{workload['max_new_tokens']} new tokens each",
        f"model: {model['name']}, {model['parameters'] / 1e6:.1f}M parameters, "
        f"{model['layers']} layers, hidden {model['hidden_size']}, "
        f"{model['heads']}/{model['kv_heads']} heads, {model['dtype']} on {model['device']} "
        f"({model['torch_threads']} thread{'' if model['torch_threads'] == 1 else 's'}); "
        f"block size {model['block_size']}",
        "",
        f"{'':<{label_width}}  {'stable-first':>{widths[0]}}  {'query-first':>{widths[1]}}",
    ]
    lines += [f"{a:<{label_width}}  {b:>{widths[0]}}  {c:>{widths[1]}}" for a, b, c in rows]
    full = stable.peak_kv_bytes_all_full
    if full is not None and stable.peak_kv_bytes and full > stable.peak_kv_bytes:
        # Sliding-window layers (KV groups, docs/hybrid.md) let go of out-of-window blocks.
        lines += [
            "",
            f"KV groups: the running requests held at most {stable.peak_kv_bytes:,} bytes of KV "
            f"(stable-first), {full / stable.peak_kv_bytes:.2f}x less than the {full:,} bytes "
            "every layer would hold keeping every block",
        ]
    lines += ["", f"time-to-first-token speedup of the stable-first layout: {result.speedup:.1f}x"]
    match = [m for m in (stable.tokens_match, query.tokens_match) if m is not None]
    if match:
        verdict = "identical to" if all(match) else "DIFFERENT from"
        lines.append(f"greedy outputs: {verdict} a full recompute without cache")
    wrong = result.wrong_context
    if wrong is not None:
        refused = "refuses it" if wrong["fingerprints_differ"] else "would NOT refuse it"
        lines.append(
            f"reusing KV computed under rope_theta={wrong['rope_theta']:g} in a model using "
            f"{wrong['other_rope_theta']:g} would shift logits by up to "
            f"{wrong['max_logit_diff']:.2f}; the cache context {refused}"
        )
    if result.answers:
        lines += ["", "answers (stable-first layout, greedy, as served from the cache):"]
        for item in result.answers:
            lines += [f"  Q: {item['query']}", f"  A: {_shorten(item['answer'], 200)}"]
    return "\n".join(lines)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def save_plot(result: DemoResult, path: str | Path) -> None:
    """A chart of time to first token per request, both layouts (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'prefixkv[plot]'") from exc
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for name, layout, marker in (
        ("stable-first", result.stable_first, "o"),
        ("query-first", result.query_first, "s"),
    ):
        ttft_ms = [t * 1000 for t in layout.ttft_s]
        axis.plot(
            range(1, len(ttft_ms) + 1),
            ttft_ms,
            marker=marker,
            label=f"{name} (hit rate {layout.hit_rate:.0%}, median {_ms(layout.ttft_median_s)})",
        )
    axis.set_yscale("log")
    axis.set_xlabel("request")
    axis.set_ylabel("time to first token (ms, log scale)")
    axis.set_title(
        f"prefixkv demo: stable-first layout is {result.speedup:.1f}x faster to first token"
    )
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(str(path), dpi=120)
    plt.close(figure)


def to_json(result: DemoResult) -> str:
    """The result as one JSON object (the fields are listed in the module docstring)."""
    return json.dumps(result.to_dict(), indent=2)
