"""The `prefixkv` command: `demo`, `analyze`, `selfcheck`, `--version`.

Exit status: 0 on success, 1 when a check fails (selfcheck), 2 on bad input (argparse's
convention), with a one-line message on stderr that names the problem.

`prefixkv analyze` owns its options (and its own `--help`) and has its own exit statuses:
  0  the whole trace was analysed
  1  the analysis ran, but some lines were malformed and skipped
  2  nothing usable: the file is missing or unreadable, no line is a valid request, or a bad
     option (argparse's own usage errors also exit with 2)
The analysis itself is `prefixkv.analyze`; this module only parses options and prints.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from prefixkv._core import __version__
from prefixkv.errors import PrefixKVError, missing_dependency

__all__ = ["analyze_main", "main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _check_count(text: str) -> int | None:
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'all', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0 or 'all', got {value}")
    return value


#: `--check`'s default, told apart from an explicit "all" (None): all for the built-in model, a
#: sample for a real one.
_CHECK_DEFAULT = -1  # not a string: argparse would run it through _check_count

#: `prefixkv demo --model-size` choices, spelled out so that the parser (and `--help`,
#: `--version`) works without torch; `prefixkv.apps.demo.MODEL_SIZES` holds the configs and
#: tests/test_cli.py checks that the two agree.
DEMO_MODEL_SIZES = ("base", "small", "tiny")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixkv",
        description="Exact, safe, fast prefix caching for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"prefixkv {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="serve an agent workload twice (stable-first vs query-first layout) and compare",
        description="Serve a built-in agent workload (long system prompt, tool schemas and "
        "few-shot examples shared by every request, then a query and a timestamp) with the "
        "prefix-caching engine, once with the shared content first and once with the query "
        "and timestamp first, and report hit rate, prefill work, time to first token and the "
        "logit difference against a full recompute.",
    )
    demo.add_argument(
        "--model",
        metavar="PATH",
        help="serve a real checkpoint instead of the built-in random model: a Hugging Face "
        "directory (config.json, *.safetensors, tokenizer.json, a chat template) or a .gguf "
        "file, rendered with its own chat template; its first answers are shown",
    )
    demo.add_argument(
        "-n", "--requests", type=_positive_int, default=None, help="default: 12 (8 with --model)"
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help="greedy tokens per request (default: 4; 48 with --model, ending earlier at its "
        "end-of-turn token)",
    )
    demo.add_argument("--seed", type=int, default=0, help="model weights and workload seed")
    demo.add_argument(
        "--model-size", choices=DEMO_MODEL_SIZES, default="small", help="default: small"
    )
    demo.add_argument("--block-size", type=_positive_int, default=16)
    demo.add_argument(
        "--check",
        type=_check_count,
        default=_CHECK_DEFAULT,
        metavar="K|all",
        help="compare K requests of each layout (spread from first to last) with a full "
        "recompute without cache; 0 skips it (default: all; 3 with --model)",
    )
    demo.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the Engine's token budget per step (default: the Engine's); a smaller one "
        "prefills long prompts in chunks",
    )
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch CPU threads (default: 1; the reference model's operations are small, and "
        "with more threads their synchronisation costs more than it saves, badly so on a busy "
        "machine)",
    )
    demo.add_argument("--json", action="store_true", help="print the results as one JSON object")
    demo.add_argument("--plot", metavar="FILE.png", help="save a chart of TTFT per request")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")

    commands.add_parser(
        "analyze",
        help="find what breaks prefix reuse in a request trace (see `prefixkv analyze -h`)",
        add_help=False,
    )
    route = commands.add_parser(
        "route-demo",
        help="engine processes publishing KV events, routed by prefix vs round-robin",
        description="Start engine instances as separate processes publishing KV events (ZMQ, "
        "vLLM's format), route an agent workload between them with a prefix index fed by those "
        "events, then round-robin, and compare hit rate and time to first token.",
    )
    route.add_argument("--instances", type=_positive_int, default=2, help="default: 2")
    route.add_argument("--agents", type=_positive_int, default=4, help="default: 4")
    route.add_argument("--rounds", type=_positive_int, default=4, help="requests per agent")
    route.add_argument("--model-size", choices=DEMO_MODEL_SIZES, default="small")
    route.add_argument("--seed", type=int, default=0)
    commands.add_parser(
        "selfcheck",
        help="a quick end-to-end check: cache, paged KV, engine vs full recompute",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `prefixkv` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "analyze":
        # The analyzer owns its options (and its own --help).
        return analyze_main(args_list[1:])
    parser = _parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "route-demo":
            status = _route_demo(args)
        else:
            status = _demo(args) if args.command == "demo" else _selfcheck()
    except ModuleNotFoundError as exc:
        # `demo` and `selfcheck` import torch and tqdm: the `demo` extra brings them all.
        extra = None if args.command == "route-demo" else "demo"  # route-demo: torch, events
        missing = missing_dependency(exc, f"prefixkv {args.command}", extra=extra)
        print(missing or f"prefixkv {args.command}: {exc}", file=sys.stderr)
        status = 2
    except (PrefixKVError, ImportError, OSError) as exc:
        print(f"prefixkv {args.command}: {exc}", file=sys.stderr)
        status = 2
    return status


def _route_demo(args: argparse.Namespace) -> int:
    from prefixkv.apps.route_demo import format_route_table, run_route_demo

    result = run_route_demo(
        instances=args.instances,
        agents=args.agents,
        rounds=args.rounds,
        model_size=args.model_size,
        seed=args.seed,
    )
    print(format_route_table(result))
    return 0


# -- prefixkv analyze ----------------------------------------------------------------------


_MAX_COUNT = 2**32 - 1  # the cache takes sizes and counts as u32


def _count(text: str) -> int:
    """A positive integer that fits the cache's u32 sizes."""
    value = _positive_int(text)
    if value > _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected at most {_MAX_COUNT}, got {value}")
    return value


def _rate(text: str) -> float:
    """A finite positive number: nan and inf would make every estimate meaningless."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
    return value


def _model_shape(value: str) -> tuple[int, int, int]:
    parts = value.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("expected LAYERS,KV_HEADS,HEAD_DIM, e.g. 32,8,128")
    return (_count(parts[0]), _count(parts[1]), _count(parts[2]))


def _analyze_parser() -> argparse.ArgumentParser:
    from prefixkv.analyze import (
        DEFAULT_DTYPE_BYTES,
        DEFAULT_MAX_LINE_BYTES,
        DEFAULT_MAX_TRACE_BYTES,
        DEFAULT_MODEL_SHAPE,
        DEFAULT_PREFILL_TOKENS_PER_SECOND,
    )

    parser = argparse.ArgumentParser(
        prog="prefixkv analyze",
        description="Replay a JSONL request trace through the prefix cache: how much it reuses, "
        "where requests part ways, and what a better prompt layout would gain.",
        epilog="Exit status: 0 clean; 1 some lines were malformed and skipped, or the trace "
        "was cut at --max-trace-bytes; 2 nothing usable (missing file, no valid line, bad "
        "option). The trace format and the JSON schema: docs/analyze.md.",
    )
    parser.add_argument(
        "trace",
        help="JSONL trace: one request per line (tokens, text or "
        "messages; optional tools, tenant, salt, timestamp, id)",
    )
    parser.add_argument(
        "--block-size", type=_count, default=16, help="tokens per cache block (default 16)"
    )
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument(
        "--capacity-blocks",
        type=_count,
        help="cache size in blocks (default: enough for the whole trace)",
    )
    capacity.add_argument(
        "--capacity-bytes",
        type=_positive_int,
        help="cache size in bytes of KV, converted with --model-shape",
    )
    parser.add_argument(
        "--model-shape",
        type=_model_shape,
        default=DEFAULT_MODEL_SHAPE,
        metavar="LAYERS,KV_HEADS,HEAD_DIM",
        help="for bytes per block (default 32,8,128: Llama-3-8B-like)",
    )
    parser.add_argument(
        "--dtype-bytes",
        type=_count,
        default=DEFAULT_DTYPE_BYTES,
        help="bytes per KV element (default 2: fp16/bf16)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or a directory holding one (default: built-in byte tokenizer)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template file or tokenizer_config.json (default: "
        "built-in simple template)",
    )
    parser.add_argument(
        "--prefill-tokens-per-second",
        type=_rate,
        default=DEFAULT_PREFILL_TOKENS_PER_SECOND,
        help="prefill throughput for the time-saved ESTIMATE (default 10000)",
    )
    parser.add_argument(
        "--examples",
        type=_positive_int,
        default=3,
        help="example request ids per finding (default 3)",
    )
    parser.add_argument(
        "--max-line-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_LINE_BYTES,
        help="longer lines are reported as malformed and never loaded "
        f"(default {DEFAULT_MAX_LINE_BYTES // 2**20} MiB)",
    )
    parser.add_argument(
        "--max-trace-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_TRACE_BYTES,
        help="read at most this much of the trace; the report says where it stopped "
        f"(default {DEFAULT_MAX_TRACE_BYTES // 2**30} GiB)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (strict JSON)")
    return parser


def analyze_main(argv: Sequence[str] | None = None) -> int:
    """`prefixkv analyze`; returns the exit status (see the module doc)."""
    from prefixkv.analyze import analyze_trace, bytes_per_block, format_report

    args = _analyze_parser().parse_args(argv)
    capacity_blocks = args.capacity_blocks
    if args.capacity_bytes is not None:
        block_bytes = bytes_per_block(args.block_size, args.model_shape, args.dtype_bytes)
        capacity_blocks = args.capacity_bytes // block_bytes
        if capacity_blocks < 1:
            print(
                f"prefixkv analyze: --capacity-bytes {args.capacity_bytes} is less than one "
                f"block ({block_bytes} bytes)",
                file=sys.stderr,
            )
            return 2
    try:
        report = analyze_trace(
            args.trace,
            block_size=args.block_size,
            capacity_blocks=capacity_blocks,
            tokenizer=args.tokenizer,
            chat_template=args.chat_template,
            prefill_tokens_per_second=args.prefill_tokens_per_second,
            model_shape=args.model_shape,
            dtype_bytes=args.dtype_bytes,
            max_examples=args.examples,
            max_line_bytes=args.max_line_bytes,
            max_trace_bytes=args.max_trace_bytes,
        )
    except OSError as exc:
        print(f"prefixkv analyze: cannot read {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except PrefixKVError as exc:
        print(f"prefixkv analyze: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        # The analysis holds the trace in memory (about 20 bytes per byte of text, and the
        # tokenizer's own copy while it encodes): the limits are the remedy.
        print(
            f"prefixkv analyze: out of memory analysing {args.trace}; lower --max-trace-bytes "
            "or --max-line-bytes",
            file=sys.stderr,
        )
        return 2
    print(report.to_json(indent=2) if args.json else format_report(report))
    if report.requests == 0:
        return 2
    return 1 if report.skipped_lines or report.truncated_at_line is not None else 0


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from prefixkv.apps.demo import format_table, run_demo, save_plot, to_json

    if args.plot is not None:
        plot_path = Path(args.plot)
        if not plot_path.parent.is_dir():
            print(
                f"prefixkv demo: cannot write {plot_path}: {plot_path.parent} is not a directory",
                file=sys.stderr,
            )
            return 2
        try:  # fail before the run, not after it
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                "prefixkv demo: --plot needs matplotlib: pip install 'prefixkv[plot]'",
                file=sys.stderr,
            )
            return 2
    import torch

    torch.set_num_threads(args.threads)
    real = args.model is not None
    if real and not Path(args.model).exists():
        print(f"prefixkv demo: --model {args.model}: no such file or directory", file=sys.stderr)
        return 2
    check = args.check
    if check == _CHECK_DEFAULT:
        check = 3 if real else None
    # A real model costs a real prefill per request: fewer requests and a sample of checks
    # keep it to a couple of minutes on one CPU thread; longer outputs make the answers readable.
    result = run_demo(
        num_requests=args.requests or (8 if real else 12),
        max_new_tokens=args.max_new_tokens or (48 if real else 4),
        seed=args.seed,
        model_size=args.model_size,
        model_path=args.model,
        block_size=args.block_size,
        checked_requests=check,
        progress=not args.quiet,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.plot is not None:
        save_plot(result, args.plot)
        print(f"prefixkv demo: wrote {args.plot}", file=sys.stderr)
    print(to_json(result) if args.json else format_table(result))
    return 0


def _selfcheck() -> int:
    """Exercise the cache, the paged KV and the engine on a tiny model; 0 if all agree."""
    import torch

    from prefixkv.cache import PrefixCache
    from prefixkv.engine.facade import Engine
    from prefixkv.models.decoder import LlamaModel, ModelConfig

    failures: list[str] = []

    def check(condition: bool, what: str) -> None:
        print(f"  {'ok  ' if condition else 'FAIL'} {what}")
        if not condition:
            failures.append(what)

    print(f"prefixkv {__version__} selfcheck (torch {torch.__version__})")
    model = LlamaModel.random(ModelConfig(vocab_size=264), seed=7)
    engine = Engine(model, num_blocks=32, block_size=4)
    prompt = [(7 * i + 3) % 256 for i in range(22)]
    first, again, longer = engine.generate(
        [prompt, prompt, [*prompt, 1, 2, 3]], max_new_tokens=4, check_exactness=True
    )
    check(first.cached_tokens == 0, "a new prompt misses")
    check(
        again.cached_tokens >= 20, f"the same prompt reuses its blocks ({again.cached_tokens}/22)"
    )
    check(longer.cached_tokens >= 20, f"a longer prompt reuses the prefix ({longer.cached_tokens})")
    check(first.output_token_ids == again.output_token_ids, "cached and uncached outputs agree")
    full_hit = engine.generate([prompt[:20]], max_new_tokens=2, check_exactness=True)[0]
    check(
        full_hit.full_hit and full_hit.computed_tokens == 4,
        "a full hit recomputes only its last block, into a private copy",
    )
    worst = max(r.max_logit_diff or 0.0 for r in (first, again, longer, full_hit))
    check(worst < 1e-3, f"logits equal a full recompute (max |diff| {worst:.1e})")
    matches = all(r.tokens_match for r in (first, again, longer, full_hit))
    check(matches, "greedy tokens equal a full recompute")
    other = Engine(model.with_config(rope_theta=50000.0), num_blocks=8, block_size=4)
    check(
        other.context.fingerprint() != engine.context.fingerprint(),
        "another RoPE theta gives another cache context",
    )
    engine.cache.check_invariants()
    assert isinstance(engine.cache, PrefixCache)  # the selfcheck model has one KV group
    check(engine.cache.stats().requests_live == 0, "every request released its blocks")
    print("selfcheck passed" if not failures else f"selfcheck FAILED: {len(failures)} check(s)")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
