"""The connector's settings: vLLM's ``kv_connector_extra_config``, parsed once and checked.

Every key is named here, with its type and default; docs/vllm.md ("The KV connector") shows
each with an example. A key this module does not know is refused by name rather than ignored:
a misspelt ``namspace`` silently sharing the default namespace with another deployment would be
the kind of mistake nobody notices until two models' blocks meet in one store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from prefixkv.errors import InvalidInputError

__all__ = ["ConnectorSettings"]

#: Settings that only the Redis tier reads: refused without ``redis_url``.
_REMOTE_ONLY = frozenset(
    {"namespace", "timeout", "ttl", "retry_after", "max_probe_blocks", "probe"}
)


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may hold: ``redis_url``, ``host_tier_bytes`` or
    both (at least one tier), and the optional settings of each."""

    #: The Valkey/Redis server every engine sharing KV points at (``redis://host:port/db``);
    #: None: no remote tier.
    redis_url: str | None = None
    #: Bytes of host memory each worker keeps block KV in (the host tier, probed before the
    #: store); None: no host tier.
    host_tier_bytes: int | None = None
    #: Key prefix in the store: one per deployment or trust domain.
    namespace: str = "prefixkv"
    #: Seconds one store call may wait for bytes (connect and each read): bounds a probe.
    timeout: float = 0.25
    #: Seconds a stored block lives (None: until the server's eviction policy removes it).
    ttl: float | None = None
    #: Blocks waiting to be written to the store, and (a queue of its own) blocks of the host
    #: tier waiting for their checksum; when full, a save is dropped and counted, never awaited.
    queue_size: int = 64
    #: Seconds the connector stops asking a store that failed.
    retry_after: float = 1.0
    #: Blocks one probe asks for at most (bounds the bytes one admission can pull).
    max_probe_blocks: int = 256
    #: How the scheduler checks a block before claiming it: "verify" (fetch and verify the
    #: whole value) or "length" (its length only; the worker verifies at load).
    probe: str = "verify"
    #: Replaces the weights digest the connector computes from the model's files (a commit
    #: hash, a release name): required when the model is not a local directory.
    model_fingerprint: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; raises `InvalidInputError` naming the
        first key that is unknown, missing or of the wrong type."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise InvalidInputError(
                f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}"
            )
        known = {f.name for f in fields(cls)}
        for name in extra:
            if name not in known:
                raise InvalidInputError(
                    f"kv_connector_extra_config[{name!r}] is not a PrefixKVConnector setting "
                    f"(known: {', '.join(sorted(known))})"
                )
        if extra.get("redis_url") is None and extra.get("host_tier_bytes") is None:
            raise InvalidInputError(
                "kv_connector_extra_config needs 'redis_url' (e.g. 'redis://127.0.0.1:6379/0'), "
                "'host_tier_bytes' (e.g. 4294967296) or both: the connector has no tier"
            )
        if extra.get("redis_url") is None:
            # Settings of the store without a store: a deployment that meant to share KV
            # through Redis and forgot the URL would otherwise run host-only, silently.
            stray = sorted(_REMOTE_ONLY & set(extra))
            if stray:
                raise InvalidInputError(
                    f"kv_connector_extra_config[{stray[0]!r}] sets the Redis tier, but "
                    "'redis_url' is not given"
                )
        settings = cls(**dict(extra))
        settings._check()
        return settings

    def _check(self) -> None:
        def where(name: str) -> str:
            return f"kv_connector_extra_config[{name!r}]"

        if self.redis_url is not None and (
            not isinstance(self.redis_url, str)
            or not self.redis_url.startswith(("redis://", "rediss://", "unix://"))
        ):
            raise InvalidInputError(
                f"{where('redis_url')} must be a redis://, rediss:// or unix:// URL, "
                f"got {self.redis_url!r}"
            )
        if not isinstance(self.namespace, str) or not self.namespace or ":" in self.namespace:
            raise InvalidInputError(
                f"{where('namespace')} must be a non-empty str without ':', got {self.namespace!r}"
            )
        for name in ("timeout", "retry_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise InvalidInputError(f"{where(name)} must be a positive number, got {value!r}")
        if self.ttl is not None and (
            isinstance(self.ttl, bool) or not isinstance(self.ttl, int | float) or not self.ttl > 0
        ):
            raise InvalidInputError(f"{where('ttl')} must be None or a positive number")
        if self.host_tier_bytes is not None and (
            isinstance(self.host_tier_bytes, bool)
            or not isinstance(self.host_tier_bytes, int)
            or self.host_tier_bytes < 1
        ):
            raise InvalidInputError(
                f"{where('host_tier_bytes')} must be None or an int >= 1, "
                f"got {self.host_tier_bytes!r}"
            )
        for name in ("queue_size", "max_probe_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{where(name)} must be an int >= 1, got {value!r}")
        if self.probe not in ("verify", "length"):
            raise InvalidInputError(
                f"{where('probe')} must be 'verify' or 'length', got {self.probe!r}"
            )
        if self.model_fingerprint is not None and (
            not isinstance(self.model_fingerprint, str) or not self.model_fingerprint
        ):
            raise InvalidInputError(f"{where('model_fingerprint')} must be a non-empty str")
