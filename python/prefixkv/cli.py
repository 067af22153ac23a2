"""The `prefixkv` command: `demo`, `analyze`, `selfcheck`, `--version`.

Exit status: 0 on success, 1 when a check fails (selfcheck), 2 on bad input (argparse's
convention), with a one-line message on stderr that names the problem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prefixkv._core import __version__
from prefixkv.errors import PrefixKVError

__all__ = ["main"]


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


def _parser() -> argparse.ArgumentParser:
    from prefixkv.demo import MODEL_SIZES

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
    demo.add_argument("-n", "--requests", type=_positive_int, default=12, help="default: 12")
    demo.add_argument(
        "--max-new-tokens", type=_positive_int, default=4, help="greedy tokens per request"
    )
    demo.add_argument("--seed", type=int, default=0, help="model weights and workload seed")
    demo.add_argument(
        "--model-size", choices=sorted(MODEL_SIZES), default="small", help="default: small"
    )
    demo.add_argument("--block-size", type=_positive_int, default=16)
    demo.add_argument(
        "--check",
        type=_check_count,
        default=None,
        metavar="K|all",
        help="compare K requests of each layout (spread from first to last) with a full "
        "recompute without cache; 0 skips it (default: all)",
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
        from prefixkv.analyze import main as analyze_main

        return analyze_main(args_list[1:])
    parser = _parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status = _demo(args) if args.command == "demo" else _selfcheck()
    except (PrefixKVError, ImportError, OSError) as exc:
        print(f"prefixkv {args.command}: {exc}", file=sys.stderr)
        status = 2
    return status


def _demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from prefixkv.demo import format_table, run_demo, save_plot, to_json

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
    result = run_demo(
        num_requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        model_size=args.model_size,
        block_size=args.block_size,
        checked_requests=args.check,
        progress=not args.quiet,
    )
    if args.plot is not None:
        save_plot(result, args.plot)
        print(f"prefixkv demo: wrote {args.plot}", file=sys.stderr)
    print(to_json(result) if args.json else format_table(result))
    return 0


def _selfcheck() -> int:
    """Exercise the cache, the paged KV and the engine on a tiny model; 0 if all agree."""
    import torch

    from prefixkv.engine import Engine
    from prefixkv.model import LlamaModel, ModelConfig

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
    check(full_hit.full_hit and full_hit.computed_tokens == 1, "a full hit computes one token")
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
    check(engine.cache.stats().requests_live == 0, "every request released its blocks")
    print("selfcheck passed" if not failures else f"selfcheck FAILED: {len(failures)} check(s)")
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
