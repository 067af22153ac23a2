"""KV events in vLLM's wire format, and the prefix index routers build from them.

- `EventRecorder` (`recorder.py`): turns a `PrefixCache`'s event recording on and drains it.
- `PrefixIndex`, `prompt_hashes`, `hash64` (`index.py`): the router-side index, in Rust.
- `KVEventPublisher`, `ZmqEventPublisher` (`publisher.py`): the ZMQ PUB + replay transport.
- `EventSubscriber`, `Endpoint` (`subscriber.py`): keeps an index in step with N instances.
- `wire` (`wire.py`): the msgspec structs, byte-compatible with vLLM's.

The first two need no optional package; the rest need the ``events`` extra
(``pip install 'prefixkv[events]'``: pyzmq, msgspec). Formats and guarantees:
``docs/events.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefixkv.errors import missing_dependency
from prefixkv.events.index import PrefixIndex, hash64, prompt_hashes
from prefixkv.events.recorder import EventRecorder

if TYPE_CHECKING:
    from prefixkv.events.publisher import KVEventPublisher, ZmqEventPublisher
    from prefixkv.events.subscriber import (
        Endpoint,
        EventSubscriber,
        SubscriberFailedError,
        SubscriberStatus,
    )

__all__ = [
    "Endpoint",
    "EventRecorder",
    "EventSubscriber",
    "KVEventPublisher",
    "PrefixIndex",
    "SubscriberFailedError",
    "SubscriberStatus",
    "ZmqEventPublisher",
    "hash64",
    "prompt_hashes",
]

_LAZY = {
    "KVEventPublisher": "prefixkv.events.publisher",
    "ZmqEventPublisher": "prefixkv.events.publisher",
    "EventSubscriber": "prefixkv.events.subscriber",
    "Endpoint": "prefixkv.events.subscriber",
    "SubscriberFailedError": "prefixkv.events.subscriber",
    "SubscriberStatus": "prefixkv.events.subscriber",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixkv.events' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        missing = missing_dependency(exc, f"prefixkv.events.{name}")
        if missing is None:
            raise
        raise missing from exc
    globals()[name] = value
    return value
