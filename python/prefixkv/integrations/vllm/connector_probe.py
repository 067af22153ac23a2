"""How the scheduler decides that the store holds a block: the two probe modes.

* ``"verify"`` (the default): fetch the values (one ``MGET``) and verify each one completely
  (`prefixkv.tiers.format`: format version, key, parent, tokens, context fingerprint, dtype,
  shape, BLAKE2b checksum of the KV bytes). A corrupted or foreign value is a miss: vLLM never
  counts it as computed, and no load error follows. The bytes cross the network twice (probe,
  then the worker's load), which the bench measures.
* ``"length"``: ask only each value's length (one pipelined ``STRLEN`` round trip) and claim
  the blocks whose value has exactly the length a block of this geometry encodes to. Cheaper
  for long prompts; a value of the right length but wrong content (bit flips, another block's
  value) is then caught by the worker's verification at load, reported as a load error, and
  recomputed by vLLM (``kv_load_failure_policy="recompute"``, which the connector requires).

Both are time-bounded by the store's timeout, stop at the first miss, and after a store failure
stop asking for `retry_after` seconds (the remote tier's rule), so a dead store costs one
timeout per `retry_after`, not one per admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prefixkv.errors import InvalidInputError, missing_dependency
from prefixkv.integrations.vllm.connector_keys import BlockGeometry
from prefixkv.tiers import BlockRecord, RemoteTier
from prefixkv.tiers.format import value_length

__all__ = ["PROBE_MODES", "BlockProbe", "LengthProbe", "VerifyingProbe"]

PROBE_MODES = ("verify", "length")


class BlockProbe(Protocol):
    def __call__(self, records: Sequence[BlockRecord], context: bytes) -> int:
        """How many of `records`, from the first, the store holds (as far as this mode checks)."""
        ...


class VerifyingProbe:
    """Claims a block only after verifying its whole value."""

    def __init__(self, remote: RemoteTier, geometry: BlockGeometry) -> None:
        self.remote = remote
        self.geometry = geometry

    def __call__(self, records: Sequence[BlockRecord], context: bytes) -> int:
        g = self.geometry
        return len(self.remote.fetch(records, context, g.dtype, g.value_shape))


class LengthProbe:
    """Claims a block whose value has the exact encoded length; the worker verifies it."""

    def __init__(
        self,
        remote: RemoteTier,
        geometry: BlockGeometry,
        url: str,
        timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import redis
        except ModuleNotFoundError as exc:
            error = missing_dependency(exc, "LengthProbe")
            if error is None:
                raise
            raise error from None
        self.remote = remote
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=None
        )
        # The length does not depend on the content, only on the geometry.
        self.value_length = value_length(geometry.block_size, geometry.dtype, geometry.value_shape)
        self._clock = clock
        self._down_until = 0.0

    def __call__(self, records: Sequence[BlockRecord], context: bytes) -> int:
        stats = self.remote.stats
        records = records[: self.remote.max_probe_blocks]
        if not records:
            return 0
        if self._clock() < self._down_until:
            stats.skipped += 1
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for record in records:
                pipe.strlen(self.remote.store_key(record.key))
            lengths = pipe.execute()
        except self._errors:
            stats.errors += 1
            self._down_until = self._clock() + self.remote.retry_after
            return 0
        count = 0
        for length in lengths:
            if length != self.value_length:
                if length == 0:
                    stats.misses += 1
                else:
                    stats.invalid += 1
                break
            count += 1
        return count

    def close(self) -> None:
        self._client.close()


def make_probe(
    mode: str, remote: RemoteTier, geometry: BlockGeometry, url: str, timeout: float
) -> BlockProbe:
    if mode == "verify":
        return VerifyingProbe(remote, geometry)
    if mode == "length":
        return LengthProbe(remote, geometry, url, timeout)
    raise InvalidInputError(f"kv_connector_extra_config['probe'] must be one of {PROBE_MODES}")
