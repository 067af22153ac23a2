"""The event subscriber and the replay socket against hostile and awkward peers: frames of every
shape, payloads nested deeper than a decoder recurses, replay sockets that answer with one frame
or never stop, sequence numbers that jump to 2**63, and a consumer too slow for ZMQ's default
high-water mark. The subscriber's thread must survive every frame, bound every replay, and say
what it saw (`status()`); each class of frame is a hypothesis strategy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest
import zmq
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from prefixkv.errors import InvalidInputError
from prefixkv.events import PrefixIndex
from prefixkv.events.publisher import ZmqEventPublisher
from prefixkv.events.subscriber import Endpoint, EventSubscriber, SubscriberFailedError
from prefixkv.events.wire import BlockStored, KVEventBatch, decode_batch, encode_batch

END = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def stored(*hashes: int) -> bytes:
    """A genuine batch storing `hashes`."""
    event = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    return encode_batch(KVEventBatch(ts=0.0, events=[event]))


def nested_extra_keys(depth: int) -> bytes:
    """A BlockStored batch whose `extra_keys` is a list nested `depth` deep (msgpack by hand:
    building it as Python objects would itself recurse)."""
    event = msgspec.msgpack.encode(
        {
            "type": "BlockStored",
            "block_hashes": [7],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 16,
            "lora_id": None,
            "medium": None,
            "lora_name": None,
        }
    )
    assert event[0] == 0x88  # a fixmap of 8 pairs; one more below
    extra = msgspec.msgpack.encode("extra_keys") + b"\x91" * depth + b"\xc0"
    return b"\x93\xcb" + bytes(8) + b"\x91" + b"\x89" + event[1:] + extra + b"\xc0"


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.002)
    return condition()


class HostileReplay:
    """A ROUTER socket answering every replay request with what `answer(start)` yields
    (frames after the client's routing id), on a thread."""

    def __init__(self, answer: Callable[[int], Iterator[list[bytes]]]) -> None:
        self.answer = answer
        self.requests = 0
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._running:
            if not self._socket.poll(20):
                continue
            client, *request = self._socket.recv_multipart()
            self.requests += 1
            for frames in self.answer(int.from_bytes(request[-1], "big")):
                if not self._running:
                    break
                try:
                    self._socket.send_multipart([client, *frames], zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)

    def close(self) -> None:
        self._running = False
        self._thread.join(5.0)
        self._socket.close(linger=0)


@contextmanager
def hostile_peer(
    answer: Callable[[int], Iterator[list[bytes]]] | None = None, **options: object
) -> Iterator[tuple[zmq.Socket[bytes], EventSubscriber, PrefixIndex]]:
    """A raw PUB socket (frames exactly as the test writes them), an optional hostile replay
    socket, and a subscriber on both, with its subscription landed."""
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    replay = HostileReplay(answer) if answer is not None else None
    index = PrefixIndex(["a"])
    endpoint = Endpoint(pub.getsockopt_string(zmq.LAST_ENDPOINT), replay and replay.endpoint)
    subscriber = EventSubscriber(index, {"a": endpoint}, **options)  # type: ignore[arg-type]
    try:
        # A frame of the wrong shape until one arrives: the subscription has landed.
        assert wait_until(lambda: pub.send(b"probe") or subscriber.received_frames > 0)
        # Probes sent before the first one was counted may still be in flight, and would be
        # counted in place of the test's own frames (a CI run under load read a status before
        # its frame had arrived). A fence of another shape, sent after all of them on the one
        # connection, arrives after them: once it is noted, every probe has been.
        pub.send_multipart([b"fence", b"fence"])
        assert wait_until(lambda: "2 parts" in (subscriber.status().last_error or ""), 20)
        yield pub, subscriber, index
    finally:
        subscriber.close()
        if replay is not None:
            replay.close()
        pub.close(linger=0)


def send_and_settle(
    pub: zmq.Socket[bytes], subscriber: EventSubscriber, messages: list[list[bytes]]
) -> None:
    before = subscriber.received_frames
    for frames in messages:
        pub.send_multipart(frames)
    assert wait_until(lambda: subscriber.received_frames >= before + len(messages), 20)


def assert_follows_again(pub: zmq.Socket[bytes], subscriber: EventSubscriber, block: int) -> None:
    """A genuine next batch is applied: the index is not frozen."""
    applied = subscriber.index.applied_seq["a"]
    seq = 0 if applied is None or applied + 1 >= 2**64 else applied + 1
    pub.send_multipart([b"", seq_bytes(seq), stored(block)])
    assert wait_until(lambda: block in subscriber.index.blocks_of("a")), subscriber.status()


# -- Fixed cases, one per failure the issue names -----------------------------------------------


def test_extra_keys_nested_past_the_decoders_recursion_is_a_decode_error() -> None:
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        decode_batch(nested_extra_keys(100_000))
    assert decode_batch(nested_extra_keys(3)).events[0].block_hashes == [7]
    with hostile_peer() as (pub, subscriber, index):
        send_and_settle(pub, subscriber, [[b"", seq_bytes(0), stored(1)]])
        send_and_settle(pub, subscriber, [[b"", seq_bytes(1), nested_extra_keys(100_000)]])
        status = subscriber.status()
        assert status.state == "running" and status.decode_errors == 1
        assert status.last_error is not None and "nested too deeply" in status.last_error
        assert index.blocks_of("a") == []  # an undecodable batch: the view starts again
        assert subscriber.wait_for("a", 1, timeout=1)
        assert_follows_again(pub, subscriber, 42)


def test_a_one_frame_replay_reply_is_refused_and_the_thread_lives() -> None:
    def one_frame(start: int) -> Iterator[list[bytes]]:
        yield [b"x"]

    with hostile_peer(one_frame, idle_replay=None) as (pub, subscriber, _):
        assert wait_until(lambda: subscriber.malformed_frames >= 1)
        # A gap asks for a replay again; the reply is refused again.
        send_and_settle(pub, subscriber, [[b"", seq_bytes(5), stored(5)]])
        status = subscriber.status()
        assert status.state == "running" and status.malformed_frames >= 2
        assert status.frame_errors == 0  # refused by shape, not by a crash
        assert_follows_again(pub, subscriber, 6)


def test_a_replay_that_never_ends_is_cut_at_its_deadline() -> None:
    def endless(start: int) -> Iterator[list[bytes]]:
        while True:  # an old sequence number, forever
            yield [b"", b"", seq_bytes(0), stored(1)]

    with hostile_peer(endless, idle_replay=None, replay_timeout=0.5) as (pub, subscriber, _):
        assert wait_until(lambda: subscriber.replay_timeouts >= 1, 5)
        assert subscriber.status().state == "running"
        assert_follows_again(pub, subscriber, 9)
        send_and_settle(pub, subscriber, [[b"", seq_bytes(100), stored(100)]])  # a gap: replay
        start = time.monotonic()
        subscriber.close()
        assert time.monotonic() - start < 3.0  # the old loop outlived close()'s 5 s join
        assert subscriber.status().state == "stopped"


def test_a_replay_longer_than_the_window_is_cut_by_count() -> None:
    def streaming(start: int) -> Iterator[list[bytes]]:
        seq = start
        while True:
            yield [b"", b"", seq_bytes(seq), stored(seq)]
            seq += 1

    with hostile_peer(streaming, idle_replay=None, replay_window=50) as (_, subscriber, index):
        assert wait_until(lambda: subscriber.malformed_frames >= 1, 5)
        # window + 1 replies (room for the end marker), then the replay is cut.
        assert subscriber.replayed_batches == 51
        assert index.applied_seq["a"] == 50
        assert subscriber.status().state == "running"


def test_a_sequence_jump_to_2_63_or_past_the_window_does_not_hide_later_batches() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as genuine:
        assert genuine.replay_endpoint is not None
        index = PrefixIndex(["a"])
        hostile = zmq.Context.instance().socket(zmq.PUB)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.bind("tcp://127.0.0.1:*")
        endpoint = Endpoint(hostile.getsockopt_string(zmq.LAST_ENDPOINT), genuine.replay_endpoint)
        # Live frames come only from the hostile socket; the genuine publisher's batches arrive
        # by replay (a gap, or a quiet spell).
        try:
            with EventSubscriber(index, {"a": endpoint}, idle_replay=0.1) as subscriber:
                first = genuine.publish_payload(stored(1))
                assert subscriber.wait_for("a", first)
                # 2**63 and above is no publisher's sequence number: refused by shape.
                assert wait_until(
                    lambda: (
                        hostile.send_multipart([b"", seq_bytes(2**63), stored(666)])
                        or subscriber.malformed_frames > 0
                    )
                )
                assert 666 not in index.blocks_of("a")
                # Below it, a jump past the replay window resynchronises.
                before = subscriber.received_frames
                hostile.send_multipart([b"", seq_bytes(2**62), stored(666)])
                assert wait_until(lambda: subscriber.received_frames > before)
                assert wait_until(lambda: subscriber.resynchronisations >= 1)
                later = genuine.publish_payload(stored(2))
                assert subscriber.wait_for("a", later)
                # The replay the jump started can apply `later` before it reads the replay's end
                # marker; only then does the subscriber weigh the hostile frame and count it
                # rejected. Wait for that verdict before looking at the index.
                assert wait_until(lambda: subscriber.rejected_frames >= 1)
                assert index.applied_seq["a"] == later
                assert 666 not in index.blocks_of("a") and 2 in index.blocks_of("a")
        finally:
            hostile.close(linger=0)


def test_a_subscriber_whose_sockets_fail_says_so() -> None:
    index = PrefixIndex(["a"])
    subscriber = EventSubscriber(index, {"a": Endpoint("nonsense://here")})
    try:
        assert wait_until(lambda: subscriber.status().state == "failed")
        status = subscriber.status()
        assert status.error is not None and "ZMQError" in status.error
        with pytest.raises(SubscriberFailedError, match="ZMQError"):
            subscriber.wait_for("a", 0, timeout=1)
    finally:
        subscriber.close()


@pytest.mark.timeout(60)
def test_replay_reaches_a_slow_consumer_whole() -> None:
    # 4,000 kept batches asked for, read a second later: ZMQ's default send high-water mark
    # (1,000 messages) dropped most of them and the end marker.
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4000) as pub:
        assert pub.replay_endpoint is not None
        # Batches of a few KB (a 16-token block's events and ids), so the kernel's socket
        # buffers cannot hide the drop.
        payload = stored(*range(2**40, 2**40 + 400))
        for _ in range(4000):
            pub.publish_payload(payload)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", seq_bytes(0)])
            time.sleep(1.0)
            seqs = []
            while dealer.poll(2000):
                frames = dealer.recv_multipart()
                if frames[-2] == END:
                    break
                seqs.append(int.from_bytes(frames[-2], "big"))
            else:
                pytest.fail(f"no end marker after {len(seqs)} batches")
        finally:
            dealer.close(linger=0)
        assert seqs == list(range(4000))


# -- Frames of every shape ------------------------------------------------------------------------

#: Arbitrary msgpack values: what a confused or hostile peer might send as a payload.
json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)

payloads = st.one_of(
    st.binary(max_size=64),
    json_like.map(msgspec.msgpack.encode),
    st.integers(0, 2**32).map(lambda h: stored(h)),
    st.integers(1, 200_000).map(nested_extra_keys),
    st.integers(1, 200_000).map(lambda depth: b"\x91" * depth + b"\xc0"),  # the whole payload
)

sequence_numbers = st.one_of(
    st.integers(0, 2**64 - 1).map(seq_bytes),
    st.sampled_from([0, 1, 2, 3, 2**63, 2**64 - 1]).map(seq_bytes),
    st.binary(max_size=12),
)

well_shaped = st.tuples(st.binary(max_size=8), sequence_numbers, payloads).map(list)
any_shape = st.lists(st.one_of(st.binary(max_size=16), payloads), min_size=1, max_size=6)
#: Each example costs real sockets and bounded replays: shrinking a failure would take minutes,
#: and the failing example is printed whole without it.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]

frame_messages = st.lists(st.one_of(well_shaped, any_shape), min_size=1, max_size=6)


@pytest.mark.timeout(300)
def test_frames_of_every_shape_never_stop_the_subscriber() -> None:
    with hostile_peer(replay_window=1000) as (pub, subscriber, _):

        @settings(max_examples=40, phases=NO_SHRINK)
        @given(frame_messages)
        def check(messages: list[list[bytes]]) -> None:
            send_and_settle(pub, subscriber, messages)
            status = subscriber.status()
            assert status.state == "running", status
            assert status.error is None
            assert_follows_again(pub, subscriber, 10**6 + subscriber.received_frames)

        check()


@pytest.mark.timeout(300)
def test_replies_of_every_shape_never_stop_the_subscriber() -> None:
    script: list[list[list[bytes]]] = []

    def answer(start: int) -> Iterator[list[bytes]]:
        yield from script.pop(0) if script else [[b"", b"", END, b""]]

    with hostile_peer(answer, idle_replay=None, replay_timeout=0.3) as (pub, subscriber, _):

        @settings(max_examples=30, phases=NO_SHRINK)
        @given(st.lists(st.one_of(well_shaped, any_shape).map(lambda f: [b"", *f]), max_size=8))
        def check(replies: list[list[bytes]]) -> None:
            script[:] = [replies]
            applied = subscriber.index.applied_seq["a"]
            gap = 5 if applied is None or applied + 5 >= 2**64 else applied + 5
            send_and_settle(pub, subscriber, [[b"", seq_bytes(gap), stored(3)]])
            assert subscriber.status().state == "running", subscriber.status()
            assert_follows_again(pub, subscriber, 10**6 + subscriber.received_frames)

        check()
