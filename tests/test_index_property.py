"""Property: after any sequence of cache operations, the index's view of an instance, built only
from its published events, equals the instance's cached set.

The state machine drives a real `PrefixCache` (small pool, so commits evict; shared prefixes,
salts, clears and context switches) with a recorder whose queue is small enough to overflow.
Each step's drain goes through the real wire format into a publisher-side buffer with sequence
numbers; a subscriber applies batches to a `PrefixIndex`, and may disconnect (missing batches)
and reconnect, catching up from the buffer as the replay socket would.
"""

from __future__ import annotations

import msgspec  # noqa: F401
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from prefixkv import CacheContext, PrefixCache, _core
from prefixkv.errors import OutOfBlocksError
from prefixkv.events import EventRecorder, PrefixIndex, hash64, prompt_hashes
from prefixkv.events.publisher import wire_events
from prefixkv.events.wire import KVEventBatch, batch_payload, decode_batch, encode_batch

BLOCK_SIZE = 2
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=9)


class IndexMatchesCache(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(
            6, context=CacheContext(model_id="prop", block_size=BLOCK_SIZE), core="blocks"
        )
        self.recorder = EventRecorder(self.cache, capacity=5, token_ids="unsalted")
        self.buffer: list[bytes] = []  # the publisher's replay buffer: seq = position
        self.index = PrefixIndex(["engine"])
        self.connected = True
        self.live: list[object] = []

    def publish(self) -> None:
        drain = self.recorder.drain()
        if drain.events:
            events = wire_events(drain.events, block_size=BLOCK_SIZE, medium="GPU")
            payload = encode_batch(KVEventBatch(ts=0.0, events=events))
            # The publisher's Rust encoding is byte for byte msgspec's encoding of the structs.
            encoded = _core.encode_events(drain.events, BLOCK_SIZE, "int64", "GPU")
            assert batch_payload(0.0, encoded) == payload
            self.buffer.append(payload)
        if self.connected:
            self.catch_up()

    def catch_up(self) -> None:
        applied = self.index.applied_seq["engine"]
        start = 0 if applied is None else applied + 1
        for seq in range(start, len(self.buffer)):
            self.index.apply("engine", decode_batch(self.buffer[seq]), seq)

    @rule(tokens=prompts, salt=st.sampled_from([None, "tenant"]), finish=st.booleans())
    def serve(self, tokens: list[int], salt: str | None, finish: bool) -> None:
        try:
            request = self.cache.begin(tokens, salt=salt)
        except OutOfBlocksError:
            return
        self.cache.commit(request, len(tokens))
        if finish:
            self.cache.finish(request)
        else:
            self.live.append(request)
        self.publish()

    @precondition(lambda self: self.live)
    @rule()
    def finish_oldest(self) -> None:
        self.cache.finish(self.live.pop(0))  # type: ignore[arg-type]
        self.publish()

    @rule(tokens=prompts)
    def low_level_commit(self, tokens: list[int]) -> None:
        full = len(tokens) // BLOCK_SIZE
        try:
            blocks = self.cache.allocate(full)
        except OutOfBlocksError:
            return
        self.cache.commit_blocks(tokens, blocks)
        self.cache.release(blocks)
        self.publish()

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.publish()

    @rule(model=st.sampled_from(["prop", "other"]))
    def switch_context(self, model: str) -> None:
        self.cache.set_context(CacheContext(model_id=model, block_size=BLOCK_SIZE))
        self.publish()

    @rule()
    def disconnect(self) -> None:
        self.connected = False

    @rule()
    def reconnect(self) -> None:
        self.connected = True
        self.catch_up()

    @invariant()
    def index_equals_cache(self) -> None:
        if not self.connected:
            return
        cached = sorted(hash64(k) for k in self.recorder.cached_keys())
        assert self.index.blocks_of("engine") == cached

    @invariant()
    def cached_keys_are_the_keys_lookups_reach(self) -> None:
        # Each cached key is the key of a prefix the cache really matches.
        self.cache.check_invariants()

    def teardown(self) -> None:
        for request in self.live:
            self.cache.finish(request)  # type: ignore[arg-type]


IndexMatchesCache.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_index_matches_cache = IndexMatchesCache.TestCase


def test_a_routed_prompt_scores_its_cached_prefix() -> None:
    cache = PrefixCache(16, context=CacheContext(model_id="r", block_size=BLOCK_SIZE))
    recorder = EventRecorder(cache)
    index = PrefixIndex(["a", "b"])
    request = cache.begin([1, 2, 3, 4, 5, 6, 7])
    cache.commit(request, 7)
    events = wire_events(recorder.drain().events, block_size=BLOCK_SIZE, medium=None)
    index.apply("a", KVEventBatch(ts=0.0, events=events))
    scores = index.score(prompt_hashes(cache, [1, 2, 3, 4, 9, 9]))
    assert scores == {"a": 2, "b": 0}
    assert index.best(prompt_hashes(cache, [1, 2, 3, 4, 5, 6])) == ("a", 3)
    # The lookup agrees.
    assert cache.lookup([1, 2, 3, 4, 9, 9]).num_cached_tokens == 2 * BLOCK_SIZE
