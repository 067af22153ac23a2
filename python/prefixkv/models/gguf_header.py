"""A bounded pre-scan of a GGUF file's header: every count in it checked against the file size
before the file reaches ``gguf.GGUFReader`` (`check_gguf_header`).

Why: the reader trusts the counts it reads. A ``tokenizer.ggml.token_type`` array declaring
2**62 items in a 300 KB file makes it loop past the end of the file, growing without bound. A
count can never honestly exceed what the rest of the file could hold (every item takes at least
one byte, a string at least its 8-byte length), so each is checked against the bytes left, and
each tensor's data against the file's end. The scan reads the header once, in time linear in
its size, and allocates nothing proportional to a count.

The layout is GGUF v2/v3's (llama.cpp's ``ggml/include/gguf.h``): magic, version, tensor count,
kv count; the key/value pairs (a string key, a value type, the value: a scalar, a string, or a
typed array, possibly of strings or arrays); the tensor infos (name, dims, type, offset); the
data, aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from prefixkv.errors import InvalidInputError

__all__ = ["check_gguf_header"]

#: Bytes per value of GGUF's fixed-size value types, by type number.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
#: ggml's limit on tensor dimensions, and on arrays nested in arrays (llama.cpp writes none).
_MAX_DIMS, _MAX_NESTING = 4, 2
_DEFAULT_ALIGNMENT = 32


class _Scanner:
    def __init__(self, data: Any, path: Path, byte_order: str) -> None:
        self.data, self.path, self.order, self.offset = data, path, byte_order, 0
        self.size = len(data)

    def fail(self, what: str) -> InvalidInputError:
        return InvalidInputError(f"{self.path} is not a valid GGUF file: {what}")

    def left(self) -> int:
        return self.size - self.offset

    def unpack(self, fmt: str, what: str) -> int:
        width = struct.calcsize(fmt)
        if self.left() < width:
            raise self.fail(f"{what} runs past the end of the file")
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += width
        return int(value)

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items of at least `item_bytes` each, checked against the bytes left."""
        count = self.unpack("Q", what)
        if count * item_bytes > self.left():
            raise self.fail(
                f"{what} declares {count} items of >= {item_bytes} bytes with only "
                f"{self.left()} bytes left in the file"
            )
        return count

    def string(self, what: str) -> bytes:
        length = self.count(f"{what} (string length)", 1)
        text = bytes(self.data[self.offset : self.offset + length])
        self.offset += length
        return text

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        if value_type in _SCALAR_SIZES:
            width = _SCALAR_SIZES[value_type]
            if self.left() < width:
                raise self.fail(f"{what} runs past the end of the file")
            start = self.offset
            self.offset += width
            if value_type == _UINT32:
                return struct.unpack_from(self.order + "I", self.data, start)[0]
            return None
        if value_type == _STRING:
            return self.string(what)
        if value_type != _ARRAY:
            raise self.fail(f"{what} has unknown value type {value_type}")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        item_type = self.unpack("I", f"{what} (array item type)")
        if item_type in _SCALAR_SIZES:
            count = self.count(f"{what} (array length)", _SCALAR_SIZES[item_type])
            self.offset += count * _SCALAR_SIZES[item_type]
            return None
        minimum = {_STRING: 8, _ARRAY: 12}.get(item_type)
        if minimum is None:
            raise self.fail(f"{what} has an array of unknown value type {item_type}")
        for _ in range(self.count(f"{what} (array length)", minimum)):
            self.value(item_type, what, depth + 1)
        return None


def check_gguf_header(path: Path, quant_sizes: dict[int, tuple[int, int]]) -> None:
    """Raise `InvalidInputError` naming the field if any count in the header of the GGUF file
    at `path` could not fit in the file, or a tensor's data runs past its end. `quant_sizes`
    is ``gguf.GGML_QUANT_SIZES`` by type number: (values per block, bytes per block)."""
    try:
        with (
            open(path, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data,
        ):
            _scan(data, path, quant_sizes)
    except (OSError, ValueError) as exc:
        if isinstance(exc, InvalidInputError):
            raise
        raise InvalidInputError(f"{path} is not a readable GGUF file: {exc}") from exc


def _scan(data: Any, path: Path, quant_sizes: dict[int, tuple[int, int]]) -> None:
    scanner = _Scanner(data, path, "<")
    if bytes(data[:4]) != b"GGUF":
        raise scanner.fail("no GGUF magic")
    scanner.offset = 4
    version = scanner.unpack("I", "version")
    if version & 0xFFFF == 0:  # written on a big-endian machine, as the reader detects it
        scanner.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise scanner.fail(f"version {version} (2 and 3 are read)")
    # A tensor info takes at least 8 (name length) + 4 (dims) + 4 (type) + 8 (offset) bytes, a
    # key/value pair 8 (key length) + 4 (type) + 1 (the smallest value).
    tensor_count = scanner.unpack("Q", "tensor_count")
    kv_count = scanner.count("kv_count", 13)
    if tensor_count * 24 > scanner.left():
        raise scanner.fail(f"tensor_count {tensor_count} cannot fit in the file")
    alignment = _DEFAULT_ALIGNMENT
    for index in range(kv_count):
        key = scanner.string(f"metadata key #{index}")
        name = repr(key.decode("utf-8", "replace"))
        value_type = scanner.unpack("I", f"metadata {name} (value type)")
        value = scanner.value(value_type, f"metadata {name}")
        if key == b"general.alignment" and value_type == _UINT32:
            alignment = value
    if alignment <= 0 or alignment & (alignment - 1):
        raise scanner.fail(f"general.alignment {alignment} is not a power of two")
    tensors: list[tuple[str, int, int]] = []
    for index in range(tensor_count):
        name = repr(scanner.string(f"tensor #{index} name").decode("utf-8", "replace"))
        dims = scanner.unpack("I", f"tensor {name} (dimension count)")
        if not 1 <= dims <= _MAX_DIMS:
            raise scanner.fail(f"tensor {name} has {dims} dimensions (1 to {_MAX_DIMS})")
        shape = [scanner.unpack("Q", f"tensor {name} (dimension)") for _ in range(dims)]
        elements = 1
        for extent in shape:
            elements *= extent
        tensor_type = scanner.unpack("I", f"tensor {name} (type)")
        offset = scanner.unpack("Q", f"tensor {name} (offset)")
        if tensor_type not in quant_sizes:
            raise scanner.fail(f"tensor {name} has unknown type {tensor_type}")
        block_values, block_bytes = quant_sizes[tensor_type]
        # llama.cpp's rule (gguf.cpp): each row (the first, innermost dimension) is whole
        # blocks; a K-quant or i-quant block spans 256 values of one row (IQ4_NL's 32).
        if shape[0] % block_values:
            raise scanner.fail(
                f"tensor {name} has rows of {shape[0]} values, not a whole number of "
                f"{block_values}-value blocks"
            )
        tensors.append((name, offset, elements // block_values * block_bytes))
    data_start = -(-scanner.offset // alignment) * alignment
    for name, offset, nbytes in tensors:
        if data_start + offset + nbytes > scanner.size:
            raise scanner.fail(
                f"tensor {name} needs {nbytes} bytes at offset {offset}, past the end of the file"
            )
