"""Shared test configuration: the hypothesis profiles and CI seed (`tests/hypothesis_profiles.py`,
whose hooks are re-exported here so pytest finds them), and where CUDA tests are collected."""

from collections.abc import Iterator

import pytest
import torch

from prefixkv import PrefixCache
from tests.hypothesis_profiles import pytest_configure, pytest_report_header

__all__ = ["pytest_configure", "pytest_report_header"]

# CUDA-only tests live in tests/cuda and are collected where a GPU is present (benches/gpu.sh
# runs them); on a CPU-only machine they are not collected rather than reported as skipped.
collect_ignore_glob = [] if torch.cuda.is_available() else ["cuda/*"]


@pytest.fixture(scope="module", params=["auto", "blocks"])
def each_default_core(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module written against `PrefixCache`'s default core twice: with the default as it
    ships ("auto": the run core where it serves the settings) and with the block core, so both
    cores answer its tests. Module-scoped (set once for every example of a hypothesis test);
    a test that names its core keeps it."""
    init = PrefixCache.__init__
    defaults = init.__kwdefaults__
    init.__kwdefaults__ = {**defaults, "core": request.param}
    try:
        yield request.param
    finally:
        init.__kwdefaults__ = defaults
