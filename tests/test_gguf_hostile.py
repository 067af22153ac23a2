"""Hostile GGUF files (issue 20, items 5, 6 and 14): every one refused with a typed error, in
bounded time and memory, before ``gguf.GGUFReader`` or torch is handed a lie.

The lying counts are found by a parser written here from the format's layout (not the
loader's), so that a count the loader forgot to check is still drawn.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from prefixkv.apps.cli import main
from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.models import config as model_config
from prefixkv.models.gguf import load_gguf
from tests.gguf_files import tiny_model, tokenizer, write_gguf

gguf = pytest.importorskip("gguf")
T = gguf.GGUFValueType

__all__ = ["tokenizer"]  # the fixture, shared with the other GGUF tests

#: Seconds a refusal may take (a 300 KB file; the lie used to cost 1 GB of RSS after 8 s).
BOUND_S = 3.0

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def count_fields(data: bytes) -> list[tuple[int, str, str]]:
    """(offset, struct format, what) of every count in a little-endian GGUF header: tensor and
    kv counts, string lengths, array lengths, dimension counts and dimensions."""
    fields: list[tuple[int, str, str]] = []
    offset = 8  # magic, version

    def take(fmt: str, what: str, record: bool = True) -> int:
        record = record and not what.startswith("item")  # inside arrays: the first two only
        nonlocal offset
        (value,) = struct.unpack_from("<" + fmt, data, offset)
        if record:
            fields.append((offset, fmt, what))
        offset += struct.calcsize(fmt)
        return int(value)

    def string(what: str) -> None:
        nonlocal offset
        length = take("Q", f"{what} length")  # moves `offset` past the length first
        offset += length

    def value(kind: int, what: str) -> None:
        nonlocal offset
        if kind in _SCALAR:
            offset += _SCALAR[kind]
        elif kind == 8:
            string(what)
        else:
            item = take("I", what, record=False)
            for index in range(take("Q", f"{what} array length")):
                value(item, what if index < 2 else f"item of {what}")

    tensors = take("Q", "tensor_count")
    for index in range(take("Q", "kv_count")):
        string(f"key {index}")
        value(take("I", "type", record=False), f"value {index}")
    for index in range(tensors):
        string(f"tensor {index} name")
        for _ in range(take("I", f"tensor {index} dims")):
            take("Q", f"tensor {index} dim")
        offset += 12  # type, offset
    return fields


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    return write_gguf(path, tiny_model(tokenizer), tokenizer)


def refused_in_bounded_time(path: Path) -> InvalidInputError:
    start = time.monotonic()
    with pytest.raises(InvalidInputError) as caught:
        load_gguf(path)
    assert time.monotonic() - start < BOUND_S
    return caught.value


def test_a_lying_token_type_count_fails_fast(small_file: Path, tmp_path: Path) -> None:
    data = bytearray(small_file.read_bytes())
    key = b"tokenizer.ggml.token_type"
    # The array's count follows the key, its value type (ARRAY) and item type.
    at = data.index(key) + len(key) + 8
    assert struct.unpack_from("<Q", data, at)[0] == 300
    struct.pack_into("<Q", data, at, 2**62)
    (tmp_path / "lie.gguf").write_bytes(data)
    error = refused_in_bounded_time(tmp_path / "lie.gguf")
    assert "tokenizer.ggml.token_type" in str(error)


def test_every_count_field_lying_is_refused(small_file: Path, tmp_path: Path) -> None:
    """Each count of the header in turn (the strategy below draws the values)."""
    original = small_file.read_bytes()
    fields = count_fields(original)
    assert len(fields) > 80  # header, every key and value, every tensor's name and dims
    for offset, fmt, what in fields:
        lying = bytearray(original)
        struct.pack_into("<" + fmt, lying, offset, 5 if fmt == "I" else 2**62)
        path = tmp_path / "lie.gguf"
        path.write_bytes(lying)
        try:
            refused_in_bounded_time(path)
        except BaseException as exc:
            raise AssertionError(f"lying {what}: {exc!r:.200}") from exc


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_lying_count_is_a_typed_error_in_bounded_time(
    small_file: Path, tmp_path: Path, data: st.DataObject
) -> None:
    original = small_file.read_bytes()
    fields = count_fields(original)
    offset, fmt, _ = data.draw(st.sampled_from(fields), label="field")
    width = struct.calcsize(fmt)
    # Larger than the file could hold: every counted item takes at least a byte.
    lie = data.draw(
        st.integers(min_value=len(original), max_value=2 ** (8 * width) - 1), label="count"
    )
    if fmt == "I":  # dimension count: anything beyond ggml's 4 is a lie
        lie = data.draw(st.integers(min_value=5, max_value=2**32 - 1), label="dims")
    lying = bytearray(original)
    struct.pack_into("<" + fmt, lying, offset, lie)
    path = tmp_path / "lie.gguf"
    path.write_bytes(lying)
    refused_in_bounded_time(path)


# -- item 5: sized before allocating ------------------------------------------------------------


@pytest.mark.parametrize(
    "replace",
    [
        {  # 4.4 TB asked
            "llama.embedding_length": (2**20, T.UINT32),
            "llama.rope.dimension_count": (2**18, T.UINT32),
            # the head dims written with it, so that only the size is wrong
            "llama.attention.key_length": (2**18, T.UINT32),
            "llama.attention.value_length": (2**18, T.UINT32),
        },
        {"llama.vocab_size": (2**40, T.UINT64)},  # 281 TB asked
    ],
)
def test_a_model_larger_than_memory_is_refused_before_allocating(
    tmp_path: Path, tokenizer: Tokenizer, replace: dict[str, Any]
) -> None:
    path = write_gguf(tmp_path / "big.gguf", tiny_model(tokenizer), tokenizer, replace=replace)
    start = time.monotonic()
    with pytest.raises(MemoryError, match=r"needs [\d,]+ bytes") as caught:
        load_gguf(path)
    assert isinstance(caught.value, PrefixKVError)
    assert time.monotonic() - start < BOUND_S


def test_the_memory_limit_applies_to_gguf_files(
    tmp_path: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(tokenizer)
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: 1_000)
    with pytest.raises(MemoryError, match="1,000 bytes"):
        load_gguf(path)


# -- item 14: malformed metadata and tensors ---------------------------------------------------


@pytest.mark.parametrize(
    ("replace", "named"),
    [
        ({"tokenizer.ggml.merges": (["Ġ zzzz"], T.ARRAY)}, "tokenizer.ggml.merges"),
        ({"llama.attention.head_count": (0, T.UINT32)}, "llama.attention.head_count"),
        ({"llama.block_count": ("two", T.STRING)}, "llama.block_count"),
        (
            {"llama.attention.layer_norm_rms_epsilon": ("1e-5", T.STRING)},
            "llama.attention.layer_norm_rms_epsilon",
        ),
        ({"tokenizer.ggml.eos_token_id": ("2", T.STRING)}, "tokenizer.ggml.eos_token_id"),
        ({"tokenizer.ggml.merges": (7, T.UINT32)}, "tokenizer.ggml.merges"),
        ({"llama.rope.freq_base": (float("inf"), T.FLOAT32)}, "llama.rope.freq_base"),
        ({"tokenizer.ggml.tokens": ([1, 2, 3], T.ARRAY)}, "tokenizer.ggml.tokens"),
    ],
)
def test_malformed_metadata_is_refused_by_name(
    tmp_path: Path, tokenizer: Tokenizer, replace: dict[str, Any], named: str
) -> None:
    path = write_gguf(tmp_path / "bad.gguf", tiny_model(tokenizer), tokenizer, replace=replace)
    with pytest.raises(InvalidInputError, match=named.replace(".", r"\.")):
        load_gguf(path)


def test_a_q_tensor_of_the_wrong_shape_is_refused_before_unpermuting(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    tensors = {"blk.0.attn_q.weight": np.zeros((5, 64), dtype=np.float32)}
    path = write_gguf(tmp_path / "q.gguf", tiny_model(tokenizer), tokenizer, tensors=tensors)
    with pytest.raises(InvalidInputError, match="q_proj"):
        load_gguf(path)


def test_demo_model_with_a_bad_gguf_prints_one_line_and_exits_2(
    tmp_path: Path, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    replace = {"llama.attention.head_count": (0, T.UINT32)}
    path = write_gguf(tmp_path / "bad.gguf", tiny_model(tokenizer), tokenizer, replace=replace)
    assert main(["demo", "--model", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "head_count" in err, err
