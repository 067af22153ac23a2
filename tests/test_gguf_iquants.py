"""i-quant GGUF tensors (issue 23): IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S,
IQ1_S and IQ1_M, the types of the files people download as ``IQ4_XS``, ``IQ3_M``,
``IQ2_XXS`` and the like.

The loader dequantizes them with the ``gguf`` package's ``gguf.quants.dequantize``. The package
has no quantizer for any of them, so the reference here is an independent port of llama.cpp's
scalar ``dequantize_row_iq*`` (``ggml/src/ggml-quants.c``), written loop for loop from the C
(not from the package's vectorized numpy) and run on arbitrary block bytes.

What is independent: the block layouts, the scale arithmetic (in llama.cpp's float32 order),
the sign tables (``ksigns_iq2xs``: seven bits plus an even-parity eighth, computed here), the
IQ4 non-linear values and IQ1's delta. What is not: the codebooks of the 2-, 3- and 1-bit
types (``iq2xxs_grid``... ``iq1s_grid``, up to 2048 entries of 8 values) are taken from the
``gguf`` package itself (its ``grid``), so a wrong entry there would go unseen, except for the
entries of ``iq2xxs_grid`` and ``iq3xxs_grid`` checked below against llama.cpp's
``ggml-common.h`` literals.
"""

from __future__ import annotations

import struct
from pathlib import Path

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
from tests.test_gguf_kquants import K_QUANTS

gguf = pytest.importorskip("gguf")

QK_K = 256
I_QUANTS = ("IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
#: (values, bytes) per block, from the C structs (block_iq4_nl ... block_iq1_m).
BLOCKS = {
    "IQ4_NL": (32, 18),  # d, qs[16]
    "IQ4_XS": (QK_K, 136),  # d, scales_h (u16), scales_l[4], qs[128]
    "IQ3_S": (QK_K, 110),  # d, qs[64], qh[8], signs[32], scales[4]
    "IQ3_XXS": (QK_K, 98),  # d, qs[64] grid indices, then 8 u32 of scale and signs
    "IQ2_XXS": (QK_K, 66),  # d, qs[32] (u16)
    "IQ2_XS": (QK_K, 74),  # d, qs[32] (u16), scales[8]
    "IQ2_S": (QK_K, 82),  # d, qs[32] grid indices, signs[32], qh[8], scales[8]
    "IQ1_S": (QK_K, 50),  # d, qs[32], qh[8] (u16)
    "IQ1_M": (QK_K, 56),  # qs[32], qh[16], scales[8] (the f16 d in their top nibbles)
}
#: llama.cpp's ``kvalues_iq4nl``: the 16 non-linear 4-bit levels of IQ4_NL and IQ4_XS.
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)
IQ1S_DELTA = np.float32(0.125)
#: ``ksigns_iq2xs``: seven sign bits and an eighth that makes the count of minus signs even.
KSIGNS = np.array([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], dtype=np.uint8)


def _grid(qtype: str) -> np.ndarray:
    """The codebook of `qtype` as the ``gguf`` package decodes it: [entries, values] float32."""
    kind = getattr(gguf.quants, qtype)
    kind.init_grid()
    return np.asarray(kind.grid, dtype=np.float32).reshape(kind.grid_shape)


def _half(data: bytes | np.ndarray, offset: int = 0) -> np.float32:
    """GGML_FP16_TO_FP32 of the little-endian half at `offset`."""
    raw = bytes(np.asarray(data, dtype=np.uint8)[offset : offset + 2])
    return np.float32(np.frombuffer(raw, dtype="<f2")[0])


def _signed(values: np.ndarray, signs: int, first_bit: int = 0) -> np.ndarray:
    """`values` with element j negated where bit ``first_bit + j`` of `signs` is set."""
    bits = (signs >> (first_bit + np.arange(len(values)))) & 1
    return np.where(bits == 1, np.float32(-1), np.float32(1)) * values


def _u16(block: np.ndarray, offset: int) -> int:
    return int(block[offset]) | int(block[offset + 1]) << 8


def _u32(block: np.ndarray, offset: int) -> int:
    return _u16(block, offset) | _u16(block, offset + 2) << 16


def dequantize_iq4_nl(block: np.ndarray) -> np.ndarray:
    d, qs = _half(block, 0), block[2:18]
    return np.concatenate([d * KVALUES_IQ4NL[qs & 0xF], d * KVALUES_IQ4NL[qs >> 4]])


def dequantize_iq4_xs(block: np.ndarray) -> np.ndarray:
    d, scales_h, scales_l, qs = _half(block, 0), _u16(block, 2), block[4:8], block[8:136]
    out: list[np.ndarray] = []
    for ib in range(8):
        ls = ((int(scales_l[ib // 2]) >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
        dl = d * np.float32(ls - 32)
        q = qs[16 * ib : 16 * ib + 16]
        out += [dl * KVALUES_IQ4NL[q & 0xF], dl * KVALUES_IQ4NL[q >> 4]]
    return np.concatenate(out)


def dequantize_iq2_xxs(block: np.ndarray) -> np.ndarray:
    d, grid = _half(block, 0), _grid("IQ2_XXS")
    out: list[np.ndarray] = []
    for ib32 in range(8):
        base = 2 + 8 * ib32
        indices, aux = block[base : base + 4], _u32(block, base + 4)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
        for l in range(4):  # noqa: E741 - the C's name
            signs = int(KSIGNS[(aux >> 7 * l) & 127])
            out.append(_signed(db * grid[indices[l]], signs))
    return np.concatenate(out)


def dequantize_iq2_xs(block: np.ndarray) -> np.ndarray:
    d, grid, scales = _half(block, 0), _grid("IQ2_XS"), block[66:74]
    out: list[np.ndarray] = []
    for ib32 in range(8):
        db = [
            d * (np.float32(0.5) + np.float32(scales[ib32] & 0xF)) * np.float32(0.25),
            d * (np.float32(0.5) + np.float32(scales[ib32] >> 4)) * np.float32(0.25),
        ]
        for l in range(4):  # noqa: E741
            q = _u16(block, 2 + 2 * (4 * ib32 + l))
            out.append(_signed(db[l // 2] * grid[q & 511], int(KSIGNS[q >> 9])))
    return np.concatenate(out)


def dequantize_iq2_s(block: np.ndarray) -> np.ndarray:
    d, grid = _half(block, 0), _grid("IQ2_S")
    qs, signs, qh, scales = block[2:34], block[34:66], block[66:74], block[74:82]
    out: list[np.ndarray] = []
    for ib32 in range(8):
        db = [
            d * (np.float32(0.5) + np.float32(scales[ib32] & 0xF)) * np.float32(0.25),
            d * (np.float32(0.5) + np.float32(scales[ib32] >> 4)) * np.float32(0.25),
        ]
        for l in range(4):  # noqa: E741
            index = int(qs[4 * ib32 + l]) | ((int(qh[ib32]) << (8 - 2 * l)) & 0x300)
            out.append(_signed(db[l // 2] * grid[index], int(signs[4 * ib32 + l])))
    return np.concatenate(out)


def dequantize_iq3_xxs(block: np.ndarray) -> np.ndarray:
    d, grid = _half(block, 0), _grid("IQ3_XXS")
    qs = block[2:66]
    out: list[np.ndarray] = []
    for ib32 in range(8):
        aux = _u32(block, 66 + 4 * ib32)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
        for l in range(4):  # noqa: E741
            signs = int(KSIGNS[(aux >> 7 * l) & 127])
            first = grid[qs[8 * ib32 + 2 * l]]
            second = grid[qs[8 * ib32 + 2 * l + 1]]
            out += [_signed(db * first, signs), _signed(db * second, signs, first_bit=4)]
    return np.concatenate(out)


def dequantize_iq3_s(block: np.ndarray) -> np.ndarray:
    d, grid = _half(block, 0), _grid("IQ3_S")
    qs, qh, signs, scales = block[2:66], block[66:74], block[74:106], block[106:110]
    out: list[np.ndarray] = []
    for ib32 in range(8):  # each 32 values: 8 grid indices, 1 qh byte, 4 sign bytes
        nibble = (int(scales[ib32 // 2]) >> 4 * (ib32 % 2)) & 0xF
        db = d * np.float32(1 + 2 * nibble)
        high = int(qh[ib32])
        for l in range(4):  # noqa: E741
            first = int(qs[8 * ib32 + 2 * l]) | ((high << (8 - 2 * l)) & 256)
            second = int(qs[8 * ib32 + 2 * l + 1]) | ((high << (7 - 2 * l)) & 256)
            sign = int(signs[4 * ib32 + l])
            out += [_signed(db * grid[first], sign), _signed(db * grid[second], sign, 4)]
    return np.concatenate(out)


def dequantize_iq1_s(block: np.ndarray) -> np.ndarray:
    d, grid, qs = _half(block, 0), _grid("IQ1_S"), block[2:34]
    out: list[np.ndarray] = []
    for ib in range(8):
        qh = _u16(block, 34 + 2 * ib)
        dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
        delta = -IQ1S_DELTA if qh & 0x8000 else IQ1S_DELTA
        for l in range(4):  # noqa: E741
            index = int(qs[4 * ib + l]) | (((qh >> 3 * l) & 7) << 8)
            out.append(dl * (grid[index] + delta))
    return np.concatenate(out)


def dequantize_iq1_m(block: np.ndarray) -> np.ndarray:
    grid, qs, qh = _grid("IQ1_S"), block[0:32], block[32:48]  # IQ1_M shares iq1s_grid
    sc = [_u16(block, 48 + 2 * k) for k in range(4)]
    # The f16 super-block scale is the top nibble of each of the four u16 scale words.
    bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
    d = _half(np.frombuffer(struct.pack("<H", bits), dtype=np.uint8))
    out: list[np.ndarray] = []
    for ib in range(8):
        word, shift = sc[ib // 2], 6 * (ib % 2)
        dl = [d * np.float32(2 * ((word >> shift) & 7) + 1),
              d * np.float32(2 * ((word >> (shift + 3)) & 7) + 1)]  # fmt: skip
        high = [int(qh[2 * ib]), int(qh[2 * ib + 1])]
        for l in range(4):  # noqa: E741
            nibble = high[l // 2] >> (4 * (l % 2))  # entries 0, 2: low nibble; 1, 3: high
            index = int(qs[4 * ib + l]) | ((nibble & 7) << 8)
            delta = -IQ1S_DELTA if nibble & 8 else IQ1S_DELTA
            out.append(dl[l // 2] * (grid[index] + delta))
    return np.concatenate(out)


REFERENCE = {
    "IQ4_NL": dequantize_iq4_nl,
    "IQ4_XS": dequantize_iq4_xs,
    "IQ3_S": dequantize_iq3_s,
    "IQ3_XXS": dequantize_iq3_xxs,
    "IQ2_XXS": dequantize_iq2_xxs,
    "IQ2_XS": dequantize_iq2_xs,
    "IQ2_S": dequantize_iq2_s,
    "IQ1_S": dequantize_iq1_s,
    "IQ1_M": dequantize_iq1_m,
}


def reference_dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 blocks to ``[rows, values]`` float32."""
    values, nbytes = BLOCKS[qtype]
    rows = blocks.reshape(blocks.shape[0], -1, nbytes)
    out = np.stack([np.concatenate([REFERENCE[qtype](block) for block in row]) for row in rows])
    assert out.shape[1] == rows.shape[1] * values
    return out.astype(np.float32, copy=False)


def set_scale(blocks: np.ndarray, qtype: str, scale: np.float16) -> None:
    """Write the f16 super-block scale `scale` into every block of `blocks` ([n, bytes]):
    random halves would include infinities and NaNs."""
    raw = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    if qtype != "IQ1_M":
        blocks[:, 0:2] = raw
        return
    bits = int(raw[0]) | int(raw[1]) << 8
    for k in range(4):  # nibble k of the half goes to the top nibble of scale word k
        at = 48 + 2 * k + 1  # the high byte of the little-endian u16
        blocks[:, at] = (blocks[:, at] & 0x0F) | (((bits >> 4 * k) & 0xF) << 4)


def random_blocks(
    qtype: str, rows: int, columns: int, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    values, nbytes = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows * columns // values, nbytes), dtype=np.uint8)
    set_scale(blocks, qtype, np.float16(scale))
    return blocks.reshape(rows, -1)


def test_every_supported_type_is_tested_and_the_layouts_are_the_package_s() -> None:
    assert set(RELATIVE_ERROR) | set(K_QUANTS) | set(I_QUANTS) == SUPPORTED_TYPES
    for qtype in I_QUANTS:
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        assert gguf.GGML_QUANT_SIZES[kind] == BLOCKS[qtype]


def test_the_package_codebooks_match_llama_cpp_s_literals() -> None:
    """Spot checks of the borrowed grids against ``ggml-common.h`` (each u64/u32 entry's bytes,
    little-endian, are the values): the package's hex decoding is not taken on trust."""
    literals = {
        "IQ2_XXS": {0: 0x0808080808080808, 2: 0x0808080808081919, 11: 0x0808080819080819,
                    255: 0x2B2B2B1908081908},
        "IQ3_XXS": {0: 0x04040404, 5: 0x04040C3E, 10: 0x04043E1C, 255: 0x3E341C04},
    }  # fmt: skip
    for qtype, entries in literals.items():
        grid = _grid(qtype)
        assert grid.shape == {"IQ2_XXS": (256, 8), "IQ3_XXS": (256, 4)}[qtype]
        for index, literal in entries.items():
            width = grid.shape[1]
            expected = [(literal >> 8 * j) & 0xFF for j in range(width)]
            assert grid[index].tolist() == expected, (qtype, index)
    assert _grid("IQ2_XS").shape == (512, 8) and _grid("IQ2_S").shape == (1024, 8)
    assert _grid("IQ3_S").shape == (512, 4) and _grid("IQ1_S").shape == (2048, 8)
    assert set(np.unique(_grid("IQ1_S"))) == {-1.0, 0.0, 1.0}
    assert KSIGNS[0] == 0 and KSIGNS[1] == 0x81 and KSIGNS[3] == 3 and KSIGNS[127] == 0xFF


@pytest.mark.parametrize("qtype", I_QUANTS)
@given(data=st.data())
def test_the_gguf_dequantizer_is_llama_cpp_s(qtype: str, data: st.DataObject) -> None:
    """Any block bytes, any finite super-block scale (subnormal, negative, zero): the package's
    dequantizer gives exactly the float32 values of llama.cpp's scalar loops."""
    count = data.draw(st.integers(1, 3), label="blocks")
    nbytes = BLOCKS[qtype][1]
    raw = data.draw(st.binary(min_size=count * nbytes, max_size=count * nbytes))
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(count, nbytes).copy()
    finite_half = st.floats(width=16, allow_nan=False, allow_infinity=False)
    for index in range(count):
        set_scale(blocks[index : index + 1], qtype, np.float16(data.draw(finite_half)))
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    theirs = gguf.quants.dequantize(blocks.reshape(1, -1), kind).reshape(-1)
    ours = reference_dequantize(blocks.reshape(1, -1), qtype).reshape(-1)
    np.testing.assert_array_equal(theirs, ours)


def _iquant_checkpoint(
    directory: Path, tokenizer: Tokenizer, types: dict[str, str]
) -> tuple[Path, Path]:
    """`quant_checkpoint` of random i-quant blocks, dequantized by the port above."""
    rng = np.random.default_rng(11)

    def draw_blocks(qtype: str, rows: int, columns: int, target: float) -> np.ndarray:
        # The same seed twice: only the scale changes.
        seed = int(rng.integers(2**32))
        blocks = random_blocks(qtype, rows, columns, np.random.default_rng(seed))
        scale = target / float(reference_dequantize(blocks, qtype).std())
        return random_blocks(qtype, rows, columns, np.random.default_rng(seed), scale)

    return quant_checkpoint(directory, tokenizer, types, draw_blocks, reference_dequantize)


@pytest.mark.parametrize("qtype", [*I_QUANTS, "mixed"])
def test_an_iquant_file_loads_and_serves_as_its_dequantized_checkpoint(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str
) -> None:
    """Every matrix in one i-quant type, or (``mixed``, as an ``IQ3_M`` file mixes them) each in
    the next of the nine: the weights are exactly the dequantized ones, and the engine serving
    the file gives the Hugging Face directory's greedy tokens and logits."""
    matrices = quant_matrices(tokenizer)
    if qtype == "mixed":
        types = {name: I_QUANTS[index % len(I_QUANTS)] for index, name in enumerate(matrices)}
    else:
        types = dict.fromkeys(matrices, qtype)
    path, hf_directory = _iquant_checkpoint(tmp_path, tokenizer, types)
    assert_serves_as_its_dequantized_checkpoint(path, hf_directory, types)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "IQ4_XS", "IQ1_M"])
def test_the_header_pre_scan_sizes_iquant_tensors_exactly(
    tmp_path: Path, tokenizer: Tokenizer, qtype: str
) -> None:
    """The bounded pre-scan counts an i-quant tensor's bytes from its blocks (32 values for
    IQ4_NL, 256 for the rest): a file one byte short of its last tensor is refused, naming it,
    before the reader sees it; a row that is not whole blocks is refused too."""
    values, _ = BLOCKS[qtype]
    types = dict.fromkeys(quant_matrices(tokenizer), qtype)
    path, _ = _iquant_checkpoint(tmp_path, tokenizer, types)
    # Rows of 256 + 16 values: never whole blocks.
    refusal = f"not a whole number of {values}-value blocks"
    assert_pre_scan_sizes_the_last_tensor_exactly(path, qtype, 256 + 16, refusal)
