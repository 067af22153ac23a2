"""Hostile arguments at the block manager's entry points (issue 8, items 8-11 and 13).

Every bad argument is a `PrefixKVError` naming the problem and leaves the cache exactly as it
was; integers follow `operator.index` (never bool, float, str or None), so a buggy engine
cannot retire or commit some other request by accident.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from prefixkv import CacheContext, PositionEncoding, PrefixCache
from prefixkv.cache import key_extras
from prefixkv.errors import (
    DuplicateRequestError,
    InvalidInputError,
    PrefixKVError,
    UnknownRequestError,
)
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

BS = 4

#: Values that are not integers, though Python would happily coerce most of them.
not_an_int = st.one_of(
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.none(),
    st.just(np.float64(2.0)),
    st.just([1]),
)
#: Integers no size argument accepts.
out_of_range = st.one_of(st.integers(max_value=0), st.integers(min_value=2**32))


def snapshot(cache: PrefixCache, request=None) -> tuple:
    stats = cache.stats()
    table = cache.block_table(request) if request is not None else None
    return (stats.blocks_free, stats.blocks_cached, stats.blocks_in_use, stats.requests_live, table)


@pytest.fixture
def busy_cache():
    cache = PrefixCache(16, block_size=BS)
    first = cache.begin(list(range(10)))
    second = cache.begin(list(range(100, 106)))
    return cache, first, second


@given(bad=not_an_int.filter(lambda value: not isinstance(value, str)))
def test_request_handles_are_never_coerced(bad) -> None:
    cache = PrefixCache(16, block_size=BS)
    # Ids 0, 1, 2: whatever int(bad) would give names a live request.
    live = [cache.begin([i] * 6) for i in range(3)]
    before = [snapshot(cache, r) for r in live]
    for call in (
        lambda: cache.finish(bad),
        lambda: cache.commit(bad, 4),
        lambda: cache.append(bad, [1]),
        lambda: cache.block_table(bad),
    ):
        with pytest.raises(InvalidInputError, match="request must be a Request or its id"):
            call()
    assert [snapshot(cache, r) for r in live] == before


@given(name=st.text(max_size=4))
def test_a_string_id_is_its_own_name_never_an_int(name: str) -> None:
    """Engines name requests with strings: "1" is not request 1."""
    cache = PrefixCache(16, block_size=BS)
    live = [cache.begin([i] * 6) for i in range(3)]
    before = [snapshot(cache, r) for r in live]
    with pytest.raises(UnknownRequestError, match="never added"):
        cache.finish(name)
    assert [snapshot(cache, r) for r in live] == before
    cache.add_request(name, [1, 2, 3])
    with pytest.raises(DuplicateRequestError):
        cache.add_request(name, [4])
    assert cache.num_tokens(name) == 3
    cache.finish(name)


@given(bad=st.one_of(not_an_int, out_of_range))
def test_size_arguments_are_typed_errors_naming_the_argument(bad) -> None:
    for name, build in (
        ("num_blocks", lambda: PrefixCache(bad)),
        ("block_size", lambda: PrefixCache(8, block_size=bad)),
        ("vocab_size", lambda: PrefixCache(8, vocab_size=bad)),
    ):
        if name == "block_size" and bad is None:
            continue  # None means "take the context's"
        if name == "vocab_size" and bad is None:
            continue  # None means "no vocabulary check"
        with pytest.raises(InvalidInputError, match=name):
            build()


@given(bad=st.one_of(st.booleans(), st.floats(), st.text(max_size=3)))
def test_counts_and_priorities_refuse_non_integers(bad) -> None:
    cache = PrefixCache(16, block_size=BS, core="blocks")
    request = cache.begin(list(range(9)))
    before = snapshot(cache, request)
    for name, call in (
        ("num_computed_tokens", lambda: cache.commit(request, bad)),
        ("count", lambda: cache.allocate(bad)),
        ("priority", lambda: cache.begin([7] * 5, priority=bad)),
        ("block id", lambda: cache.release([bad])),
        ("pin", lambda: cache.unpin(bad)),
    ):
        with pytest.raises(InvalidInputError, match=name):
            call()
    assert snapshot(cache, request) == before


@given(
    tokens=st.lists(st.integers(0, 50), min_size=1, max_size=20),
    where=st.integers(0, 19),
    flag=st.booleans(),
)
def test_a_bool_among_token_ids_is_refused(tokens, where, flag) -> None:
    cache = PrefixCache(16, block_size=BS)
    where %= len(tokens)
    tokens[where] = flag
    with pytest.raises(InvalidInputError, match=rf"position {where}.*bool"):
        cache.begin(tokens)
    with pytest.raises(InvalidInputError, match="bool"):
        cache.lookup(tuple(tokens))
    assert cache.stats().requests_live == 0


# Token ids around every width the core's list reader sees: one CPython digit (< 2**30), two
# (< 2**60, which `long` holds), the u32 edge and past `long` (its overflow flag).
token_ids = st.one_of(
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 1, 2**30 - 1, 2**30, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]),
)
bad_token_ids = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**32),
    st.sampled_from([-1, -(2**30), 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 2**100]),
    st.builds(np.int64, st.integers(0, 2**32 - 1)),  # not an exact int: read by operator.index
)


@given(tokens=st.lists(token_ids, min_size=1, max_size=70))
def test_every_form_of_token_ids_reads_the_same_ids(tokens) -> None:
    """A list, a tuple and a numpy array of the same ids give the same block keys (the list
    reader takes each exact int with one C-API call; numpy goes as raw bytes)."""
    cache = PrefixCache(16, block_size=BS)
    expected = cache.block_keys(np.array(tokens, dtype=np.uint64))
    assert cache.block_keys(tokens) == expected
    assert cache.block_keys(tuple(tokens)) == expected
    assert cache.block_keys([np.int64(t) for t in tokens]) == expected


# Each width's edges: the sign bit, the u32 edge, and every stray high bit an 8-byte id can hold.
EDGE_IDS = [0, 1, 127, 128, 255, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1]
EDGE_IDS += [2**k for k in range(32, 64)] + [2**64 - 1, -1, -2, -128, -(2**15), -(2**31), -(2**63)]
INTEGER_DTYPES = [
    np.dtype(c) for c in ("i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", ">i4", ">u8")
]


@given(
    data=st.data(),
    dtype=st.sampled_from(INTEGER_DTYPES),
    # Past 2,048 ids too: the pass runs in 512-byte pieces, prefetching 4 KiB ahead.
    n=st.one_of(st.integers(1, 70), st.integers(500, 2200)),
    one_bad=st.booleans(),
)
def test_integer_arrays_of_every_width_are_read_or_refused_by_position(
    data, dtype, n, one_bad
) -> None:
    """The core narrows each width in one pass that ORs the bits outside 0 ..= 2**32 - 1: one
    bad id alone (a stray sign or high bit) must send it to the slow pass naming it, and valid
    ids must read as the same ids in a list."""
    info = np.iinfo(dtype)
    low, high = max(int(info.min), 0), min(int(info.max), 2**32 - 1)
    in_range = [v for v in EDGE_IDS if low <= v <= high]
    values = data.draw(
        st.lists(
            st.one_of(st.integers(low, high), st.sampled_from(in_range)), min_size=n, max_size=n
        )
    )
    cache = PrefixCache(16, block_size=BS)
    out_of_range = [v for v in EDGE_IDS if info.min <= v <= info.max and not low <= v <= high]
    if not one_bad or not out_of_range:
        assert cache.block_keys(np.array(values, dtype=dtype)) == cache.block_keys(values)
        return
    where = data.draw(st.integers(0, n - 1))
    values[where] = data.draw(st.sampled_from(out_of_range))
    with pytest.raises(InvalidInputError, match=rf"{values[where]} at position {where} "):
        cache.begin(np.array(values, dtype=dtype))
    assert cache.stats().requests_live == 0


@given(
    tokens=st.lists(token_ids, min_size=1, max_size=40),
    bad=bad_token_ids,
    where=st.integers(0, 39),
    form=st.sampled_from([list, tuple]),
)
# Found by hypothesis: an int below i128's range overflowed the binding's int reading, whose
# error put the value after "token at position 0" instead of the usual words.
@example(tokens=[0], bad=-(2**127) - 1, where=0, form=list)
def test_a_bad_token_id_anywhere_is_refused_by_position(tokens, bad, where, form) -> None:
    cache = PrefixCache(16, block_size=BS)
    where %= len(tokens)
    tokens[where] = bad
    if isinstance(bad, np.int64):  # an in-range numpy int is a valid id, read the slow way
        assert cache.lookup(form(tokens)).num_cached_tokens == 0
        return
    with pytest.raises(InvalidInputError, match=rf"{bad} at position {where} is out of range"):
        cache.begin(form(tokens))
    assert cache.stats().requests_live == 0


@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_long_arrays_are_read_to_the_last_id(dtype) -> None:
    """Ids are narrowed in 512-byte pieces with a prefetch ahead (`convert.rs`, `widen`): the
    last piece, a short one, and a bad id in it must be read like the others."""
    info = np.iinfo(dtype)
    n = 3 * 4096 + 5
    values = np.arange(n, dtype=np.int64) % min(int(info.max) + 1, 2**32)
    cache = PrefixCache(16, block_size=BS)
    array = values.astype(dtype)
    assert cache.block_keys(array) == cache.block_keys(array.tolist())
    if int(info.max) > 2**32 - 1 or int(info.min) < 0:
        bad = -1 if int(info.min) < 0 else 2**32
        array[n - 1] = bad
        with pytest.raises(InvalidInputError, match=rf"{bad} at position {n - 1} "):
            cache.begin(array)
        assert cache.stats().requests_live == 0


def test_token_errors_say_what_is_wrong() -> None:
    cache = PrefixCache(16, block_size=BS)
    with pytest.raises(
        InvalidInputError, match="18446744073709551616 at position 1 is out of range"
    ):
        cache.begin([1, 2**64])
    with pytest.raises(InvalidInputError, match=r"integer dtype.*bfloat16"):
        cache.begin(torch.tensor([1, 2, 3], dtype=torch.bfloat16))
    with pytest.raises(InvalidInputError, match="integer dtype"):
        cache.begin(torch.tensor([True, False]))
    with pytest.raises(InvalidInputError, match="integer dtype"):
        cache.begin(np.array([1.0, 2.0]))


def test_sizes_that_overflow_are_invalid_input_errors() -> None:
    for build in (
        lambda: PrefixCache(2**63),
        lambda: PrefixCache(8, vocab_size=2**64),
        lambda: CacheContext(block_size=2**64),
        lambda: PrefixCache(8, block_size=0),
    ):
        with pytest.raises(InvalidInputError):
            build()
    with pytest.raises(InvalidInputError, match="block_size must be a positive int, got 0"):
        PrefixCache(8, block_size=0)
    with pytest.raises(InvalidInputError, match="vocab_size must be in 1"):
        PrefixCache(8, vocab_size=0)


def test_unpin_after_clear_says_the_clear_dropped_it() -> None:
    cache = PrefixCache(8, block_size=BS)
    request = cache.begin(list(range(8)))
    cache.commit(request, 8)
    cache.finish(request)
    pin = cache.pin(list(range(8)))
    cache.clear()
    with pytest.raises(UnknownRequestError, match="clear"):
        cache.unpin(pin)
    with pytest.raises(UnknownRequestError, match="never taken"):
        cache.unpin(pin.id + 100)


def test_set_context_refuses_what_is_not_a_context() -> None:
    cache = PrefixCache(8, block_size=BS)
    for bad in ("x", None, {"block_size": 4}):
        with pytest.raises(InvalidInputError, match="CacheContext"):
            cache.set_context(bad)
    assert cache.context == CacheContext(block_size=BS)


def test_extras_parsed_once_match_keyword_extras() -> None:
    cache = PrefixCache(16, block_size=BS)
    tokens = list(range(9))
    request = cache.begin(tokens, salt="tenant-a", adapter="lora-1")
    cache.commit(request, 9)
    cache.finish(request)
    extras = key_extras(salt="tenant-a", adapter="lora-1")
    assert cache.lookup(tokens, extras=extras).num_cached_tokens == 8
    assert cache.lookup(tokens, extras=key_extras(salt="tenant-b")).num_cached_tokens == 0
    assert cache.block_keys(tokens, extras=extras) == cache.block_keys(
        tokens, salt="tenant-a", adapter="lora-1"
    )
    with pytest.raises(InvalidInputError, match="not both"):
        cache.lookup(tokens, salt="x", extras=extras)


def test_results_are_named_and_frozen() -> None:
    cache = PrefixCache(16, block_size=BS)
    request = cache.begin(list(range(9)))
    assert (request.num_prompt_tokens, request.num_cached_tokens) == (9, 0)
    assert request.num_tokens_to_compute == 9
    assert len(request.block_table) == 3
    with pytest.raises(AttributeError):
        request.id = 5  # type: ignore[misc]
    match = cache.lookup(list(range(9)))
    assert (match.num_cached_tokens, match.full_hit, match.block_ids) == (0, False, [])


# -- admission: what a cache can give -------------------------------------------------------
def test_blocks_obtainable_counts_what_eviction_can_reach() -> None:
    # The engine's repro: one 24-token prompt served leaves a chain of 6 cached blocks, of
    # which only the last is an evictable leaf; allocation can still evict the whole chain.
    cache = PrefixCache(8, block_size=BS, core="blocks")
    request = cache.begin(list(range(24)))
    cache.commit(request, 24)
    cache.finish(request)
    stats = cache.stats()
    assert stats.blocks_evictable == 1
    assert stats.blocks_obtainable == 8 == cache.blocks_obtainable()
    assert cache.blocks_obtainable(3) == 3
    granted = cache.allocate(5)
    assert len(granted) == 5


@given(
    prompts=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    hold=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_blocks_obtainable_is_exactly_what_allocate_grants(prompts, hold) -> None:
    cache = PrefixCache(12, block_size=BS, core="blocks")
    held = []
    for index, num_blocks in enumerate(prompts):
        tokens = [index] * (num_blocks * BS)
        try:
            request = cache.begin(tokens)
        except PrefixKVError:
            continue
        cache.commit(request, len(tokens))
        if hold[index]:
            held.append(request)
        else:
            cache.finish(request)
    obtainable = cache.stats().blocks_obtainable
    assert cache.blocks_obtainable() == obtainable
    if obtainable < cache.num_blocks:
        with pytest.raises(PrefixKVError):
            cache.allocate(obtainable + 1)
    if obtainable:
        assert len(cache.allocate(obtainable)) == obtainable


# -- CacheContext: equality is the fingerprint's --------------------------------------------
scalars = st.one_of(st.integers(-3, 3), st.floats(-3, 3, allow_nan=False), st.booleans(), st.none())


@given(
    a=st.dictionaries(st.sampled_from("xyz"), scalars),
    b=st.dictionaries(st.sampled_from("xyz"), scalars),
)
def test_context_equality_and_hash_agree_with_the_fingerprint(a, b) -> None:
    first, second = CacheContext(extra=a), CacheContext(extra=b)
    same = first.fingerprint() == second.fingerprint()
    assert (first == second) == same
    if same:
        assert hash(first) == hash(second)


def test_context_extra_is_a_read_only_copy() -> None:
    extra = {"sink_tokens": 4}
    context = CacheContext(extra=extra)
    fingerprint = context.fingerprint()
    extra["sink_tokens"] = 8
    with pytest.raises(TypeError):
        context.extra["sink_tokens"] = 8  # type: ignore[index]
    assert context.fingerprint() == fingerprint


def test_context_fields_are_checked_at_construction() -> None:
    for build in (
        lambda: CacheContext(position_encoding={"kind": "rope"}),  # type: ignore[arg-type]
        lambda: CacheContext(model_id="bad \ud800 text"),
        lambda: CacheContext(extra={"a": float("nan")}),
        lambda: CacheContext(position_encoding=PositionEncoding(rope_theta=float("inf"))),
        lambda: CacheContext(block_size=True),
    ):
        with pytest.raises(InvalidInputError):
            build()


# ----- issue 20 --------------------------------------------------------------------------------


@given(name=st.text(max_size=3), where=st.integers(0, 3))
def test_a_request_id_with_a_lone_surrogate_is_invalid_input(name: str, where: int) -> None:
    """A str that has no UTF-8 form names no request: refused by name (it used to escape as
    UnicodeEncodeError), whatever the call."""
    bad = name[:where] + "\udc80" + name[where:]
    cache = PrefixCache(16, block_size=BS)
    live = cache.begin([1] * 6)
    before = snapshot(cache, live)
    for call in (
        lambda: cache.add_request(bad, [1, 2]),
        lambda: cache.begin([1, 2], request_id=bad),
        lambda: cache.allocate_slots(bad, 1),
        lambda: cache.finish(bad),
    ):
        with pytest.raises(InvalidInputError, match="request id must be valid Unicode"):
            call()
    assert snapshot(cache, live) == before


def test_absurd_sizes_are_refused_by_figure_not_as_out_of_blocks() -> None:
    """`PrefixCache(16, block_size=2**24)` allocated (and wrote) 1 GiB at construction, and
    without that memory said "OutOfBlocksError: needed 16, only 0 free"."""
    with pytest.raises(InvalidInputError, match="block_size 16777216 is above the largest"):
        PrefixCache(16, block_size=2**24)
    with pytest.raises(InvalidInputError, match=r"num_blocks 4294967295 .* bytes up front"):
        PrefixCache(2**32 - 1, block_size=BS)
    assert PrefixCache(4, block_size=2**16).block_size == 2**16


def test_a_hit_that_grew_since_start_position_leaves_room_for_the_tokens() -> None:
    """A waiting request's `start_position` was 0; another request then committed the same
    prefix. `allocate_slots(B, 13)` said "... (append them first)"; now the hit is cut back so
    the 13 tokens the scheduler counted fit, and `Slots` says where they start."""
    cache = PrefixCache(16, block_size=BS)
    tokens = list(range(14))
    cache.add_request("B", tokens)
    assert cache.start_position("B") == 0
    first = cache.begin(tokens)
    cache.commit(first, 14)
    assert cache.start_position("B") == 12
    slots = cache.allocate_slots("B", 13)
    assert (slots.num_computed_tokens, len(slots.block_ids)) == (0, 4)
    cache.add_request("C", tokens)
    slots = cache.allocate_slots("C", 6)
    assert (slots.num_computed_tokens, slots.num_cached_tokens) == (8, 8)
    cache.check_invariants()


@pytest.mark.parametrize("value", ["", "yes", "true", "2", " 1"])
def test_a_bad_huge_pages_setting_is_refused_by_name(monkeypatch, value: str) -> None:
    """`PREFIXKV_HUGE_PAGES` (rust/core/src/hugepages.rs) is 0 or 1: anything else is refused
    when a cache is built, naming the variable and the value, rather than read as either."""
    monkeypatch.setenv("PREFIXKV_HUGE_PAGES", value)
    with pytest.raises(
        InvalidInputError, match="PREFIXKV_HUGE_PAGES must be 0.*got " + re.escape(f'"{value}"')
    ):
        PrefixCache(8, block_size=BS)


def test_the_huge_pages_setting_is_read_when_a_cache_is_built_not_at_a_reset(monkeypatch) -> None:
    """A reset builds no cache anew: a bad value set since does not make `clear` or
    `set_context` fail (the run core once read it again at every reset)."""
    cache = PrefixCache(8, block_size=BS)
    request = cache.begin(list(range(12)))
    cache.commit(request, 12)
    cache.finish(request)
    monkeypatch.setenv("PREFIXKV_HUGE_PAGES", "yes")
    cache.clear()
    cache.set_context(CacheContext(block_size=BS, model_id="after"))
    assert cache.lookup(list(range(12))).num_cached_tokens == 0
    cache.check_invariants()


def test_huge_pages_on_or_off_give_the_same_answers(monkeypatch) -> None:
    """70,000 blocks: the table's slots and token rows pass the 4 MiB from which the core
    advises huge pages. The setting may change where the arrays sit, never what they hold."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50_000, int(n)) for n in rng.integers(1, 400, 40)]
    answers = []
    for value in ("1", "0"):
        monkeypatch.setenv("PREFIXKV_HUGE_PAGES", value)
        cache = PrefixCache(70_000, block_size=BS)
        seen = []
        for prompt in prompts + prompts[::-1]:
            request = cache.begin(prompt)
            seen.append((request.num_cached_tokens, cache.lookup(prompt).num_cached_tokens))
            cache.commit(request, len(prompt))
            cache.finish(request)
        cache.check_invariants()
        answers.append(seen)
    assert answers[0] == answers[1]
    assert any(hit for hit, _ in answers[0])
