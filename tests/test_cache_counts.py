"""Counts at the edges of the integer widths (issue 20, item 2).

Every count argument of `PrefixCache` and `GroupedPrefixCache` is checked arithmetic all the way
down: a count the binding cannot hold (negative, 2**64 and above) or one whose sum with the
request's position overflows 64 bits is an `InvalidInputError` naming the argument; any other
count gets the answer the arithmetic of unbounded integers gives (a block count, False, an
`OutOfBlocksError` when the pool cannot supply it). A refusal changes nothing, and a question
(`can_allocate_slots`, `blocks_needed`, `blocks_obtainable`, `start_position`) never changes
anything.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import InvalidInputError, OutOfBlocksError, PrefixKVError
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv_groups import KVGroupSpec

BS = 4
NUM_BLOCKS = 16
WIDTH = 2**64

#: Counts at and around the widths a count may wrap at (2**64, 2**63, 2**32), and negatives.
edges = [base + delta for base in (2**64, 2**63, 2**32) for delta in (-2, -1, 0, 1)]
edge_counts = st.one_of(
    st.sampled_from([*edges, -1, -(2**63), -(2**64), 0, 1]),
    st.integers(2**64 - 2**12, 2**64 + 2**12),
    st.integers(2**63 - 2**12, 2**63 + 2**12),
    st.integers(max_value=-1),
)
#: A sane value for each count argument not under test.
small = st.integers(0, 12)


def snapshot(cache: PrefixCache, requests) -> tuple:
    stats = cache.stats()
    tables = tuple(
        (cache.block_table(r), cache.num_tokens(r), cache.num_computed_tokens(r)) for r in requests
    )
    return (
        stats.blocks_free,
        stats.blocks_cached,
        stats.blocks_in_use,
        stats.requests_live,
        stats.lookups,
        tables,
    )


def busy_cache() -> tuple[PrefixCache, dict[str, tuple[int | str, int, int, int]]]:
    """A cache with a waiting request, a scheduled one with tokens left to compute and one
    with none left: name -> (request, start, tokens, blocks held)."""
    cache = PrefixCache(NUM_BLOCKS, block_size=BS, core="blocks")
    cache.add_request("waiting", list(range(1000, 1010)))
    done = cache.begin(list(range(10)))
    cache.commit(done, 10)
    partial = cache.begin(list(range(100, 110)))
    cache.commit(partial, 4)
    return cache, {
        "waiting": ("waiting", 0, 10, 0),
        "nothing left": (done.id, 10, 10, 3),
        "partial": (partial.id, 4, 10, 3),
    }


def expected_slots(start: int, tokens: int, held: int, new: int, lookahead: int):
    """Blocks `allocate_slots(new, lookahead)` takes, by unbounded arithmetic; or the argument
    an `InvalidInputError` must name."""
    for name, value in (("num_new_tokens", new), ("num_lookahead_tokens", lookahead)):
        if not 0 <= value < WIDTH:
            return name
    if new > tokens - start:
        return "num_new_tokens"
    end = start + new + lookahead
    if end >= WIDTH:
        return "num_lookahead_tokens"
    return max(0, -(-end // BS) - held)


@given(
    which=st.sampled_from(["waiting", "nothing left", "partial"]),
    argument=st.sampled_from(["num_new_tokens", "num_lookahead_tokens", "watermark_blocks"]),
    value=edge_counts,
    others=st.tuples(small, small, st.integers(0, 2)),
)
def test_slot_counts_at_the_edges(which, argument, value, others) -> None:
    cache, requests = busy_cache()
    request, start, tokens, held = requests[which]
    new, lookahead, watermark = others
    new = min(new, tokens - start)
    args = {"num_new_tokens": new, "num_lookahead_tokens": lookahead, "watermark_blocks": watermark}
    args[argument] = value
    names = [r for r, *_ in requests.values()]
    before = snapshot(cache, names)
    needed = expected_slots(
        start, tokens, held, args["num_new_tokens"], args["num_lookahead_tokens"]
    )
    expected = needed
    watermark = args["watermark_blocks"]
    if isinstance(needed, int) and not (0 <= watermark < WIDTH and needed + watermark < WIDTH):
        expected = "watermark_blocks"
    obtainable = cache.blocks_obtainable()

    # Questions first: they change nothing, whatever they answer.
    lookahead = args["num_lookahead_tokens"]
    if isinstance(needed, str):
        with pytest.raises(InvalidInputError, match=needed):
            cache.blocks_needed(request, args["num_new_tokens"], num_lookahead_tokens=lookahead)
    else:
        assert (
            cache.blocks_needed(request, args["num_new_tokens"], num_lookahead_tokens=lookahead)
            == needed
        )
    if isinstance(expected, str):
        with pytest.raises(InvalidInputError, match=expected):
            cache.can_allocate_slots(request, **args)
        with pytest.raises(InvalidInputError, match=expected):
            cache.allocate_slots(request, **args)
        assert snapshot(cache, names) == before
        return
    fits = expected + watermark <= obtainable
    assert cache.can_allocate_slots(request, **args) is fits
    assert snapshot(cache, names) == before
    if not fits:
        with pytest.raises(OutOfBlocksError):
            cache.allocate_slots(request, **args)
        assert snapshot(cache, names) == before
        return
    slots = cache.allocate_slots(request, **args)
    assert len(slots.block_ids) == expected
    assert slots.num_computed_tokens == start
    cache.check_invariants()


@given(
    which=st.sampled_from(["waiting", "nothing left", "partial"]),
    call=st.sampled_from(
        [
            "commit",
            "truncate",
            "accept_drafts",
            "limit_cached_prefix",
            "blocks_obtainable",
            "allocate",
        ]
    ),
    value=edge_counts.filter(lambda v: not 0 <= v <= 1),
)
def test_every_other_count_at_the_edges(which, call, value) -> None:
    cache, requests = busy_cache()
    request = requests[which][0]
    names = [r for r, *_ in requests.values()]
    before = snapshot(cache, names)
    in_range = 0 <= value < WIDTH
    if call == "blocks_obtainable":
        if in_range:
            assert cache.blocks_obtainable(value) == min(value, cache.blocks_obtainable())
        else:
            with pytest.raises(InvalidInputError, match="up_to"):
                cache.blocks_obtainable(value)
    elif call == "allocate":
        # Never more than the pool: refused as such, or as a count no block count can be.
        with pytest.raises(OutOfBlocksError if in_range else InvalidInputError):
            cache.allocate(value)
    elif call == "limit_cached_prefix":
        if in_range:
            # A cap above every prompt lifts nothing and is kept.
            cache.limit_cached_prefix(request, value)
            assert cache.start_position(request) == requests[which][1]
        else:
            with pytest.raises(InvalidInputError, match="max_cached_tokens"):
                cache.limit_cached_prefix(request, value)
    else:
        name = {
            "commit": "num_computed_tokens",
            "truncate": "num_tokens|truncate",
            "accept_drafts": "num_accepted",
        }[call]
        with pytest.raises(InvalidInputError, match=name):
            getattr(cache, call)(request, value)
    assert snapshot(cache, names) == before


def test_the_reported_wraps() -> None:
    """The four wraps of the issue, each a plain answer or a typed refusal now."""
    cache, requests = busy_cache()
    done = requests["nothing left"][0]
    waiting = "waiting"
    with pytest.raises(InvalidInputError, match="num_new_tokens"):
        cache.allocate_slots(done, 2**64 - 1)
    with pytest.raises(InvalidInputError, match="num_lookahead_tokens"):
        cache.allocate_slots(waiting, 1, num_lookahead_tokens=2**64 - 1)
    assert cache.block_table(waiting) == []
    # 2**64-2 lookahead slots from position 10 overflow; from position 0 they are a count.
    with pytest.raises(InvalidInputError, match="num_lookahead_tokens"):
        cache.can_allocate_slots(done, 0, num_lookahead_tokens=2**64 - 2)
    assert cache.can_allocate_slots(waiting, 0, num_lookahead_tokens=2**64 - 2) is False
    with pytest.raises(InvalidInputError, match="num_lookahead_tokens"):
        cache.blocks_needed(done, 0, num_lookahead_tokens=2**64 - 1)
    assert cache.blocks_needed(waiting, 0, num_lookahead_tokens=2**64 - 4) == 2**62 - 1


# ----- GroupedPrefixCache ------------------------------------------------------------------


def grouped() -> tuple[GroupedPrefixCache, list]:
    specs = (KVGroupSpec(0, None, (0,)), KVGroupSpec(1, 8, (1,)))
    cache = GroupedPrefixCache(
        specs, (NUM_BLOCKS, NUM_BLOCKS), context=CacheContext(block_size=BS), block_sizes=(8, 4)
    )
    cache.add_request("waiting", list(range(1000, 1010)))
    cache.add_request("done", list(range(16)))
    cache.allocate_slots("done", 16)
    cache.commit("done", 16)
    return cache, ["waiting", "done"]


def grouped_snapshot(cache: GroupedPrefixCache, names) -> tuple:
    stats = cache.stats()
    return (
        tuple((s.blocks_free, s.blocks_cached, s.blocks_in_use, s.lookups) for s in stats.groups),
        tuple(cache.block_tables(n) for n in names),
    )


@given(
    which=st.sampled_from(["waiting", "done"]),
    call=st.sampled_from(
        [
            "allocate_slots:new",
            "allocate_slots:lookahead",
            "allocate_slots:watermark",
            "can_allocate_slots:new",
            "can_allocate_slots:lookahead",
            "can_allocate_slots:watermark",
            "commit",
            "truncate",
            "accept_drafts",
        ]
    ),
    value=edge_counts.filter(lambda v: not 0 <= v < 2**31),
)
def test_grouped_counts_at_the_edges(which, call, value) -> None:
    cache, names = grouped()
    before = grouped_snapshot(cache, names)
    method, _, argument = call.partition(":")
    if argument:
        args = {"num_new_tokens": 0, "num_lookahead_tokens": 0, "watermark_blocks": 0}
        key = {"new": "num_new_tokens", "lookahead": "num_lookahead_tokens"}.get(
            argument, "watermark_blocks"
        )
        args[key] = value
        try:
            answer = getattr(cache, method)(which, **args)
        except OutOfBlocksError:
            # Only a count that fits 64 bits and asks for more blocks than the pool has.
            assert 0 <= value < WIDTH and key != "num_new_tokens"
        except InvalidInputError as error:
            assert key in str(error)
        else:
            # A watermark or lookahead beyond every pool can never be granted.
            assert method == "can_allocate_slots" and answer is False, answer
    else:
        with pytest.raises(PrefixKVError) as raised:
            getattr(cache, method)(which, value)
        assert isinstance(raised.value, InvalidInputError)
    assert grouped_snapshot(cache, names) == before
    cache.check_invariants()
