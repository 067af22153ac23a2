"""KV event recording: what is recorded, what is withheld, overflow, and optional packages.
Both cores record events; `test_run_cache.py` checks that they record the same ones."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import InvalidInputError, MissingDependencyError
from prefixkv.events import EventRecorder, PrefixIndex, hash64
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

CORES = pytest.mark.parametrize("core", ["blocks", "runs"])


def cache(num_blocks: int = 8, block_size: int = 2, core: str = "blocks") -> PrefixCache:
    context = CacheContext(model_id="ev", block_size=block_size)
    return PrefixCache(num_blocks, context=context, core=core)


def serve(c: PrefixCache, tokens: list[int], **keys: str) -> None:
    request = c.begin(tokens, **keys)  # type: ignore[arg-type]
    c.commit(request, len(tokens))
    c.finish(request)


@CORES
def test_stored_events_carry_the_block_keys_without_rehashing(core: str) -> None:
    c = cache(core=core)
    recorder = EventRecorder(c)
    serve(c, [1, 2, 3, 4, 5], adapter="lora-a")
    (event,) = recorder.drain().events
    assert event.kind == "stored"
    assert event.keys == c.block_keys([1, 2, 3, 4], adapter="lora-a")
    assert event.hashes64 == [hash64(k) for k in event.keys]
    assert event.parent is None and event.token_ids == [1, 2, 3, 4]
    assert event.adapter == b"lora-a" and all(event.extras)
    # A continuation chains on its parent's key.
    request = c.begin([1, 2, 3, 4, 7, 8], adapter="lora-a")
    c.commit(request, 6)
    (event,) = recorder.drain().events
    assert event.parent == c.block_keys([1, 2, 3, 4], adapter="lora-a")[-1]
    assert event.keys == c.block_keys([1, 2, 3, 4, 7, 8], adapter="lora-a")[2:]


@CORES
def test_deduplicated_commits_publish_nothing_and_evictions_are_removals(core: str) -> None:
    c = cache(num_blocks=4, core=core)
    recorder = EventRecorder(c)
    a, b = c.begin([1, 2, 3, 4]), c.begin([1, 2, 3, 4])
    c.commit(a, 4)
    c.commit(b, 4)  # duplicates: no new blocks
    c.finish(a)
    c.finish(b)
    assert [e.kind for e in recorder.drain().events] == ["stored"]
    serve(c, [9, 9, 9, 9, 9, 9, 9, 9])  # needs the whole pool: evicts both blocks
    kinds = [e.kind for e in recorder.drain().events]
    assert kinds == ["removed", "stored"]


@CORES
@pytest.mark.parametrize("policy", ["all", "unsalted", "none"])
def test_token_ids_policy_for_salted_tenants(core: str, policy: str) -> None:
    c = cache(core=core)
    recorder = EventRecorder(c, token_ids=policy)  # type: ignore[arg-type]
    serve(c, [1, 2, 3, 4], salt="tenant-a")
    serve(c, [5, 6], adapter="x")
    salted, plain = recorder.drain().events
    assert salted.token_ids == ([1, 2, 3, 4] if policy == "all" else [])
    assert plain.token_ids == ([] if policy == "none" else [5, 6])
    # Keys are published either way; the salt itself never is (it only changes the keys).
    assert salted.keys == c.block_keys([1, 2, 3, 4], salt="tenant-a")


@CORES
def test_a_slow_consumer_overflows_into_a_counted_resynchronisation(core: str) -> None:
    c = cache(num_blocks=64, block_size=1, core=core)
    recorder = EventRecorder(c, capacity=4)
    for token in range(10):
        serve(c, [100 + token])
    drain = recorder.drain()
    assert drain.resynchronised and drain.overflows == 1
    assert drain.dropped_blocks >= 5
    assert drain.events[0].kind == "cleared"
    assert sorted(k for e in drain.events[1:] for k in e.keys) == sorted(recorder.cached_keys())
    assert recorder.counters().dropped_blocks == drain.dropped_blocks
    # Back to normal afterwards.
    serve(c, [7])
    assert not recorder.drain().resynchronised


@CORES
def test_enabling_on_a_warm_cache_snapshots_it_and_clear_is_one_event(core: str) -> None:
    c = cache(core=core)
    serve(c, [1, 2, 3, 4])
    recorder = EventRecorder(c)
    drain = recorder.drain()
    assert drain.resynchronised and drain.dropped_blocks == 0
    assert [e.kind for e in drain.events] == ["cleared", "stored", "stored"]
    c.clear()
    assert [e.kind for e in recorder.drain().events] == ["cleared"]
    recorder.close()
    assert not recorder.enabled
    serve(c, [1, 2])
    assert recorder.drain().events == []


def test_bad_arguments_are_typed_errors() -> None:
    c = cache()
    with pytest.raises(InvalidInputError):
        EventRecorder(c, capacity=0)
    with pytest.raises(InvalidInputError):
        EventRecorder(c, token_ids="some")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        EventRecorder(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        PrefixIndex(["a", "a"])
    with pytest.raises(InvalidInputError):
        PrefixIndex([f"i{n}" for n in range(65)])
    index = PrefixIndex(["a"])
    with pytest.raises(InvalidInputError):
        index.store("b", [1])
    with pytest.raises(InvalidInputError):
        index.score([-1])  # type: ignore[list-item]
    from prefixkv.events import KVEventPublisher

    with pytest.raises(InvalidInputError):
        KVEventPublisher(c, "tcp://127.0.0.1:*", hashes="hex")  # type: ignore[arg-type]


def test_importing_prefixkv_imports_no_optional_package() -> None:
    code = (
        "import sys, prefixkv, prefixkv.events; "
        "from prefixkv import PrefixCache; "
        "bad = {'zmq', 'msgspec', 'prometheus_client', 'torch'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("blocked", "name", "extra"),
    [
        ("zmq", "KVEventPublisher", "events"),
        ("msgspec", "EventSubscriber", "events"),
    ],
)
def test_a_missing_extra_is_a_missing_dependency_error(
    monkeypatch: pytest.MonkeyPatch, blocked: str, name: str, extra: str
) -> None:
    import prefixkv.events as events

    for module in list(sys.modules):
        if module.startswith(("prefixkv.events.publisher", "prefixkv.events.subscriber")) or (
            module.startswith("prefixkv.events.wire")
        ):
            monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, blocked, None)
    monkeypatch.delitem(events.__dict__, name, raising=False)
    with pytest.raises(MissingDependencyError, match=rf"prefixkv\[{extra}\]"):
        getattr(events, name)


def test_a_publisher_without_subscribers_never_blocks() -> None:
    from prefixkv.events import KVEventPublisher

    c = cache(num_blocks=256, block_size=1)
    with KVEventPublisher(c, "tcp://127.0.0.1:*", hwm=1) as publisher:
        start = time.perf_counter()
        for token in range(200):
            serve(c, [token])
            publisher.flush()
        assert time.perf_counter() - start < 5
        assert publisher.socket.next_sequence == 200
