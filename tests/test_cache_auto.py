"""`PrefixCache(core="auto")`, the default: the run core where it serves the settings, and a
move to the block core at the first low-level block call while the cache is still empty. The
move must be invisible but for speed: the same answers, block ids, evicted blocks, KV events
and counters as a cache built with ``core="blocks"``. Once the run core is in use, a low-level
call is refused by name and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import PrefixKVError, UnsupportedFeatureError
from prefixkv.events import EventRecorder

BS = 4


def test_auto_picks_the_run_core_where_it_serves_the_settings() -> None:
    assert PrefixCache(8, block_size=BS).core == "runs"
    assert PrefixCache(8, block_size=BS, full_hit="reuse_last_block").core == "runs"
    assert PrefixCache(8, block_size=BS, sliding_window=8).core == "blocks"
    explicit = PrefixCache(8, block_size=BS, sliding_window=8, window_release="explicit")
    assert explicit.core == "blocks"
    assert PrefixCache(8, block_size=BS, _key_bits=8).core == "blocks"
    assert PrefixCache(8, block_size=BS, core="blocks").core == "blocks"
    assert "core='runs'" in repr(PrefixCache(8, block_size=BS))


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        value = call()
    except PrefixKVError as error:
        return ("error", type(error).__name__)
    if hasattr(value, "block_ids"):
        return ("match", value.num_cached_tokens, value.full_hit, list(value.block_ids))
    return ("ok", value)


def _events(recorder: EventRecorder) -> list[Any]:
    drain = recorder.drain()
    return [(e.kind, e.keys, e.parent, e.token_ids) for e in drain.events]


def test_a_fresh_auto_cache_moves_to_the_block_core_carrying_its_settings() -> None:
    """Lookups, the eviction log and an event recorder set up on the run core carry over."""
    caches = [PrefixCache(4, block_size=BS), PrefixCache(4, block_size=BS, core="blocks")]
    recorders = [EventRecorder(cache) for cache in caches]
    for cache in caches:
        cache.set_eviction_log(True)
        assert cache.lookup(list(range(8))).num_cached_tokens == 0
    assert caches[0].core == "runs"
    answers: list[list[Any]] = [[], []]
    for cache, seen in zip(caches, answers, strict=True):
        blocks = cache.allocate(2)
        seen.append(blocks)
        seen.append(cache.commit_blocks(list(range(8)), blocks))
        cache.release(blocks)
        # The pair is found and released; four blocks then evict it, leaf first.
        found = cache.match_and_acquire(list(range(9)))
        seen.append((found.num_cached_tokens, found.full_hit, list(found.block_ids)))
        cache.release(found.block_ids)
        more = cache.allocate(4)
        seen.append((more, cache.drain_evicted()))
        cache.release(more)
        seen.append(cache.lookup(list(range(8))).num_cached_tokens)
    assert caches[0].core == "blocks"
    assert answers[0] == answers[1]
    auto_events, block_events = (_events(recorder) for recorder in recorders)
    assert auto_events == block_events
    assert {event[0] for event in auto_events} >= {"stored", "removed"}
    stats = [cache.stats() for cache in caches]
    for name in ("lookups", "lookup_tokens", "hit_tokens", "evictions", "committed_blocks"):
        assert getattr(stats[0], name) == getattr(stats[1], name), name
    assert repr(stats[0]) == repr(stats[1])
    caches[0].check_invariants()


@pytest.mark.parametrize("used", ["begin", "finished", "pin", "add_request"])
def test_an_auto_cache_in_use_refuses_low_level_calls_and_changes_nothing(used: str) -> None:
    cache = PrefixCache(8, block_size=BS)
    prompt = list(range(10))
    if used == "add_request":
        cache.add_request("r", prompt)
    else:
        request = cache.begin(prompt)
        cache.commit(request, len(prompt))
        if used != "begin":
            cache.finish(request)
        if used == "pin":
            cache.pin(prompt)

    def state() -> tuple[int, ...]:
        stats = cache.stats()
        names = ("blocks_free", "blocks_cached", "blocks_in_use", "blocks_pinned")
        names += ("requests_live", "committed_blocks", "lookups")
        return tuple(getattr(stats, name) for name in names)

    before = state()
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("match_and_acquire", lambda: cache.match_and_acquire(prompt)),
        ("allocate", lambda: cache.allocate(1)),
        ("commit_blocks", lambda: cache.commit_blocks(prompt[:4], [0])),
        ("release", lambda: cache.release([0])),
    ]
    for name, call in calls:
        with pytest.raises(UnsupportedFeatureError, match=f'{name} .*core="blocks"'):
            call()
    assert state() == before
    assert cache.core == "runs"
    assert cache.lookup(prompt).num_cached_tokens == (0 if used == "add_request" else 8)
    cache.check_invariants()


def test_a_context_switch_before_the_move_keys_the_block_core_under_the_new_context() -> None:
    first, second = (
        CacheContext(block_size=BS, model_id="a"),
        CacheContext(block_size=BS, model_id="b"),
    )
    auto, blocks = PrefixCache(4, context=first), PrefixCache(4, context=first, core="blocks")
    for cache in (auto, blocks):
        cache.set_context(second)
        ids = cache.allocate(1)
        cache.commit_blocks(list(range(4)), ids)
        cache.release(ids)
    assert auto.core == "blocks"
    assert auto.context == second
    assert auto.block_keys(list(range(4))) == blocks.block_keys(list(range(4)))
    assert auto.lookup(list(range(5))).num_cached_tokens == 4
    other = PrefixCache(4, context=first, core="blocks")
    assert auto.block_keys(list(range(4))) != other.block_keys(list(range(4)))


low_level_step = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 5)),
    st.tuples(st.just("release_all"), st.just(0)),
    st.tuples(st.just("commit"), st.integers(0, 3)),
    st.tuples(st.just("match"), st.integers(0, 3)),
    st.tuples(st.just("lookup"), st.integers(0, 3)),
)


@given(steps=st.lists(low_level_step, max_size=25))
def test_low_level_calls_answer_alike_on_auto_and_blocks(steps: list[tuple[str, int]]) -> None:
    """A low-level caller of the default cache gets exactly what ``core="blocks"`` gives."""
    prompts = [[p] * 6 + list(range(p, p + 6)) for p in range(4)]
    caches = [PrefixCache(6, block_size=BS), PrefixCache(6, block_size=BS, core="blocks")]
    held: list[list[int]] = [[], []]
    answers: list[list[Any]] = [[], []]
    for what, n in steps:
        for cache, mine, seen in zip(caches, held, answers, strict=True):
            if what == "allocate":
                out = _outcome(lambda c=cache, k=n: c.allocate(k))
                if out[0] == "ok":
                    mine.extend(out[1])
            elif what == "release_all":
                out = _outcome(lambda c=cache, b=list(mine): c.release(b))
                mine.clear()
            elif what == "commit":
                ids = mine[:3]
                out = _outcome(lambda c=cache, b=ids, k=n: c.commit_blocks(prompts[k][:12], b))
            elif what == "match":
                out = _outcome(lambda c=cache, k=n: c.match_and_acquire(prompts[k]))
                if out[0] == "match":
                    mine.extend(out[3])
            else:
                out = _outcome(lambda c=cache, k=n: c.lookup(prompts[k]))
            seen.append(out)
    assert answers[0] == answers[1]
    assert repr(caches[0].stats()) == repr(caches[1].stats())
    for cache in caches:
        cache.check_invariants()
