"""The compiled Triton kernel and the torch backend on CUDA, against the reference path.

Collected only where CUDA is available (see tests/conftest.py); `benches/gpu.sh` runs them.
The CPU suite checks the same kernel under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.kv.prefill import triton_available
from tests.test_attention import UNIT_ROUNDOFF, Case, CaseSpec, build, case_specs


def on_cuda(case: Case) -> Case:
    moved = {
        f.name: getattr(case, f.name).cuda()
        if torch.is_tensor(getattr(case, f.name))
        else getattr(case, f.name)
        for f in dataclasses.fields(case)
    }
    return Case(**moved)


def error_against_reference(case: Case, backend: str, dtype: torch.dtype) -> float:
    expected = case.run("reference", dtype=torch.float64)
    output = case.run(backend, dtype=dtype)
    assert output.is_cuda and torch.isfinite(output).all()
    scale = float(case.value_pages.abs().max()) or 1.0
    return float((output.double() - expected).abs().max()) / scale


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@settings(max_examples=25)
@given(spec=case_specs(max_seq_len=300, head_dims=(32, 64, 128)))
def test_cuda_backends_match_reference(backend: str, dtype: torch.dtype, spec: CaseSpec) -> None:
    if backend == "triton" and not triton_available():
        pytest.fail("triton must import on a CUDA machine")
    case = on_cuda(build(spec))
    bound = 1e-5 if dtype == torch.float32 else 4 * UNIT_ROUNDOFF[dtype]
    assert error_against_reference(case, backend, dtype) <= bound


@given(st.integers(0, 2**31))
@settings(max_examples=5)
def test_auto_picks_a_working_backend_on_cuda(seed: int) -> None:
    spec = CaseSpec(
        requests=(),
        num_kv_heads=2,
        group_size=2,
        head_dim=64,
        block_size=16,
        spare_blocks=0,
        table_padding=-1,
        extra_columns=0,
        sliding_window=None,
        seed=seed,
    )
    from tests.test_attention import Request

    spec = dataclasses.replace(spec, requests=(Request(512, 256), Request(100, 99)))
    case = on_cuda(build(spec))
    assert error_against_reference(case, "auto", torch.float16) <= 4 * UNIT_ROUNDOFF[torch.float16]
