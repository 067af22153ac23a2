"""The production-shaped benchmark's SGLang peer (benches/peer_sglang.py): SGLang's
UnifiedRadixCache on its Rust tree core, driven as SGLang's scheduler drives it. With a pool that
never evicts it must cache exactly what prefixkv caches on every request (both are exact prefix
caches; only eviction policy may set them apart), so the driver matches, inserts and locks what
it should; under the trace's pressure it must evict, leak no page and leave no lock."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import peer_sglang
import workloads
from production_workload import BLOCK_SIZE, TraceParams, production_trace

from prefixkv import PrefixCache

TRACE = TraceParams().scaled(0.02)


def prefixkv_hits(trace, num_blocks: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    cache = PrefixCache(num_blocks, block_size=BLOCK_SIZE)
    hits = []
    for request in trace.requests():
        held = cache.begin(request.tokens)
        cache.commit(held, held.num_prompt_tokens)
        cache.finish(held)
        hits.append(held.num_cached_tokens)
    return np.array(hits)


@pytest.mark.parametrize("tree_core", sorted(peer_sglang.TREE_CORES))
def test_without_eviction_sglang_caches_what_prefixkv_caches(tree_core: str) -> None:
    trace = production_trace(TRACE, seed=1)
    roomy = trace.working_set_blocks() + 2 * trace.num_blocks()
    theirs = peer_sglang.replay(trace, num_blocks=roomy, tree_core=tree_core)
    assert str(theirs["backend"]) == peer_sglang.TREE_CORES[tree_core]
    assert theirs["evicted_tokens"].sum() == 0
    ours = prefixkv_hits(trace, roomy)
    assert np.array_equal(theirs["cached"], ours)
    assert 0 < ours.sum() < trace.prompt_lengths().sum()  # hits and misses both happen


def test_under_pressure_it_evicts_without_leaking_pages() -> None:
    trace = production_trace(TRACE, seed=1)
    # replay() raises PeerError if a page leaked or a lock was left when the trace ends.
    theirs = peer_sglang.replay(trace)
    assert theirs["evicted_tokens"].sum() > 0
    lengths = trace.prompt_lengths()
    assert (theirs["cached"] < lengths).all()
    assert (theirs["cached"] % BLOCK_SIZE == 0).all()
    for phase in peer_sglang.PHASES:
        assert (theirs[f"{phase}_ns"] > 0).all()


def test_least_of_passes_takes_each_request_s_least_and_refuses_other_hits() -> None:
    """The least whole request is the least of each replay's sum of phases (not the sum of each
    phase's least), and the least core time is per request across replays."""
    match, alloc, insert, release = peer_sglang.PHASES
    # Request 0 is fastest in replay 0, request 1 in replay 1; each replay's phases peak apart.
    first = {match: [1, 9], alloc: [1, 9], insert: [5, 0], release: [0, 0]}
    second = {match: [9, 1], alloc: [0, 1], insert: [0, 1], release: [9, 0]}

    def run(phases: dict[str, list[int]], core: list[int], cached: list[int]) -> dict:  # type: ignore[type-arg]
        return {
            **{f"{p}_ns": np.array(v) for p, v in phases.items()},
            "core_ns": np.array(core),
            "cached": np.array(cached),
        }

    least = peer_sglang.least_of([run(first, [4, 1], [0, 16]), run(second, [2, 3], [0, 16])])
    # Sums: replay 0 is [7, 18], replay 1 is [18, 3]; the per-phase minima would sum to [1, 2].
    assert least["least_total_ns"].tolist() == [7, 3]
    assert least["least_core_ns"].tolist() == [2, 1]
    no_core = {k: v for k, v in run(first, [0, 0], [0, 16]).items() if k != "core_ns"}
    assert "least_core_ns" not in peer_sglang.least_of([no_core])
    with pytest.raises(workloads.HitMismatch, match="cached different tokens"):
        peer_sglang.least_of([run(first, [1, 1], [0, 16]), run(first, [1, 1], [0, 0])])
