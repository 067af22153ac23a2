"""Lookups on several threads while one thread begins, commits and finishes requests.

No crash, no wrong hit: every hit length a reader sees must be a prefix that some request
actually committed (block-aligned), whatever the interleaving.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from prefixkv import OutOfBlocksError, PrefixCache
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

BS = 4


def test_readers_never_see_a_wrong_hit_while_a_writer_mutates():
    rng = np.random.default_rng(1)
    stems = [rng.integers(0, 50, size=64, dtype=np.int64) for _ in range(6)]
    cache = PrefixCache(48, block_size=BS)  # small: the writer evicts constantly
    stop = threading.Event()
    errors: list[BaseException] = []
    lookups = [0]

    def longest_valid_hit(tokens: np.ndarray) -> int:
        """The most a correct cache could return: the longest block-aligned common prefix."""
        best = 0
        for stem in stems:
            n = min(len(stem), len(tokens))
            diff = np.nonzero(stem[:n] != tokens[:n])[0]
            common = int(diff[0]) if diff.size else n
            best = max(best, common // BS * BS)
        return best

    def reader(seed: int) -> None:
        local = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                stem = stems[int(local.integers(len(stems)))].copy()
                cut = int(local.integers(1, len(stem)))
                stem[cut:] = local.integers(50, 60, size=len(stem) - cut)  # diverge at `cut`
                match = cache.lookup(stem)
                assert match.num_cached_tokens <= longest_valid_hit(stem), "wrong hit"
                assert len(match.block_ids) * BS >= match.num_cached_tokens
                lookups[0] += 1
        except BaseException as exc:  # report in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(20000):
            stem = stems[i % len(stems)]
            tokens = stem[: int(rng.integers(BS, len(stem)))]
            try:
                request = cache.begin(tokens, priority=int(rng.integers(-1, 2)))
            except OutOfBlocksError:
                continue
            cache.commit(request, len(tokens))
            cache.finish(request)
            if i % 3000 == 2999:
                cache.clear()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert lookups[0] > 0
    cache.check_invariants()
    stats = cache.stats()
    assert stats.blocks_in_use == 0
    assert stats.evictions > 0
