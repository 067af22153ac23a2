"""PrefixKVConnector inside vLLM's real Scheduler (mocked KVCacheConfig, fake model-runner
outputs) and on the CPU backend's real KV cache views, against a real redis-server on loopback.

Engine A computes (random KV stands in for a forward) and saves; a fresh engine B, sharing only
the store, must get A's blocks, bit for bit, or recompute: never other KV.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import redis
import torch

# First: it imports vLLM under a filter for torch's own import-time deprecation warning.
from tests.vllm.connector_support import (
    Engine,
    live_engine,
    make_request,
    prompt_of,
    run_to_completion,
    vllm_config,
    write_model_dir,
)

# isort: split
from vllm.v1.request import RequestStatus

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector import PrefixKVConnector
from tests.redis_server import RedisServer, client, server  # noqa: F401 (fixtures)
from tests.vllm.connector_support import model_dir, shutdown_engines  # noqa: F401 (fixtures)

BS = 16


def engine(model_dir: Path, url: str, **options: object) -> Engine:
    return live_engine(vllm_config(model_dir, url, block_size=BS, **options))  # type: ignore[arg-type]


def serve(a: Engine, prompt: list[int]) -> list[int]:
    """Run `prompt` to completion on `a`, wait for its saves; the block ids of its prompt."""
    request = make_request(prompt, block_size=BS)
    blocks: list[int] = []
    for output in run_to_completion(a, request):
        for new in output.scheduled_new_reqs:
            blocks = list(new.block_ids[0])
    assert a.worker.remote.flush(10)
    return blocks


def admit(b: Engine, prompt: list[int], **kwargs: object) -> tuple[int, list[int]]:
    """Schedule `prompt` on `b` once: the tokens it counts computed and its block ids."""
    request = make_request(prompt, block_size=BS, max_tokens=4, **kwargs)  # type: ignore[arg-type]
    b.scheduler.add_request(request)
    output = b.step()
    [new] = output.scheduled_new_reqs
    return new.num_computed_tokens, list(new.block_ids[0])


def test_a_fresh_engine_loads_the_first_engines_blocks_exactly(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(5 * BS + 3)
    a = engine(model_dir, server.url)
    a_blocks = serve(a, prompt)
    assert a.worker.remote.stats.writes == 5
    expected = [a.block_kv(block).clone() for block in a_blocks[:5]]

    b = engine(model_dir, server.url)
    computed, b_blocks = admit(b, prompt)
    # Every full prompt block, but the last token is always computed.
    assert computed == 5 * BS
    assert b.worker.worker_side is not None
    assert b.worker.worker_side.stats.loaded_blocks == 5
    for block, kv in zip(b_blocks[:5], expected, strict=True):
        assert torch.equal(b.block_kv(block), kv)


def test_a_prompt_ending_on_a_block_boundary_leaves_its_last_block_to_compute(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(4 * BS, seed=1)
    serve(engine(model_dir, server.url), prompt)
    computed, _ = admit(engine(model_dir, server.url), prompt)
    assert computed == 3 * BS


def test_only_the_shared_prefix_is_loaded(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    shared = prompt_of(3 * BS, seed=2)
    serve(engine(model_dir, server.url), shared + prompt_of(2 * BS + 5, seed=3))
    computed, _ = admit(engine(model_dir, server.url), shared + prompt_of(2 * BS + 5, seed=4))
    assert computed == 3 * BS


def _corrupt_payload(client: redis.Redis, key: bytes) -> None:
    value = bytearray(client.get(key))  # type: ignore[arg-type]
    value[-7] ^= 0x40
    client.set(key, bytes(value))


def _store_keys_in_chain_order(client: redis.Redis, a: Engine, prompt: list[int]) -> list[bytes]:
    side = a.connector.scheduler_side
    assert side is not None
    keys = side.keys_per_rank[0]
    records = keys.records(prompt, len(prompt) // BS)
    return [a.worker.remote.store_key(r.key).encode() for r in records]


def test_a_corrupted_value_is_a_miss_at_the_probe_and_never_a_load_error(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(5 * BS + 1, seed=5)
    a = engine(model_dir, server.url)
    serve(a, prompt)
    keys = _store_keys_in_chain_order(client, a, prompt)
    _corrupt_payload(client, keys[2])

    b = engine(model_dir, server.url)
    computed, _ = admit(b, prompt)
    assert computed == 2 * BS
    side = b.worker.worker_side
    assert side is not None and side.stats.load_error_blocks == 0
    assert b.connector.remote.stats.invalid == 1


def test_length_probe_claims_a_corrupted_value_then_vllm_recomputes_it(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(5 * BS + 1, seed=6)
    a = engine(model_dir, server.url)
    a_blocks = serve(a, prompt)
    expected = [a.block_kv(block).clone() for block in a_blocks[:2]]
    keys = _store_keys_in_chain_order(client, a, prompt)
    _corrupt_payload(client, keys[2])

    b = engine(model_dir, server.url, probe="length")
    request = make_request(prompt, block_size=BS, max_tokens=4)
    b.scheduler.add_request(request)
    output = b.step()
    [new] = output.scheduled_new_reqs
    assert new.num_computed_tokens == 5 * BS  # claimed on length alone
    side = b.worker.worker_side
    assert side is not None and side.stats.load_error_blocks == 3
    for block, kv in zip(list(new.block_ids[0])[:2], expected, strict=True):
        assert torch.equal(b.block_kv(block), kv)
    # The recompute policy rolled the request back to the first failed block; it lives on.
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 2 * BS
    output = b.step()
    assert output.num_scheduled_tokens[request.request_id] == len(prompt) - 2 * BS


def test_the_fail_policy_is_refused_by_name(model_dir: Path, server: RedisServer) -> None:
    with pytest.raises(InvalidInputError, match="kv_load_failure_policy"):
        engine(model_dir, server.url, policy="fail")


def test_unknown_extra_config_keys_are_refused_by_name(
    model_dir: Path, server: RedisServer
) -> None:
    with pytest.raises(InvalidInputError, match="namspace"):
        engine(model_dir, server.url, namspace="x")


@pytest.mark.parametrize("probe", ["verify", "length"])
@pytest.mark.parametrize(
    "change",
    ["dtype", "weights", "config", "salt", "namespace", "fingerprint"],
)
def test_another_model_dtype_salt_or_namespace_never_hits(
    change: str,
    probe: str,
    tmp_path: Path,
    model_dir: Path,
    server: RedisServer,
    client: redis.Redis,
) -> None:
    """Under the length probe the key alone keeps them apart (a value of another dtype of the
    same size has the same length): each setting must be in the key, not only in the value."""
    prompt = prompt_of(4 * BS + 1, seed=7)
    serve(engine(model_dir, server.url), prompt)
    options: dict[str, object] = {"probe": probe}
    kwargs: dict[str, object] = {}
    other_dir = model_dir
    if change == "dtype":
        options["dtype"] = "bfloat16"
    elif change == "weights":
        other_dir = write_model_dir(tmp_path / "other", weights=b"w2")
    elif change == "config":
        other_dir = write_model_dir(tmp_path / "other", hidden_size=64)
    elif change == "salt":
        kwargs["cache_salt"] = "tenant-b"
    elif change == "namespace":
        options["namespace"] = "other"
    else:
        options["model_fingerprint"] = "rev-2"
    computed, _ = admit(engine(other_dir, server.url, **options), prompt, **kwargs)
    assert computed == 0
    # The control: the same engine settings as A do hit.
    computed, _ = admit(engine(model_dir, server.url, probe=probe), prompt)
    assert computed == 4 * BS


def test_the_model_path_is_not_the_identity(
    tmp_path: Path, model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(3 * BS + 1, seed=8)
    serve(engine(model_dir, server.url), prompt)
    copy = write_model_dir(tmp_path / "copy-of-model")
    computed, _ = admit(engine(copy, server.url), prompt)
    assert computed == 3 * BS


def test_a_dead_store_is_a_miss_within_its_timeout_and_saves_do_not_wait(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(6 * BS + 1, seed=9)
    b = engine(model_dir, server.url, timeout=0.1, queue_size=1)
    server.stop()
    try:
        start = time.monotonic()
        computed, _ = admit(b, prompt)
        elapsed = time.monotonic() - start
    finally:
        server.start()
    assert computed == 0
    assert elapsed < 2.0
    stats = b.worker.remote.stats
    # Six blocks saved against a one-block queue and a dead store: dropped or failed, counted.
    assert b.worker.remote.flush(5)
    assert stats.dropped + stats.write_errors == 6
    assert b.connector.remote.stats.errors == 1


def test_a_value_replaced_between_probe_and_load_is_reported_not_loaded(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    """The race the recompute policy exists for: verified at the probe, gone at the load."""
    prompt = prompt_of(4 * BS + 2, seed=10)
    a = engine(model_dir, server.url)
    serve(a, prompt)
    keys = _store_keys_in_chain_order(client, a, prompt)
    b = engine(model_dir, server.url)
    request = make_request(prompt, block_size=BS, max_tokens=4)
    b.scheduler.add_request(request)
    output = b.scheduler.schedule()
    client.set(keys[1], client.get(keys[3]))  # another block's (valid) value under key 1
    b.worker.bind_connector_metadata(output.kv_connector_metadata)
    b.worker.start_load_kv(None)  # type: ignore[arg-type]
    [new] = output.scheduled_new_reqs
    assert b.worker.get_block_ids_with_load_errors() == set(list(new.block_ids[0])[1:4])


def test_header_fields_of_a_stored_value_name_the_block(
    model_dir: Path, server: RedisServer, client: redis.Redis
) -> None:
    prompt = prompt_of(2 * BS + 1, seed=11)
    a = engine(model_dir, server.url)
    serve(a, prompt)
    [first, _] = _store_keys_in_chain_order(client, a, prompt)
    value = client.get(first)
    assert value is not None and value[:4] == b"PKVB"
    ndim = value[7]
    shape = struct.unpack_from(f"<{ndim}I", value, 8)
    assert shape == (2, 2, BS, 64)  # layers, KV heads, block size, K and V head dims


def test_connector_class_is_what_vllm_loads(model_dir: Path, server: RedisServer) -> None:
    a = engine(model_dir, server.url)
    assert type(a.scheduler.connector) is PrefixKVConnector
    assert a.connector.requires_kv_delivery is False
