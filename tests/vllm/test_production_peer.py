"""The production-shaped benchmark's vLLM peer (benches/peer_vllm.py): vLLM's own
KVCacheManager, replaying the seeded trace under eviction pressure, caches the same tokens as
prefixkv on every request, so the benchmark's side-by-side timings compare the same work."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import bench_production
from production_workload import TraceParams, production_trace

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import peer_vllm


def test_vllm_caches_what_prefixkv_caches_on_every_request() -> None:
    trace = production_trace(TraceParams().scaled(0.03), seed=2)
    ours = bench_production.replay(trace)
    theirs = peer_vllm.replay(trace)
    assert ours["evictions"][0] > 0  # the pool is under pressure, so victims matter
    assert np.array_equal(theirs["cached"], ours["every_hit"])
    assert 0 < theirs["cached"].sum() < ours["lengths"].sum()
    assert (theirs["hash_ns"] > 0).all() and (theirs["manager_ns"] > 0).all()
