"""The production-shaped benchmark's trace and replay (benches/production_workload.py,
benches/bench_production.py): the trace is what the seed says and has the shape it claims, and the
replay's hit check between prefixkv and the Python baseline holds, and fails when it should."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))

import bench_production
from production_workload import (
    BLOCK_SIZE,
    TraceParams,
    production_trace,
)
from python_baseline import PyPrefixCache

SMALL = TraceParams().scaled(0.03)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    first = production_trace(SMALL, seed=3)
    again = production_trace(SMALL, seed=3)
    other = production_trace(SMALL, seed=4)
    assert first.order == again.order
    assert first.digest() == again.digest()
    assert first.digest() != other.digest()


def test_turns_grow_from_the_previous_prompt_and_sessions_interleave() -> None:
    trace = production_trace(SMALL, seed=1)
    previous: dict[int, np.ndarray] = {}
    sessions_between = 0
    last_session = None
    times = []
    for request in trace.requests():
        times.append(request.time)
        assert 0 < len(request.tokens) <= SMALL.max_prompt_tokens
        before = previous.get(request.session)
        if before is not None:
            # previous prompt + answer + new text: the old prompt is a strict prefix
            assert len(request.tokens) > len(before)
            assert np.array_equal(request.tokens[: len(before)], before)
            sessions_between += last_session != request.session
        previous[request.session] = request.tokens.copy()
        last_session = request.session
    assert times == sorted(times)
    assert sessions_between > 0  # some turn follows another session's request
    # shared prefixes: two sessions of the same kind and prefix start with the same tokens
    by_prefix: dict[tuple[str, int], list[int]] = {}
    for s in trace.sessions:
        by_prefix.setdefault((s.kind, s.prefix), []).append(s.index)
    a, b = next(v for v in by_prefix.values() if len(v) > 1)[:2]
    shared = len(trace.shared_prefixes[trace.sessions[a].kind][trace.sessions[a].prefix])
    assert np.array_equal(previous[a][:shared], previous[b][:shared])
    assert not np.array_equal(previous[a][shared : shared + 64], previous[b][shared : shared + 64])


def test_the_cache_is_a_tenth_of_the_working_set() -> None:
    trace = production_trace(TraceParams().scaled(0.1), seed=0)
    longest = max(s.prompt_tokens[-1] for s in trace.sessions)
    assert trace.num_blocks() == max(
        round(0.1 * trace.working_set_blocks()), 2 * -(-longest // BLOCK_SIZE)
    )
    assert trace.num_blocks() < trace.working_set_blocks() / 5


def test_replay_agrees_on_hits_under_eviction() -> None:
    trace = production_trace(SMALL, seed=0)
    result = bench_production.summarize(bench_production.replay(trace), trace)
    assert result["hits_identical"]
    assert result["evictions_per_request"] > 0
    assert result["evictions_per_request"] == result["python_evictions_per_request"]
    assert 0.0 < result["hit_rate"] < 1.0


def test_replay_detects_a_baseline_that_evicts_other_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Head-first release puts a chain's first blocks at the cold end of the LRU: evicting
    # them orphans the rest, so later hits differ from the core's and the replay must say so.
    def finish_head_first(self: PyPrefixCache, request) -> None:  # type: ignore[no-untyped-def]
        del self._requests[request.id]
        self._release(request.block_table)

    monkeypatch.setattr(PyPrefixCache, "finish", finish_head_first)
    trace = production_trace(SMALL, seed=0)
    with pytest.raises(bench_production.HitMismatch, match="prefixkv cached"):
        bench_production.replay(trace)


def test_working_set_is_the_distinct_blocks_a_cache_that_never_evicts_holds() -> None:
    trace = production_trace(SMALL, seed=5)
    working_set = trace.working_set_blocks()
    cache = PyPrefixCache(working_set + 2 * trace.num_blocks(), BLOCK_SIZE)
    for request in trace.requests():
        held = cache.begin(request.tokens)
        cache.commit(held, held.num_prompt_tokens)
        cache.finish(held)
    assert cache.evictions == 0
    assert len(cache._table) == working_set


def test_prefixkv_alone_replays_to_the_same_hits_and_keeps_the_least_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = production_trace(SMALL, seed=0)
    raw = bench_production.replay(trace)
    least = bench_production.least_prefixkv_ns(trace, 2, raw["every_hit"])
    assert least.shape == (trace.num_requests,) and (least > 0).all()
    # The run core alone caches the same tokens on every request (it refuses otherwise).
    runs = bench_production.least_prefixkv_ns(trace, 1, raw["every_hit"], core="runs")
    assert runs.shape == (trace.num_requests,) and (runs > 0).all()
    # Each request's least over the passes, whichever pass it came from.
    n = trace.num_requests
    times = iter([np.arange(n, 0, -1), np.arange(1, n + 1), np.full(n, n // 2)])
    hits = raw["every_hit"]
    monkeypatch.setattr(
        bench_production,
        "replay_alone",
        lambda trace, core="blocks": {"total_ns": next(times), "cached": hits},
    )
    expected = np.minimum(np.minimum(np.arange(n, 0, -1), np.arange(1, n + 1)), n // 2)
    assert bench_production.least_prefixkv_ns(trace, 3, hits).tolist() == expected.tolist()
    # Another trace's hits (a wrong expectation) are refused, not compared silently.
    wrong = hits.copy()
    wrong[np.flatnonzero(wrong)[0]] += bench_production.BLOCK_SIZE
    times = iter([np.arange(n)])
    with pytest.raises(bench_production.HitMismatch, match="prefixkv alone"):
        bench_production.least_prefixkv_ns(trace, 1, wrong)
