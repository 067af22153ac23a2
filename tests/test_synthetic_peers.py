"""The synthetic traces' side-by-side benchmark (benches/bench_synthetic_peers.py, section 1d):
the grid replay keeps each request's least time and refuses passes that cached differently, a
workload read as a trace is the workload, and the prefixkv side reports the hits the workloads
are built to have."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import bench_synthetic_peers
import common
import workloads

SMALL_GRID = [("agent", 256, 6), ("unrelated", 256, 6), ("chat", 256, 16), ("pressure", 256, 12)]


def test_a_workload_read_as_a_trace_is_the_workload() -> None:
    trace = workloads.synthetic_trace("pressure", 512, 10, seed=4)
    again = workloads.pressure(512, 10, seed=4)
    prompts = [r.tokens for r in trace.requests()]
    assert len(prompts) == trace.num_requests == len(again.prompts)
    assert all(np.array_equal(a, b) for a, b in zip(prompts, again.prompts, strict=True))
    assert trace.num_blocks() == again.num_blocks
    assert trace.params.max_prompt_tokens == max(len(p) for p in again.prompts)


def test_the_grid_keeps_each_request_s_least_time_and_the_hits() -> None:
    times = iter([np.array([5, 1, 9]), np.array([3, 4, 9]), np.array([4, 2, 1])])

    def replay(trace: workloads.SyntheticTrace) -> dict[str, np.ndarray]:
        return {"total_ns": next(times), "cached": np.array([0, 16, 32])}

    out = workloads.replay_grid(replay, [("unrelated", 64, 2)], seed=0, passes=3)
    assert out["unrelated__64__total_ns"].tolist() == [3, 1, 1]
    assert out["unrelated__64__cached"].tolist() == [0, 16, 32]


def test_the_grid_refuses_passes_that_cached_differently() -> None:
    hits = iter([np.array([0, 16]), np.array([0, 32])])

    def replay(trace: workloads.SyntheticTrace) -> dict[str, np.ndarray]:
        return {"total_ns": np.array([1, 1]), "cached": next(hits)}

    with pytest.raises(workloads.HitMismatch, match="cached different tokens"):
        workloads.replay_grid(replay, [("agent", 64, 1)], seed=0, passes=2)
    with pytest.raises(ValueError, match="at least 1"):
        workloads.replay_grid(replay, [("agent", 64, 1)], seed=0, passes=0)


def test_prefixkv_alone_reports_every_trace_with_its_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workloads, "PEER_GRID", SMALL_GRID)
    monkeypatch.delenv("PREFIXKV_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("PREFIXKV_SGLANG_PYTHON", raising=False)
    result = bench_synthetic_peers.run()
    rows = {r["workload"]: r for r in result["rows"]}
    assert list(rows) == [name for name, _, _ in SMALL_GRID]
    # Built to hit: the agent's shared prefix (95% of 16 blocks, rounded to 15), none of
    # unrelated prompts, a chat turn its history; the timed requests exclude the warm-up.
    assert rows["agent"]["hit_rate"] == pytest.approx(240 / 256)
    assert rows["unrelated"]["hit_rate"] == 0
    assert 0.5 < rows["chat"]["hit_rate"] < 1
    assert rows["agent"]["requests"] == 6
    for row in result["rows"]:
        assert row["prefixkv_us"]["mean"] > 0 and row["peers_us"] == {}
        assert bench_synthetic_peers.worst(result, "sglang", "mean") is None
    assert "| agent | 256 |" in bench_synthetic_peers.markdown(result)


def test_peers_are_compared_request_by_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge in `run`: each peer's timed requests against prefixkv's, vLLM's hits required
    equal to prefixkv's, SGLang's two replays required to agree with each other."""
    monkeypatch.setattr(workloads, "PEER_GRID", SMALL_GRID[:2])
    ours = workloads.replay_grid(common.replay_alone, SMALL_GRID[:2], 0, 1)

    def fake_peer(scale: int, sglang: bool) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"version": np.array("0.0")}
        for name, length, _ in SMALL_GRID[:2]:
            key = f"{name}__{length}__"
            hits = ours[key + "cached"]
            out[key + "total_ns"] = np.full(len(hits), scale * 1_000)
            out[key + "cached"] = hits.copy()
            if sglang:
                out[key + "core_ns"] = np.full(len(hits), 1_000)
                out[key + "cached_core_split"] = hits.copy()
        return out

    peers = {"peer_vllm.py": fake_peer(100, False), "peer_sglang.py": fake_peer(50, True)}
    monkeypatch.setattr(
        bench_synthetic_peers, "_peer", lambda python, script, quick, seed: peers[script]
    )
    result = bench_synthetic_peers.run(vllm_python="v", sglang_python="s")
    for row in result["rows"]:
        ours_mean = row["prefixkv_us"]["mean"]
        assert row["peers_us"]["vllm"]["mean"] == pytest.approx(100)
        assert row["peer_vs_prefixkv"]["vllm"]["mean"] == pytest.approx(100 / ours_mean)
        assert row["peer_vs_prefixkv"]["sglang"]["mean"] == pytest.approx(50 / ours_mean)
        assert row["peer_vs_prefixkv"]["sglang_core"]["mean"] == pytest.approx(1 / ours_mean)
        assert row["sglang_requests_equal"] == 1.0
    assert bench_synthetic_peers.worst(result, "vllm", "mean") is not None
    # A vLLM hit that differs from prefixkv's fails the run; so do SGLang's replays disagreeing.
    peers["peer_vllm.py"]["agent__256__cached"][-1] += 16
    with pytest.raises(workloads.HitMismatch, match="vLLM and prefixkv"):
        bench_synthetic_peers.run(vllm_python="v", sglang_python="s")
    peers["peer_vllm.py"]["agent__256__cached"][-1] -= 16
    peers["peer_sglang.py"]["agent__256__cached_core_split"][-1] += 16
    with pytest.raises(workloads.HitMismatch, match="two replays"):
        bench_synthetic_peers.run(vllm_python="v", sglang_python="s")
