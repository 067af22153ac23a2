"""Prometheus metrics of a `PrefixCache`, named as vLLM names its own (``metrics`` extra).

`PrefixCacheCollector` is a custom prometheus_client collector: it reads `cache.stats()` (and a
`KVEventPublisher`'s or `EventRecorder`'s counters) at scrape time, so serving pays nothing
between scrapes. Register it once::

    from prometheus_client import REGISTRY, start_http_server
    REGISTRY.register(PrefixCacheCollector(engine.cache, publisher=publisher))
    start_http_server(8000)

Names and semantics (``prefixkv:`` where vLLM uses ``vllm:``; counters get ``_total``):

===============================================  =========  =========================================
metric                                           type       meaning
===============================================  =========  =========================================
``prefixkv:prefix_cache_queries``                counter    prompt tokens looked up (vLLM: same name)
``prefixkv:prefix_cache_hits``                   counter    of those, tokens read from the cache
``prefixkv:kv_cache_usage_perc``                 gauge      fraction of blocks in use (0..1)
``prefixkv:kv_cache_blocks``                     gauge      blocks by ``state``: free, cached, in_use,
                                                            pinned, evictable
``prefixkv:prefix_cache_evictions``              counter    cached blocks evicted
``prefixkv:prefix_cache_committed_blocks``       counter    blocks published into the cache
``prefixkv:prefix_cache_dedup_drops``            counter    commits dropped as duplicates of a
                                                            cached block (the copy is freed)
``prefixkv:prefix_cache_collisions``             counter    table-key collisions (never a wrong hit)
``prefixkv:prefix_cache_probes``                 counter    lock-free `lookup` calls (routing probes)
``prefixkv:prefix_cache_released_blocks``        counter    blocks a sliding-window group released
``prefixkv:requests_live``                       gauge      requests between begin and finish
``prefixkv:kv_events_recorded_blocks``           counter    blocks whose events were recorded
``prefixkv:kv_events_dropped_blocks``            counter    of those, dropped by a full queue
``prefixkv:kv_events_resyncs``                   counter    resynchronisations after an overflow
===============================================  =========  =========================================

A hybrid model's `GroupedPrefixCache` reports the block figures per KV group, with a
``kv_group`` label ("0" is the full-attention group when the model has one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prefixkv.cache import PrefixCache
    from prefixkv.events import EventRecorder, KVEventPublisher
    from prefixkv.group_cache import GroupedPrefixCache

__all__ = ["PrefixCacheCollector"]


class PrefixCacheCollector(Collector):
    """Exposes `cache`'s counters (and `publisher`'s or `recorder`'s event counters).

    Args:
        cache: the cache to report: a `PrefixCache`, or a hybrid model's `GroupedPrefixCache`,
            whose block figures are reported per KV group (label ``kv_group``; every group
            serves the same hit lengths, so the query and hit counters are group 0's).
        publisher / recorder: where the event counters come from (give at most one).
        labels: constant labels for every sample (vLLM labels by ``model_name``).
    """

    def __init__(
        self,
        cache: PrefixCache | GroupedPrefixCache,
        *,
        publisher: KVEventPublisher | None = None,
        recorder: EventRecorder | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        from prefixkv.errors import InvalidInputError

        if publisher is not None and recorder is not None:
            raise InvalidInputError("give a publisher or a recorder, not both")
        self.cache = cache
        self.publisher = publisher
        self.recorder = recorder if publisher is None else publisher.recorder
        self.labels = dict(labels or {})
        self._events_recorded = 0
        self._events_dropped = 0

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _per_group(
        self,
        family: type[CounterMetricFamily] | type[GaugeMetricFamily],
        name: str,
        doc: str,
        values: list[tuple[str | None, Any]],
    ) -> Metric:
        """One sample per group (labelled ``kv_group``), or one unlabelled for a plain cache."""
        grouped = values[0][0] is not None
        names = [*self.labels, "kv_group"] if grouped else list(self.labels)
        metric = family(name, doc, labels=names)
        for group, value in values:
            extra = [group] if group is not None else []
            metric.add_metric([*self.labels.values(), *extra], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        from prefixkv.group_cache import GroupedCacheStats

        everything = self.cache.stats()
        per_group: list[tuple[str | None, Any]]
        if isinstance(everything, GroupedCacheStats):
            per_group = [(str(g), stats) for g, stats in enumerate(everything.groups)]
        else:
            per_group = [(None, everything)]
        stats = per_group[0][1]
        yield self._counter(
            "prefixkv:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.lookup_tokens,
        )
        yield self._counter(
            "prefixkv:prefix_cache_hits",
            "Prompt tokens whose KV was read from the prefix cache.",
            stats.hit_tokens,
        )
        yield self._per_group(
            GaugeMetricFamily,
            "prefixkv:kv_cache_usage_perc",
            "Fraction of KV blocks in use by requests (0..1).",
            [(g, s.blocks_in_use / (s.blocks_total or 1)) for g, s in per_group],
        )
        grouped = per_group[0][0] is not None
        blocks = GaugeMetricFamily(
            "prefixkv:kv_cache_blocks",
            "KV blocks by state.",
            labels=[*self.labels, *(["kv_group"] if grouped else []), "state"],
        )
        for group, group_stats in per_group:
            for state in ("free", "cached", "in_use", "pinned", "evictable"):
                value: Any = getattr(group_stats, f"blocks_{state}")
                extra = [group] if group is not None else []
                blocks.add_metric([*self.labels.values(), *extra, state], value)
        yield blocks
        for name, doc, field in (
            ("evictions", "Cached blocks evicted.", "evictions"),
            ("committed_blocks", "Blocks published into the cache.", "committed_blocks"),
            (
                "dedup_drops",
                "Committed blocks dropped as duplicates of a cached block.",
                "deduplicated_blocks",
            ),
            ("collisions", "Table-key collisions (each costs a miss).", "collisions"),
            ("probes", "Lock-free lookups (routing probes).", "probes"),
            (
                "released_blocks",
                "Blocks a sliding-window group released as its window moved on.",
                "blocks_released",
            ),
        ):
            yield self._per_group(
                CounterMetricFamily,
                f"prefixkv:prefix_cache_{name}",
                doc,
                [(g, getattr(s, field)) for g, s in per_group],
            )
        yield self._gauge(
            "prefixkv:requests_live", "Requests between begin and finish.", stats.requests_live
        )
        if self.recorder is not None:
            counters = self.recorder.counters()
            yield self._counter(
                "prefixkv:kv_events_recorded_blocks",
                "Blocks whose KV events were recorded.",
                counters.recorded_blocks,
            )
            yield self._counter(
                "prefixkv:kv_events_dropped_blocks",
                "Blocks whose KV events were dropped by a full queue (then resynchronised).",
                counters.dropped_blocks,
            )
            yield self._counter(
                "prefixkv:kv_events_resyncs",
                "Resynchronisations after an event queue overflow.",
                counters.overflows,
            )
