"""Text to tokens: the tokenizers, with the provenance the cache and the analyzer need.

The cache matches token ids, so two requests share KV only if the same tokenizer turned the same
rendered text into the same ids. A tokenizer therefore has a `digest()`: the cache context must
include it, because the same ids from two different vocabularies are different prompts.
`ByteTokenizer` (the built-in default, no dependencies) hashes a description of its vocabulary;
`HFTokenizer` hashes the bytes of the user's `tokenizer.json` (``tokenizers`` is an optional
dependency, `prefixkv[hf]`, imported only when one is loaded).

Chat templates, the step before tokenizing, live in `prefixkv.text.chat`; their names are re-exported
here, where they were first defined.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from prefixkv.errors import InvalidInputError, MissingDependencyError
from prefixkv.text.chat import (
    ChatTemplate,
    ChatTemplateSet,
    JinjaChatTemplate,
    Segment,
    SimpleChatTemplate,
    load_chat_template,
    message_text,
    segment_at,
)

# A lone UTF-16 surrogate: possible in a Python str, not in UTF-8 text.
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")

__all__ = [
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateSet",
    "HFTokenizer",
    "JinjaChatTemplate",
    "Segment",
    "SimpleChatTemplate",
    "Tokenizer",
    "load_chat_template",
    "load_tokenizer",
    "message_text",
    "segment_at",
]

Offsets = list[tuple[int, int]]


def _position_type(text: str) -> str:
    """The `array` type code for character positions in `text`: 4 bytes when they fit."""
    return "I" if len(text) < 2**32 else "q"


def _missing(package: str, feature: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"{feature} needs the '{package}' package: pip install 'prefixkv[hf]'"
    )


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Tokenizer(Protocol):
    """What the analyzer needs from a tokenizer. One that also has `encode_with_starts` (as
    prefixkv's do) is asked for that instead of `encode_with_offsets`: on a long prompt the
    list of offset tuples costs ~100 bytes a token."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        """Token ids and, per token, the (start, end) character span of `text` it came from."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def digest(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus a few special tokens matched as whole strings.

    The special tokens are the built-in chat template's role markers, so a rendered role header
    costs one token rather than a dozen bytes. Like Hugging Face's added tokens, a special token's
    text inside user content is also encoded as the special id; that is fine for measuring reuse,
    which only needs encoding to be deterministic.
    """

    SPECIAL_TOKENS: tuple[str, ...] = (
        "<|bos|>",
        "<|eos|>",
        "<|end|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<|tools|>",
    )
    VERSION = "prefixkv-bytes/1"

    def __init__(self) -> None:
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._special_text = {i: tok for tok, i in self._special_ids.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in self.SPECIAL_TOKENS))

    @property
    def name(self) -> str:
        return "bytes"

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIAL_TOKENS)

    @property
    def bos_token(self) -> str:
        return "<|bos|>"

    @property
    def eos_token(self) -> str:
        return "<|eos|>"

    def token_to_id(self, token: str) -> int | None:
        return self._special_ids.get(token)

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def encode_with_starts(self, text: str) -> tuple[list[int], array[int]]:
        """Token ids and, per token, the character position in `text` where it starts: what
        `encode_with_offsets` gives, in 4 bytes a token rather than a tuple's ~100."""
        ids: list[int] = []
        starts: array[int] = array(_position_type(text))
        pos = 0
        for match in self._special_re.finditer(text):
            self._starts_plain(text, pos, match.start(), ids, starts)
            ids.append(self._special_ids[match.group()])
            starts.append(match.start())
            pos = match.end()
        self._starts_plain(text, pos, len(text), ids, starts)
        return ids, starts

    @staticmethod
    def _starts_plain(text: str, start: int, end: int, ids: list[int], starts: array[int]) -> None:
        if start == end:
            return
        chunk = text[start:end]
        if chunk.isascii():
            ids.extend(chunk.encode("ascii"))
            starts.extend(range(start, end))
            return
        for i, char in enumerate(chunk, start):
            encoded = char.encode("utf-8", "surrogatepass")
            ids.extend(encoded)
            starts.extend([i] * len(encoded))

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        ids: list[int] = []
        offsets: Offsets = []
        pos = 0
        for match in self._special_re.finditer(text):
            self._encode_plain(text, pos, match.start(), ids, offsets)
            ids.append(self._special_ids[match.group()])
            offsets.append((match.start(), match.end()))
            pos = match.end()
        self._encode_plain(text, pos, len(text), ids, offsets)
        return ids, offsets

    @staticmethod
    def _encode_plain(text: str, start: int, end: int, ids: list[int], offsets: Offsets) -> None:
        if start == end:
            return
        chunk = text[start:end]
        if chunk.isascii():  # the common case: one byte per character
            ids.extend(chunk.encode("ascii"))
            offsets.extend((i, i + 1) for i in range(start, end))
            return
        for i, char in enumerate(chunk, start):
            encoded = char.encode("utf-8", "surrogatepass")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))

    def decode(self, ids: Sequence[int]) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                pending.append(token)
                continue
            if pending:
                parts.append(pending.decode("utf-8", "replace"))
                pending.clear()
            parts.append(self._special_text.get(token, f"<|{token}|>"))
        if pending:
            parts.append(pending.decode("utf-8", "replace"))
        return "".join(parts)

    def digest(self) -> str:
        description = json.dumps(
            {
                "version": self.VERSION,
                "bytes": "utf-8 bytes are ids 0..255",
                "special_tokens": list(self.SPECIAL_TOKENS),
                "special_ids_from": 256,
                "normalisation": "none",
            },
            sort_keys=True,
        )
        return hashlib.sha256(description.encode()).hexdigest()

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package.

    Text is encoded with `add_special_tokens=False`: chat templates already render the BOS token
    into the text, and a text trace holds exactly what the engine tokenizes.
    """

    def __init__(self, path: str | os.PathLike[str], *, json_text: str | None = None) -> None:
        """Read `path`; or, with `json_text` (a tokenizer built in memory, e.g. from a GGUF
        file's metadata by `prefixkv.models.gguf`), use that JSON and let `path` only name it."""
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:
            raise _missing("tokenizers", "a Hugging Face tokenizer.json") from exc
        self.path = Path(path)
        if json_text is not None:
            data = json_text.encode("utf-8")
        else:
            try:
                data = self.path.read_bytes()
            except OSError as exc:
                raise InvalidInputError(f"cannot read tokenizer file {self.path}: {exc}") from exc
        self._digest = hashlib.sha256(data).hexdigest()
        try:
            self._tokenizer = _HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a plain Exception on a bad file
            raise InvalidInputError(f"{self.path} is not a valid tokenizer.json: {exc}") from exc

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        token_id = self._tokenizer.token_to_id(token)
        return None if token_id is None else int(token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._encoding(text).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        encoding = self._encoding(text)
        return list(encoding.ids), [(int(s), int(e)) for s, e in encoding.offsets]

    def encode_with_starts(self, text: str) -> tuple[list[int], array[int]]:
        """Token ids and each token's start in `text` (see `ByteTokenizer.encode_with_starts`)."""
        encoding = self._encoding(text)
        starts = array(_position_type(text), (int(start) for start, _ in encoding.offsets))
        return list(encoding.ids), starts

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False))

    def _encoding(self, text: str) -> Any:
        """`tokenizers`' encoding of `text`; a lone UTF-16 surrogate, which is not text UTF-8
        can hold (the library raises a bare `TypeError`), is refused by position."""
        try:
            return self._tokenizer.encode(text, add_special_tokens=False)
        except TypeError:
            bad = _LONE_SURROGATE.search(text)
            if bad is None:
                raise
            raise InvalidInputError(
                f"text holds a lone UTF-16 surrogate (U+{ord(bad.group()):04X}) at position "
                f"{bad.start()}: not text a tokenizer can encode"
            ) from None

    def digest(self) -> str:
        return self._digest

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(spec: str | os.PathLike[str] | None) -> ByteTokenizer | HFTokenizer:
    """None (or "bytes") gives the built-in `ByteTokenizer`; a tokenizer.json, or a directory
    holding one, gives an `HFTokenizer`."""
    if spec is None or str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise InvalidInputError(
            f"tokenizer {str(spec)!r}: expected 'bytes', a tokenizer.json file or a directory "
            f"holding one, and {path} does not exist"
        )
    return HFTokenizer(path)
