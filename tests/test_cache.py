"""Behaviour of `PrefixCache` one capability at a time (the state machine covers mixtures)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from hashlib import sha256

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import prefixkv
from prefixkv import (
    AttentionMask,
    BlockStateError,
    CacheContext,
    InvalidBlockError,
    InvalidInputError,
    OutOfBlocksError,
    PositionEncoding,
    PrefixCache,
    PrefixKVError,
    UnknownRequestError,
)
from tests.core_defaults import each_default_core  # noqa: F401  (a fixture)

# Each test runs on the default core as it ships ("auto") and on the block core.
pytestmark = pytest.mark.usefixtures("each_default_core")

BS = 4


def serve(cache: PrefixCache, tokens, generated=(), **kwargs) -> prefixkv.Request:
    """One whole request life: begin, commit the prompt, decode, commit, finish."""
    request = cache.begin(tokens, **kwargs)
    cache.commit(request, len(tokens))
    if generated:
        cache.append(request, list(generated))
        cache.commit(request, len(tokens) + len(generated))
    cache.finish(request)
    return request


def snapshot(cache: PrefixCache) -> tuple:
    stats = cache.stats()
    fields = (
        "lookups",
        "hit_tokens",
        "evictions",
        "blocks_free",
        "blocks_cached",
        "blocks_in_use",
        "blocks_pinned",
    )
    refs = tuple(cache.ref_count(b) for b in range(cache.num_blocks))
    cached = tuple(cache.is_cached(b) for b in range(cache.num_blocks))
    return tuple(getattr(stats, f) for f in fields), refs, cached


def test_second_request_reuses_full_blocks_only():
    cache = PrefixCache(16, block_size=BS)
    first = serve(cache, list(range(10)))
    assert first.num_cached_tokens == 0
    second = cache.begin(list(range(10)))
    # Two full blocks (8 tokens) are shared; the 2-token tail belongs to each request alone.
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert cache.ref_count(second.block_table[0]) == 1
    cache.finish(second)
    assert cache.stats().hit_tokens == 8


def test_full_hit_by_default_recomputes_the_last_block_into_a_private_copy():
    cache = PrefixCache(16, block_size=BS)
    first = serve(cache, list(range(8)))
    again = cache.begin(list(range(8)))
    assert again.full_hit and not again.last_token_shared
    assert again.num_cached_tokens == 8 - BS
    assert again.num_tokens_to_compute == BS
    assert again.block_table[0] == first.block_table[0]
    assert not cache.is_cached(again.block_table[1]), "the runner writes into a private block"
    assert cache.commit(again, 8) == 2
    assert cache.stats().deduplicated_blocks == 1, "the recomputed block is the cached one"
    cache.finish(again)
    cache.check_invariants()


def test_full_hit_in_reuse_mode_recomputes_only_the_last_token_and_allocates_nothing():
    cache = PrefixCache(16, block_size=BS, full_hit="reuse_last_block")
    serve(cache, list(range(8)))
    free_before = cache.stats().blocks_free
    again = cache.begin(list(range(8)))
    assert again.full_hit and again.last_token_shared
    assert again.num_cached_tokens == 7
    assert again.num_tokens_to_compute == 1
    assert len(again.block_table) == 2
    assert all(cache.is_cached(b) for b in again.block_table)
    assert cache.stats().blocks_free == free_before, "a full hit needs no private block"
    cache.finish(again)
    with pytest.raises(InvalidInputError, match="full_hit"):
        PrefixCache(16, block_size=BS, full_hit="share")


def test_next_chat_turn_hits_the_previous_answer():
    cache = PrefixCache(16, block_size=BS)
    turn1 = [1, 2, 3, 4, 5, 6]
    answer = [7, 8, 9, 10, 11]
    serve(cache, turn1, generated=answer)
    turn2 = turn1 + answer + [12, 13, 14]
    request = cache.begin(turn2)
    assert request.num_cached_tokens == 8, "blocks holding the generated answer are reused"
    cache.finish(request)


def test_duplicate_blocks_are_deduplicated_and_kept_as_spares_on_release():
    cache = PrefixCache(16, block_size=BS, core="blocks")
    tokens = list(range(9))
    a = cache.begin(tokens)
    b = cache.begin(tokens)  # both miss: computed concurrently
    assert set(a.block_table).isdisjoint(b.block_table)
    cache.commit(a, 9)
    cache.commit(b, 9)
    assert cache.stats().deduplicated_blocks == 2
    assert all(cache.is_cached(x) for x in a.block_table[:2])
    assert not any(cache.is_cached(x) for x in b.block_table)
    cache.finish(b)
    assert all(cache.ref_count(x) == 0 for x in b.block_table)
    cache.finish(a)
    # b's duplicates are spares, as vLLM keeps its copies cached and free
    # (rust/core/src/pool.rs): cached content, obtainable, not on the free list.
    assert cache.stats().blocks_cached == 4
    assert cache.stats().blocks_free == 12
    assert cache.stats().blocks_obtainable == 16
    cache.check_invariants()
    taken = cache.allocate(16)
    assert sorted(taken) == list(range(16))
    cache.release(taken)
    cache.check_invariants()


def test_eviction_takes_lru_leaves_before_their_parents():
    cache = PrefixCache(4, block_size=BS)
    serve(cache, [*list(range(8)), 99])  # caches A0 <- A1
    serve(cache, [50] * 4 + [99])  # caches B0, newer
    stats = cache.stats()
    assert stats.blocks_cached == 3
    # Needs 2 blocks, 1 free: evicts the LRU leaf A1, never A0 before A1.
    request = cache.begin([70] * 5)
    assert cache.stats().evictions == 1
    assert cache.lookup([*list(range(8)), 0]).num_cached_tokens == 4, "A0 stays; A1 went"
    assert cache.lookup([50] * 4 + [0]).num_cached_tokens == 4
    cache.finish(request)
    cache.check_invariants()


def test_pinned_prefix_survives_pressure_and_unpin_releases_it():
    cache = PrefixCache(4, block_size=BS)
    system = list(range(8))
    serve(cache, [*system, 1])
    pin = cache.pin(system)
    assert pin.num_blocks == 2
    with pytest.raises(OutOfBlocksError):
        cache.begin([9] * 13)  # needs 4 blocks; only 2 can be freed
    big = cache.begin([9] * 8)
    assert cache.lookup([*system, 0]).num_cached_tokens == 8
    cache.finish(big)
    cache.unpin(pin)
    serve(cache, [5] * 16)
    assert cache.lookup([*system, 0]).num_cached_tokens == 0


def test_low_priority_blocks_are_evicted_first():
    cache = PrefixCache(3, block_size=BS)
    serve(cache, [1] * 5, priority=10)  # older but important
    serve(cache, [2] * 5, priority=-1)  # newer but disposable
    request = cache.begin([3] * 5)
    assert cache.lookup([1] * 5).num_cached_tokens == 4
    assert cache.lookup([2] * 5).num_cached_tokens == 0
    cache.finish(request)


def test_out_of_blocks_changes_nothing():
    cache = PrefixCache(4, block_size=BS)
    serve(cache, list(range(8)))
    held = cache.begin([*list(range(8)), 1])
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match="out of KV blocks"):
        cache.begin(list(range(100, 117)))
    with pytest.raises(MemoryError):
        cache.append(held, [1] * 12)
    assert snapshot(cache) == before
    cache.finish(held)


def test_clear_detaches_referenced_blocks_and_stops_publishing():
    cache = PrefixCache(16, block_size=BS, core="blocks")
    serve(cache, list(range(8)))
    live = cache.begin([*list(range(8)), 1, 2, 3, 4, 5])
    cache.clear()
    assert cache.lookup(list(range(9))).num_cached_tokens == 0
    assert cache.stats().blocks_cached == 0
    assert cache.ref_count(live.block_table[0]) == 1, "a live request keeps reading its blocks"
    cache.commit(live, 13)  # computed under the old weights: must not be published
    assert cache.stats().blocks_cached == 0
    cache.finish(live)
    stats = cache.stats()
    assert (stats.blocks_free, stats.blocks_in_use) == (16, 0)


# ----- what must match -------------------------------------------------------------------------

CONTEXT_CHANGES = {
    "model_id": "other-model",
    "weights_digest": "sha256:abc",
    "tokenizer_id": "other-tokenizer",
    "tokenizer_digest": "d1",
    "chat_template_version": "v2",
    "position_encoding": PositionEncoding(rope_theta=500000.0),
    "adapters": ("lora-a",),
    "attention_mask": AttentionMask(kind="sliding_window", sliding_window=4096),
    "kv_dtype": "bfloat16",
    "kv_quantization": "fp8",
    "extra": {"sink_tokens": 4},
}
POSITION_CHANGES = {
    "kind": "alibi",
    "rope_theta": 10000.5,
    "rope_scaling": "linear",
    "rope_scaling_params": (("factor", 2.0),),
    "position_offset": 1,
}


def test_every_context_field_is_covered():
    names = {f.name for f in dataclasses.fields(CacheContext)} - {"block_size"}
    assert names == set(CONTEXT_CHANGES)
    assert {f.name for f in dataclasses.fields(PositionEncoding)} == set(POSITION_CHANGES)


@pytest.mark.parametrize(
    "changed",
    [dataclasses.replace(CacheContext(block_size=BS), **{k: v}) for k, v in CONTEXT_CHANGES.items()]
    + [
        CacheContext(
            block_size=BS, position_encoding=dataclasses.replace(PositionEncoding(), **{k: v})
        )
        for k, v in POSITION_CHANGES.items()
    ],
)
def test_changing_any_context_field_misses_everything(changed):
    base = CacheContext(block_size=BS)
    assert changed.fingerprint() != base.fingerprint()
    tokens = list(range(12))
    cache = PrefixCache(16, context=base)
    serve(cache, tokens)
    assert cache.lookup(tokens).num_cached_tokens > 0
    cache.set_context(changed)
    assert cache.lookup(tokens).num_cached_tokens == 0
    # Even blocks published under the new context are not found under the old one.
    serve(cache, tokens)
    other = PrefixCache(16, context=base)
    assert other.lookup(tokens).num_cached_tokens == 0


def test_context_fingerprint_is_deterministic_across_processes():
    code = (
        "from prefixkv import CacheContext, PositionEncoding;"
        "print(CacheContext(model_id='m', position_encoding=PositionEncoding(rope_theta=1e6),"
        " extra={'b': 1, 'a': 2.5}).fingerprint().hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = CacheContext(
        model_id="m", position_encoding=PositionEncoding(rope_theta=1e6), extra={"a": 2.5, "b": 1}
    )
    assert out.stdout.strip() == here.fingerprint().hex()


@pytest.mark.parametrize("kind", ["dynamic", "Dynamic", "dynamic_ntk", "longrope", "new-kind"])
def test_length_dependent_or_unknown_rope_is_refused(kind):
    context = CacheContext(position_encoding=PositionEncoding(rope_scaling=kind))
    with pytest.raises(InvalidInputError, match="depends on the total sequence length"):
        PrefixCache(8, context=context)


@pytest.mark.parametrize("kind", [None, "linear", "ntk", "yarn", "llama3", "Linear"])
def test_static_rope_scaling_is_accepted(kind):
    PrefixCache(8, context=CacheContext(position_encoding=PositionEncoding(rope_scaling=kind)))


def test_a_float_and_its_hex_string_are_different_contexts():
    as_float = CacheContext(extra={"kv_scale": 0.5})
    as_string = CacheContext(extra={"kv_scale": (0.5).hex()})
    assert as_float.fingerprint() != as_string.fingerprint()


def test_salt_adapter_and_multimodal_items_isolate():
    cache = PrefixCache(32, block_size=BS)
    tokens = list(range(12))
    serve(cache, tokens, salt="tenant-a", adapter="lora-1", multimodal=[(4, 4, b"img-1")])
    assert (
        cache.lookup(
            tokens, salt="tenant-a", adapter="lora-1", multimodal=[(4, 4, b"img-1")]
        ).num_cached_tokens
        == 12 - BS  # a full hit recomputes its last block
    )
    assert (
        cache.lookup(tokens, adapter="lora-1", multimodal=[(4, 4, b"img-1")]).num_cached_tokens == 0
    )
    assert (
        cache.lookup(
            tokens, salt="tenant-b", adapter="lora-1", multimodal=[(4, 4, b"img-1")]
        ).num_cached_tokens
        == 0
    )
    assert (
        cache.lookup(tokens, salt="tenant-a", multimodal=[(4, 4, b"img-1")]).num_cached_tokens == 0
    )
    assert (
        cache.lookup(
            tokens, salt="tenant-a", adapter="lora-2", multimodal=[(4, 4, b"img-1")]
        ).num_cached_tokens
        == 0
    )
    # A different image: the block before it still hits, the blocks from the image on do not.
    assert (
        cache.lookup(
            tokens, salt="tenant-a", adapter="lora-1", multimodal=[(4, 4, b"img-2")]
        ).num_cached_tokens
        == 4
    )
    # Same image, shifted by one token within the block: a different alignment, a miss.
    assert (
        cache.lookup(
            tokens, salt="tenant-a", adapter="lora-1", multimodal=[(5, 4, b"img-1")]
        ).num_cached_tokens
        == 4
    )


# ----- keys ------------------------------------------------------------------------------------


def test_block_keys_follow_the_documented_layout():
    """Recompute keys from the byte layout in docs/design.md with hashlib: another component can too."""
    context = CacheContext(block_size=BS, model_id="m")
    cache = PrefixCache(4, context=context)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    fingerprint = sha256(b"prefixkv.context.v1\0" + context.canonical_bytes()).digest()
    assert fingerprint == context.fingerprint()

    def root(salt: bytes) -> bytes:
        return sha256(
            b"prefixkv.root.v1\0" + fingerprint + len(salt).to_bytes(4, "little") + salt
        ).digest()

    def little_endian(block: list[int]) -> bytes:
        return b"".join(t.to_bytes(4, "little") for t in block)

    parent, expected = root(b"t"), []
    for i in range(2):
        block = tokens[i * BS : (i + 1) * BS]
        parent = sha256(b"\x00" + parent + little_endian(block)).digest()
        expected.append(parent)
    assert cache.block_keys(tokens, salt=b"t") == expected

    # With an adapter, the block's extras come between the parent and the tokens.
    extras = b"\x01" + (4).to_bytes(4, "little") + b"lora"
    first = sha256(
        b"\x01"
        + root(b"")
        + len(extras).to_bytes(4, "little")
        + extras
        + little_endian(tokens[:BS])
    ).digest()
    assert cache.block_keys(tokens, adapter="lora")[0] == first


def test_forced_collisions_never_give_a_wrong_hit():
    """With 4-bit keys most distinct blocks collide; every hit must still be the right KV."""
    rng = np.random.default_rng(0)
    cache = PrefixCache(64, block_size=2, _key_bits=4)
    content: dict[int, tuple] = {}  # block id -> (salt, token prefix) its KV was computed for
    for _ in range(400):
        stem = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 9)))]
        salt = str(int(rng.integers(0, 2)))
        request = cache.begin(stem, salt=salt)
        for i, block in enumerate(
            request.block_table[: request.num_cached_tokens // 2 + request.last_token_shared]
        ):
            if i * 2 < request.num_cached_tokens or request.last_token_shared:
                assert content[block] == (salt, tuple(stem[: (i + 1) * 2])), "wrong KV returned"
        for i, block in enumerate(request.block_table):
            if not cache.is_cached(block):
                content[block] = (salt, tuple(stem[: (i + 1) * 2]))
        cache.commit(request, len(stem))
        cache.finish(request)
        cache.check_invariants()
    stats = cache.stats()
    assert stats.collisions > 0, "the test must actually produce collisions"
    assert stats.hit_tokens > 0


# ----- token id formats and bad input -----------------------------------------------------------


def test_small_integer_dtypes_read_the_same_ids():
    cache = PrefixCache(16, block_size=BS)
    tokens = [1, 2, 3, 4, 5, 100, 7, 8, 9]
    serve(cache, tokens)
    for dtype in (np.int8, np.uint8, np.int16, np.uint16):
        assert cache.lookup(np.array(tokens, dtype=dtype)).num_cached_tokens == 8


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.int64)[::1],
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # strided view
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=">i8"),  # big-endian
        lambda t: np.array(t[::-1], dtype=np.int64)[::-1],  # negative stride
        lambda t: np.frombuffer(
            b"\0" + np.array(t, "<i8").tobytes(), "<i8", offset=1
        ),  # misaligned, read-only
        lambda t: np.repeat(np.array(t, dtype=np.uint32), 3)[1::3],  # strided, 4-byte
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t, dtype=torch.int32),
    ],
)
def test_token_id_formats_agree(convert):
    """Every integer width and byte order reads as the same ids (the core narrows them)."""
    cache = PrefixCache(16, block_size=BS)
    tokens = [5, 1, 2, 3, 4, 4000000000 % 2**31, 7, 8, 9]
    serve(cache, tokens)
    assert cache.lookup(convert(tokens)).num_cached_tokens == 8


@given(
    ids=st.lists(st.integers(0, 127), min_size=1, max_size=40),
    code=st.sampled_from(["i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8"]),
    byteorder=st.sampled_from("<>"),
    step=st.sampled_from([1, 2, 3, -1, -2]),
    misaligned=st.booleans(),
)
def test_any_integer_array_reads_as_its_list(ids, code, byteorder, step, misaligned):
    """The core reads an array in place (or gathers a strided one): whatever its dtype, byte
    order, stride or alignment, it holds the ids the same list does (checked through the
    SHA-256 block keys, which cover every id of every block)."""
    cache = PrefixCache(64, block_size=BS)
    dtype = np.dtype(code).newbyteorder(byteorder)
    backing = np.zeros(len(ids) * abs(step), dtype=dtype)
    view = backing[:: abs(step)] if step > 0 else backing[::step]
    view[:] = ids
    if misaligned and dtype.itemsize > 1:
        raw = b"\0" + view.tobytes()
        view = np.frombuffer(raw, dtype=dtype, offset=1)
    assert view.tolist() == ids
    assert cache.block_keys(view) == cache.block_keys(ids)


def test_an_array_is_read_once_and_may_change_after_the_call():
    """The core reads a numpy array in place, into its own copy: writing to the array after
    `begin` returns changes nothing the cache holds."""
    cache = PrefixCache(16, block_size=BS)
    tokens = np.arange(1, 10, dtype=np.int64)
    request = cache.begin(tokens)
    tokens[:] = 7
    cache.commit(request, request.num_prompt_tokens)
    cache.finish(request)
    assert cache.lookup(list(range(1, 10))).num_cached_tokens == 8
    assert cache.lookup([7] * 9).num_cached_tokens == 0


def test_a_broadcast_array_reads_its_repeated_id():
    cache = PrefixCache(16, block_size=BS)
    serve(cache, [5] * 9)
    assert cache.lookup(np.broadcast_to(np.int64(5), (9,))).num_cached_tokens == 8


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ((np.zeros((2, 4), dtype=np.int64), 8, True), "one-dimensional, got 2 dimensions"),
        ((np.zeros(4, dtype=np.int64), 4, True), "announced 4-byte ids, its items are 8 bytes"),
        ((object(), 8, True), "bytes or a one-dimensional integer array"),
        ((b"\0" * 7, 8, True), "not a whole number of 8-byte ids"),
        ((np.zeros(4, dtype=np.int64), 3, True), "width of 1, 2, 4 or 8"),
        ((np.broadcast_to(np.int64(1), (2**59,)), 8, False), "too large to copy"),
        ((1, 2, True), "position 2 must be an int, not bool"),
    ],
)
def test_the_core_refuses_a_malformed_packed_array(tokens, message):
    """The core's `(data, width, signed)` form, which `as_token_ids` builds, checked by the core
    itself: a caller of `_core` directly gets a typed error for a malformed one (its shape,
    item size and width; what the ids mean is the caller's word, as for `bytes`)."""
    cache = PrefixCache(8, block_size=BS)
    serve(cache, list(range(8)))
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match=message):
        cache._core.lookup(tokens, prefixkv.KeyExtras())
    assert snapshot(cache) == before


BAD_TOKENS = [
    ([1, -2, 3], InvalidInputError, "position 1"),
    ([1, 2**32], InvalidInputError, "out of range"),
    ([1, "a"], InvalidInputError, "must be an int, not str"),
    (np.array([1, -5], dtype=np.int64), InvalidInputError, "negative"),
    (np.array([1, 2**40], dtype=np.int64), InvalidInputError, "out of range"),
    (np.array([1, 2, 2**63], dtype=np.uint64), InvalidInputError, "position 2 is out of range"),
    (np.array([3, -1], dtype=np.int16), InvalidInputError, "-1 at position 1 is negative"),
    (np.array([-128], dtype=np.int8), InvalidInputError, "-128 at position 0 is negative"),
    (np.array([1.0, 2.0]), InvalidInputError, "integer dtype"),
    (np.zeros((2, 2), dtype=np.int32), InvalidInputError, "one-dimensional"),
    (torch.tensor([1, -1]), InvalidInputError, "negative"),
    ({1, 2}, InvalidInputError, "list, tuple"),
    # The core's packed form, never reachable from the public calls (a float array's bits
    # would read as ids): a tuple of ids never holds a bool.
    ((np.arange(8, dtype=np.float32), 4, False), InvalidInputError, "position 2 .* not bool"),
    ((1, 2, True), InvalidInputError, "position 2 .* not bool"),
]


@pytest.mark.parametrize(("tokens", "error", "message"), BAD_TOKENS)
def test_bad_token_ids_are_refused_and_change_nothing(tokens, error, message):
    cache = PrefixCache(8, block_size=BS)
    serve(cache, list(range(8)))
    before = snapshot(cache)
    for call in (cache.begin, cache.lookup):
        with pytest.raises(error, match=message):
            call(tokens)
    assert snapshot(cache) == before


def test_vocab_size_is_enforced():
    cache = PrefixCache(8, block_size=BS, vocab_size=100)
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        cache.begin([1, 2, 100])


def test_bad_calls_raise_typed_errors_and_change_nothing():
    cache = PrefixCache(8, block_size=BS, core="blocks")
    request = cache.begin(list(range(6)))
    raw = cache.allocate(1)
    before = snapshot(cache)
    cases = [
        (lambda: cache.finish(12345), UnknownRequestError, KeyError),
        (lambda: cache.commit(request, 7), InvalidInputError, ValueError),
        (lambda: cache.commit(request, -1), InvalidInputError, ValueError),
        (lambda: cache.append(999, [1]), UnknownRequestError, KeyError),
        (lambda: cache.release([raw[0], raw[0]]), BlockStateError, ValueError),
        (lambda: cache.release([100]), InvalidBlockError, KeyError),
        (lambda: cache.release([-1]), InvalidBlockError, KeyError),
        (lambda: cache.commit_blocks([1, 2, 3], raw), BlockStateError, ValueError),
        (lambda: cache.commit_blocks(list(range(8)), [5, raw[0]]), InvalidBlockError, KeyError),
        (lambda: cache.allocate(-1), InvalidInputError, ValueError),
        (lambda: cache.allocate(100), OutOfBlocksError, MemoryError),
        (lambda: cache.unpin(42), UnknownRequestError, KeyError),
        (lambda: cache.begin([]), InvalidInputError, ValueError),
        (lambda: cache.begin([1], salt=3), InvalidInputError, ValueError),
        (lambda: cache.begin([1], multimodal=[(0, -1, b"x")]), InvalidInputError, ValueError),
        (lambda: cache.set_context(CacheContext(block_size=8)), InvalidInputError, ValueError),
    ]
    for call, error, builtin in cases:
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, (PrefixKVError, builtin))
        assert isinstance(info.value, builtin)
        assert str(info.value), "the message names the problem"
        assert snapshot(cache) == before, f"{call} changed the cache"
    cache.finish(request)
    with pytest.raises(UnknownRequestError, match="already finished"):
        cache.finish(request)
    cache.release(raw)
    with pytest.raises(BlockStateError, match="double release"):
        cache.release(raw)


def test_low_level_calls_compose_like_a_request():
    cache = PrefixCache(8, block_size=BS)
    tokens = list(range(10))
    blocks = cache.allocate(3)
    assert cache.commit_blocks(tokens, blocks[:2]) == blocks[:2]
    cache.release(blocks)
    matched = cache.match_and_acquire(tokens)
    assert matched.block_ids == blocks[:2] and matched.num_cached_tokens == 8
    assert cache.ref_count(blocks[0]) == 1
    # Someone else computed the same blocks: they dedupe to the cached copies.
    other = cache.allocate(2)
    assert cache.commit_blocks(tokens, other) == blocks[:2]
    cache.release(other + matched.block_ids)
    assert cache.stats().blocks_in_use == 0
    cache.check_invariants()


def test_constructor_validation():
    with pytest.raises(InvalidInputError):
        PrefixCache(0)
    with pytest.raises(InvalidInputError):
        PrefixCache(8, block_size=0)
    with pytest.raises(InvalidInputError, match="differs"):
        PrefixCache(8, block_size=8, context=CacheContext(block_size=16))


# ----- found in review: each of these once broke a promise above ------------------------------


def test_low_level_blocks_computed_before_clear_are_never_published():
    cache = PrefixCache(8, block_size=BS)
    blocks = cache.allocate(1)
    matched_before = cache.allocate(1)
    cache.commit_blocks([9, 9, 9, 9], matched_before)
    held = cache.match_and_acquire([9, 9, 9, 9, 1])
    cache.set_context(CacheContext(block_size=BS, weights_digest="v2"))
    before = snapshot(cache)
    for stale in (blocks, held.block_ids):
        with pytest.raises(BlockStateError, match="before clear"):
            cache.commit_blocks([1, 2, 3, 4], stale)
    assert snapshot(cache) == before
    assert cache.lookup([1, 2, 3, 4, 5]).num_cached_tokens == 0
    fresh = cache.allocate(1)
    assert cache.commit_blocks([1, 2, 3, 4], fresh) == fresh
    cache.release(blocks + held.block_ids + fresh + matched_before)
    assert cache.stats().blocks_in_use == 0


def test_release_cannot_drop_a_reference_a_request_owns():
    cache = PrefixCache(8, block_size=BS, core="blocks")
    request = cache.begin([1, 2, 3, 4, 5])
    before = snapshot(cache)
    with pytest.raises(BlockStateError, match="a block a request owns"):
        cache.release(request.block_table[:1])
    assert snapshot(cache) == before
    cache.finish(request)
    assert cache.stats().blocks_in_use == 0


def test_huge_counts_raise_instead_of_aborting():
    cache = PrefixCache(8, block_size=BS)
    for count in (2**40, 2**62):
        with pytest.raises(OutOfBlocksError):
            cache.allocate(count)
    # Refused by its figure before allocating (issue 20): never an OutOfBlocksError, since no
    # block was asked for.
    with pytest.raises(InvalidInputError, match="bytes up front"):
        PrefixCache(2**32 - 1, block_size=BS)


def test_integer_arguments_out_of_range_raise_prefixkv_errors():
    cache = PrefixCache(8, block_size=BS)
    with pytest.raises(UnknownRequestError):
        cache.finish(-1)  # a valid id, never added
    for bad in (2**64, 2**100):
        with pytest.raises(InvalidInputError, match="64-bit signed range"):
            cache.finish(bad)
        with pytest.raises(InvalidInputError, match="64-bit signed range"):
            cache.commit(bad, 0)
    with pytest.raises(InvalidInputError, match="priority"):
        cache.begin([1, 2], priority=2**31)
    with pytest.raises(InvalidInputError, match="must be an int"):
        cache.commit_blocks([1, 2, 3, 4], [0.5])
    with pytest.raises(InvalidBlockError):
        cache.release([2**70])
    with pytest.raises(InvalidInputError):
        cache.unpin(-1)
    assert cache.stats().blocks_in_use == 0


def test_multimodal_item_length_is_part_of_the_key():
    cache = PrefixCache(16, block_size=BS)
    placeholder = 7
    serve(cache, [placeholder] * 4 + [1, 2, 3, 4, 5], multimodal=[(0, 4, b"img")])
    # The same image at the same place, encoded to more placeholder tokens: different KV.
    longer = [placeholder] * 8 + [5]
    assert cache.lookup(longer, multimodal=[(0, 8, b"img")]).num_cached_tokens == 0


def test_a_low_priority_hit_does_not_demote_a_protected_prefix():
    cache = PrefixCache(3, block_size=BS)
    serve(cache, [1] * 5, priority=10)
    serve(cache, [1] * 5, priority=-5)  # hits the protected block with a low priority
    serve(cache, [2] * 5)  # newer, default priority
    request = cache.begin([3] * 5)  # needs two blocks: one free, one evicted
    assert cache.lookup([1] * 5).num_cached_tokens == 4, "the protected prefix stays"
    assert cache.lookup([2] * 5).num_cached_tokens == 0
    cache.finish(request)
