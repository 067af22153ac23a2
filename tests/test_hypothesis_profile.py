"""The CI hypothesis profile draws fresh examples for every commit, reproducibly
(`tests/hypothesis_profiles.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests.hypothesis_profiles import commit_seed

REPOSITORY = Path(__file__).resolve().parent.parent


def test_the_ci_profile_draws_fresh_examples_and_prints_the_blob() -> None:
    ci = settings.get_profile("ci")
    assert not ci.derandomize
    assert ci.print_blob
    assert ci.database is None


def git(directory: Path, *args: str) -> str:
    command = ["git", "-C", str(directory), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def test_the_seed_is_the_commit(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    git(tmp_path, "commit", "-q", "--allow-empty", "-m", "one")
    first = git(tmp_path, "rev-parse", "HEAD")
    assert commit_seed(tmp_path) == (int(first[:16], 16), f"commit {first[:12]}")
    git(tmp_path, "commit", "-q", "--allow-empty", "-m", "two")
    assert commit_seed(tmp_path)[0] != int(first[:16], 16)


def test_without_git_or_a_commit_the_seed_is_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert commit_seed(tmp_path) == (0, "no git commit found")  # not a checkout
    git(tmp_path, "init", "-q")
    assert commit_seed(tmp_path) == (0, "no git commit found")  # no commit yet
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert commit_seed(REPOSITORY) == (0, "no git commit found")  # git not installed


DRAWING_TEST = """
from hypothesis import given, strategies as st

@given(st.integers())
def test_draw(value):
    with open({out!r}, "a") as out:
        out.write(f"{{value}}\\n")
"""


def draws(tmp_path: Path, name: str, *options: str) -> tuple[list[str], str]:
    """The integers one hypothesis test draws under the CI profile, and pytest's header."""
    out = tmp_path / f"{name}.txt"
    test_file = tmp_path / f"test_{name}.py"
    test_file.write_text(DRAWING_TEST.format(out=str(out)))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(test_file),
            "-p",
            "tests.hypothesis_profiles",
            *options,
        ],
        cwd=REPOSITORY,
        env=dict(os.environ, HYPOTHESIS_PROFILE="ci"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if "hypothesis profile" in line)
    return out.read_text().split(), header


def test_ci_runs_draw_what_the_printed_seed_draws(tmp_path: Path) -> None:
    """The seed derived from the commit reaches hypothesis: a run with that seed passed by hand
    draws the same examples (an unseeded run would draw others)."""
    derived, header = draws(tmp_path, "derived", "-p", "no:cacheprovider")
    seed, origin = commit_seed(REPOSITORY)
    assert f"seed {seed} ({origin};" in header
    replayed, _ = draws(tmp_path, "replayed", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}")
    assert derived == replayed
    assert len(set(derived)) > 10
