"""Shared test configuration: the hypothesis profiles and CI seed (`tests/hypothesis_profiles.py`,
whose hooks are re-exported here so pytest finds them), and where CUDA tests are collected."""

import torch

from tests.hypothesis_profiles import pytest_configure, pytest_report_header

__all__ = ["pytest_configure", "pytest_report_header"]

# CUDA-only tests live in tests/cuda and are collected where a GPU is present (benches/gpu.sh
# runs them); on a CPU-only machine they are not collected rather than reported as skipped.
collect_ignore_glob = [] if torch.cuda.is_available() else ["cuda/*"]
