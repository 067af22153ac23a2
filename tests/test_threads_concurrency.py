"""Two threads driving one cache through the whole request API at once.

Since the per-step calls release the GIL for prefill-sized work (`rust/py/src/gil.rs`), a
commit, an allocation or a preemption on one thread runs in the core while the other thread
looks up, begins or finishes. Nothing here times anything: every assertion is an invariant that
holds under any interleaving.

- **No block is handed out twice.** A fresh block (a position past the cached prefix) must be
  held by no live request of either thread.
- **Every hit is right.** Each thread "writes KV" into its fresh blocks as it commits: a record
  of the whole token prefix the block ends. A block a request gets as a cached hit must carry
  exactly its own prefix. The same holds for `lookup` on pinned prompts, whose blocks can be
  neither evicted nor reused while pinned.
- **The books balance** at the end: invariants, no live request, no block in use.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from prefixkv import CacheContext, InvalidInputError, OutOfBlocksError, PrefixCache
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv_groups import KVGroupSpec
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

BS = 4
#: Prompts up to 240 tokens (60 blocks): past the 16 blocks from which calls release the GIL.
MAX_PROMPT = 240
STEMS = 5


class Books:
    """What the threads know about blocks, behind a lock of its own (never held in a cache call)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders: Counter[int] = Counter()
        #: Block -> the token prefix whose KV was last written into it.
        self.written: dict[int, tuple[int, ...]] = {}

    def take(self, tokens: list[int], table: list[int], num_cached: int, first_new: int) -> None:
        """A request now holds `table[first_new:]` (fresh) on top of what it held; its
        positions below `num_cached // BS` are hits that must carry its own prefix."""
        with self.lock:
            for position in range(first_new, len(table)):
                block = table[position]
                if position >= num_cached // BS:
                    assert self.holders[block] == 0, f"block {block} handed out while held"
                else:
                    self._check_hit(tokens, position, block)
                self.holders[block] += 1

    def _check_hit(self, tokens: list[int], position: int, block: int) -> None:
        expected = tuple(tokens[: (position + 1) * BS])
        assert self.written.get(block) == expected, f"block {block} at {position}: wrong KV"

    def check_hits(self, tokens: list[int], blocks: list[int], num_cached: int) -> None:
        with self.lock:
            for position in range(num_cached // BS):
                self._check_hit(tokens, position, blocks[position])

    def write(self, tokens: list[int], table: list[int], start: int, end: int) -> None:
        """The KV of tokens `start:end` is computed: full blocks among them are written."""
        with self.lock:
            for position in range(start // BS, end // BS):
                self.written[table[position]] = tuple(tokens[: (position + 1) * BS])

    def drop(self, table: list[int]) -> None:
        # Before `finish`/`preempt`: once the cache may reuse a block, this request no longer
        # holds it, so the other thread may see it handed out at once.
        with self.lock:
            for block in table:
                self.holders[block] -= 1


def _prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    stem = stems[rng.randrange(len(stems))]
    keep = rng.randrange(len(stem))
    tail = [rng.randrange(1000, 1100) for _ in range(rng.randrange(1, MAX_PROMPT - keep + 1))]
    return stem[:keep] + tail


def _whole_prompt(cache: PrefixCache, books: Books, rng: random.Random, tokens: list[int]) -> None:
    request = cache.begin(tokens)
    table = list(request.block_table)
    books.take(tokens, table, request.num_cached_tokens, 0)
    # Commit in one go or in a few pieces; KV written before each commit, as an engine does.
    done = request.num_cached_tokens
    while done < len(tokens):
        upto = rng.choice([len(tokens), rng.randrange(done, len(tokens)) + 1])
        books.write(tokens, table, done, upto)
        cache.commit(request.id, upto)
        done = upto
    books.drop(table)
    cache.finish(request.id)


def _step_calls(
    cache: PrefixCache, books: Books, rng: random.Random, tokens: list[int], rid: str
) -> None:
    cache.add_request(rid, tokens)
    table: list[int] = []
    try:
        for _life in range(2):  # run, maybe preempt, run again
            # The first call matches the cached prefix and may ask only for tokens past it: the
            # lookup says how many, unless the other thread published more in between.
            chunk = rng.choice([len(tokens), rng.randrange(1, 80)])
            ask = min(chunk, len(tokens) - cache.lookup(tokens).num_cached_tokens)
            try:
                slots = cache.allocate_slots(rid, ask)
            except InvalidInputError:
                ask = 1
                slots = cache.allocate_slots(rid, ask)
            num_cached = slots.num_cached_tokens
            done = slots.num_computed_tokens
            while True:
                books.take(tokens, table + list(slots.block_ids), num_cached, len(table))
                table += list(slots.block_ids)
                books.write(tokens, table, done, done + ask)
                done += ask
                cache.commit(rid, done)
                if done == len(tokens):
                    break
                ask = min(rng.choice([len(tokens), rng.randrange(1, 80)]), len(tokens) - done)
                slots = cache.allocate_slots(rid, ask)
            for _ in range(rng.randrange(0, 2 * BS)):
                token = rng.randrange(1000, 1100)
                cache.append_tokens(rid, [token])
                tokens = [*tokens, token]
                slots = cache.allocate_slots(rid, 1)
                books.take(tokens, table + list(slots.block_ids), 0, len(table))
                table += list(slots.block_ids)
                books.write(tokens, table, done, done + 1)
                cache.commit(rid, done + 1)
                done += 1
            if rng.random() < 0.5:
                break
            books.drop(table)
            table = []
            cache.preempt(rid)
    finally:
        books.drop(table)
        cache.finish(rid)


@pytest.mark.parametrize("seed", [0, 1])
def test_two_threads_on_the_request_api_never_share_a_block_wrongly(seed: int) -> None:
    master = random.Random(seed)
    stems = [[master.randrange(1000) for _ in range(MAX_PROMPT)] for _ in range(STEMS)]
    cache = PrefixCache(400, block_size=BS)  # both threads' requests fit; the history evicts
    books = Books()
    pinned = [stem[: 12 * BS] for stem in stems[:2]]
    pins = []
    for tokens in pinned:
        _whole_prompt(cache, books, master, tokens)
        pins.append(cache.pin(tokens))
    errors: list[BaseException] = []
    counts = Counter[str]()

    def worker(name: str, thread_seed: int) -> None:
        rng = random.Random(thread_seed)
        try:
            for i in range(1000):
                tokens = _prompt(rng, stems)
                kind = rng.randrange(3)
                try:
                    if kind == 0:
                        _whole_prompt(cache, books, rng, tokens)
                    elif kind == 1:
                        _step_calls(cache, books, rng, tokens, f"{name}{i}")
                    else:
                        probe = pinned[rng.randrange(len(pinned))]
                        probe = probe + tokens[: rng.randrange(len(tokens))]
                        match = cache.lookup(probe)
                        assert match.num_cached_tokens >= len(pinned[0]) - BS
                        books.check_hits(probe, list(match.block_ids), len(pinned[0]) - BS)
                    counts[name] += 1
                except OutOfBlocksError:
                    counts["out of blocks"] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(name, seed * 10 + k)) for k, name in enumerate("ab")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert counts["a"] + counts["b"] > 1500, counts
    cache.check_invariants()
    stats = cache.stats()
    assert stats.requests_live == 0
    assert stats.blocks_in_use == 0
    assert stats.hit_tokens > 0
    assert stats.evictions > 0
    for pin in pins:
        cache.unpin(pin)
    cache.check_invariants()
    assert cache.stats().blocks_pinned == 0
    assert not +books.holders, books.holders


def test_two_threads_on_grouped_caches_keep_every_group_consistent() -> None:
    """The hybrid-model path (`CoreGroups`): a full-attention and a sliding-window group driven
    as one from two threads. No error but running out of blocks, every group's invariants
    hold, and nothing is left in use."""
    specs = (KVGroupSpec(0, None, (0,)), KVGroupSpec(1, 8 * BS, (1,)))
    cache = GroupedPrefixCache(specs, (300, 300), context=CacheContext(block_size=BS))
    master = random.Random(7)
    stems = [[master.randrange(1000) for _ in range(MAX_PROMPT)] for _ in range(STEMS)]
    errors: list[BaseException] = []
    served = Counter[str]()

    def worker(name: str, thread_seed: int) -> None:
        rng = random.Random(thread_seed)
        try:
            for i in range(400):
                rid = f"{name}{i}"
                tokens = _prompt(rng, stems)
                cache.add_request(rid, tokens)
                try:
                    done = cache.start_position(rid)
                    while done < len(tokens):
                        ask = min(
                            rng.choice([len(tokens), rng.randrange(1, 80)]), len(tokens) - done
                        )
                        try:
                            slots = cache.allocate_slots(rid, ask)
                        except InvalidInputError:  # the hit grew since start_position
                            slots = cache.allocate_slots(rid, 1)
                            ask = 1
                        done = slots.num_computed_tokens + ask
                        cache.commit(rid, done)
                    for step in range(rng.randrange(0, 2 * BS)):
                        cache.append_tokens(rid, [step])
                        cache.allocate_slots(rid, 1)
                        done += 1
                        cache.commit(rid, done)
                    if rng.random() < 0.2:
                        cache.preempt(rid)
                    served[name] += 1
                except OutOfBlocksError:
                    served["out of blocks"] += 1
                finally:
                    cache.finish(rid)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n, k)) for k, n in enumerate("ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert served["a"] + served["b"] > 600, served
    cache.check_invariants()
    stats = cache.stats()
    assert stats.requests_live == 0
    assert stats.blocks_in_use == 0
    assert stats.hit_rate > 0
