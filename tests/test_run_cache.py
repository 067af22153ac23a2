"""`PrefixCache(core="runs")`, the cache on runs of blocks (issue 24), against the default
core through the public API: a state machine drives both with the same calls (the request
cycle, the step API with chunks, lookahead, watermarks, drafts, truncation, preemption, caps,
ids given and picked, bad input) and every call must answer alike, the same result or the same
exception class, with the same block tables and block counts after it, and the same KV events
(drained after every step, event for event: keys, parents, tokens, adapters, overflows and the
snapshots that resynchronise them). The Rust suite checks
the core type call for call far harder (`run_cache/step_tests.rs`); this checks the binding,
the request map and the conversions. Then what the run core does not serve yet: refused by
name, nothing changed."""

from __future__ import annotations

import faulthandler
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import (
    InvalidInputError,
    PrefixKVError,
    UnknownRequestError,
    UnsupportedFeatureError,
)
from prefixkv.events import EventRecorder

BLOCK_SIZE = 4
VOCAB = 40
Items = list[tuple[int, int, str]] | None


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call answered: its result, or its exception's class (never a crash)."""
    try:
        return ("ok", call())
    except PrefixKVError as error:
        return ("error", type(error).__name__)


def answer(value: Any) -> Any:
    """A comparable form of a call's answer (`Request`, `Slots` and `PrefixMatch` by field)."""
    fields = ("id", "block_table", "block_ids", "num_cached_tokens", "num_computed_tokens")
    fields += ("full_hit", "last_token_shared", "num_prompt_tokens")
    if hasattr(value, "num_cached_tokens"):
        return tuple(getattr(value, f, None) for f in fields)
    if hasattr(value, "num_blocks"):  # a `Pin`
        return ("pin", value.id, value.num_blocks)
    return value


def drained(recorder: EventRecorder) -> tuple[Any, ...]:
    """A drain, comparable: every event's fields, then the flag and counters."""
    drain = recorder.drain()
    events = [(e.kind, e.keys, e.parent, e.token_ids, e.adapter, e.extras) for e in drain.events]
    counts = (drain.recorded_blocks, drain.dropped_blocks, drain.overflows)
    return (events, drain.resynchronised, counts)


#: Multimodal items: none mostly, else one or two from a few placements and two contents, so
#: that prompts share them (hits through them) or differ only by them (equal placeholder tokens,
#: other image: never a hit).
ITEMS = st.one_of(
    st.none(),
    st.none(),
    st.lists(
        st.tuples(
            st.sampled_from([0, 2, 4, 5, 8]),
            st.sampled_from([1, 4, 6]),
            st.sampled_from(["img-a", "img-b"]),
        ),
        min_size=1,
        max_size=2,
    ),
)


@st.composite
def prompts(draw: st.DrawFn, seen: list[list[int]]) -> list[int]:
    """A cut of a prompt seen before, then tokens from a small vocabulary."""
    base = draw(st.sampled_from(seen))
    if draw(st.integers(0, 3)) == 0 and len(base) >= BLOCK_SIZE:
        # Whole blocks of a prompt seen before, and nothing after: a full hit when they are
        # still cached (both `full_hit` modes shape it; random cuts rarely land there).
        return base[: len(base) // BLOCK_SIZE * BLOCK_SIZE]
    prompt = base[: draw(st.integers(0, len(base)))]
    prompt += draw(st.lists(st.integers(0, 9), max_size=3 * BLOCK_SIZE))
    return prompt


class BothCores(RuleBasedStateMachine):
    """The same calls on a `core="blocks"` and a `core="runs"` cache."""

    def __init__(self) -> None:
        super().__init__()
        context = CacheContext(block_size=BLOCK_SIZE)
        self.num_blocks = 12
        self.blocks = PrefixCache(self.num_blocks, context=context, vocab_size=VOCAB, core="blocks")
        self.runs = PrefixCache(self.num_blocks, context=context, vocab_size=VOCAB, core="runs")
        # The eviction log a host tier drains: the same blocks, in the same order.
        for cache in (self.blocks, self.runs):
            cache.set_eviction_log(True)
        self.ids: list[int | str] = []
        self.seen: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
        self.next_id = 0
        # Pin ids, the same from both cores (each counts from 1), live or dropped by a reset.
        self.pins: list[int] = []
        # Live requests scheduled (given slots since added or preempted): the run core resets
        # only while none is.
        self.scheduled: set[int | str] = set()
        # Each core's event recorder, while events are on.
        self.recorders: list[EventRecorder] = []

    @initialize(
        full_hit=st.sampled_from(["recompute_last_block", "reuse_last_block"]),
        events=st.booleans(),
    )
    def serve_full_hits(self, full_hit: str, events: bool) -> None:
        # Both modes: a full hit's last block recomputed into a private block, or held shared
        # with only the last token computed (`last_token_shared`).
        context = CacheContext(block_size=BLOCK_SIZE)
        self.blocks, self.runs = (
            PrefixCache(
                self.num_blocks, context=context, vocab_size=VOCAB, full_hit=full_hit, core=core
            )
            for core in ("blocks", "runs")
        )
        for cache in (self.blocks, self.runs):
            cache.set_eviction_log(True)
        if events:
            self.recorders = [EventRecorder(c) for c in (self.blocks, self.runs)]

    @rule(
        on=st.booleans(),
        capacity=st.integers(1, 12),
        token_ids=st.sampled_from(["all", "unsalted", "none"]),
    )
    def events(self, on: bool, capacity: int, token_ids: str) -> None:
        """Events on (again: a snapshot of what is cached follows; a small queue overflows
        into a resynchronisation) or off."""
        for recorder in self.recorders:
            recorder.close()
        self.recorders = []
        if on:
            self.recorders = [
                EventRecorder(c, capacity=capacity, token_ids=token_ids)  # type: ignore[arg-type]
                for c in (self.blocks, self.runs)
            ]

    def both(self, what: str, call: Callable[[PrefixCache], Any]) -> tuple[str, Any]:
        expected = outcome(lambda: call(self.blocks))
        got = outcome(lambda: call(self.runs))
        assert (got[0], answer(got[1])) == (expected[0], answer(expected[1])), what
        return got

    def prompt(self, data: st.DataObject) -> list[int]:
        prompt: list[int] = data.draw(prompts(self.seen))
        if data.draw(st.integers(0, 19)) == 0:
            prompt.append(VOCAB)  # outside the vocabulary: refused by both
        return prompt

    def request(self, data: st.DataObject) -> int | str:
        if not self.ids or data.draw(st.integers(0, 15)) == 0:
            return "never-added"
        return data.draw(st.sampled_from(self.ids))

    @rule(
        data=st.data(),
        salt=st.sampled_from([None, "tenant"]),
        adapter=st.sampled_from([None, None, "lora-a", "lora-b"]),
        priority=st.integers(-1, 1),
        items=ITEMS,
    )
    def add_request(
        self,
        data: st.DataObject,
        salt: str | None,
        adapter: str | None,
        priority: int,
        items: Items,
    ) -> None:
        prompt = self.prompt(data)
        rid: int | str = f"r{self.next_id}" if self.next_id % 2 else self.next_id + 1000
        self.next_id += 1
        if self.ids and data.draw(st.integers(0, 9)) == 0:
            rid = self.ids[0]  # a live id again: refused by both
        kind, _ = self.both(
            "add_request",
            lambda c: c.add_request(
                rid, prompt, salt=salt, adapter=adapter, priority=priority, multimodal=items
            ),
        )
        if kind == "ok":
            self.ids.append(rid)
            self.seen.append(prompt)

    @rule(
        data=st.data(),
        salt=st.sampled_from([None, "tenant"]),
        adapter=st.sampled_from([None, None, "lora-a"]),
        items=ITEMS,
    )
    def begin(
        self, data: st.DataObject, salt: str | None, adapter: str | None, items: Items
    ) -> None:
        prompt = self.prompt(data)
        as_numpy = data.draw(st.booleans())
        tokens: Any = np.array(prompt, dtype=np.int64) if as_numpy else prompt
        kind, request = self.both(
            "begin", lambda c: c.begin(tokens, salt=salt, adapter=adapter, multimodal=items)
        )
        if kind == "ok":
            self.ids.append(request.id)
            self.scheduled.add(request.id)
            self.seen.append(prompt)

    @rule(data=st.data(), salt=st.sampled_from([None, "tenant"]), items=ITEMS)
    def serve(self, data: st.DataObject, salt: str | None, items: Items) -> None:
        # A whole request (begun, its prompt's KV committed, finished): it leaves its blocks
        # cached, so that later prompts hit, fully too (the other rules rarely commit a prompt
        # whole).
        prompt = self.prompt(data)
        kind, request = self.both(
            "serve: begin", lambda c: c.begin(prompt, salt=salt, multimodal=items)
        )
        if kind == "ok":
            self.both("serve: commit", lambda c: c.commit(request.id, len(prompt)))
            self.both("serve: finish", lambda c: c.finish(request.id))
            self.seen.append(prompt)

    @rule(data=st.data(), adapter=st.sampled_from([None, "lora-a", "lora-b"]), items=ITEMS)
    def lookup(self, data: st.DataObject, adapter: str | None, items: Items) -> None:
        prompt = self.prompt(data)
        self.both("lookup", lambda c: c.lookup(prompt, adapter=adapter, multimodal=items))
        self.both("block_keys", lambda c: c.block_keys(prompt, adapter=adapter, multimodal=items))

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def allocate_slots(self, data: st.DataObject) -> None:
        rid = self.request(data)
        if data.draw(st.booleans()):
            self.both("start_position", lambda c: c.start_position(rid))
        known = 0
        if rid in self.ids:
            known = self.runs.num_tokens(rid) - self.runs.start_position(rid)
        # Mostly what the request has (a chunked prefill, or all of it), now and then more.
        n = data.draw(st.one_of(st.integers(0, known), st.just(known), st.integers(0, 14)))
        lookahead = data.draw(st.sampled_from([0, 0, 0, 3]))
        watermark = data.draw(st.sampled_from([0, 0, 0, 2]))
        self.both("can_allocate_slots", lambda c: c.can_allocate_slots(rid, n))
        self.both("blocks_needed", lambda c: c.blocks_needed(rid, n))
        kind, _ = self.both(
            "allocate_slots",
            lambda c: c.allocate_slots(
                rid, n, num_lookahead_tokens=lookahead, watermark_blocks=watermark
            ),
        )
        if kind == "ok":
            self.scheduled.add(rid)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        rid = self.request(data)
        written = 0
        if rid in self.ids:
            slots = len(self.runs.block_table(rid)) * BLOCK_SIZE
            written = min(self.runs.num_tokens(rid), slots)
        # Mostly every token with a slot (the step's KV written), now and then anything.
        n = data.draw(st.one_of(st.just(written), st.just(written), st.integers(0, 30)))
        self.both("commit", lambda c: c.commit(rid, n))

    @rule(
        data=st.data(),
        salt=st.sampled_from([None, "tenant"]),
        adapter=st.sampled_from([None, None, None, "lora-a"]),
        priority=st.integers(-1, 1),
        items=ITEMS,
    )
    def whole_request(
        self,
        data: st.DataObject,
        salt: str | None,
        adapter: str | None,
        priority: int,
        items: Items,
    ) -> None:
        """Begun, committed and finished in one go, as traffic fills the cache."""
        prompt = self.prompt(data)
        kind, request = self.both(
            "begin",
            lambda c: c.begin(
                prompt, salt=salt, adapter=adapter, priority=priority, multimodal=items
            ),
        )
        if kind == "ok":
            self.seen.append(prompt)
            self.both("commit", lambda c: c.commit(request.id, len(prompt)))
            self.both("finish", lambda c: c.finish(request.id))

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), draft=st.booleans())
    def append_tokens(self, data: st.DataObject, draft: bool) -> None:
        rid = self.request(data)
        tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        self.both("append_tokens", lambda c: c.append_tokens(rid, tokens, draft=draft))

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        rid = self.request(data)
        tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        self.both("append", lambda c: c.append(rid, tokens))

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def accept_or_truncate(self, data: st.DataObject) -> None:
        rid = self.request(data)
        n = data.draw(st.integers(0, 20))
        if data.draw(st.booleans()):
            self.both("accept_drafts", lambda c: c.accept_drafts(rid, n))
        else:
            self.both("truncate", lambda c: c.truncate(rid, n))

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), cap=st.one_of(st.none(), st.integers(0, 20)))
    def limit_cached_prefix(self, data: st.DataObject, cap: int | None) -> None:
        rid = self.request(data)
        self.both("limit_cached_prefix", lambda c: c.limit_cached_prefix(rid, cap))

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = self.request(data)
        kind, _ = self.both("preempt", lambda c: c.preempt(rid))
        if kind == "ok":
            self.scheduled.discard(rid)

    @rule(
        data=st.data(),
        salt=st.sampled_from([None, "tenant"]),
        adapter=st.sampled_from([None, None, "lora-a"]),
        items=ITEMS,
    )
    def pin(self, data: st.DataObject, salt: str | None, adapter: str | None, items: Items) -> None:
        """A pinned prefix stays out of eviction's reach (not a reference): the same blocks
        pinned, and from then on the same victims, counts and refusals."""
        prompt = self.prompt(data)
        kind, pin = self.both(
            "pin", lambda c: c.pin(prompt, salt=salt, adapter=adapter, multimodal=items)
        )
        if kind == "ok":
            self.pins.append(pin.id)

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        """A live pin, one unpinned or dropped by a reset (refused alike), or one never taken."""
        pin = data.draw(st.sampled_from(self.pins)) if self.pins else 99
        self.both("unpin", lambda c: c.unpin(pin))

    @precondition(lambda self: not self.scheduled)
    @rule(new_context=st.booleans())
    def reset(self, new_context: bool) -> None:
        """`clear` / `set_context` while no request is scheduled (the run core refuses them
        otherwise): nothing hits after it, the next allocations take the same blocks (a review
        found a fresh free list handed them out in another order), and the requests waiting
        or preempted match again under the new context (a review found the run core refused
        them, which made vLLM's `reset_prefix_cache` fail)."""
        context = CacheContext(block_size=BLOCK_SIZE, model_id=f"m{self.next_id}")
        if new_context:
            self.both("set_context", lambda c: c.set_context(context))
        else:
            self.both("clear", lambda c: c.clear())

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = self.request(data)
        kind, _ = self.both("finish", lambda c: c.finish(rid))
        if kind == "ok":
            self.ids.remove(rid)
            self.scheduled.discard(rid)

    @invariant()
    def same_state(self) -> None:
        for rid in self.ids:
            for what in ("block_table", "num_tokens", "num_computed_tokens"):
                self.both(what, lambda c, what=what, rid=rid: getattr(c, what)(rid))
            self.both("request_block_keys", lambda c, rid=rid: c.request_block_keys(rid))
        expected, got = self.blocks.stats(), self.runs.stats()
        # A review found committed_blocks counting the copies of blocks published first.
        for field in ("committed_blocks", "deduplicated_blocks", "collisions", "probes"):
            assert getattr(got, field) == getattr(expected, field), field
        for field in ("lookups", "lookup_tokens", "hit_tokens", "evictions", "blocks_free"):
            assert getattr(got, field) == getattr(expected, field), field
        for field in ("blocks_cached", "blocks_in_use", "blocks_obtainable", "requests_live"):
            assert getattr(got, field) == getattr(expected, field), field
        assert got.blocks_pinned == expected.blocks_pinned, "blocks_pinned"
        assert self.runs.drain_evicted() == self.blocks.drain_evicted(), "drain_evicted"
        if self.recorders:
            expected_drain, got_drain = (drained(r) for r in self.recorders)
            assert got_drain == expected_drain, "drain_events"
            expected_keys, got_keys = (sorted(r.cached_keys()) for r in self.recorders)
            assert got_keys == expected_keys, "cached_keys"
        for block in range(self.num_blocks):
            self.both("ref_count", lambda c, block=block: c.ref_count(block))
            self.both("is_cached", lambda c, block=block: c.is_cached(block))
        self.runs.check_invariants()


BothCores.TestCase.settings = settings(deadline=None, stateful_step_count=40)
test_the_run_core_answers_every_call_as_the_default_core = BothCores.TestCase


def test_what_the_run_core_does_not_serve_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedFeatureError, match="sliding_window is not served by the run"):
        PrefixCache(8, sliding_window=16, core="runs")
    with pytest.raises(InvalidInputError, match="core must be one of"):
        PrefixCache(8, core="radix")
    cache = PrefixCache(8, block_size=BLOCK_SIZE, core="runs")
    request = cache.begin(list(range(10)))

    def state() -> tuple[str, int, list[int]]:
        return (repr(cache.stats()), cache.stats().probes, cache.block_table(request))

    before = state()
    unserved: list[tuple[str, Callable[[], Any]]] = [
        ("match_and_acquire", lambda: cache.match_and_acquire([1, 2, 3, 4])),
        ("allocate", lambda: cache.allocate(1)),
        ("commit_blocks", lambda: cache.commit_blocks([1, 2, 3, 4], [0])),
        ("release", lambda: cache.release([0])),
    ]
    for name, call in unserved:
        with pytest.raises(UnsupportedFeatureError, match=name):
            call()
    refused: list[tuple[str, Callable[[], Any]]] = [
        ("only while no request is scheduled", cache.clear),
        (
            "only while no request is scheduled",
            lambda: cache.set_context(CacheContext(block_size=4)),
        ),
        ("sliding-window", lambda: cache.lookup_in_window([1, 2], 4)),
    ]
    for name, call in refused:
        with pytest.raises(InvalidInputError, match=name):
            call()
    with pytest.raises(UnknownRequestError, match="never taken"):
        cache.unpin(3)
    assert state() == before
    cache.commit(request, 10)
    cache.finish(request)
    assert cache.lookup(list(range(10))).num_cached_tokens == 8
    # With no request live, a reset forgets every cached block.
    cache.set_context(CacheContext(block_size=BLOCK_SIZE, model_id="another"))
    assert cache.lookup(list(range(10))).num_cached_tokens == 0
    assert cache.stats().blocks_obtainable == 8
    cache.check_invariants()


def test_calls_from_two_threads_do_not_deadlock() -> None:
    """A large commit releases the GIL; it must not hold the cache's lock while it waits to
    take the GIL back, or a thread calling in under the GIL would wait for the lock forever
    (found by a review of the first binding: it hung in 4 of 4 runs). A hang kills the run
    after a minute, with every thread's traceback, instead of stalling CI."""
    cache = PrefixCache(256, core="runs")
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            cache.blocks_obtainable()
            cache.lookup(list(range(400)))

    poller = threading.Thread(target=poll)
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        poller.start()
        for i in range(300):
            prompt = list(range(i * 400, i * 400 + 400))
            request = cache.begin(prompt)
            cache.commit(request, len(prompt))
            cache.finish(request)
        stop.set()
        poller.join()
    finally:
        stop.set()
        faulthandler.cancel_dump_traceback_later()
    cache.check_invariants()


def test_a_reset_with_requests_waiting_keys_them_anew_and_empties_the_eviction_log() -> None:
    """A review found the run core refusing `clear` while a request waited or was preempted
    (holding no block), which made vLLM's `reset_prefix_cache` fail on it, and no test that a
    reset empties the eviction log. Both cores: a preempted and a waiting request stay, match
    again under the new context (nothing cached then), and publish alike; the blocks evicted
    before the reset are not drained after it."""
    context = CacheContext(block_size=BLOCK_SIZE)
    caches = [PrefixCache(6, context=context, core=core) for core in ("blocks", "runs")]
    outcomes = []
    for cache in caches:
        cache.set_eviction_log(True)
        for first in (0, 100, 200):  # 3 prompts of 2 blocks fill the pool of 6
            request = cache.begin(list(range(first, first + 8)))
            cache.commit(request, 8)
            cache.finish(request)
        prompt = list(range(300, 308))
        cache.add_request("preempted", prompt, salt="tenant")
        cache.allocate_slots("preempted", 8)
        cache.commit("preempted", 8)
        cache.preempt("preempted")
        cache.add_request("waiting", list(range(8)))
        assert cache.stats().blocks_in_use == 0
        assert cache.stats().evictions > 0, "the log holds evicted blocks before the reset"
        cache.set_context(CacheContext(block_size=BLOCK_SIZE, model_id="after"))
        drained_after_reset = cache.drain_evicted()
        slots = [cache.allocate_slots(rid, 8) for rid in ("preempted", "waiting")]
        for rid in ("preempted", "waiting"):
            cache.commit(rid, 8)
            cache.finish(rid)
        outcomes.append(
            (
                drained_after_reset,
                [(s.num_cached_tokens, s.block_ids) for s in slots],
                cache.lookup(prompt, salt="tenant").num_cached_tokens,
                cache.stats().blocks_cached,
            )
        )
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == [], "blocks evicted under the old context are not drained after"
    # Published under the new context: a lookup of the prompt hits it (all but the last block,
    # which a full hit recomputes).
    assert outcomes[0][2] == 8 - BLOCK_SIZE, "the preempted request published anew"


@pytest.mark.parametrize("core", ["blocks", "runs"])
def test_an_images_blocks_hit_only_with_the_same_image(core: str) -> None:
    """Placeholder tokens are the same for every image: the blocks an image overlaps, and all
    after them, hit only for the same image in the same place (the run core tags those blocks;
    the state machine above checks it call for call against the default core)."""
    cache = PrefixCache(32, block_size=BLOCK_SIZE, core=core)
    prompt = [1, 2, 3, 4] + [9] * 8 + [5, 6, 7, 8, 0]
    image = [(4, 8, "cat")]
    request = cache.begin(prompt, multimodal=image)
    cache.commit(request, len(prompt))
    cache.finish(request)
    assert cache.lookup(prompt, multimodal=image).num_cached_tokens == 16
    # Another image, or none, in the same placeholders: only the text before it hits.
    assert cache.lookup(prompt, multimodal=[(4, 8, "dog")]).num_cached_tokens == 4
    assert cache.lookup(prompt).num_cached_tokens == 4
    # The same image placed one token later covers other blocks' tokens: a miss from there.
    assert cache.lookup(prompt, multimodal=[(5, 8, "cat")]).num_cached_tokens == 4
    cache.check_invariants()


@pytest.mark.parametrize("core", ["blocks", "runs"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_an_image_reaching_the_last_position_keys_its_blocks(core: str, block_size: int) -> None:
    """An item's end at 2**64 - 1: a review found the run core's tag range overflowing at block
    size 1, so the image's blocks went untagged and hit for another image or for text."""
    cache = PrefixCache(16, block_size=block_size, core=core)
    prompt = [5] * 4 * block_size
    cat, dog = [(0, 2**64 - 1, "cat")], [(0, 2**64 - 1, "dog")]
    request = cache.begin(prompt, multimodal=cat)
    cache.commit(request, len(prompt))
    cache.finish(request)
    assert cache.lookup(prompt, multimodal=cat).num_cached_tokens == 3 * block_size
    assert cache.lookup(prompt, multimodal=dog).num_cached_tokens == 0
    assert cache.lookup(prompt).num_cached_tokens == 0
    cache.check_invariants()
