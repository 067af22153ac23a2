"""Recording a `PrefixCache`'s KV events (needs no optional package).

The core records every stored, removed and cleared block under the cache's lock
(`rust/core/src/events/mod.rs`); an `EventRecorder` turns that on for one cache and drains it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from prefixkv import _core
from prefixkv._core import EventCounters, EventDrain
from prefixkv.errors import InvalidInputError

if TYPE_CHECKING:
    from prefixkv.cache import PrefixCache

TokenIds = Literal["all", "unsalted", "none"]

#: Blocks queued between two drains before the queue overflows (then the next drain
#: resynchronises: `AllBlocksCleared` and every cached block, see `docs/events.md`).
DEFAULT_CAPACITY = 1 << 16


class EventRecorder:
    """Records `cache`'s KV events until `close()`.

    Args:
        cache: the `PrefixCache` to record.
        capacity: most blocks queued between two `drain()` calls; past it the queue is dropped,
            the loss counted (`dropped_blocks`), and the next drain resynchronises.
        token_ids: which token ids events carry: ``"all"`` (as vLLM), ``"unsalted"`` (a salted
            request's blocks go out as keys only) or ``"none"`` (keys only).
    """

    def __init__(
        self, cache: PrefixCache, *, capacity: int = DEFAULT_CAPACITY, token_ids: TokenIds = "all"
    ) -> None:
        if not isinstance(getattr(cache, "_core", None), _core.CoreCache | _core.CoreRunCache):
            raise InvalidInputError(
                f"EventRecorder needs a prefixkv PrefixCache, got {type(cache).__name__}"
            )
        self._cache = cache
        self.token_ids = token_ids
        _core.enable_events(cache._core, capacity, token_ids)
        # A `PrefixCache(core="auto")` may move to its block core while empty; it enables
        # events there with these settings (`PrefixCache._block_core`).
        cache._event_settings = (capacity, token_ids)

    @property
    def _recorded(self) -> _core.CoreCache | _core.CoreRunCache:
        """The recorded cache's core, read at every call: an "auto" cache may have moved to
        its block core since."""
        return self._cache._core

    @property
    def cache(self) -> PrefixCache:
        """The recorded cache."""
        return self._cache

    @property
    def block_size(self) -> int:
        """Tokens per block of the recorded cache."""
        return self._recorded.block_size

    def drain(self) -> EventDrain:
        """The events since the last drain, with the recorder's counters."""
        return _core.drain_events(self._recorded)

    def counters(self) -> EventCounters:
        """Blocks recorded, blocks dropped by overflows, and overflows, since the cache began."""
        return _core.event_counters(self._recorded)

    def cached_keys(self) -> list[bytes]:
        """The SHA-256 block key of every block the cache holds now."""
        return _core.cached_keys(self._recorded)

    @property
    def enabled(self) -> bool:
        """Whether the cache still records events."""
        return _core.events_enabled(self._recorded)

    def close(self) -> None:
        """Stops recording (queued events are discarded; counters are kept)."""
        _core.disable_events(self._recorded)
