"""PrefixKVConnector's host tier: the scheduler's index (`HostIndex`) in vLLM's real Scheduler,
each worker's pool (`HostPool`) on the CPU backend's real KV cache views, and the two kept
exact through vLLM's worker metadata.

A block served from the host is the block this engine computed, bit for bit, or the worker
reports it and vLLM recomputes it: a slot whose save was dropped, whose bytes were corrupted,
or that the scheduler believes holds another generation or another request's block is never
loaded. vLLM's own prefix cache is off in the engine tests (or the blocks are wiped), so a hit
can only come from the connector.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

# First: it imports vLLM under a filter for torch's own import-time deprecation warning.
from tests.vllm.connector_support import (
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    Engine,
    block_in_token_order,
    cpu_kv_caches,
    live_engine,
    make_request,
    prompt_of,
    run_to_completion,
    vllm_config,
)

# isort: split
from vllm.v1.request import RequestStatus

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector import PrefixKVWorkerMetadata
from prefixkv.integrations.vllm.connector_config import ConnectorSettings
from prefixkv.integrations.vllm.connector_host import HostIndex, HostPool, HostReport, HostSlot
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, RequestKeys
from prefixkv.integrations.vllm.connector_scheduler import BlockJob
from prefixkv.integrations.vllm.connector_worker import WorkerSide
from prefixkv.tiers import BlockRecord
from tests.redis_server import RedisServer, client, server  # noqa: F401 (fixtures)
from tests.vllm.connector_support import model_dir, shutdown_engines  # noqa: F401 (fixtures)

BS = 16
#: Bytes of one block in the engine tests (fp16, 2 layers, 2 KV heads, K and V of 32).
BLOCK_BYTES = 2 * len(LAYERS) * KV_HEADS * BS * 2 * HEAD_SIZE


def engine(model_dir: Path, url: str | None = None, **options: object) -> Engine:
    options.setdefault("host_tier_bytes", 16 * BLOCK_BYTES)
    options.setdefault("prefix_caching", False)
    return live_engine(vllm_config(model_dir, url, block_size=BS, **options))  # type: ignore[arg-type]


def serve(e: Engine, prompt: list[int]) -> list[torch.Tensor]:
    """Run `prompt` to completion, wait for the host digests; the KV of its full blocks."""
    request = make_request(prompt, block_size=BS)
    blocks: list[int] = []
    for output in run_to_completion(e, request):
        for new in output.scheduled_new_reqs:
            blocks = list(new.block_ids[0])
    assert host_pool(e).flush(10)
    if e.worker.remote is not None:
        assert e.worker.remote.flush(10)
    return [e.block_kv(block).clone() for block in blocks[: len(prompt) // BS]]


def wipe(e: Engine) -> None:
    """Zero the whole KV cache: a block that holds the saved KV afterwards was loaded."""
    for cache in e.kv_caches.values():
        cache.zero_()


def admit(e: Engine, prompt: list[int]) -> tuple[int, list[int]]:
    """Schedule `prompt` once: the tokens vLLM counts computed and its block ids."""
    request = make_request(prompt, block_size=BS, max_tokens=4)
    e.scheduler.add_request(request)
    output = e.step()
    [new] = output.scheduled_new_reqs
    return new.num_computed_tokens, list(new.block_ids[0])


def worker(e: Engine) -> WorkerSide:
    side = e.worker.worker_side
    assert side is not None
    return side


def host_pool(e: Engine) -> HostPool:
    pool = worker(e).host
    assert pool is not None
    return pool


def host_index(e: Engine) -> HostIndex:
    side = e.connector.scheduler_side
    assert side is not None and side.host is not None
    return side.host


# -- one engine: the second request loads what the first computed -------------------------------


def test_a_later_request_loads_its_prefix_from_the_host_exactly(model_dir: Path) -> None:
    prompt = prompt_of(5 * BS + 3)
    e = engine(model_dir)
    expected = serve(e, prompt)
    assert host_pool(e).stats.saved_blocks == 5
    wipe(e)
    computed, blocks = admit(e, prompt)
    assert computed == 5 * BS
    assert worker(e).stats.host_loaded_blocks == 5
    assert worker(e).take_load_errors() == set()
    for block, kv in zip(blocks[:5], expected, strict=True):
        assert torch.equal(e.block_kv(block), kv)


def test_the_host_is_probed_first_and_the_store_serves_the_rest(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(5 * BS + 3, seed=1)
    # Two slots: the host keeps the chain's first two blocks, the store all five.
    e = engine(model_dir, server.url, host_tier_bytes=2 * BLOCK_BYTES)
    expected = serve(e, prompt)
    assert len(host_index(e)) == 2
    wipe(e)
    computed, blocks = admit(e, prompt)
    assert computed == 5 * BS
    assert worker(e).stats.host_loaded_blocks == 2
    assert worker(e).stats.loaded_blocks == 5
    assert e.worker.remote is not None and e.worker.remote.stats.hits == 3
    for block, kv in zip(blocks[:5], expected, strict=True):
        assert torch.equal(e.block_kv(block), kv)


def test_corrupted_host_bytes_are_a_load_error_then_recomputed_and_forgotten(
    model_dir: Path,
) -> None:
    prompt = prompt_of(5 * BS + 1, seed=2)
    e = engine(model_dir)
    expected = serve(e, prompt)
    records = e.connector.scheduler_side.keys_per_rank[0].records(prompt, 5)  # type: ignore[union-attr]
    [_, _, victim, *_] = host_index(e).match(records)
    host_pool(e).slots[victim.slot].view(torch.int16)[0, 0, 3, 5] ^= 0x10
    wipe(e)

    request = make_request(prompt, block_size=BS, max_tokens=4)
    e.scheduler.add_request(request)
    output = e.step()
    [new] = output.scheduled_new_reqs
    assert new.num_computed_tokens == 5 * BS  # claimed from the index
    assert worker(e).stats.load_error_blocks == 3
    for block, kv in zip(list(new.block_ids[0])[:2], expected[:2], strict=True):
        assert torch.equal(e.block_kv(block), kv)
    # vLLM's recompute policy rolled the request back to the bad block; it lives on.
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 2 * BS
    # The worker's report reached the scheduler in the same step: the slot is forgotten.
    assert host_index(e).stats.forgotten_blocks == 1
    assert len(host_index(e).match(records)) == 2
    for _ in range(8):
        if request.request_id not in e.scheduler.requests:
            break
        e.step()
    # The recomputed blocks were saved again: a third request hits all five.
    assert host_pool(e).flush(10)
    wipe(e)
    assert admit(e, prompt)[0] == 5 * BS
    assert worker(e).stats.load_error_blocks == 3


def test_dropped_saves_are_forgotten_and_an_unverifiable_claim_is_a_load_error(
    model_dir: Path,
) -> None:
    prompt = prompt_of(4 * BS + 1, seed=3)
    e = engine(model_dir, queue_size=1)
    pool = host_pool(e)
    pool.close()  # the digest thread stops: the first save's digest never comes
    pool.DIGEST_WAIT = 0.2
    serve_request = make_request(prompt, block_size=BS)
    list(run_to_completion(e, serve_request))
    assert pool.stats.dropped == 3
    assert host_index(e).stats.forgotten_blocks == 3  # reported in the step that dropped them
    wipe(e)
    computed, blocks = admit(e, prompt)
    # Block 0's save was queued, never digested: claimed, then refused at load.
    assert computed == BS
    assert worker(e).stats.load_error_blocks == 1
    assert not e.block_kv(blocks[0]).any()


def test_another_salt_never_hits_the_host(model_dir: Path) -> None:
    prompt = prompt_of(3 * BS + 1, seed=4)
    e = engine(model_dir)
    serve(e, prompt)
    request = make_request(prompt, block_size=BS, max_tokens=2, cache_salt="tenant-b")
    e.scheduler.add_request(request)
    [new] = e.step().scheduled_new_reqs
    assert new.num_computed_tokens == 0


def test_a_full_host_pool_evicts_least_recently_used_chains(model_dir: Path) -> None:
    e = engine(model_dir, host_tier_bytes=4 * BLOCK_BYTES)
    first, second = prompt_of(2 * BS + 1, seed=5), prompt_of(2 * BS + 1, seed=6)
    serve(e, first)
    serve(e, second)
    third = prompt_of(2 * BS + 1, seed=7)
    wipe(e)
    assert admit(e, first)[0] == 2 * BS  # first is now the most recently used
    serve(e, third)  # evicts second's two blocks
    wipe(e)
    assert admit(e, first)[0] == 2 * BS
    assert host_index(e).stats.evicted_blocks == 2
    assert admit(e, second)[0] == 0


def test_vllms_connector_reset_empties_the_host_tier(model_dir: Path) -> None:
    prompt = prompt_of(3 * BS + 1, seed=8)
    e = engine(model_dir)
    serve(e, prompt)
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert len(host_index(e)) == 0
    wipe(e)
    assert admit(e, prompt)[0] == 0


# -- settings ------------------------------------------------------------------------------------


def test_host_tier_bytes_smaller_than_a_block_is_refused_by_name(model_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match="host_tier_bytes"):
        engine(model_dir, host_tier_bytes=BLOCK_BYTES - 1)


def test_no_tier_and_store_settings_without_a_store_are_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match="redis_url"):
        ConnectorSettings.from_extra_config({})
    with pytest.raises(InvalidInputError, match="'probe'"):
        ConnectorSettings.from_extra_config({"host_tier_bytes": 1 << 20, "probe": "length"})
    host_only = ConnectorSettings.from_extra_config({"host_tier_bytes": 1 << 20})
    assert host_only.redis_url is None and host_only.host_tier_bytes == 1 << 20


def test_worker_reports_aggregate_over_ranks() -> None:
    a = PrefixKVWorkerMetadata(HostReport([HostSlot(1, 4)]))
    b = PrefixKVWorkerMetadata(HostReport([HostSlot(2, 9)]))
    merged = a.aggregate(b)
    assert isinstance(merged, PrefixKVWorkerMetadata)
    assert merged.report.forget == [HostSlot(1, 4), HostSlot(2, 9)]


# -- the index alone ----------------------------------------------------------------------------


def _records(n: int, seed: int = 0) -> list[BlockRecord]:
    out: list[BlockRecord] = []
    for i in range(n):
        key = bytes([seed, i]) * 16
        out.append(BlockRecord(key, out[-1].key if out else None, (seed, i)))
    return out


def test_index_reports_about_an_older_generation_change_nothing() -> None:
    index = HostIndex(2)
    [old] = index.reserve(_records(1))
    index.forget([old])
    [new] = index.reserve(_records(1))
    assert new.slot == old.slot and new.generation != old.generation
    index.forget([old])  # late report about the content the slot held before
    assert index.match(_records(1)) == [new]


def test_index_keeps_a_chain_prefix_when_the_chain_is_longer_than_the_pool() -> None:
    index = HostIndex(3)
    slots = index.reserve(_records(5))
    assert len(slots) == 3
    assert index.match(_records(5)) == slots


def test_index_does_not_claim_a_record_with_other_tokens_under_its_key() -> None:
    index = HostIndex(2)
    index.reserve(_records(1))
    [record] = _records(1)
    assert index.match([BlockRecord(record.key, None, (99,))]) == []


# -- the worker's pool on the CPU backend's real KV views ----------------------------------------

BLOCK = 64
KERNEL_BLOCK = 32  # two kernel blocks per scheduler block, as the CPU backend splits them
NUM_BLOCKS = 8


def _worker_side(
    capacity: int, *, salt_rank: int = 0
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches, identity = cpu_kv_caches(
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        kernel_block_size=KERNEL_BLOCK,
        dtype=torch.float16,
        dtype_name="fp16",
    )
    side = WorkerSide(RequestKeys(identity, salt_rank), None, host_capacity=capacity)
    side.register_kv_caches(caches, LAYERS, NUM_BLOCKS)
    return side, caches


def _block(caches: dict[str, torch.Tensor], block_id: int) -> torch.Tensor:
    return block_in_token_order(caches, NUM_BLOCKS, block_id)


_MUTATIONS = st.sampled_from(["none", "flip", "swap", "stale", "foreign", "drop", "empty"])


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 4),
    victim=st.integers(0, 3),
    mutation=_MUTATIONS,
    byte=st.integers(0, 10**9),
    bit=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_host_round_trip_is_exact_or_reported(
    num_blocks: int, victim: int, mutation: str, byte: int, bit: int, seed: int
) -> None:
    """Save a request's blocks into the host pool, damage one slot (or nothing), load into
    a wiped cache: the blocks before the damage are the saved ones bit for bit, the damaged
    one and every later one are reported and left untouched, and the slot is reported to
    the scheduler."""
    victim %= num_blocks
    side, caches = _worker_side(capacity=6)
    try:
        generator = torch.Generator().manual_seed(seed)
        for cache in caches.values():
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
        tokens = torch.randint(0, 50000, (num_blocks * BLOCK,), generator=generator).tolist()
        source = [5, 2, 7, 0][:num_blocks]
        slots = tuple(HostSlot(s, 10 + s) for s in (4, 0, 3, 1)[:num_blocks])
        saved = [_block(caches, b).clone() for b in source]
        job = BlockJob("r", 0, tuple(source), tuple(tokens), None, None, slots)
        side.save([], [job])
        pool = side.host
        assert pool is not None and pool.flush(10)
        assert pool.take_report() is None

        planned = list(slots)
        if mutation == "flip":
            raw = pool.slots[slots[victim].slot].view(torch.uint8).view(-1)
            raw[byte % raw.numel()] ^= 1 << bit
        elif mutation == "swap" and num_blocks > 1:
            other = slots[(victim + 1) % num_blocks].slot
            pool.slots[slots[victim].slot] = pool.slots[other].clone()
        elif mutation == "stale":  # the scheduler planned another generation of the slot
            planned[victim] = HostSlot(slots[victim].slot, slots[victim].generation + 1)
        elif mutation == "foreign":  # the planned slot and generation, another request's block
            other_tokens = list(tokens[: (victim + 1) * BLOCK])
            other_tokens[victim * BLOCK] += 1
            other = BlockJob(
                "o", victim, (source[victim],), tuple(other_tokens), None, None, (slots[victim],)
            )
            side.save([], [other])
            assert pool.flush(10)
        elif mutation == "drop":
            pool._contents[slots[victim].slot] = None
        elif mutation == "empty":
            planned[victim] = HostSlot(5, 1)  # a slot never written
        damaged = mutation != "none" and not (mutation == "swap" and num_blocks == 1)

        for cache in caches.values():
            cache.zero_()
        targets = (6, 1, 3, 4)[:num_blocks]
        side.load([BlockJob("r", 0, targets, tuple(tokens), None, None, tuple(planned))])
        good = victim if damaged else num_blocks
        assert side.take_load_errors() == set(targets[good:])
        for target, kv in zip(targets[:good], saved, strict=False):
            assert torch.equal(_block(caches, target), kv)
        for target in targets[good:]:
            assert not _block(caches, target).any()
        report = pool.take_report()
        if damaged:
            assert report is not None and report.forget == [planned[victim]]
        else:
            assert report is None
    finally:
        side.close()


def test_a_full_digest_queue_drops_the_save_and_reports_it() -> None:
    side, _ = _worker_side(capacity=4)
    try:
        pool = side.host
        assert pool is not None
        pool.close()  # no digest thread: the queue only fills
        pool._digests._queue = type(pool._digests._queue)(maxsize=1)
        tokens = list(range(3 * BLOCK))
        slots = (HostSlot(0, 1), HostSlot(1, 2), HostSlot(2, 3))
        side.save([], [BlockJob("r", 0, (0, 1, 2), tuple(tokens), None, None, slots)])
        assert pool.stats.dropped == 2
        report = pool.take_report()
        assert report is not None and report.forget == [slots[1], slots[2]]
    finally:
        side.close()


# -- the scheduler's index and a worker's pool together ------------------------------------------


class IndexAndPool(RuleBasedStateMachine):
    """The scheduler's index and one worker's pool, driven as the connector drives them (the
    worker's reports delivered after every call), against a reference of the bytes last saved
    under each key; slots are corrupted at random. A load returns exactly the saved bytes of
    each block it serves, and after a failed one the index no longer claims the bad slot."""

    GEOMETRY = BlockGeometry(1, 1, 4, 2, 2, torch.float32)

    def __init__(self) -> None:
        super().__init__()
        self.index = HostIndex(3)
        self.pool = HostPool(self.GEOMETRY, 3, queue_size=2)
        self.truth: dict[bytes, torch.Tensor] = {}
        self.generator = torch.Generator().manual_seed(0)

    def _deliver(self) -> None:
        report = self.pool.take_report()
        if report is not None:
            self.index.forget(report.forget)

    @rule(chain=st.integers(0, 2), length=st.integers(1, 4))
    def save(self, chain: int, length: int) -> None:
        records = _records(length, chain)
        held = len(self.index.match(records))
        slots = self.index.reserve(records[held:])
        kv = torch.randn((len(slots), *self.GEOMETRY.value_shape), generator=self.generator)
        self.pool.save(slots, records[held : held + len(slots)], kv)
        for record, block in zip(records[held:], kv, strict=False):
            self.truth[record.key] = block.clone()
        self._deliver()

    @rule(chain=st.integers(0, 2), length=st.integers(1, 4))
    def load(self, chain: int, length: int) -> None:
        records = _records(length, chain)
        slots = self.index.match(records)
        served = self.pool.fetch(slots, records)
        for record, kv in zip(records, served, strict=False):
            assert torch.equal(kv, self.truth[record.key])
        self._deliver()
        if len(served) < len(slots):
            assert len(self.index.match(records)) == len(served)

    @rule(slot=st.integers(0, 2), byte=st.integers(0, 63), bit=st.integers(0, 7))
    def corrupt(self, slot: int, byte: int, bit: int) -> None:
        self.pool.slots[slot].view(torch.uint8).view(-1)[byte] ^= 1 << bit

    @rule()
    def flush(self) -> None:
        assert self.pool.flush(10)

    def teardown(self) -> None:
        self.pool.close()


IndexAndPool.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_index_and_pool = IndexAndPool.TestCase
