"""The remote tier against a real redis-server on loopback (started here, on a port chosen at
run time): served blocks are exact, and a corrupted, truncated, foreign or slow value, or a dead
server, is a counted miss that the model recomputes, within the store's timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import Engine
from prefixkv.errors import MissingDependencyError
from prefixkv.tiers import RedisStore
from tests.redis_server import FaultProxy, RedisServer, client, server  # noqa: F401 (fixtures)
from tests.test_tiers import MODEL, assert_exact, prompts_from

_STORES: list[RedisStore] = []


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while _STORES:
        _STORES.pop().close()


def engine_for(url: str, *, timeout: float = 0.2, **settings_: object) -> Engine:
    store = RedisStore(url, timeout=timeout)
    _STORES.append(store)
    options: dict[str, object] = dict(num_blocks=16, block_size=4, remote_store=store)
    options.update(settings_)
    return Engine(MODEL, **options)  # type: ignore[arg-type]


def remote(engine: Engine):  # type: ignore[no-untyped-def]
    assert engine.tiers is not None and engine.tiers.remote is not None
    return engine.tiers.remote


def test_store_round_trip_and_missing_keys(server: RedisServer, client: redis.Redis) -> None:
    store = RedisStore(server.url)
    _STORES.append(store)
    store.put_many([("a", b"1"), ("b", b"\x00\xff"), ("c", b"0123456789")])
    assert store.get_many(["a", "x", "b"], [8, 8, 8]) == [b"1", None, b"\x00\xff"]
    # Never more than one byte past the expected length: enough to see a value is longer.
    assert store.get_many(["c", "c"], [3, 10]) == [b"0123", b"0123456789"]
    client.rpush("a list", b"x")  # another type under the key: a miss, not an error
    assert store.get_many(["a list"], [8]) == [None]


def test_the_expected_length_is_the_encoded_length() -> None:
    import torch

    from prefixkv.tiers.format import encode_block, value_length

    for dtype, shape, tokens in (
        (torch.float32, (2, 2, 4, 1, 8), (1, 2, 3, 4)),
        (torch.bfloat16, (2, 3, 16, 2, 4), tuple(range(16))),
        (torch.float16, (2, 1), ()),
    ):
        kv = torch.zeros(shape, dtype=dtype)
        value = encode_block(b"k" * 32, b"p" * 32, tokens, b"c" * 32, kv)
        assert value_length(len(tokens), dtype, shape) == len(value)


def test_hostile_values_cost_at_most_their_expected_length(
    server: RedisServer, client: redis.Redis
) -> None:
    # Three 32 MiB values under keys a lookup will ask for: the old probe (one MGET of the
    # whole run) held them all before checking any.
    import tracemalloc

    import torch

    from prefixkv.tiers.host import BlockRecord
    from prefixkv.tiers.remote import RemoteTier

    store = RedisStore(server.url, timeout=5.0)
    _STORES.append(store)
    tier = RemoteTier(store)
    try:
        records = [BlockRecord(bytes([n]) * 32, None, (1, 2, 3, 4)) for n in range(3)]
        huge = b"\x00" * (32 * 2**20)
        for record in records:
            client.set(tier.store_key(record.key), huge)
        tracemalloc.start()
        try:
            served = tier.fetch(records, b"c" * 32, torch.float32, (2, 2, 4, 1, 8))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert served == []
        assert tier.stats.invalid == 1 and tier.stats.hits == 0
        assert peak < 2**20, f"the probe held {peak / 2**20:.1f} MiB"
    finally:
        tier.close()


def test_a_second_engine_serves_the_first_ones_prefix(
    server: RedisServer, client: redis.Redis
) -> None:
    prompts = prompts_from(3, 3, 22, shared=12)
    first = engine_for(server.url)
    assert_exact(first.generate(prompts, max_new_tokens=3, check_exactness=True))
    assert remote(first).flush()
    assert remote(first).stats.writes > 0 and remote(first).stats.dropped == 0
    second = engine_for(server.url)
    results = second.generate(prompts, max_new_tokens=3, check_exactness=True)
    assert_exact(results)
    assert remote(second).stats.hits > 0
    assert second.tiers is not None and second.tiers.stats.remote_hit_blocks > 0
    assert results[0].cached_tokens >= 16


def test_another_namespace_or_context_is_never_served(
    server: RedisServer, client: redis.Redis
) -> None:
    prompts = prompts_from(4, 2, 20, shared=8)
    first = engine_for(server.url)
    first.generate(prompts, max_new_tokens=2)
    assert remote(first).flush()
    other_namespace = engine_for(server.url, remote_namespace="tenant-b")
    assert_exact(other_namespace.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(other_namespace).stats.hits == 0
    # The same weights under another model id: another context fingerprint, other keys.
    store = RedisStore(server.url, timeout=0.2)
    _STORES.append(store)
    other_context = Engine(MODEL, num_blocks=16, block_size=4, remote_store=store, model_id="x")
    assert_exact(other_context.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(other_context).stats.hits == 0


@pytest.mark.parametrize("fault", ["truncate", "corrupt", "swap", "garbage"])
def test_bad_values_are_counted_misses(
    server: RedisServer, client: redis.Redis, fault: str
) -> None:
    prompts = prompts_from(5, 2, 22, shared=0)
    first = engine_for(server.url)
    first.generate(prompts, max_new_tokens=2)
    assert remote(first).flush()
    keys = sorted(client.keys("prefixkv:*"))
    assert keys
    values = [client.get(key) for key in keys]
    for i, key in enumerate(keys):
        value = values[i]
        assert isinstance(value, bytes)
        if fault == "truncate":
            client.set(key, value[: len(value) // 2])
        elif fault == "corrupt":
            client.set(key, value[:-5] + bytes([value[-5] ^ 0x40]) + value[-4:])
        elif fault == "swap":  # another block's (valid) value under this key
            client.set(key, values[(i + 1) % len(values)])
        else:
            client.set(key, b"\x00" * 7)
    second = engine_for(server.url)
    assert_exact(second.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(second).stats.hits == 0
    assert remote(second).stats.invalid > 0


def test_a_dead_server_costs_at_most_one_timeout(server: RedisServer, client: redis.Redis) -> None:
    prompts = prompts_from(6, 3, 22, shared=8)
    engine = engine_for(server.url, timeout=0.1)
    server.stop()
    started = time.perf_counter()
    assert_exact(engine.generate(prompts, max_new_tokens=2, check_exactness=True))
    elapsed = time.perf_counter() - started
    stats = remote(engine).stats
    assert stats.errors >= 1 and stats.hits == 0
    assert remote(engine).flush()
    assert stats.write_errors > 0
    assert elapsed < 5.0
    server.start()


def test_slow_replies_are_misses_within_the_timeout(
    server: RedisServer, client: redis.Redis
) -> None:
    prompts = prompts_from(7, 2, 22, shared=0)
    first = engine_for(server.url)
    first.generate(prompts, max_new_tokens=2)
    assert remote(first).flush()
    proxy = FaultProxy(server.port)
    try:
        proxy.delay = 0.5
        slow = engine_for(proxy.url, timeout=0.05)
        started = time.perf_counter()
        assert_exact(slow.generate(prompts, max_new_tokens=2, check_exactness=True))
        assert time.perf_counter() - started < 2.0
        assert remote(slow).stats.errors >= 1 and remote(slow).stats.hits == 0
        proxy.delay = 0.0
        fine = engine_for(proxy.url)
        assert_exact(fine.generate(prompts, max_new_tokens=2, check_exactness=True))
        assert remote(fine).stats.hits > 0
    finally:
        proxy.close()


def test_a_full_write_queue_drops_and_counts(server: RedisServer, client: redis.Redis) -> None:
    proxy = FaultProxy(server.port)
    try:
        proxy.delay = 0.2
        engine = engine_for(proxy.url, timeout=1.0, remote_queue_size=1)
        assert_exact(
            engine.generate(prompts_from(8, 4, 22, 0), max_new_tokens=2, check_exactness=True)
        )
        stats = remote(engine).stats
        assert stats.dropped > 0
        assert remote(engine).flush(timeout=10)
        assert stats.writes + stats.dropped + stats.write_errors > 0
        assert remote(engine).pending() == 0
    finally:
        proxy.close()


def test_an_unexpected_write_failure_is_counted_and_the_writer_lives_on(
    server: RedisServer, client: redis.Redis
) -> None:
    # A store may raise what it never promised (a client library's own bug, a MemoryError while
    # encoding): the writer thread must count it and keep serving later writes, not die silently
    # and leave every later save queued forever.
    engine = engine_for(server.url)
    tier = remote(engine)
    real_put_many = tier.store.put_many

    def broken_put_many(values: object) -> None:
        raise RuntimeError("a client bug")

    tier.store.put_many = broken_put_many
    try:
        engine.generate(prompts_from(9, 2, 22, 0), max_new_tokens=2)
        assert tier.flush(timeout=10)
    finally:
        tier.store.put_many = real_put_many
    assert tier.stats.write_errors > 0 and tier.stats.writes == 0
    engine.generate(prompts_from(10, 2, 22, 0), max_new_tokens=2)
    assert tier.flush(timeout=10)
    assert tier.stats.writes > 0


def test_write_back_with_a_host_tier(server: RedisServer, client: redis.Redis) -> None:
    prompts = prompts_from(9, 6, 22, shared=4)
    engine = engine_for(server.url, remote_write="write_back", host_tier_bytes=1 << 16)
    assert_exact(engine.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(engine).flush()
    assert remote(engine).stats.writes > 0  # evicted from a 16-block pool
    second = engine_for(server.url, remote_write="write_back")
    assert_exact(second.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(second).stats.hits > 0


@settings(max_examples=12)
@given(
    num_blocks=st.integers(8, 20),
    host_blocks=st.sampled_from([0, 2, 8]),
    fault=st.sampled_from(["none", "corrupt", "truncate", "delete", "kill"]),
    fraction=st.floats(0.1, 1.0),
    write=st.sampled_from(["write_through", "write_back"]),
    seed=st.integers(0, 2**16),
)
def test_remote_faults_never_change_outputs(
    server: RedisServer,
    num_blocks: int,
    host_blocks: int,
    fault: str,
    fraction: float,
    write: str,
    seed: int,
) -> None:
    if server.process is None:
        server.start()
    raw = redis.Redis.from_url(server.url)
    raw.flushall()
    per_block = (
        MODEL.config.num_layers * 2 * 4 * MODEL.config.num_kv_heads * MODEL.config.head_dim * 4
    )
    host = host_blocks * per_block or None
    prompts = prompts_from(seed, 4, 18, shared=seed % 12)
    first = engine_for(server.url, num_blocks=num_blocks, remote_write=write, host_tier_bytes=host)
    assert_exact(first.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(first).flush()
    keys = raw.keys("prefixkv:*")
    chosen = keys[: max(1, int(len(keys) * fraction))] if keys else []
    for key in chosen:
        value = raw.get(key)
        assert isinstance(value, bytes)
        if fault == "corrupt":
            raw.set(key, value[:-1] + bytes([value[-1] ^ 1]))
        elif fault == "truncate":
            raw.set(key, value[:-3])
        elif fault == "delete":
            raw.delete(key)
    raw.close()
    if fault == "kill":
        server.stop()
    second = engine_for(server.url, num_blocks=num_blocks, remote_write=write, host_tier_bytes=host)
    assert_exact(second.generate(prompts, max_new_tokens=2, check_exactness=True))
    assert remote(second).flush()
    assert remote(second).pending() == 0
    assert second.cache.stats().blocks_in_use == 0
    if fault == "kill":
        assert remote(second).stats.hits == 0
        server.start()


_WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from prefixkv import Engine
    from prefixkv.tiers import RedisStore
    from tests.test_tiers import MODEL, prompts_from
    engine = Engine(MODEL, num_blocks=64, block_size=4, remote_store=RedisStore(sys.argv[1]))
    results = engine.generate(prompts_from(11, 2, 40, shared=32), max_new_tokens=4,
                              check_exactness=True)
    engine.tiers.remote.flush()
    print(json.dumps({
        "exact": all(r.tokens_match and r.max_logit_diff < 1e-3 for r in results),
        "remote_hits": engine.tiers.stats.remote_hit_blocks,
        "outputs": [r.output_token_ids for r in results],
    }))
    """
)


def test_two_engine_processes_share_one_server(server: RedisServer, client: redis.Redis) -> None:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}

    def run() -> dict:  # type: ignore[type-arg]
        out = subprocess.run(
            [sys.executable, "-c", _WORKER, server.url],
            capture_output=True, text=True, env=env, cwd=root, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    first, second = run(), run()
    assert first["exact"] and second["exact"]
    assert first["remote_hits"] == 0
    assert second["remote_hits"] >= 8  # the shared 32-token prefix, from the other process
    assert first["outputs"] == second["outputs"]


def test_redis_store_without_redis_py_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "from prefixkv.tiers import RedisStore\n"
        "from prefixkv.errors import MissingDependencyError\n"
        "try:\n    RedisStore('redis://127.0.0.1:1')\n"
        "except MissingDependencyError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "prefixkv[redis]" in out.stdout
    assert issubclass(MissingDependencyError, ImportError)


def test_demo_shows_every_tier(
    server: RedisServer, client: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixkv.apps.tiers_demo import main

    assert main(["--redis-url", server.url, "--prompt-tokens", "128"]) == 0
    out = capsys.readouterr().out
    for row in ("recompute", "device hit", "host hit", "remote hit"):
        assert row in out


def test_a_dropped_engine_stops_its_writer_thread(server: RedisServer, client: redis.Redis) -> None:
    import gc
    import threading

    def writers() -> int:
        return sum(t.name == "prefixkv-remote-writer" for t in threading.enumerate())

    gc.collect()
    time.sleep(0.05)
    before = writers()
    engine = engine_for(server.url)
    engine.generate(prompts_from(12, 1, 20, 0), max_new_tokens=1)
    assert writers() == before + 1
    del engine
    gc.collect()
    deadline = time.monotonic() + 5
    while writers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writers() == before
    assert client.keys("prefixkv:*")  # queued writes were made before the thread stopped
