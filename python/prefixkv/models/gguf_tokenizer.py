"""A GGUF file's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2,
Mistral, TinyLlama...) as a `tokenizers` tokenizer: `sentencepiece_tokenizer`.

llama.cpp's converter writes such a vocabulary as three parallel arrays: the pieces
(``tokenizer.ggml.tokens``, a space spelled ``▁``), a score per piece (``scores``) and a type per
piece (``token_type``: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte); no
merges. Tokenizing it is a BPE whose merge order is the score of the piece a merge makes, with
each character missing from the pieces spelled as its UTF-8 bytes ``<0x00>``..``<0xFF>``
(byte fallback). The rebuild is the one transformers' own GGUF loader makes
(``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), token for token, which
``tests/test_gguf_sentencepiece.py`` checks:

* **Merges** are derived from the pieces: every split of a piece into two pieces is a merge,
  ranked by the whole piece's score (higher first), then the longer left part, then the
  longer right part, then piece order.
* **Spaces**: ``▁`` replaces each space and one is prepended to the text's first word (the
  Metaspace pre-tokenizer, ``prepend_scheme="first"``, not split). That is what
  ``tokenizer.ggml.add_space_prefix`` true (or absent) means; false is refused, since
  transformers ignores the flag and llama.cpp would then tokenize differently.
* **Whole tokens**: control tokens and the BOS/EOS/unknown/padding tokens are matched whole and
  special, user-defined tokens whole but not special.
* **BOS/EOS**: ``tokenizer.ggml.add_bos_token`` (true when absent, as llama.cpp and
  transformers assume for this vocabulary) and ``add_eos_token`` become the tokenizer's
  post-processor, used where text is encoded with special tokens. `HFTokenizer.encode` encodes
  without them: chat templates write ``<s>`` themselves.

Refused by name: ``tokenizer.ggml.merges`` other than the ones the scores imply (llama.cpp
ignores them for this model, transformers uses them), a vocabulary without all 256 byte pieces (a character outside it would become
``<unk>`` in one reader and be dropped or split in another), scores that are not one finite
number per piece, and a vocabulary whose merge derivation would take more than a bounded
amount of work (`_MAX_SPLIT_WORK`; the file is untrusted).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixkv.errors import InvalidInputError

if TYPE_CHECKING:
    from prefixkv.text.tokenizers import HFTokenizer

__all__ = ["sentencepiece_tokenizer"]

_SPACE = "\u2581"
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp's token types
#: Characters copied while deriving merges: sum over pieces of len * (len - 1). A real
#: 256k-piece vocabulary (Gemma) needs a few million; a hostile one-megabyte piece 10**12.
_MAX_SPLIT_WORK = 1 << 28
_SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def sentencepiece_tokenizer(metadata: Any, path: Path) -> HFTokenizer:
    """The tokenizer of a GGUF file whose ``tokenizer.ggml.model`` is ``"llama"``; `metadata`
    is `prefixkv.models.gguf`'s reader of the file's keys."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from prefixkv.text.tokenizers import HFTokenizer

    tokens: list[str] = metadata.strings("tokenizer.ggml.tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InvalidInputError(f"{path}: tokenizer.ggml.tokens repeats a token")
    missing_bytes = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing_bytes:
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.tokens has no byte-fallback token {missing_bytes[0]} "
            f"({len(missing_bytes)} of the 256 missing); a SentencePiece vocabulary without "
            "byte fallback is not supported"
        )
    scores = metadata.require("tokenizer.ggml.scores")
    if (
        not isinstance(scores, list)
        or len(scores) != len(tokens)
        or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
            for s in scores
        )
    ):
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.scores must be one finite number per token "
            f"({len(tokens)} tokens)"
        )
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(token_types, list) or len(token_types) != len(tokens):
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.token_type must be an array with one entry per token"
        )
    if _flag(metadata, path, "add_space_prefix", default=True) is not True:
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.add_space_prefix false is not supported: the text would "
            "be tokenized without the leading '\u2581' transformers always adds"
        )
    add_bos = _flag(metadata, path, "add_bos_token", default=True)
    add_eos = _flag(metadata, path, "add_eos_token", default=False)

    merges = _merges(tokens, scores, vocab, path)
    if metadata.get("tokenizer.ggml.merges") is not None:
        # llama.cpp ignores merges for this model (it ranks by score), transformers uses them:
        # accepted only where both readers then agree.
        listed = [tuple(m.split(" ", 1)) for m in metadata.strings("tokenizer.ggml.merges")]
        if listed != merges:
            raise InvalidInputError(
                f"{path}: tokenizer.ggml.merges differ from the merges tokenizer.ggml.scores "
                "imply; llama.cpp would ignore them and transformers use them"
            )
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first", split=False
    )
    # Strip the one space the pre-tokenizer prepended.
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    named_ids = (_token_id(metadata, key) for key in _SPECIAL_ID_KEYS)
    special_ids = {index for index, kind in enumerate(token_types) if kind == _CONTROL_TOKEN}
    special_ids |= {index for index in named_ids if index is not None and index < len(tokens)}
    user = [t for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED_TOKEN]
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tokenizer.post_processor = _bos_eos(metadata, tokens, add_bos, add_eos, processors, path)
    return HFTokenizer(f"{path}#tokenizer", json_text=tokenizer.to_str())


def _merges(
    tokens: list[str], scores: list[float], vocab: dict[str, int], path: Path
) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best first (see the module docstring)."""
    work = sum(len(token) * (len(token) - 1) for token in tokens)
    if work > _MAX_SPLIT_WORK:
        raise InvalidInputError(
            f"{path}: tokenizer.ggml.tokens is too long to derive merges from ({work} "
            f"characters to compare, at most {_MAX_SPLIT_WORK})"
        )
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=True):
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        ranked.extend((score, len(left), len(right), left, right) for left, right in splits)
    # Stable: equal keys keep piece order. (Two splits of one piece never tie: their left
    # parts differ in length.)
    ranked.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _flag(metadata: Any, path: Path, key: str, *, default: bool) -> bool:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidInputError(
            f"{path}: metadata 'tokenizer.ggml.{key}' must be a bool, got {value!r:.60}"
        )
    return value


def _token_id(metadata: Any, key: str) -> int | None:
    if metadata.get(f"tokenizer.ggml.{key}") is None:
        return None
    return int(metadata.integer(f"tokenizer.ggml.{key}", minimum=0))


def _bos_eos(
    metadata: Any, tokens: list[str], add_bos: bool, add_eos: bool, processors: Any, path: Path
) -> Any:
    """The post-processor adding BOS and/or EOS around a sequence, as the flags say."""
    ends: dict[str, tuple[str, int]] = {}
    for flag, key, name in ((add_bos, "bos_token_id", "bos"), (add_eos, "eos_token_id", "eos")):
        if not flag:
            continue
        index = _token_id(metadata, key)
        if index is None or index >= len(tokens):
            raise InvalidInputError(
                f"{path}: tokenizer.ggml.add_{name}_token is set but tokenizer.ggml.{key} "
                "names no token"
            )
        ends[name] = (tokens[index], index)
    first = [ends["bos"][0]] if "bos" in ends else []
    last = [ends["eos"][0]] if "eos" in ends else []
    single = [*first, "$A", *last]
    pair = [*single, *first, "$B:1", *last]
    return processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(ends.values())
    )
