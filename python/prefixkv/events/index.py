"""The router-side prefix index (needs no optional package; the subscriber feeding it does).

`PrefixIndex` names instances, applies their events (prefixkv's or vLLM's, decoded by
`wire.decode_batch`) and scores prompts; the map itself lives in Rust
(`rust/core/src/index.rs`): lock-free reads, so scoring never waits for an update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prefixkv import _core
from prefixkv.errors import InvalidInputError

if TYPE_CHECKING:
    from prefixkv.cache import PrefixCache
    from prefixkv.events.wire import KVEventBatch


def hash64(block_hash: bytes | int) -> int:
    """The 64-bit form of a block hash: an int as it is, a key's last 8 bytes big-endian."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(block_hash[-8:], "big")


def prompt_hashes(
    cache_or_fingerprint: PrefixCache | bytes,
    tokens: Any,
    *,
    block_size: int | None = None,
    salt: str | bytes | None = None,
    adapter: str | bytes | None = None,
) -> list[int]:
    """The 64-bit hashes a prefixkv instance publishes for the full blocks of `tokens`.

    Give the instance's `PrefixCache` (or a cache built with the same `CacheContext`), or its
    context fingerprint (`CacheContext.fingerprint()`) and `block_size`.
    """
    from prefixkv.cache import as_token_ids, key_extras

    if isinstance(cache_or_fingerprint, bytes):
        if block_size is None:
            raise InvalidInputError("prompt_hashes needs block_size with a fingerprint")
        fingerprint = cache_or_fingerprint
    else:
        context = cache_or_fingerprint.context
        fingerprint = context.fingerprint()
        block_size = context.block_size if block_size is None else block_size
    keys = key_extras(salt=salt, adapter=adapter)
    return _core.prompt_hashes(fingerprint, block_size, as_token_ids(tokens), keys)


def _hashes(hashes: Iterable[bytes | int]) -> list[int]:
    """64-bit hashes, or `InvalidInputError` naming what is wrong."""
    out = []
    for h in hashes:
        if isinstance(h, bool) or not isinstance(h, (int, bytes)):
            raise InvalidInputError(f"a block hash is an int or bytes, got {type(h).__name__}")
        if isinstance(h, int) and not 0 <= h < 1 << 64:
            raise InvalidInputError(f"an int block hash is in 0 .. 2**64-1, got {h}")
        out.append(hash64(h))
    return out


class PrefixIndex:
    """Which of N instances holds which block, and how much of a prompt each holds.

    Args:
        instances: the instances' names (at most 64), in the order `score` reports them.
    """

    def __init__(self, instances: Sequence[str]) -> None:
        names = list(instances)
        if len(set(names)) != len(names):
            raise InvalidInputError(f"instance names must be distinct, got {names}")
        self._core = _core.PrefixIndex(len(names))
        self.instances = names
        self._ids = {name: i for i, name in enumerate(names)}
        #: Per instance, the sequence number of the last batch applied (None: none yet). A new
        #: subscriber on this index resumes from here, so restarting one loses nothing.
        self.applied_seq: dict[str, int | None] = dict.fromkeys(names)

    def _id(self, instance: str) -> int:
        try:
            return self._ids[instance]
        except KeyError:
            raise InvalidInputError(
                f"unknown instance {instance!r}; known: {self.instances}"
            ) from None

    def store(self, instance: str, hashes: Iterable[bytes | int]) -> None:
        """`instance` now holds these blocks."""
        self._core.store(self._id(instance), _hashes(hashes))

    def remove(self, instance: str, hashes: Iterable[bytes | int]) -> None:
        """`instance` no longer holds these blocks (unknown ones are ignored)."""
        self._core.remove(self._id(instance), _hashes(hashes))

    def clear(self, instance: str) -> None:
        """`instance` holds nothing."""
        self._core.clear(self._id(instance))

    def apply(self, instance: str, batch: KVEventBatch, seq: int | None = None) -> None:
        """Applies one decoded batch of `instance`'s events, in order."""
        from prefixkv.events.wire import AllBlocksCleared, BlockRemoved, BlockStored

        ident = self._id(instance)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._core.store(ident, [hash64(h) for h in event.block_hashes])
            elif isinstance(event, BlockRemoved):
                self._core.remove(ident, [hash64(h) for h in event.block_hashes])
            elif isinstance(event, AllBlocksCleared):
                self._core.clear(ident)
        if seq is not None:
            self.applied_seq[instance] = seq

    def score(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per instance, how many leading blocks of the prompt (its `prompt_hashes`) it holds."""
        return dict(zip(self.instances, self._core.score(_hashes(hashes)), strict=True))

    def best(self, hashes: Sequence[int]) -> tuple[str, int]:
        """The instance holding the longest prefix (the first such, on a tie) and its length."""
        scores = self._core.score(_hashes(hashes))
        best = max(range(len(scores)), key=scores.__getitem__)
        return self.instances[best], scores[best]

    def blocks_of(self, instance: str) -> list[int]:
        """The 64-bit hashes `instance` holds, sorted."""
        return self._core.blocks_of(self._id(instance))

    def __len__(self) -> int:
        return len(self._core)
