"""`benches/bench_threads.py`'s run on a second interpreter refuses one with a GIL by name,
before any benchmark runs (the run itself is a benchmark: `python benches/run.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))

import bench_threads


def test_an_interpreter_with_a_gil_is_refused_by_name() -> None:
    # The suite runs on the abi3 build, an interpreter with a GIL (the free-threaded check
    # copies other tests).
    with pytest.raises(bench_threads.InterpreterFailed, match="not a free-threaded interpreter"):
        bench_threads.run_in(sys.executable)


def test_a_missing_interpreter_is_refused_by_name(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    with pytest.raises(bench_threads.InterpreterFailed, match="cannot be run"):
        bench_threads.run_in(str(missing))


def test_the_interpreter_is_named_with_its_mode() -> None:
    info = bench_threads.interpreter()
    name = bench_threads.interpreter_name(info)
    assert name.startswith(f"{info['implementation']} {info['version']}, ")
    assert ("no GIL" in name) == info["free_threaded"]
