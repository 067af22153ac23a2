"""The synthetic traces' SGLang peer (benches/peer_sglang.py --synthetic): on the traces that
never evict, SGLang's radix cache caches exactly what prefixkv caches on every request (both are
exact prefix caches; only eviction may set them apart), and both of its passes (whole request,
core calls timed apart) replay the same work."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))

import common
import peer_sglang
import workloads

#: Every synthetic workload but `pressure`, whose pool is built to evict.
GRID = [(name, 512, 12) for name in workloads.GENERATORS if name != "pressure"]


def test_sglang_caches_what_prefixkv_caches_where_nothing_is_evicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workloads, "PEER_GRID", GRID)
    theirs = peer_sglang.synthetic(quick=False, seed=3, passes=2)
    ours = workloads.replay_grid(common.replay_alone, GRID, seed=3, passes=1)
    for name, length, _ in GRID:
        key = f"{name}__{length}__"
        assert np.array_equal(theirs[key + "cached"], ours[key + "cached"]), name
        assert np.array_equal(theirs[key + "cached_core_split"], ours[key + "cached"]), name
        assert (theirs[key + "core_ns"] >= 0).all() and (theirs[key + "total_ns"] > 0).all()
    assert ours["agent__512__cached"].sum() > 0
