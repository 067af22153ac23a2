"""Conformance of the published KV events with vLLM's wire format.

Two independent references, neither taken from prefixkv's own `wire.py`:
- expected payload bytes written by hand from the msgpack specification and vLLM's struct
  options: the batch a positional array of all its fields (msgspec's `omit_defaults` leaves
  fields out of maps only, so the rank is there, nil when unset), each event a map tagged
  ``"type"`` with its fields in declaration order, the defaulted ones left out;
- a decoder declared here from vLLM's `vllm/distributed/kv_events.py` struct definitions, field
  for field, fed the frames a real cache publishes over ZMQ.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import msgspec
import pytest
import zmq

from prefixkv import CacheContext, PrefixCache
from prefixkv.errors import InvalidInputError
from prefixkv.events import PrefixIndex, hash64, prompt_hashes
from prefixkv.events.publisher import KVEventPublisher, wire_events
from prefixkv.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

# --- vLLM's structs, declared from its source (options and fields as vLLM declares them) -------


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


vllm_decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
vllm_encoder = msgspec.msgpack.Encoder()

# --- msgpack, by the specification ------------------------------------------------------------


def mp_str(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 32
    return bytes([0xA0 | len(data)]) + data


def mp_uint(value: int) -> bytes:
    if value < 128:
        return bytes([value])
    if value < 256:
        return b"\xcc" + bytes([value])
    if value < 65536:
        return b"\xcd" + struct.pack(">H", value)
    if value < 2**32:
        return b"\xce" + struct.pack(">I", value)
    return b"\xcf" + struct.pack(">Q", value)


def mp_array(items: list[bytes]) -> bytes:
    assert len(items) < 16
    return bytes([0x90 | len(items)]) + b"".join(items)


def mp_map(pairs: list[tuple[str, bytes]]) -> bytes:
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(mp_str(k) + v for k, v in pairs)


NIL = b"\xc0"


def mp_float(value: float) -> bytes:
    return b"\xcb" + struct.pack(">d", value)


def mp_bin(data: bytes) -> bytes:
    return b"\xc4" + bytes([len(data)]) + data


# --- the cases --------------------------------------------------------------------------------


def small_cache(num_blocks: int = 8, block_size: int = 2) -> PrefixCache:
    return PrefixCache(num_blocks, context=CacheContext(model_id="wire", block_size=block_size))


def test_payload_bytes_are_vllms_encoding() -> None:
    events = [
        BlockStored(
            block_hashes=[2**64 - 1, 7],
            parent_block_hash=None,
            token_ids=[1, 300],
            block_size=1,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    ]
    expected = mp_array(
        [
            mp_float(1.5),
            mp_array(
                [
                    mp_map(
                        [
                            ("type", mp_str("BlockStored")),
                            ("block_hashes", mp_array([mp_uint(2**64 - 1), mp_uint(7)])),
                            ("parent_block_hash", NIL),
                            ("token_ids", mp_array([mp_uint(1), mp_uint(300)])),
                            ("block_size", mp_uint(1)),
                            ("lora_id", NIL),
                            ("medium", mp_str("GPU")),
                            ("lora_name", NIL),
                        ]
                    ),
                    mp_map(
                        [
                            ("type", mp_str("BlockRemoved")),
                            ("block_hashes", mp_array([mp_uint(7)])),
                            ("medium", mp_str("GPU")),
                        ]
                    ),
                    mp_map([("type", mp_str("AllBlocksCleared"))]),
                ]
            ),
            NIL,
        ]
    )
    assert encode_batch(KVEventBatch(ts=1.5, events=events)) == expected
    # A rank goes third; bytes hashes are msgpack bin.
    with_rank = KVEventBatch(
        ts=1.5,
        events=[BlockRemoved(block_hashes=[b"\x01" * 32], medium=None)],
        data_parallel_rank=3,
    )
    assert encode_batch(with_rank) == mp_array(
        [
            mp_float(1.5),
            mp_array(
                [
                    mp_map(
                        [
                            ("type", mp_str("BlockRemoved")),
                            ("block_hashes", mp_array([mp_bin(b"\x01" * 32)])),
                            ("medium", NIL),
                        ]
                    )
                ]
            ),
            mp_uint(3),
        ]
    )


def subscribe(endpoint: str, topic: bytes) -> Any:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub: Any, timeout_ms: int = 5000) -> list[bytes]:
    assert sub.poll(timeout_ms), "no frame arrived"
    return sub.recv_multipart()


def settle(publisher: KVEventPublisher, sub: Any) -> None:
    """PUB drops what is sent before a subscription lands: wait for it with probe batches."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        publisher.socket.publish([])
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("subscription never became live")


@pytest.mark.parametrize("hashes", ["int64", "bytes"])
def test_published_frames_decode_with_vllms_structs(hashes: str) -> None:
    cache = small_cache()
    with KVEventPublisher(
        cache, "tcp://127.0.0.1:*", topic="kv@pod0@model", hashes=hashes, data_parallel_rank=0
    ) as publisher:  # type: ignore[arg-type]
        sub = subscribe(publisher.endpoint, b"kv@pod0@model")
        try:
            settle(publisher, sub)
            first_seq = publisher.socket.next_sequence
            prompt = [5, 6, 7, 8, 9]
            request = cache.begin(prompt, salt="t")
            cache.commit(request, 5)
            cache.finish(request)
            publisher.flush()
            topic, seq, payload = receive(sub)
            assert topic == b"kv@pod0@model"
            assert int.from_bytes(seq, "big") == first_seq and len(seq) == 8
            batch = vllm_decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            (stored,) = batch.events
            assert isinstance(stored, VllmBlockStored)
            keys = cache.block_keys(prompt, salt="t")
            want = [hash64(k) for k in keys] if hashes == "int64" else keys
            assert stored.block_hashes == want
            assert stored.parent_block_hash is None
            assert stored.token_ids == [5, 6, 7, 8]
            assert stored.block_size == 2
            assert stored.medium == "GPU"
            assert stored.lora_name is None and stored.extra_keys is None
            cache.clear()
            publisher.flush()
            _, seq2, payload = receive(sub)
            assert int.from_bytes(seq2, "big") == first_seq + 1
            assert vllm_decoder.decode(payload).events == [VllmAllBlocksCleared()]
        finally:
            sub.close(linger=0)


def test_replay_returns_kept_batches_then_the_end_marker() -> None:
    cache = small_cache()
    with KVEventPublisher(
        cache, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="t", buffer_steps=2
    ) as publisher:
        for tokens in ([1, 2], [3, 4], [5, 6]):
            request = cache.begin(tokens)
            cache.commit(request, 2)
            cache.finish(request)
            publisher.flush()
        assert publisher.replay_endpoint is not None
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(publisher.replay_endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = []
            while True:
                assert dealer.poll(5000)
                frame = dealer.recv_multipart()
                frames.append(frame)
                if int.from_bytes(frame[-2], "big", signed=True) == -1:
                    break
        finally:
            dealer.close(linger=0)
        # Only the last two batches are kept: 1 and 2, each [b"", topic, seq, payload].
        assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [1, 2]
        assert all(f[1] == b"t" for f in frames[:-1])
        assert frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        stored = vllm_decoder.decode(frames[-2][3]).events[0]
        assert stored.token_ids == [5, 6]


def test_vllm_shaped_batches_round_trip_through_the_index() -> None:
    # What a vLLM instance sends (bytes hashes, with its optional fields set), decoded by our
    # decoder and applied to the index beside a prefixkv instance.
    h = [bytes([i]) * 32 for i in range(1, 5)]
    vllm_batch = VllmKVEventBatch(
        ts=2.0,
        events=[
            VllmBlockStored(
                block_hashes=h[:3],
                parent_block_hash=None,
                token_ids=list(range(48)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            VllmBlockRemoved(block_hashes=[h[2]], medium="GPU", group_idx=0),
        ],
        data_parallel_rank=0,
    )
    decoded = decode_batch(vllm_encoder.encode(vllm_batch))
    assert isinstance(decoded.events[0], BlockStored)
    assert decoded.events[0].group_idx == 0
    index = PrefixIndex(["vllm", "prefixkv"])
    index.apply("vllm", decoded, seq=0)
    assert index.score([hash64(x) for x in h]) == {"vllm": 2, "prefixkv": 0}
    # int and bytes forms of one hash are one block.
    assert hash64(h[0]) == int.from_bytes(h[0], "big") & (2**64 - 1)
    index.remove("vllm", [hash64(h[0])])
    assert index.score([hash64(x) for x in h]) == {"vllm": 0, "prefixkv": 0}
    # A prefixkv cache's batch lands in the same index, and its router hashes match.
    cache = small_cache()
    from prefixkv.events import EventRecorder

    recorder = EventRecorder(cache)
    request = cache.begin([1, 2, 3, 4, 5])
    cache.commit(request, 5)
    events = wire_events(recorder.drain().events, block_size=2, medium="GPU")
    index.apply("prefixkv", decode_batch(encode_batch(KVEventBatch(ts=0.0, events=events))), 0)
    assert index.score(prompt_hashes(cache, [1, 2, 3, 4, 5])) == {"vllm": 0, "prefixkv": 2}


@pytest.mark.parametrize("hashes", ["int64", "bytes"])
@pytest.mark.parametrize("medium", ["GPU", None])
def test_the_rust_encoding_is_msgspecs_byte_for_byte(hashes: str, medium: str | None) -> None:
    from prefixkv import _core
    from prefixkv.events import EventRecorder
    from prefixkv.events.wire import batch_payload

    c = small_cache(num_blocks=64, block_size=16)
    recorder = EventRecorder(c)
    long_adapter = "adapter-" + "x" * 40  # a str8, not a fixstr
    tokens = [t * 977 % 200_000 for t in range(20 * 16)]  # every int width, array16 lists
    request = c.begin(tokens, adapter=long_adapter, multimodal=[(3, 40, "img")])
    c.commit(request, len(tokens))
    c.finish(request)
    c.clear()
    request = c.begin(tokens[:40], salt="s")
    c.commit(request, 40)
    c.finish(request)
    serve_all = c.begin(list(range(64 * 16)))  # evicts everything else
    c.finish(serve_all)
    events = recorder.drain().events
    assert {e.kind for e in events} == {"stored", "removed", "cleared"}
    structs = wire_events(events, block_size=16, hashes=hashes, medium=medium)  # type: ignore[arg-type]
    for rank in (None, 0, 300):
        expected = encode_batch(KVEventBatch(ts=123.25, events=structs, data_parallel_rank=rank))
        encoded = _core.encode_events(events, 16, hashes, medium)
        assert batch_payload(123.25, encoded, rank) == expected
    with pytest.raises(InvalidInputError):
        _core.encode_events(events, 16, "hex", medium)


def test_malformed_payloads_are_typed_errors() -> None:
    with pytest.raises(InvalidInputError):
        decode_batch(b"\x93\x01")
    with pytest.raises(InvalidInputError):
        decode_batch(vllm_encoder.encode([1.0, [{"type": "Nope"}]]))


def test_a_subscriber_clears_a_view_it_cannot_trust() -> None:
    from prefixkv.events import Endpoint, EventSubscriber, ZmqEventPublisher

    stored = [
        BlockStored(
            block_hashes=[n],
            parent_block_hash=None,
            token_ids=[],
            block_size=16,
            lora_id=None,
            medium=None,
            lora_name=None,
        )
        for n in (1, 2, 3)
    ]
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=1) as pub:
        assert pub.replay_endpoint is not None
        for event in stored:  # only the last is kept for replay
            pub.publish([event])
        index = PrefixIndex(["a"])
        endpoint = {"a": Endpoint(pub.endpoint, pub.replay_endpoint)}
        with EventSubscriber(index, endpoint) as subscriber:
            assert subscriber.wait_for("a", 2)
            # Batches 0 and 1 are gone for good: the view restarts from what follows.
            assert subscriber.unrecoverable_gaps == 1
            assert index.blocks_of("a") == [3]
            seq = pub.publish_payload(b"\xc1 not msgpack")
            assert subscriber.wait_for("a", seq)
            assert subscriber.decode_errors == 1
            assert index.blocks_of("a") == []


def test_a_batch_lost_last_is_recovered_after_a_quiet_spell() -> None:
    from prefixkv.events import Endpoint, EventSubscriber, ZmqEventPublisher

    with (
        ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        ZmqEventPublisher("tcp://127.0.0.1:*") as silent,
    ):
        assert pub.replay_endpoint is not None
        index = PrefixIndex(["a"])
        # Live frames come from a socket that never sends: only replays can deliver.
        endpoint = {"a": Endpoint(silent.endpoint, pub.replay_endpoint)}
        with EventSubscriber(index, endpoint, idle_replay=0.1) as subscriber:
            seq = pub.publish([BlockRemoved(block_hashes=[1], medium=None), AllBlocksCleared()])
            assert subscriber.wait_for("a", seq, timeout=5)
            assert subscriber.replayed_batches == 1
