"""The synthetic traces' vLLM peer (benches/peer_vllm.py --synthetic): vLLM's KVCacheManager
caches the same tokens as prefixkv on every request of every synthetic trace, so section 1d's
side-by-side timings compare the same work (bench_synthetic_peers.py fails the run otherwise)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import common
import workloads

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import peer_vllm

GRID = [(name, 512, 20) for name in workloads.GENERATORS]


def test_vllm_caches_what_prefixkv_caches_on_every_synthetic_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workloads, "PEER_GRID", GRID)
    theirs = peer_vllm.synthetic(quick=False, seed=1, passes=2)
    ours = workloads.replay_grid(common.replay_alone, GRID, seed=1, passes=1)
    for name, length, _ in GRID:
        key = f"{name}__{length}__"
        assert np.array_equal(theirs[key + "cached"], ours[key + "cached"]), name
        assert (theirs[key + "total_ns"] > 0).all()
    assert ours["pressure__512__cached"].sum() > 0  # the traces hit, so the check has teeth
