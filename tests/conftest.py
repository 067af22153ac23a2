"""Shared test configuration: hypothesis profiles.

`HYPOTHESIS_PROFILE=ci` (set by .ci/run) runs several times more examples than the default
profile a developer gets locally, and the same examples on every run (`derandomize`): the
merge gate must not pass or fail by the draw. Local runs keep drawing new examples, which is
where new failures are found; each prints its reproduction blob.
"""

import os

import torch
from hypothesis import HealthCheck, settings

# CUDA-only tests live in tests/cuda and are collected where a GPU is present (benches/gpu.sh
# runs them); on a CPU-only machine they are not collected rather than reported as skipped.
collect_ignore_glob = [] if torch.cuda.is_available() else ["cuda/*"]

settings.register_profile(
    "default",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_report_header() -> str:
    return f"hypothesis profile: {settings.get_current_profile_name()}"
