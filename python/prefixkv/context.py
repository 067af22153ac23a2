"""What must match for reuse to be safe: the execution context of a block's KV.

The token prefix is not enough. Two requests with the same tokens produce different KV if the
weights, the tokenizer, the chat template, the position encoding, an adapter, the attention
mask or the KV dtype differ, and reusing one's KV for the other is silent numerical corruption.
`CacheContext` names every such setting as a typed field; its canonical serialization is hashed
into the root of every block key, so changing any field makes every lookup miss.

Canonical serialization (version 1): a JSON object with sorted keys, no whitespace, UTF-8,
every float written as ``{"float": float.hex()}`` (exact, language-independent, and never equal
to a string), tuples as arrays.
The fingerprint is ``SHA-256(b"prefixkv.context.v1\\0" + canonical_bytes)`` (see the core's
``key.rs`` for the rest of the key layout).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any

from prefixkv.errors import InvalidInputError

__all__ = ["AttentionMask", "CacheContext", "PositionEncoding"]

#: RoPE scaling types whose frequencies are fixed, so a prefix's KV does not depend on what
#: follows it. An allowlist, not a denylist: a kind not named here (dynamic NTK, LongRoPE, which
#: switches factors past the original length, or anything new) is treated as length-dependent
#: and refused, because a wrong guess would be silent corruption.
STATIC_ROPE_SCALING = frozenset({"default", "linear", "ntk", "yarn", "llama3"})


@dataclass(frozen=True)
class PositionEncoding:
    """How positions enter the KV: a different convention gives different keys."""

    kind: str = "rope"  # "rope", "alibi", "absolute", "none"
    rope_theta: float = 10000.0
    #: RoPE scaling type: None, "linear", "ntk" (static NTK-aware), "dynamic" (length-dependent),
    #: "yarn", "llama3", ... with its parameters as sorted (name, value) pairs.
    rope_scaling: str | None = None
    rope_scaling_params: tuple[tuple[str, float], ...] = ()
    #: Position of the first token (some engines start at 1, or offset a shared prefix).
    position_offset: int = 0

    @property
    def length_dependent(self) -> bool:
        """True unless a token's KV is known not to depend on the total length (see
        `STATIC_ROPE_SCALING`); reuse is refused when it does."""
        if self.rope_scaling is None:
            return False
        return self.rope_scaling.strip().lower() not in STATIC_ROPE_SCALING


@dataclass(frozen=True)
class AttentionMask:
    """The attention pattern the KV was computed under."""

    kind: str = "causal"  # "causal", "sliding_window", "per_layer", "prefix_lm", ...
    sliding_window: int | None = None
    #: Hybrid models (kind "per_layer"): each layer's window, None for a full-attention layer.
    #: Left out of the serialization when empty, so single-kind contexts keep the fingerprint
    #: they had before the field existed.
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))


@dataclass(frozen=True, eq=False)
class CacheContext:
    """Every prefix-affecting setting. Two requests share KV only under equal contexts.

    Equality and hashing are those of the fingerprint (the canonical serialization), so two
    contexts compare equal exactly when the cache would share KV between them: `1` and `1.0`
    in a field are different contexts (the canonical form tags floats), as they are to the
    cache. `extra` is frozen into a read-only mapping at construction.
    """

    model_id: str = ""
    #: Weights revision or content digest: a fine-tune or a weights update must miss.
    weights_digest: str = ""
    tokenizer_id: str = ""
    #: Digest of the vocabulary and normalisation rules.
    tokenizer_digest: str = ""
    chat_template_version: str = ""
    position_encoding: PositionEncoding = field(default_factory=PositionEncoding)
    #: Adapters applied model-wide (per-request adapters go in each request's extra keys).
    adapters: tuple[str, ...] = ()
    attention_mask: AttentionMask = field(default_factory=AttentionMask)
    kv_dtype: str = "float32"
    kv_quantization: str = "none"
    block_size: int = 16
    #: Anything else that changes KV (e.g. {"sink_tokens": 4}); values must be JSON scalars.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or not 1 <= self.block_size <= _MAX_U32
        ):
            raise InvalidInputError(
                f"block_size must be an int in 1 ..= {_MAX_U32}, got {self.block_size!r}"
            )
        if not isinstance(self.position_encoding, PositionEncoding):
            raise InvalidInputError(
                "position_encoding must be a PositionEncoding, not "
                f"{type(self.position_encoding).__name__}"
            )
        if not isinstance(self.attention_mask, AttentionMask):
            raise InvalidInputError(
                f"attention_mask must be an AttentionMask, not {type(self.attention_mask).__name__}"
            )
        if not isinstance(self.extra, Mapping):
            raise InvalidInputError(f"extra must be a mapping, not {type(self.extra).__name__}")
        if isinstance(self.adapters, (str, bytes)):
            raise InvalidInputError("adapters must be a sequence of str, not one string")
        for name, value in self.extra.items():
            if not isinstance(name, str):
                raise InvalidInputError(f"extra keys must be str, got {name!r}")
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise InvalidInputError(
                    f"extra[{name!r}] must be a str, int, float, bool or None, got {type(value).__name__}"
                )
        # A read-only copy: mutating the caller's dict (or this one) cannot change a live
        # context's fingerprint.
        object.__setattr__(self, "extra", MappingProxyType(dict(sorted(self.extra.items()))))
        object.__setattr__(self, "adapters", tuple(self.adapters))
        # Serialize once: refuses what cannot be serialized (a lone surrogate, a NaN, an
        # unknown type) at construction, with the field named, instead of at first use.
        object.__setattr__(self, "_canonical", self._serialize())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheContext):
            return NotImplemented
        return self.canonical_bytes() == other.canonical_bytes()

    def __hash__(self) -> int:
        return hash(self.canonical_bytes())

    def _serialize(self) -> bytes:
        data = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                value = dict(value)
            elif hasattr(value, "__dataclass_fields__"):
                value = asdict(value)
                if f.name == "attention_mask" and not value["layer_windows"]:
                    del value["layer_windows"]
            data[f.name] = _canonical(value, f.name)
        data["version"] = 1
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        try:
            return text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"a CacheContext field holds text that is not valid Unicode: {exc.reason}"
            ) from None

    def canonical_bytes(self) -> bytes:
        """The canonical serialization whose hash is the fingerprint."""
        return self._canonical  # type: ignore[attr-defined,no-any-return]

    def fingerprint(self) -> bytes:
        """32-byte SHA-256 fingerprint: the root of every block key under this context."""
        from prefixkv._core import context_fingerprint

        return context_fingerprint(self.canonical_bytes())

    @property
    def reuse_is_safe(self) -> bool:
        """False when KV of a prefix is not what a full recompute would give (dynamic RoPE)."""
        return not self.position_encoding.length_dependent


_MAX_U32 = 2**32 - 1


def _canonical(value: Any, where: str) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInputError(f"CacheContext field {where} is {value}: not a finite number")
        return {"float": value.hex()}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise InvalidInputError(
        f"cannot serialize {type(value).__name__} in CacheContext field {where}"
    )
