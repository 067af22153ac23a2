"""The Prometheus collector: vLLM-like names, values from the cache at scrape time."""

from __future__ import annotations

import prometheus_client  # noqa: F401
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import InvalidInputError
from prefixkv.events import EventRecorder
from prefixkv.metrics import PrefixCacheCollector
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")


def test_scrape_reports_queries_hits_usage_and_event_loss() -> None:
    cache = PrefixCache(8, context=CacheContext(model_id="m", block_size=2))
    recorder = EventRecorder(cache, capacity=1)
    registry = CollectorRegistry()
    registry.register(PrefixCacheCollector(cache, recorder=recorder, labels={"model_name": "m"}))
    for _ in range(2):
        request = cache.begin([1, 2, 3, 4, 5])
        cache.commit(request, 5)
        cache.finish(request)
    live = cache.begin([7, 8])
    text = generate_latest(registry).decode()
    sample = 'model_name="m"'
    assert f"prefixkv:prefix_cache_queries_total{{{sample}}} 12.0" in text
    assert f"prefixkv:prefix_cache_hits_total{{{sample}}} 4.0" in text
    assert f"prefixkv:kv_cache_usage_perc{{{sample}}} 0.125" in text
    assert f'prefixkv:kv_cache_blocks{{{sample},state="cached"}} 2.0' in text
    assert f"prefixkv:kv_events_dropped_blocks_total{{{sample}}} 2.0" in text
    assert f"prefixkv:kv_events_resyncs_total{{{sample}}} 1.0" in text
    cache.finish(live)


def test_publisher_and_recorder_are_exclusive() -> None:
    cache = PrefixCache(8, context=CacheContext(model_id="m", block_size=2))
    recorder = EventRecorder(cache)
    with pytest.raises(InvalidInputError):
        PrefixCacheCollector(cache, publisher=object(), recorder=recorder)  # type: ignore[arg-type]
