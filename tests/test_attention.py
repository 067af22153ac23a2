"""Paged prefill attention: every backend against the reference, on drawn batches.

The oracle is ``backend="reference"`` run in float64 on the very same (already rounded) inputs,
so the difference measures only a backend's own arithmetic. Bounds, with ``u`` the unit
roundoff of the input dtype (2^-24 float32, 2^-11 float16, 2^-8 bfloat16) and ``V`` the largest
value magnitude (the output is a convex combination of value rows, so ``|out| <= V``):

- torch backend: float32 accumulation, then one rounding of the output: ``u * V`` plus float32
  noise. Tested at ``2u * V`` for half precision and ``1e-5 * V`` for float32.
- triton backend: as above, plus the probabilities rounded to the input dtype before ``P @ V``
  (FlashAttention's choice, for tensor cores), another ``u * V``. Tested at ``4u * V``.

Attention is made sharp on purpose (queries and keys scaled by 3, so scores have a standard
deviation near 9): with near-uniform attention an off-by-one in the causal mask or a wrong page
barely moves the output and a test would pass on wrong code. Unused page slots are filled with
NaN, so reading a key past a request's last token, or a padding entry of a block table, poisons
the output instead of going unnoticed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.kv import prefill as attention
from prefixkv.kv.pages import KVDeviceError, KVDtypeError, KVIndexError, KVShapeError, PagedKVCache
from prefixkv.kv.prefill import BackendUnavailableError, paged_prefill_attention

pytestmark = pytest.mark.timeout(180)
CHILD_TIMEOUT_S = 400  # the interpreted checks run 100 examples under the "ci" profile

SHARPNESS = 3.0
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
HALF_DTYPES = [torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class Request:
    seq_len: int
    cached_len: int

    @property
    def query_len(self) -> int:
        return self.seq_len - self.cached_len


@dataclass(frozen=True)
class CaseSpec:
    """Everything drawn for one batch; `build` turns it into tensors."""

    requests: tuple[Request, ...]
    num_kv_heads: int
    group_size: int
    head_dim: int
    block_size: int
    spare_blocks: int
    table_padding: int  # value of unused block table entries: -1, 0 or out of range
    extra_columns: int
    sliding_window: int | None
    seed: int


@dataclass
class Case:
    query: torch.Tensor
    key_pages: torch.Tensor
    value_pages: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    sliding_window: int | None

    def run(
        self, backend: str, *, dtype: torch.dtype | None = None, **kwargs: object
    ) -> torch.Tensor:
        """Attention with every float input cast to `dtype` (default: as built)."""
        dtype = dtype or self.query.dtype
        options = {"sliding_window": self.sliding_window, **kwargs}
        return paged_prefill_attention(
            self.query.to(dtype),
            self.key_pages.to(dtype),
            self.value_pages.to(dtype),
            self.block_tables,
            self.query_lens,
            self.seq_lens,
            backend=backend,  # type: ignore[arg-type]
            **options,  # type: ignore[arg-type]
        )

    def max_value(self) -> float:
        rows = [
            self.value_pages.flatten(0, 1)[self.slots_of(b)]
            for b in range(len(self.seq_lens))
            if self.seq_lens[b] > 0
        ]
        return float(torch.cat(rows).abs().max())

    def slots_of(self, request: int) -> torch.Tensor:
        size = int(self.key_pages.shape[1])
        positions = torch.arange(self.seq_lens[request])
        return self.block_tables[request, positions // size].long() * size + positions % size


@st.composite
def cached_lengths(draw: st.DrawFn, seq_len: int, block_size: int) -> int:
    """Cached tokens m for a request of n tokens: 0, a block boundary, mid-block or n - 1."""
    boundaries = list(range(0, seq_len, block_size))
    return draw(
        st.one_of(
            st.just(0),
            st.just(seq_len - 1),
            st.sampled_from(boundaries),
            st.integers(0, seq_len - 1),
        )
    )


@st.composite
def case_specs(
    draw: st.DrawFn,
    *,
    max_requests: int = 4,
    max_seq_len: int = 48,
    head_dims: tuple[int, ...] = (16, 32, 64),
) -> CaseSpec:
    block_size = draw(st.one_of(st.sampled_from([1, 3, 16, 32]), st.integers(1, 32)))
    requests = []
    for _ in range(draw(st.integers(1, max_requests))):
        seq_len = draw(st.integers(1, max_seq_len))
        requests.append(Request(seq_len, draw(cached_lengths(seq_len, block_size))))
    return CaseSpec(
        requests=tuple(requests),
        num_kv_heads=draw(st.integers(1, 2)),
        group_size=draw(st.sampled_from([1, 2, 3])),
        head_dim=draw(st.sampled_from(head_dims)),
        block_size=block_size,
        spare_blocks=draw(st.integers(0, 3)),
        table_padding=draw(st.sampled_from([-1, 0, 10**6])),
        extra_columns=draw(st.integers(0, 2)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, max_seq_len + 2))),
        seed=draw(st.integers(0, 2**31)),
    )


def build(spec: CaseSpec, dtype: torch.dtype = torch.float32) -> Case:
    """Pages in shuffled block order, unused slots NaN, K and V written via PagedKVCache."""
    generator = torch.Generator().manual_seed(spec.seed)
    size = spec.block_size
    blocks_needed = [-(-r.seq_len // size) for r in spec.requests]
    num_blocks = sum(blocks_needed) + spec.spare_blocks
    cache = PagedKVCache(1, num_blocks, size, spec.num_kv_heads, spec.head_dim, dtype=dtype)
    cache.storage.fill_(math.nan)
    order = torch.randperm(num_blocks, generator=generator)
    columns = max(blocks_needed) + spec.extra_columns
    tables = torch.full((len(spec.requests), columns), spec.table_padding, dtype=torch.int32)
    used = 0
    for b, request in enumerate(spec.requests):
        tables[b, : blocks_needed[b]] = order[used : used + blocks_needed[b]].int()
        used += blocks_needed[b]
        positions = torch.arange(request.seq_len)
        slots = tables[b, positions // size].long() * size + positions % size
        shape = (request.seq_len, spec.num_kv_heads, spec.head_dim)
        keys = SHARPNESS * torch.randn(shape, generator=generator)
        values = torch.randn(shape, generator=generator)
        cache.write(0, keys.to(dtype), values.to(dtype), slots)
    num_queries = sum(r.query_len for r in spec.requests)
    num_heads = spec.num_kv_heads * spec.group_size
    query = SHARPNESS * torch.randn((num_queries, num_heads, spec.head_dim), generator=generator)
    return Case(
        query=query.to(dtype),
        key_pages=cache.key_pages[0],
        value_pages=cache.value_pages[0],
        block_tables=tables,
        query_lens=[r.query_len for r in spec.requests],
        seq_lens=[r.seq_len for r in spec.requests],
        sliding_window=spec.sliding_window,
    )


def relative_error(case: Case, output: torch.Tensor) -> float:
    """Max |output - float64 reference|, in units of the largest value magnitude."""
    expected = case.run("reference", dtype=torch.float64)
    assert torch.isfinite(output).all()
    return float((output.double() - expected).abs().max()) / max(case.max_value(), 1e-30)


def torch_backend(case: Case, query_tile: int, kv_tile_tokens: int) -> torch.Tensor:
    """The torch backend with small tiles, so short test sequences still span many tiles."""
    batch = attention._check_inputs(
        case.query,
        case.key_pages,
        case.value_pages,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        None,
    )
    head_dim = int(case.query.shape[2])
    return attention._torch_attention(
        case.query,
        case.key_pages,
        case.value_pages,
        case.block_tables,
        batch,
        1.0 / math.sqrt(head_dim),
        case.sliding_window,
        query_tile=query_tile,
        kv_tile_tokens=kv_tile_tokens,
    )


# -- torch backend ---------------------------------------------------------------------------


@given(spec=case_specs(), query_tile=st.integers(1, 9), kv_tile_tokens=st.integers(1, 40))
def test_torch_backend_matches_reference_float32(
    spec: CaseSpec, query_tile: int, kv_tile_tokens: int
) -> None:
    case = build(spec)
    assert relative_error(case, torch_backend(case, query_tile, kv_tile_tokens)) <= 1e-5


def fused_backend(case: Case, query_tile: int) -> torch.Tensor:
    """The CPU torch backend's SDPA path with small query tiles, so short test sequences span
    many masked tiles."""
    batch = attention._check_inputs(
        case.query,
        case.key_pages,
        case.value_pages,
        case.block_tables,
        case.query_lens,
        case.seq_lens,
        None,
    )
    return attention._sdpa_attention(
        case.query,
        case.key_pages,
        case.value_pages,
        case.block_tables,
        batch,
        1.0 / math.sqrt(int(case.query.shape[2])),
        case.sliding_window,
        query_tile=query_tile,
    )


@given(spec=case_specs(), query_tile=st.integers(1, 9))
def test_fused_cpu_path_matches_reference_float32(spec: CaseSpec, query_tile: int) -> None:
    """The SDPA path (the CPU default) is as exact as the tiled walk: same float32 bound, stale
    NaN slots never read, windows and cached prefixes across several query tiles."""
    case = build(spec)
    assert relative_error(case, fused_backend(case, query_tile)) <= 1e-5


def test_cpu_prefill_is_one_fused_call_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the torch backend hands each request's attention to torch's fused SDPA kernel
    (one call for an uncached request, one per query tile over a cached prefix) instead of
    walking KV tiles in Python, which made SmolLM2's 4,096-token prefill 0.82x transformers'."""
    calls: list[tuple[int, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((int(args[0].shape[2]), kwargs.get("attn_mask") is None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    # Uncached 1,100 tokens and 700 new after a 400-token prefix, no window: one causal call for
    # the first, two masked query tiles (512 + 188) for the second.
    spec = CaseSpec((Request(1100, 0), Request(1100, 400)), 1, 3, 16, 16, 0, 0, 0, None, seed=5)
    case = build(spec)
    output = case.run("torch")
    assert calls == [(1100, True), (512, False), (188, False)]
    assert relative_error(case, output) <= 1e-5


@given(spec=case_specs(max_seq_len=40), dtype=st.sampled_from(HALF_DTYPES))
def test_torch_backend_matches_reference_half(spec: CaseSpec, dtype: torch.dtype) -> None:
    case = build(spec, dtype)
    assert relative_error(case, case.run("torch")) <= 2 * UNIT_ROUNDOFF[dtype]


@given(spec=case_specs(max_requests=2))
def test_auto_is_torch_on_cpu_and_default_scale(spec: CaseSpec) -> None:
    case = build(spec)
    explicit = case.run("torch", scale=1.0 / math.sqrt(int(case.query.shape[2])))
    assert torch.equal(case.run("auto"), explicit)
    assert torch.equal(case.run("torch"), explicit)


@given(spec=case_specs(max_requests=1, max_seq_len=40))
def test_full_hit_equals_full_recompute(spec: CaseSpec) -> None:
    """The last token computed from cache (query_len 1) matches the last row of a full prefill."""
    request = spec.requests[0]
    full = build(
        CaseSpec(**{**spec.__dict__, "requests": (Request(request.seq_len, 0),)}), torch.float64
    )
    hit = Case(**{**full.__dict__, "query": full.query[-1:], "query_lens": [1]})
    torch.testing.assert_close(hit.run("torch"), full.run("torch")[-1:], rtol=1e-12, atol=1e-12)


def test_empty_requests_and_empty_batch() -> None:
    spec = CaseSpec((Request(5, 5), Request(4, 1)), 1, 2, 16, 3, 0, -1, 0, None, seed=7)
    case = build(spec)
    assert case.query.shape[0] == 3
    torch.testing.assert_close(case.run("torch"), case.run("reference"))


# -- triton backend (interpreted on the CPU, in a child process) ------------------------------
#
# Triton's interpreter must be chosen before triton is first imported (triton.language's own
# helpers are jitted at import), and it would then be on for every test in the process. So the
# interpreted checks run in a fresh interpreter with TRITON_INTERPRET=1, started by one test
# here; they are plain functions (no ``test_`` prefix) so pytest does not also run them in this
# process.


@given(
    spec=case_specs(max_requests=3, max_seq_len=40, head_dims=(16, 32)),
    dtype=st.sampled_from([torch.float32, *HALF_DTYPES]),
)
def check_triton_matches_reference(spec: CaseSpec, dtype: torch.dtype) -> None:
    case = build(spec, dtype)
    bound = 1e-5 if dtype == torch.float32 else 4 * UNIT_ROUNDOFF[dtype]
    assert relative_error(case, case.run("triton")) <= bound


def check_triton_long_query_tiles_and_odd_head_dim() -> None:
    """Several query tiles and key chunks per request, a head dim that is not a power of two."""
    spec = CaseSpec((Request(45, 9), Request(38, 0)), 2, 2, 24, 5, 1, -1, 1, 20, seed=3)
    for dtype in (torch.float32, *HALF_DTYPES):
        case = build(spec, dtype)
        bound = 1e-5 if dtype == torch.float32 else 4 * UNIT_ROUNDOFF[dtype]
        assert relative_error(case, case.run("triton")) <= bound


INTERPRETED_CHECKS = (
    check_triton_matches_reference,
    check_triton_long_query_tiles_and_odd_head_dim,
)


def run_interpreted_checks() -> None:
    """Entry point of the child process."""
    import triton

    assert triton.knobs.runtime.interpret, "TRITON_INTERPRET=1 must be set before importing triton"
    for check in INTERPRETED_CHECKS:
        check()


@pytest.mark.timeout(CHILD_TIMEOUT_S + 20)
def test_triton_kernel_under_interpreter() -> None:
    pytest.importorskip("triton")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([tests_dir, *sys.path]),
    }
    script = "import conftest, test_attention; test_attention.run_interpreted_checks()"
    child = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert child.returncode == 0, f"interpreted Triton checks failed:\n{child.stdout}{child.stderr}"


def test_triton_refuses_cpu_tensors_and_float64_outside_the_interpreter() -> None:
    case = build(CaseSpec((Request(4, 1),), 1, 1, 16, 2, 0, -1, 0, None, seed=0))
    with pytest.raises(KVDtypeError):
        case.run("triton", dtype=torch.float64)
    pytest.importorskip("triton")
    previous = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            case.run("triton")
    finally:
        if previous is not None:
            os.environ["TRITON_INTERPRET"] = previous


# -- errors ---------------------------------------------------------------------------------


def error_case() -> Case:
    return build(CaseSpec((Request(7, 3), Request(5, 0)), 2, 2, 16, 3, 1, -1, 1, None, seed=1))


def with_changes(**changes: object) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        case = error_case()
        arguments: dict[str, object] = {
            "query": case.query,
            "key_pages": case.key_pages,
            "value_pages": case.value_pages,
            "block_tables": case.block_tables,
            "query_lens": case.query_lens,
            "seq_lens": case.seq_lens,
        }
        for name, change in changes.items():
            arguments[name] = change(arguments[name]) if callable(change) else change
        return paged_prefill_attention(**arguments)  # type: ignore[arg-type]

    return call


ERROR_CASES: list[tuple[str, type[PrefixKVError], Callable[[], torch.Tensor]]] = [
    ("query rank", KVShapeError, with_changes(query=lambda q: q.flatten(1))),
    ("query head dim", KVShapeError, with_changes(query=lambda q: q[..., :8])),
    ("heads not a multiple", KVShapeError, with_changes(query=lambda q: q[:, :3])),
    ("pages rank", KVShapeError, with_changes(key_pages=lambda k: k.flatten(0, 1))),
    ("value pages shape", KVShapeError, with_changes(value_pages=lambda v: v[:, :2])),
    ("query dtype", KVDtypeError, with_changes(query=lambda q: q.half())),
    ("integer query", KVDtypeError, with_changes(query=lambda q: q.int())),
    ("value dtype", KVDtypeError, with_changes(value_pages=lambda v: v.double())),
    ("pages device", KVDeviceError, with_changes(key_pages=lambda k: k.to("meta"))),
    ("table dtype", KVDtypeError, with_changes(block_tables=lambda t: t.float())),
    ("table rank", KVShapeError, with_changes(block_tables=lambda t: t[0])),
    ("table rows", KVShapeError, with_changes(block_tables=lambda t: t[:1])),
    ("table too short", KVShapeError, with_changes(block_tables=lambda t: t[:, :2])),
    (
        "table block out of range",
        KVIndexError,
        with_changes(block_tables=lambda t: t.clone().index_fill_(1, torch.tensor([1]), 99)),
    ),
    (
        "table negative block",
        KVIndexError,
        with_changes(block_tables=lambda t: t.clone().index_fill_(1, torch.tensor([0]), -1)),
    ),
    ("query longer than seq", KVShapeError, with_changes(query_lens=[8, 5], seq_lens=[7, 5])),
    ("query count", KVShapeError, with_changes(query_lens=[4, 4])),
    ("lengths count", KVShapeError, with_changes(seq_lens=[7])),
    ("negative length", KVShapeError, with_changes(query_lens=[-1, 10])),
    ("float lengths", KVDtypeError, with_changes(seq_lens=torch.tensor([7.0, 5.0]))),
    ("bool lengths", KVDtypeError, with_changes(seq_lens=[True, 5])),
]


@pytest.mark.parametrize(
    ("call", "error"),
    [(case[2], case[1]) for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_bad_inputs_raise(call: Callable[[], torch.Tensor], error: type[PrefixKVError]) -> None:
    with pytest.raises(error) as raised:
        call()
    assert isinstance(raised.value, PrefixKVError)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("flash", {}),
        ("torch", {"scale": 0.0}),
        ("torch", {"scale": -1.0}),
        ("torch", {"sliding_window": 0}),
        ("torch", {"sliding_window": 2.5}),
    ],
)
def test_bad_options_raise(backend: str, options: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        error_case().run(backend, **options)


def test_lengths_as_tensors_and_padding_ignored() -> None:
    case = error_case()
    as_tensors = paged_prefill_attention(
        case.query,
        case.key_pages,
        case.value_pages,
        case.block_tables.long(),
        torch.tensor(case.query_lens),
        torch.tensor(case.seq_lens, dtype=torch.int32),
        backend="torch",
    )
    torch.testing.assert_close(as_tensors, case.run("reference"))
