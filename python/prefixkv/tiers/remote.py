"""The remote tier: block KV in a shared store that other engine processes read too.

`RemoteStore` is the whole interface a store needs (batched get, batched put); `RedisStore`
implements it on Valkey or Redis through redis-py. `RemoteTier` puts the policy on top:

* Keys: ``namespace + ":" + hex(SHA-256 block key)``; the block key already binds the context
  fingerprint, salt, adapter and every earlier token, so two engines share a value exactly when
  they would share the device block.
* Reads: one round trip (pipelined ``GETRANGE``) for the run of consecutive keys after the
  device and host hits, served from the first key up to the first miss. A block's value has one
  exact length (`format.value_length`), and no more than that is read per key: a store value is
  untrusted, and one hostile 100 MB value must not cost 100 MB (a longer value arrives cut and
  fails verification). Each value is verified (`prefixkv.tiers.format`); a value that fails, a
  timeout or a dead server ends the run and is counted, never raised to the scheduler.
* Time bound: every call runs under the store's socket timeout; after a failure the tier stops
  asking for `retry_after` seconds, so a dead server costs one timeout, not one per step.
* Writes: a bounded queue drained by one background thread, batched into one pipelined round
  trip per drain; when the queue is full a write is dropped and counted.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prefixkv.errors import InvalidInputError, PrefixKVError, missing_dependency
from prefixkv.tiers.background import BackgroundQueue
from prefixkv.tiers.format import BlockFormatError, decode_block, encode_block, value_length
from prefixkv.tiers.host import BlockRecord

__all__ = ["RedisStore", "RemoteStore", "RemoteTier", "StoreError"]


class StoreError(PrefixKVError, ConnectionError):
    """The remote store could not answer (down, unreachable, timed out, refused)."""


class RemoteStore(Protocol):
    """A key-value store for block values. Both calls are one round trip, and raise
    `StoreError` (only) when the store cannot answer."""

    def get_many(self, keys: Sequence[str], max_bytes: Sequence[int]) -> list[bytes | None]:
        """Per key, its value (None when absent), of which at most `max_bytes[i] + 1` bytes
        are read: one byte past the expected length, so that a longer value is seen to be
        longer."""
        ...

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...


class RedisStore:
    """`RemoteStore` on Valkey or Redis (redis-py; ``pip install 'prefixkv[redis]'``).

    Args:
        url: ``redis://host:port/db`` (or ``rediss://`` for TLS).
        timeout: seconds a call may wait for the server (connect and each read): the bound on
            how long a remote probe can stall the scheduler.
        ttl: seconds a value lives (None: until the server's eviction policy removes it; run
            the server with ``maxmemory`` and ``allkeys-lru``).
    """

    def __init__(self, url: str, *, timeout: float = 0.05, ttl: float | None = None) -> None:
        try:
            import redis
        except ModuleNotFoundError as exc:
            error = missing_dependency(exc, "RedisStore")
            if error is None:
                raise
            raise error from None
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise InvalidInputError(f"timeout must be a positive number, got {timeout!r}")
        self.url = url
        self.timeout = float(timeout)
        self.ttl_ms = None if ttl is None else int(ttl * 1000)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            retry=None,
        )
        # Closes the connections when the store is dropped (a collected socket warns).
        self._closer = weakref.finalize(self, self._client.close)

    def get_many(self, keys: Sequence[str], max_bytes: Sequence[int]) -> list[bytes | None]:
        if len(max_bytes) != len(keys):
            raise InvalidInputError(f"max_bytes has {len(max_bytes)} entries for {len(keys)} keys")
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, limit in zip(keys, max_bytes, strict=True):
                # GETRANGE's end is inclusive: limit + 1 bytes at most.
                pipe.getrange(key, 0, limit)
            values: list[Any] = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            raise StoreError(f"{self.url}: {type(exc).__name__}: {exc}") from None
        # A missing key reads as b"" (as does an empty value: no block is empty); a key of
        # another type answers an error: both are misses.
        return [value if isinstance(value, bytes) and value else None for value in values]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, value, px=self.ttl_ms)
            pipe.execute()
        except self._errors as exc:
            raise StoreError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._closer()


@dataclass
class RemoteStats:
    """Counters of one `RemoteTier` (blocks, not requests)."""

    hits: int = 0
    #: Probed keys the store did not hold.
    misses: int = 0
    #: Values that failed verification (wrong header, truncated, corrupted): counted misses.
    invalid: int = 0
    #: Probes or write batches that failed (timeout, dead server): counted misses.
    errors: int = 0
    #: Probes skipped because the store failed less than `retry_after` ago.
    skipped: int = 0
    writes: int = 0
    #: Writes dropped because the queue was full.
    dropped: int = 0
    #: Writes lost because the store failed.
    write_errors: int = 0


class RemoteTier:
    """Verified, time-bounded reads and queued writes over a `RemoteStore`."""

    def __init__(
        self,
        store: RemoteStore,
        *,
        namespace: str = "prefixkv",
        queue_size: int = 256,
        retry_after: float = 1.0,
        max_probe_blocks: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.retry_after = retry_after
        self.max_probe_blocks = max_probe_blocks
        self.stats = RemoteStats()
        self._clock = clock
        self._down_until = 0.0
        # Its thread holds the store and the counters, not the tier, so a tier nobody holds
        # is collected and the thread stops (queued writes first).
        self._writes: BackgroundQueue[tuple[str, BlockRecord, bytes, torch.Tensor]] = (
            BackgroundQueue(
                functools.partial(_write, store, self.stats),
                queue_size=queue_size,
                name="prefixkv-remote-writer",
                max_batch=64,
            )
        )

    def store_key(self, key: bytes) -> str:
        return f"{self.namespace}:{key.hex()}"

    # -- reads ---------------------------------------------------------------------------

    def fetch(
        self,
        records: Sequence[BlockRecord],
        context: bytes,
        dtype: torch.dtype,
        shape: Sequence[int],
    ) -> list[torch.Tensor]:
        """The KV of `records[:n]` for the longest run the store holds and verifies; one round
        trip. Never raises for a store failure."""
        records = records[: self.max_probe_blocks]
        if not records:
            return []
        if self._clock() < self._down_until:
            self.stats.skipped += 1
            return []
        try:
            values = self.store.get_many(
                [self.store_key(r.key) for r in records],
                [value_length(len(r.tokens), dtype, shape) for r in records],
            )
        except StoreError:
            self.stats.errors += 1
            self._down_until = self._clock() + self.retry_after
            return []
        served: list[torch.Tensor] = []
        for record, value in zip(records, values, strict=False):
            if value is None:
                self.stats.misses += 1
                break
            try:
                kv = decode_block(
                    value,
                    key=record.key,
                    parent=record.parent,
                    tokens=record.tokens,
                    context=context,
                    dtype=dtype,
                    shape=shape,
                )
            except BlockFormatError:
                self.stats.invalid += 1
                break
            served.append(kv)
        self.stats.hits += len(served)
        return served

    # -- writes --------------------------------------------------------------------------

    def put(self, record: BlockRecord, context: bytes, kv: torch.Tensor) -> None:
        """Queue one block's value (`kv` must not change afterwards: pass a copy)."""
        if not self._writes.offer((self.store_key(record.key), record, context, kv)):
            self.stats.dropped += 1

    def pending(self) -> int:
        return self._writes.pending()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued write was attempted; False on timeout."""
        return self._writes.flush(timeout)

    def close(self) -> None:
        """Stop the writer thread (queued writes are attempted first)."""
        self._writes.close()


def _write(
    store: RemoteStore,
    stats: RemoteStats,
    writes: list[tuple[str, BlockRecord, bytes, torch.Tensor]],
) -> None:
    """One batch of queued writes (up to 64), one pipelined round trip."""
    try:
        values = [
            (key, encode_block(r.key, r.parent, r.tokens, context, kv))
            for key, r, context, kv in writes
        ]
        store.put_many(values)
        stats.writes += len(values)
    except (StoreError, BlockFormatError):
        stats.write_errors += len(writes)
    except Exception:  # the writer thread must outlive any one batch
        # What a store never promised to raise (a client library's bug, a MemoryError while
        # encoding) is counted the same way: a dead writer would leave every later save queued.
        stats.write_errors += len(writes)
