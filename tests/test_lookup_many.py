"""`PrefixCache.lookup_many`: a batch of probes answers as `lookup` does prompt by prompt, on
both cores, and a refused prompt refuses the whole batch by position, changing nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import InvalidInputError
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

BLOCK_SIZE = 4
VOCAB = 50
CORES = ("blocks", "runs")


def answer(match: Any) -> tuple[Any, ...]:
    return (
        list(match.block_ids),
        match.num_cached_tokens,
        match.full_hit,
        match.last_token_shared,
    )


def a_cache(core: str, full_hit: str = "recompute_last_block") -> PrefixCache:
    context = CacheContext(block_size=BLOCK_SIZE)
    return PrefixCache(16, context=context, vocab_size=VOCAB, full_hit=full_hit, core=core)


token_lists = st.lists(st.integers(0, 6), min_size=1, max_size=6 * BLOCK_SIZE)


@given(
    served=st.lists(st.tuples(token_lists, st.sampled_from([None, "tenant"])), max_size=6),
    probes=st.lists(st.tuples(token_lists, st.booleans()), max_size=8),
    salt=st.sampled_from([None, "tenant"]),
    core=st.sampled_from(CORES),
    full_hit=st.sampled_from(["recompute_last_block", "reuse_last_block"]),
)
def test_a_batch_answers_as_one_lookup_per_prompt(
    served: list[tuple[list[int], str | None]],
    probes: list[tuple[list[int], bool]],
    salt: str | None,
    core: str,
    full_hit: str,
) -> None:
    cache = a_cache(core, full_hit)
    for tokens, served_salt in served:
        request = cache.begin(tokens, salt=served_salt)
        cache.commit(request, len(tokens))
        cache.finish(request)
    # Lists and numpy arrays of several dtypes, mixed in one batch.
    batch = [np.array(t, dtype=np.int32) if as_array else t for t, as_array in probes]
    before = cache.stats().probes
    many = cache.lookup_many(batch, salt=salt)
    assert cache.stats().probes == before + len(batch)
    one_by_one = [cache.lookup(tokens, salt=salt) for tokens in batch]
    assert [answer(m) for m in many] == [answer(m) for m in one_by_one]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ([1, 2, -1], "token id -1 at position 2"),
        (np.array([3, VOCAB], dtype=np.int64), f"token id {VOCAB} at position 1 is outside"),
        (np.array([1, 2**40], dtype=np.int64), "position 1"),
        ("not tokens", "token ids must be"),
    ],
)
def test_a_refused_prompt_refuses_the_batch_by_position_and_changes_nothing(
    core: str, bad: Any, says: str
) -> None:
    cache = a_cache(core)
    request = cache.begin(list(range(8)))
    cache.commit(request, 8)
    cache.finish(request)
    before = repr(cache.stats())
    with pytest.raises(InvalidInputError, match="prompt 1 of the batch") as raised:
        cache.lookup_many([list(range(8)), bad, list(range(4))])
    assert says in str(raised.value)
    assert repr(cache.stats()) == before


@pytest.mark.parametrize("core", CORES)
def test_an_empty_batch_and_any_iterable(core: str) -> None:
    cache = a_cache(core)
    assert cache.lookup_many([]) == []
    rows = np.arange(12, dtype=np.int64).reshape(3, 4)  # a 2-D array: one prompt per row
    assert [m.num_cached_tokens for m in cache.lookup_many(rows)] == [0, 0, 0]
    assert len(cache.lookup_many(iter([[1, 2], [3]]))) == 2


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("as_array", [False, True])
def test_a_generator_refilling_one_buffer_gets_each_prompts_answer(
    core: str, as_array: bool
) -> None:
    # Found by a review: the core reads the prompts once the iterator is done, so an iterator
    # handing out one buffer refilled for each prompt made every prompt read the last one.
    cache = a_cache(core)
    request = cache.begin([1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.commit(request, 9)
    cache.finish(request)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 7, 7, 7, 7], [1, 2, 3, 4, 9]]

    def rows() -> Any:
        if as_array:
            buffer = np.zeros(9, dtype=np.int64)
            for prompt in prompts:
                view = buffer[: len(prompt)]
                view[:] = prompt
                yield view
        else:
            shared: list[int] = []
            for prompt in prompts:
                shared[:] = prompt
                yield shared

    one_by_one = [answer(cache.lookup(p)) for p in prompts]
    assert [answer(m) for m in cache.lookup_many(rows())] == one_by_one
    assert [m.num_cached_tokens for m in cache.lookup_many(rows())] == [8, 0, 4]


@pytest.mark.parametrize("core", CORES)
def test_prompts_that_are_not_an_iterable_are_refused_by_name(core: str) -> None:
    with pytest.raises(InvalidInputError, match="prompts must be an iterable"):
        a_cache(core).lookup_many(7)  # type: ignore[arg-type]
