"""`_core.CoreRunCache`, the cache on runs of blocks (issue 24, experimental, for benches),
through the binding: the same hits and block tables as `PrefixCache` on the same requests
(the Rust suite checks the core type against the core cache far harder, `run_cache/tests.rs`;
this checks the conversions and the request map), and bad input refused by name with nothing
changed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv import CacheContext, PrefixCache, _core
from prefixkv.cache import as_token_ids, key_extras
from prefixkv.errors import InvalidInputError, OutOfBlocksError, UnknownRequestError

BLOCK_SIZE = 4
NO_EXTRAS = key_extras()


def pair(num_blocks: int) -> tuple[PrefixCache, _core.CoreRunCache]:
    context = CacheContext(block_size=BLOCK_SIZE)
    return (
        PrefixCache(num_blocks, context=context),
        _core.CoreRunCache(num_blocks, BLOCK_SIZE, context.fingerprint()),
    )


@st.composite
def workloads(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], str | None, int]]]:
    """A small cache and prompts that share prefixes (a cut of an earlier prompt, then fresh
    tokens from a small vocabulary), each under one of two salts and one of three priorities."""
    num_blocks = draw(st.integers(4, 24))
    prompts: list[tuple[list[int], str | None, int]] = []
    for _ in range(draw(st.integers(1, 30))):
        prompt: list[int] = []
        salt = draw(st.sampled_from([None, None, None, "tenant"]))
        if prompts and draw(st.booleans()):
            base, salt, _ = prompts[draw(st.integers(0, len(prompts) - 1))]
            prompt = base[: draw(st.integers(0, len(base)))]
        prompt += draw(st.lists(st.integers(0, 5), max_size=3 * BLOCK_SIZE))
        if not prompt:
            prompt = [1]
        prompts.append((prompt, salt, draw(st.integers(-1, 1))))
    return num_blocks, prompts


@settings(deadline=None)
@given(workloads())
def test_the_run_cache_hands_out_the_caches_blocks(
    workload: tuple[int, list[tuple[list[int], str | None, int]]],
) -> None:
    num_blocks, prompts = workload
    cache, runs = pair(num_blocks)
    for i, (prompt, salt, priority) in enumerate(prompts):
        probe = runs.lookup(prompt, key_extras(salt=salt))
        expected_probe = cache.lookup(prompt, salt=salt)
        assert (probe.block_ids, probe.num_cached_tokens, probe.full_hit) == (
            expected_probe.block_ids,
            expected_probe.num_cached_tokens,
            expected_probe.full_hit,
        ), f"request {i}: lookup"
        # numpy ids on one side, a list on the other: both conversions are checked.
        try:
            expected = cache.begin(np.array(prompt, dtype=np.int64), salt=salt, priority=priority)
        except OutOfBlocksError:
            with pytest.raises(OutOfBlocksError):
                runs.begin(prompt, key_extras(salt=salt), priority)
            continue
        got = runs.begin(prompt, key_extras(salt=salt), priority)
        assert (got.num_cached_tokens, got.full_hit, got.num_prompt_tokens) == (
            expected.num_cached_tokens,
            expected.full_hit,
            expected.num_prompt_tokens,
        ), f"request {i}"
        assert got.block_table == expected.block_table, f"request {i}"
        # A chunk first, sometimes (a chunked prefill), then the whole prompt.
        chunk = len(prompt) // (1 + i % 3)
        cache.commit(expected, chunk)
        runs.commit(got, chunk)
        cache.commit(expected, len(prompt))
        runs.commit(got, len(prompt))
        cache.finish(expected)
        runs.finish(got)
        runs.check_invariants()
    assert runs.obtainable() == num_blocks


def test_bad_input_is_refused_by_name_and_changes_nothing() -> None:
    _, runs = pair(8)
    with pytest.raises(InvalidInputError, match="at least one token"):
        runs.begin([], NO_EXTRAS)
    with pytest.raises(InvalidInputError, match="adapter or multimodal"):
        runs.begin([1, 2], key_extras(adapter="lora-a"))
    with pytest.raises(InvalidInputError, match="out of range"):
        runs.begin(as_token_ids([1, -1]), NO_EXTRAS)
    with pytest.raises(InvalidInputError, match="32 bytes"):
        _core.CoreRunCache(8, BLOCK_SIZE, b"short")
    with pytest.raises(InvalidInputError, match="num_blocks"):
        _core.CoreRunCache(0, BLOCK_SIZE, bytes(32))
    assert runs.obtainable() == 8
    request = runs.begin(list(range(10)), NO_EXTRAS)
    with pytest.raises(InvalidInputError, match="exceeds the request's 10 tokens"):
        runs.commit(request, 11)
    with pytest.raises(OutOfBlocksError, match="needed 8"):
        runs.begin(list(range(100, 130)), NO_EXTRAS)
    assert runs.obtainable() == 8 - 3
    # A chunk first (one block published), then the rest.
    runs.commit(request, 5)
    assert runs.lookup(list(range(10)), NO_EXTRAS).num_cached_tokens == 4
    runs.commit(request, 10)
    runs.finish(request)
    with pytest.raises(UnknownRequestError):
        runs.finish(request)
    with pytest.raises(UnknownRequestError):
        runs.commit(request, 10)
    runs.check_invariants()
    # The first two blocks were published and are found again.
    again = runs.begin(list(range(10)), NO_EXTRAS)
    assert again.num_cached_tokens == 8


def test_calls_from_two_threads_do_not_deadlock() -> None:
    """A large commit releases the GIL; it must not hold the cache's lock while it waits to
    take the GIL back, or a thread calling in under the GIL would wait for the lock forever
    (found by a review: it hung in 4 of 4 runs). A hang kills the run after a minute, with
    every thread's traceback, instead of stalling CI."""
    import faulthandler
    import threading

    _, runs = pair(256)
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            runs.obtainable()

    poller = threading.Thread(target=poll)
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        poller.start()
        for i in range(300):
            prompt = list(range(i * 400, i * 400 + 400))
            request = runs.begin(prompt, NO_EXTRAS)
            runs.commit(request, len(prompt))
            runs.finish(request)
        stop.set()
        poller.join()
    finally:
        stop.set()
        faulthandler.cancel_dump_traceback_later()
    runs.check_invariants()
