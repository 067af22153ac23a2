"""The default CPU thread count (issue 14): idle cores, at least 1, never more than the CPUs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.engine import threads
from prefixkv.engine.threads import available_cpus, configure_torch_threads, default_torch_threads

cpus_st = st.integers(min_value=1, max_value=256)
load_st = st.floats(min_value=0, max_value=1000, allow_nan=False)


@given(cpus=cpus_st, load=load_st)
def test_the_default_is_between_one_and_the_cpus(cpus: int, load: float) -> None:
    assert 1 <= default_torch_threads(cpus=cpus, load=load) <= cpus


@given(cpus=cpus_st, load=load_st, more=st.floats(min_value=0, max_value=100))
def test_more_load_never_means_more_threads(cpus: int, load: float, more: float) -> None:
    assert default_torch_threads(cpus=cpus, load=load + more) <= default_torch_threads(
        cpus=cpus, load=load
    )


@pytest.mark.parametrize(
    ("cpus", "load", "expected"),
    [(2, 0.0, 2), (2, 0.6, 1), (2, 3.9, 1), (16, 0.2, 16), (16, 4.0, 12), (16, float("nan"), 16)],
)
def test_idle_cores_are_used_and_busy_ones_are_not(cpus: int, load: float, expected: int) -> None:
    assert default_torch_threads(cpus=cpus, load=load) == expected


def test_configure_lowers_only_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        assert available_cpus() >= 1
        for env, start, expected in (
            ({"PREFIXKV_TORCH_THREADS": "3"}, 1, 3),
            ({"OMP_NUM_THREADS": "2"}, 5, 5),
            ({}, 1, 1),  # a smaller count chosen before is kept
        ):
            monkeypatch.setattr(threads, "_configured", False)
            for name in threads.THREAD_ENV_VARS:
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            torch.set_num_threads(start)
            assert configure_torch_threads() == expected
        monkeypatch.setattr(threads, "_configured", False)
        monkeypatch.setattr(threads, "default_torch_threads", lambda: 1)
        torch.set_num_threads(4)
        assert configure_torch_threads() == 1  # a busy machine: lowered
        torch.set_num_threads(4)
        assert configure_torch_threads() == 4  # only the first call acts
    finally:
        torch.set_num_threads(before)


def test_busy_cpus_now_is_a_share_of_the_machine() -> None:
    import os

    assert 0.0 <= threads.busy_cpus_now(0.02) <= (os.cpu_count() or 1) + 1e-9
