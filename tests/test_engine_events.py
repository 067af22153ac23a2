"""The Engine publishes its KV events every step and exposes its metrics.

A subscriber on loopback (ports chosen at run time) keeps a prefix index in step with an
engine serving through a small pool (so blocks are stored, evicted and, after a weight change,
cleared); after each `generate` the index holds exactly the engine's cached blocks.
"""

from __future__ import annotations

import prometheus_client
import pytest
import torch

from prefixkv import InvalidInputError
from prefixkv.engine.facade import Engine
from prefixkv.events import EventSubscriber, PrefixIndex
from prefixkv.events.subscriber import Endpoint
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.text.tokenizers import ByteTokenizer
from tests.engine_support import random_prompt


@pytest.mark.timeout(120)
def test_the_index_follows_the_engine_step_by_step() -> None:
    model = LlamaModel.random(ModelConfig(vocab_size=ByteTokenizer().vocab_size), seed=1)
    engine = Engine(model, num_blocks=24, block_size=4, max_num_batched_tokens=16)
    publisher = engine.publish_kv_events("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@t@m")
    with pytest.raises(InvalidInputError, match="already publishes"):
        engine.publish_kv_events("tcp://127.0.0.1:*")
    index = PrefixIndex(["engine"])
    endpoint = Endpoint(publisher.endpoint, publisher.replay_endpoint, "kv@t@m")
    try:
        with EventSubscriber(index, {"engine": endpoint}) as subscriber:

            def in_step() -> None:
                assert subscriber.wait_for("engine", publisher.socket.next_sequence - 1)
                cached = sorted(
                    int.from_bytes(k[-8:], "big") for k in publisher.recorder.cached_keys()
                )
                assert index.blocks_of("engine") == cached
                assert len(cached) == engine.cache.stats().blocks_cached

            system = random_prompt(20, seed=2)
            engine.generate(
                [system + random_prompt(6, seed=3 + i) for i in range(3)], max_new_tokens=3
            )
            in_step()
            # More distinct prompts than the pool holds: evictions are published too.
            engine.generate([random_prompt(30, seed=10 + i) for i in range(4)], max_new_tokens=2)
            assert engine.cache.stats().evictions > 0
            in_step()
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)  # a weight change clears the cache
            engine.generate([[*system, 1, 2]], max_new_tokens=2)
            in_step()
        collector = engine.metrics_collector()
        registry = prometheus_client.CollectorRegistry()
        registry.register(collector)
        text = prometheus_client.generate_latest(registry).decode()
        assert "prefixkv:prefix_cache_queries" in text
        stats = engine.cache.stats()
        queries = registry.get_sample_value(
            "prefixkv:prefix_cache_queries_total", {"model_name": ""}
        )
        assert queries == stats.lookup_tokens
    finally:
        engine.close()
    assert engine.kv_events is None
