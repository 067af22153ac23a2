"""What `pip install prefixkv` (no extras: numpy only) must give an engine, checked end to end.

The block manager round trip (begin / commit / finish / lookup with list and numpy token ids,
salts, context changes, a refused oversized prompt), `prefixkv analyze` on a small trace, and a
clear `MissingDependencyError` naming the extra for every torch-based name, with torch never
imported.

Run in an environment without the extras (`.ci/run` builds the wheel and installs it into a
fresh virtual environment for this), or with `--block-optional` in a full environment, which
makes torch, safetensors, tqdm, matplotlib, transformers, tokenizers, jinja2 and triton
unimportable first (what tests/test_packaging.py does). Prints one line and exits 0 when all
holds; any failure is an AssertionError with a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import tempfile
from importlib.abc import MetaPathFinder
from pathlib import Path

OPTIONAL = (
    "torch",
    "safetensors",
    "tqdm",
    "matplotlib",
    "transformers",
    "tokenizers",
    "jinja2",
    "triton",
)


class _BlockOptional(MetaPathFinder):
    """Behaves as if the optional packages were not installed: importing one raises the
    ModuleNotFoundError that Python raises for a missing package."""

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname.partition(".")[0] in OPTIONAL:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _block_manager() -> None:
    import numpy as np

    from prefixkv import CacheContext, OutOfBlocksError, PositionEncoding, PrefixCache

    context = CacheContext(
        model_id="smoke", position_encoding=PositionEncoding(rope_theta=500000.0), block_size=4
    )
    cache = PrefixCache(num_blocks=16, context=context)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 more

    first = cache.begin(prompt)
    assert first.num_cached_tokens == 0 and len(first.block_table) == 5, first
    assert cache.commit(first, len(prompt)) == 4
    cache.finish(first)

    # The same prompt as a numpy array (any integer dtype) reuses the 4 full blocks.
    again = cache.begin(np.asarray(prompt, dtype=np.int64))
    assert again.num_cached_tokens == 16 and again.block_table[:4] == first.block_table[:4]
    assert again.num_tokens_to_compute == 2
    cache.finish(again)

    # A full hit: every block is cached; the last block is recomputed into a private copy
    # (the default `full_hit="recompute_last_block"`), so the runner never writes a shared one.
    match = cache.lookup(np.asarray(prompt[:12], dtype=np.int32))
    assert match.full_hit and match.num_cached_tokens == 8, match
    assert match.block_ids == first.block_table[:2]
    assert cache.lookup(prompt, salt="another tenant").num_cached_tokens == 0

    try:
        cache.begin(list(range(100)))  # 25 blocks in a pool of 16
    except OutOfBlocksError:
        pass
    else:
        raise AssertionError("an oversized prompt was accepted")
    stats = cache.stats()  # the refused prompt changed nothing
    assert stats.hit_tokens == 16 and stats.blocks_cached == 4 and stats.blocks_in_use == 0, stats
    cache.check_invariants()

    cache.set_context(CacheContext(model_id="smoke", block_size=4))  # another RoPE theta
    assert cache.lookup(prompt).num_cached_tokens == 0
    cache.check_invariants()


def _analyze() -> None:
    from prefixkv.apps.cli import main

    stable = "You are Harbor, the support assistant. " * 20
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        lines = [{"text": f"Current time: 09:0{i}:17Z\n{stable}Question {i}?"} for i in range(4)]
        trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(["analyze", str(trace), "--json"])
    assert status == 0, status
    report = json.loads(out.getvalue())
    assert isinstance(report, dict) and report, report


def _kv_groups() -> None:
    """A hybrid model's block managers: one per KV group, a sliding one releasing blocks."""
    from prefixkv import CacheContext, GroupedPrefixCache, KVGroupSpec

    specs = (KVGroupSpec(0, None, (1,)), KVGroupSpec(1, 8, (0,)))
    cache = GroupedPrefixCache(specs, (16, 16), context=CacheContext(block_size=4))
    cache.add_request("a", list(range(40)))
    slots = cache.allocate_slots("a", 40)
    assert slots.num_computed_tokens == 0, slots
    cache.commit("a", 40)
    full, sliding = cache.block_tables("a")
    assert sliding[0] == cache.null_blocks[1] and full[0] != cache.null_blocks[1], (full, sliding)
    cache.finish("a")
    cache.add_request("b", list(range(40)))
    assert cache.start_position("b") == 36
    cache.finish("b")
    cache.check_invariants()


def _torch_names_fail_clearly() -> None:
    import prefixkv
    from prefixkv import MissingDependencyError

    for name in ("Engine", "PagedKVCache", "LlamaModel", "paged_prefill_attention"):
        try:
            getattr(prefixkv, name)
        except MissingDependencyError as exc:
            assert isinstance(exc, ImportError)
            assert f"prefixkv.{name} needs torch" in str(exc), exc
            assert "pip install 'prefixkv[torch]'" in str(exc), exc
        else:
            raise AssertionError(f"prefixkv.{name} loaded without torch")


def main(argv: list[str]) -> int:
    if "--block-optional" in argv:
        sys.meta_path.insert(0, _BlockOptional())
    elif importlib.util.find_spec("torch") is not None:
        print(
            "smoke_no_extras: torch is installed here; run it in an environment without the "
            "extras, or with --block-optional",
            file=sys.stderr,
        )
        return 2
    _block_manager()
    _kv_groups()
    _analyze()
    _torch_names_fail_clearly()
    imported = sorted(name for name in OPTIONAL if name in sys.modules)
    assert not imported, f"imported without being asked for: {imported}"
    import prefixkv

    print(f"prefixkv {prefixkv.__version__}: block manager and analyze work without the extras")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
