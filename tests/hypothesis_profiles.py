"""Hypothesis profiles and the CI seed, as a pytest plugin (`tests/conftest.py` loads it).

`HYPOTHESIS_PROFILE=ci` (set by `make ci`, which .ci/run calls) runs several times more examples
than the default profile a developer gets locally, drawn afresh for every commit yet
reproducibly: the seed is derived from the commit being tested (``git rev-parse HEAD``), so a
rerun of the same commit replays the same examples and the next commit explores new ones. The
report header prints the seed; a failure prints its reproduction blob (``print_blob``), and
``--hypothesis-seed=N`` on the command line replays a whole run (it overrides the derived seed).
Without git, or outside a checkout (an unpacked sdist), the seed is 0.

CI once froze its examples (``derandomize=True``) after a random draw failed; the cause was
real (the two forward paths rounded attention differently in bfloat16, see
`tests/test_model_paged.py`), and a frozen draw hides the next such case. Local runs with the
default profile draw new examples on every run.

Kept apart from the conftest (and free of torch) so that `tests/test_hypothesis_profile.py` can
load it into a fresh pytest quickly (``-p tests.hypothesis_profiles``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    # The examples depend on the seed alone, not on failures a local database remembers.
    database=None,
    # Explicit: where the CI environment variable is set, hypothesis's own defaults (which a
    # registered profile inherits) derandomize, and the commit's seed would be ignored.
    derandomize=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

#: Where the seed came from, for the report header ("" when none was derived).
_seed_origin = ""


def commit_seed(repository: Path) -> tuple[int, str]:
    """The CI seed for the checkout at `repository` and where it came from: HEAD's hash read as
    an integer (its first 16 hex digits), or 0 when git or the commit cannot be read."""
    try:
        result = subprocess.run(
            ["git", "-C", str(repository), "rev-parse", "--verify", "--quiet", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        commit = result.stdout.strip()
        return int(commit[:16], 16), f"commit {commit[:12]}"
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0, "no git commit found"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under the CI profile, give hypothesis the commit's seed unless one was passed. Runs before
    hypothesis's own `pytest_configure`, which is what reads ``--hypothesis-seed``."""
    global _seed_origin
    if settings.get_current_profile_name() != "ci":
        return
    if config.getoption("hypothesis_seed", default=None) is not None:
        _seed_origin = "--hypothesis-seed"
        return
    seed, _seed_origin = commit_seed(Path(__file__).resolve().parent)
    config.option.hypothesis_seed = str(seed)


def pytest_report_header(config: pytest.Config) -> str:
    header = f"hypothesis profile: {settings.get_current_profile_name()}"
    seed = config.getoption("hypothesis_seed", default=None)
    if seed is not None:
        header += f", seed {seed} ({_seed_origin or 'given'}; rerun: --hypothesis-seed={seed})"
    return header
