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
    # "(on)": the probe ran and read the GIL on, not an import error read as a refusal.
    with pytest.raises(
        bench_threads.InterpreterFailed, match=r"not a free-threaded interpreter .*\(on\)"
    ):
        bench_threads.run_in(sys.executable)


def test_a_relative_interpreter_path_is_read_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe runs in benches/: a relative path must not be resolved there.
    # A wrapper script, not a symlink: a venv's interpreter found through a symlink elsewhere
    # loses its venv (and prefixkv with it).
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(bench_threads.InterpreterFailed, match=r"\(on\)") as refused:
        bench_threads.check_interpreter("bin/python")
    assert str(tmp_path / "bin" / "python") in str(refused.value)


def test_a_missing_interpreter_is_refused_by_name(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    with pytest.raises(bench_threads.InterpreterFailed, match="cannot be run"):
        bench_threads.run_in(str(missing))


def test_the_interpreter_is_named_with_its_mode() -> None:
    info = bench_threads.interpreter()
    name = bench_threads.interpreter_name(info)
    assert name.startswith(f"{info['implementation']} {info['version']}, ")
    assert ("no GIL" in name) == info["free_threaded"]
