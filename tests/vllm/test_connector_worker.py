"""The connector's worker side on vLLM's real CPU KV cache views (`allocate_kv_cache`, the CPU
backend's layout, kernel blocks smaller than scheduler blocks), against a real redis-server:
what a worker loads is exactly what another saved, or it is reported; a hostile value in the
store (flipped, truncated, extended, another block's, another context's) is never loaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# First: it imports vLLM under a filter for torch's own import-time deprecation warning.
from tests.vllm.connector_support import (
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    block_in_token_order,
    cpu_kv_caches,
)

# isort: split

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector_config import ConnectorSettings
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, EngineIdentity, RequestKeys
from prefixkv.integrations.vllm.connector_scheduler import BlockJob
from prefixkv.integrations.vllm.connector_worker import WorkerSide
from prefixkv.tiers import RedisStore, RemoteTier
from tests.redis_server import RedisServer, server  # noqa: F401 (fixture)

BLOCK = 64
KERNEL_BLOCK = 32  # the CPU backend's kernels take multiples of 32: two per scheduler block
NUM_BLOCKS = 12


class Worker:
    def __init__(self, url: str, *, dtype: torch.dtype = torch.float16, rank: int = 0) -> None:
        self.caches, identity = cpu_kv_caches(
            block_size=BLOCK,
            num_blocks=NUM_BLOCKS,
            kernel_block_size=KERNEL_BLOCK,
            dtype=dtype,
            dtype_name=str(dtype),
        )
        self.store = RedisStore(url, timeout=1.0)
        self.remote = RemoteTier(self.store, namespace="worker-test")
        self.side = WorkerSide(RequestKeys(identity, rank), self.remote)
        self.side.register_kv_caches(self.caches, LAYERS, NUM_BLOCKS)

    def block(self, block_id: int) -> torch.Tensor:
        """Block `block_id` in token order, ``[layers, heads, block, head dims]``."""
        return block_in_token_order(self.caches, NUM_BLOCKS, block_id)

    def close(self) -> None:
        self.remote.close()
        self.store.close()


@pytest.fixture
def workers(server: RedisServer) -> Iterator[list[Worker]]:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    made: list[Worker] = []
    yield made
    for worker in made:
        worker.close()


def job(
    tokens: list[int], block_ids: list[int], first: int = 0, salt: str | None = None
) -> BlockJob:
    return BlockJob("r", first, tuple(block_ids), tuple(tokens), salt, None)


def tokens_for(num_blocks: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (num_blocks * BLOCK,), generator=generator).tolist()


def saved_by_a(server: RedisServer, workers: list[Worker], tokens: list[int]) -> Worker:
    a = Worker(server.url)
    workers.append(a)
    for cache in a.caches.values():
        cache.copy_(torch.randn(cache.shape).to(cache.dtype))
    a.side.save([job(tokens, [3, 7, 1])])
    assert a.remote.flush(10) and a.remote.stats.writes == 3
    return a


def test_kernel_split_blocks_round_trip_between_two_workers(
    server: RedisServer, workers: list[Worker]
) -> None:
    tokens = tokens_for(3)
    a = saved_by_a(server, workers, tokens)
    b = Worker(server.url)
    workers.append(b)
    b.side.load([job(tokens, [0, 5, 9])])
    assert b.side.take_load_errors() == set()
    for mine, theirs in ((0, 3), (5, 7), (9, 1)):
        assert torch.equal(b.block(mine), a.block(theirs))
    # Blocks nobody loaded into are untouched (zeros from allocation).
    assert not b.block(2).any()
    # The stored value is the scheduler block in the manager view's order (the kernel blocks
    # in sequence), not in the order of the kernel view it is held in.
    g = a.side.geometry
    records = a.side.keys.records(tokens, 3)
    [first, *_] = a.remote.fetch(records, a.side.keys.fingerprint, g.dtype, g.value_shape)
    assert torch.equal(first, a.block(3))


def test_a_load_from_the_middle_of_the_chain(server: RedisServer, workers: list[Worker]) -> None:
    tokens = tokens_for(3, seed=1)
    a = saved_by_a(server, workers, tokens)
    b = Worker(server.url)
    workers.append(b)
    b.side.load([job(tokens, [4, 6], first=1)])
    assert b.side.take_load_errors() == set()
    assert torch.equal(b.block(4), a.block(7)) and torch.equal(b.block(6), a.block(1))


@pytest.mark.parametrize("what", ["rank", "salt", "dtype"])
def test_another_rank_salt_or_dtype_loads_nothing(
    what: str, server: RedisServer, workers: list[Worker]
) -> None:
    tokens = tokens_for(3, seed=2)
    saved_by_a(server, workers, tokens)
    b = Worker(
        server.url,
        rank=1 if what == "rank" else 0,
        dtype=torch.bfloat16 if what == "dtype" else torch.float16,
    )
    workers.append(b)
    b.side.load([job(tokens, [0, 1, 2], salt="other" if what == "salt" else None)])
    assert b.side.take_load_errors() == {0, 1, 2}
    assert not any(b.block(i).any() for i in range(3))


_MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**9), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(1, 10**9), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 64), st.just(0)),
    st.tuples(st.just("swap"), st.integers(0, 2), st.just(0)),
    st.tuples(st.just("garbage"), st.integers(0, 4096), st.just(0)),
)


@settings(max_examples=25, deadline=None)
@given(victim=st.integers(0, 2), mutation=_MUTATIONS)
def test_a_hostile_value_is_reported_never_loaded(
    server: RedisServer, victim: int, mutation: tuple[str, int, int]
) -> None:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    made: list[Worker] = []
    try:
        tokens = tokens_for(3, seed=3)
        a = saved_by_a(server, made, tokens)
        keys = [a.remote.store_key(r.key) for r in a.side.keys.records(tokens, 3)]
        value = bytearray(client.get(keys[victim]) or b"")
        kind, amount, bit = mutation
        if kind == "flip":
            value[amount % len(value)] ^= 1 << bit
        elif kind == "truncate":
            value = value[: amount % len(value)]
        elif kind == "extend":
            value += bytes(amount)
        elif kind == "swap":
            other = keys[amount] if amount != victim else keys[(victim + 1) % 3]
            value = bytearray(client.get(other) or b"")
        else:
            value = bytearray(torch.randint(0, 256, (amount,), dtype=torch.uint8).numpy().tobytes())
        client.set(keys[victim], bytes(value))

        b = Worker(server.url)
        made.append(b)
        b.side.load([job(tokens, [0, 1, 2])])
        errors = b.side.take_load_errors()
        assert errors == set(range(victim, 3))
        for mine, theirs in zip(range(victim), (3, 7, 1), strict=False):
            assert torch.equal(b.block(mine), a.block(theirs))
        assert not any(b.block(i).any() for i in range(victim, 3))
    finally:
        for worker in made:
            worker.close()
        client.close()


def test_a_full_queue_drops_saves_without_waiting(server: RedisServer) -> None:
    worker = Worker(server.url)
    try:
        worker.remote.close()  # no writer: the queue only fills
        worker.remote = RemoteTier(worker.store, namespace="worker-test", queue_size=2)
        worker.remote.close()
        worker.side.remote = worker.remote
        worker.side.save([job(tokens_for(3, seed=4), [0, 1, 2])])
        assert worker.remote.stats.dropped >= 1
        assert worker.side.stats.queued_save_blocks == 3
    finally:
        worker.close()


def test_a_cache_view_of_another_shape_is_refused_by_name(server: RedisServer) -> None:
    worker = Worker(server.url)
    try:
        caches = dict(worker.caches)
        caches[LAYERS[1]] = torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE + 2)
        with pytest.raises(InvalidInputError, match=LAYERS[1]):
            worker.side.register_kv_caches(caches, LAYERS, NUM_BLOCKS)
    finally:
        worker.close()


@given(
    name=st.sampled_from(
        [
            "redis_url",
            "host_tier_bytes",
            "namespace",
            "timeout",
            "ttl",
            "queue_size",
            "retry_after",
            "max_probe_blocks",
            "probe",
            "model_fingerprint",
            "nmespace",
        ]
    ),
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.floats(allow_nan=True),
        st.text(max_size=8),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_extra_config_is_accepted_or_refused_by_name(name: str, value: object) -> None:
    extra = {"redis_url": "redis://127.0.0.1:1/0", name: value}
    try:
        settings_ = ConnectorSettings.from_extra_config(extra)
    except InvalidInputError as exc:
        assert name in str(exc)
    else:
        assert getattr(settings_, name) == value


def test_the_kv_reader_is_in_the_key() -> None:
    """Backends read a block's bytes differently: the same tokens on another platform or
    backend must be another key, or a CUDA engine would read CPU_ATTN's bytes as its own."""
    geometry = BlockGeometry(2, KV_HEADS, BLOCK, HEAD_SIZE, HEAD_SIZE, torch.float16)

    def first_key(reader: str) -> bytes:
        identity = EngineIdentity("sha256:x", "cfg", "f16", "auto", "None", 1, 1, reader, geometry)
        return RequestKeys(identity, 0).records(tokens_for(1), 1)[0].key

    keys = {
        first_key(r) for r in ("cpu/CPU_ATTN/0.32", "cuda/FLASH_ATTN/0.32", "cpu/CPU_ATTN/0.33")
    }
    assert len(keys) == 3
