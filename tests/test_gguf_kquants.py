"""K-quant GGUF tensors (issue 23): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, the 256-value
super-block formats of the files people download as ``Q4_K_M`` and the like.

The loader dequantizes them with the ``gguf`` package's ``gguf.quants.dequantize``. That
package has no quantizer for these types, so the reference here is an independent port of
llama.cpp's scalar ``dequantize_row_q{2..6}_K`` (``ggml/src/ggml-quants.c``, QK_K = 256),
written loop for loop from the C rather than from the package's vectorized numpy, and run
on arbitrary block bytes (every byte pattern is a valid block). A file of K-quant tensors
must then load and serve exactly like a Hugging Face directory holding their dequantized
values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixkv.models.gguf import SUPPORTED_TYPES
from tests.gguf_files import (
    assert_pre_scan_sizes_the_last_tensor_exactly,
    assert_serves_as_its_dequantized_checkpoint,
    quant_checkpoint,
    quant_matrices,
)
from tests.gguf_files import tokenizer as tokenizer  # the module-scoped fixture
from tests.test_gguf import RELATIVE_ERROR

gguf = pytest.importorskip("gguf")

QK_K = 256
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: Bytes per 256-value block, from the C structs (block_q2_K ... block_q6_K).
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
#: Where each block's float16 super-block scales sit: d, and dmin for the types with minimums.
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _half(block: np.ndarray, offset: int) -> np.float32:
    """GGML_FP16_TO_FP32 of the little-endian half at `offset`."""
    return np.float32(np.frombuffer(block[offset : offset + 2].tobytes(), dtype="<f2")[0])


def _f32(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def dequantize_q2_k(block: np.ndarray) -> np.ndarray:
    # struct: scales[16], qs[64], d, dmin
    scales, qs = block[0:16], block[16:80]
    d, dmin = _half(block, 80), _half(block, 82)
    out: list[np.ndarray] = []
    index = 0
    for n in range(0, QK_K, 128):
        q = qs[n // 4 : n // 4 + 32]
        shift = 0
        for _ in range(4):
            for half in (0, 16):
                scale = int(scales[index])
                index += 1
                dl, ml = d * np.float32(scale & 0xF), dmin * np.float32(scale >> 4)
                out.append(dl * _f32((q[half : half + 16] >> shift) & 3) - ml)
            shift += 2
    return np.concatenate(out)


def dequantize_q3_k(block: np.ndarray) -> np.ndarray:
    # struct: hmask[32], qs[64], scales[12] (16 six-bit scales), d
    hmask, qs, packed = block[0:32], block[32:96], block[96:108]
    d_all = _half(block, 108)

    def scale(j: int) -> int:  # as quantize_row_q3_K_reference packs them
        low = packed[j] & 0xF if j < 8 else packed[j - 8] >> 4
        high = (packed[8 + j % 4] >> (2 * (j // 4))) & 3
        return int(low | (high << 4)) - 32

    out: list[np.ndarray] = []
    index, mask = 0, 1
    for n in range(0, QK_K, 128):
        q = qs[n // 4 : n // 4 + 32]
        shift = 0
        for _ in range(4):
            for half in (0, 16):
                dl = d_all * np.float32(scale(index))
                index += 1
                low = ((q[half : half + 16] >> shift) & 3).astype(np.int32)
                high = np.where(hmask[half : half + 16] & mask, 0, 4)
                out.append(dl * _f32(low - high))
            shift += 2
            mask <<= 1
    return np.concatenate(out)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """llama.cpp's get_scale_min_k4: eight 6-bit scales and minimums in 12 bytes."""
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return (
        int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)),
        int((q[j + 4] >> 4) | ((q[j] >> 6) << 4)),
    )


def dequantize_q4_k(block: np.ndarray) -> np.ndarray:
    # struct: d, dmin, scales[12], qs[128]
    d, dmin = _half(block, 0), _half(block, 2)
    scales, qs = block[4:16], block[16:144]
    out: list[np.ndarray] = []
    for index, j in enumerate(range(0, QK_K, 64)):
        q = qs[j // 2 : j // 2 + 32]
        sc1, m1 = _scale_min_k4(2 * index, scales)
        sc2, m2 = _scale_min_k4(2 * index + 1, scales)
        out.append(d * np.float32(sc1) * _f32(q & 0xF) - dmin * np.float32(m1))
        out.append(d * np.float32(sc2) * _f32(q >> 4) - dmin * np.float32(m2))
    return np.concatenate(out)


def dequantize_q5_k(block: np.ndarray) -> np.ndarray:
    # struct: d, dmin, scales[12], qh[32], qs[128]
    d, dmin = _half(block, 0), _half(block, 2)
    scales, qh, qs = block[4:16], block[16:48], block[48:176]
    out: list[np.ndarray] = []
    u1, u2 = 1, 2
    for index, j in enumerate(range(0, QK_K, 64)):
        ql = qs[j // 2 : j // 2 + 32]
        sc1, m1 = _scale_min_k4(2 * index, scales)
        sc2, m2 = _scale_min_k4(2 * index + 1, scales)
        low = (ql & 0xF).astype(np.int32) + np.where(qh & u1, 16, 0)
        high = (ql >> 4).astype(np.int32) + np.where(qh & u2, 16, 0)
        out.append(d * np.float32(sc1) * _f32(low) - dmin * np.float32(m1))
        out.append(d * np.float32(sc2) * _f32(high) - dmin * np.float32(m2))
        u1, u2 = u1 << 2, u2 << 2
    return np.concatenate(out)


def dequantize_q6_k(block: np.ndarray) -> np.ndarray:
    # struct: ql[128], qh[64], scales[16] (int8), d
    ql_all, qh_all = block[0:128], block[128:192]
    scales = block[192:208].view(np.int8)
    d = _half(block, 208)
    out = np.empty(QK_K, dtype=np.float32)
    for n in range(0, QK_K, 128):
        ql, qh = ql_all[n // 2 : n // 2 + 64], qh_all[n // 4 : n // 4 + 32]
        sc = scales[n // 16 : n // 16 + 8]
        for l in range(32):  # noqa: E741 - the C's name
            is_ = l // 16
            q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
            q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
            q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
            q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
            out[n + l] = d * np.float32(sc[is_]) * np.float32(q1)
            out[n + l + 32] = d * np.float32(sc[is_ + 2]) * np.float32(q2)
            out[n + l + 64] = d * np.float32(sc[is_ + 4]) * np.float32(q3)
            out[n + l + 96] = d * np.float32(sc[is_ + 6]) * np.float32(q4)
    return out


REFERENCE = {
    "Q2_K": dequantize_q2_k,
    "Q3_K": dequantize_q3_k,
    "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k,
    "Q6_K": dequantize_q6_k,
}


def reference_dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 blocks to ``[rows, row_bytes / block_bytes * 256]``."""
    rows = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[qtype])
    return np.stack([np.concatenate([REFERENCE[qtype](block) for block in row]) for row in rows])


def random_blocks(
    qtype: str, rows: int, columns: int, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """Random block bytes for a ``[rows, columns]`` tensor with every super-block scale set to
    `scale` (random halves would include infinities and NaNs)."""
    blocks = rng.integers(0, 256, (rows * columns // QK_K, BLOCK_BYTES[qtype]), dtype=np.uint8)
    half = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        blocks[:, offset : offset + 2] = half
    return blocks.reshape(rows, -1)


def test_every_supported_type_is_tested() -> None:
    i_quants = {name for name in SUPPORTED_TYPES if name.startswith("IQ")}  # test_gguf_iquants
    assert set(RELATIVE_ERROR) | set(K_QUANTS) == SUPPORTED_TYPES - i_quants
    for qtype in K_QUANTS:
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        assert gguf.GGML_QUANT_SIZES[kind] == (QK_K, BLOCK_BYTES[qtype])


@pytest.mark.parametrize("qtype", K_QUANTS)
@given(data=st.data())
def test_the_gguf_dequantizer_is_llama_cpp_s(qtype: str, data: st.DataObject) -> None:
    """Any block bytes, any finite super-block scales (subnormal, negative, zero): the package's
    dequantizer gives exactly the float32 values of llama.cpp's scalar loops."""
    count = data.draw(st.integers(1, 3), label="blocks")
    raw = data.draw(
        st.binary(min_size=count * BLOCK_BYTES[qtype], max_size=count * BLOCK_BYTES[qtype])
    )
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(count, BLOCK_BYTES[qtype]).copy()
    finite_half = st.floats(width=16, allow_nan=False, allow_infinity=False)
    for index in range(count):
        for offset in SCALE_OFFSETS[qtype]:
            value = np.float16(data.draw(finite_half))
            blocks[index, offset : offset + 2] = np.frombuffer(value.tobytes(), dtype=np.uint8)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    theirs = gguf.quants.dequantize(blocks.reshape(1, -1), kind).reshape(-1)
    ours = reference_dequantize(blocks.reshape(1, -1), qtype).reshape(-1)
    np.testing.assert_array_equal(theirs, ours)


def _kquant_checkpoint(
    directory: Path, tokenizer: Tokenizer, types: dict[str, str], arch: str = "llama"
) -> tuple[Path, Path]:
    """`quant_checkpoint` of random K-quant blocks, dequantized by llama.cpp's loops (above)."""
    rng = np.random.default_rng(7)

    def draw_blocks(qtype: str, rows: int, columns: int, target: float) -> np.ndarray:
        blocks = random_blocks(qtype, rows, columns, rng)
        return random_blocks(
            qtype, rows, columns, np.random.default_rng(rng.integers(2**32)),
            scale=target / float(reference_dequantize(blocks, qtype).std()),
        )  # fmt: skip

    return quant_checkpoint(directory, tokenizer, types, draw_blocks, reference_dequantize, arch)


@pytest.mark.parametrize(
    ("qtype", "arch"), [*((qtype, "llama") for qtype in K_QUANTS), ("mixed", "llama"),
                        ("mixed", "qwen3")],
)  # fmt: skip
def test_a_kquant_file_loads_and_serves_as_its_dequantized_checkpoint(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str, arch: str
) -> None:
    """Every matrix in one K-quant type, or (``mixed``, as a ``Q4_K_M`` file mixes them) each
    in the next of the five, for a Llama and a Qwen3 (what a ``Qwen3-8B-Q4_K_M.gguf`` is): the
    weights are exactly the dequantized ones, and the engine serving the file gives the Hugging
    Face directory's greedy tokens and logits."""
    matrices = quant_matrices(tokenizer)
    if qtype == "mixed":
        types = {name: K_QUANTS[index % 5] for index, name in enumerate(matrices)}
    else:
        types = dict.fromkeys(matrices, qtype)
    path, hf_directory = _kquant_checkpoint(tmp_path, tokenizer, types, arch)
    checkpoint = assert_serves_as_its_dequantized_checkpoint(path, hf_directory, types)
    assert checkpoint.model.config.qk_norm is (arch == "qwen3")


def test_the_header_pre_scan_sizes_kquant_tensors_exactly(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    """The bounded pre-scan (`prefixkv.models.gguf_header`) counts a K-quant tensor's bytes from
    its 256-value blocks: a file one byte short of its last tensor is refused, naming it, before
    the reader sees it; a row that is not whole super-blocks is refused too."""
    types = dict.fromkeys(quant_matrices(tokenizer), "Q4_K")
    path, _ = _kquant_checkpoint(tmp_path, tokenizer, types)
    # A row of 128 values in a Q4_K tensor.
    refusal = "not a whole number of 256-value blocks"
    assert_pre_scan_sizes_the_last_tensor_exactly(path, "Q4_K", 128, refusal)
