"""Publishing a cache's KV events as vLLM does: a ZMQ PUB socket and a replay ROUTER socket.

Each batch leaves as three frames, ``[topic, sequence, payload]``: the topic as UTF-8 bytes, the
sequence number as 8 bytes big-endian (0, 1, 2, ... without gaps: one is taken per batch sent,
in the thread that sends), the payload as `wire.encode_batch` writes it. The last
`buffer_steps` batches are kept; a subscriber that missed some sends the first sequence number
it wants (8 bytes big-endian) to the replay socket and gets back, per kept batch from there on,
``[topic, sequence, payload]``, then ``[b"", -1 as 8 signed bytes, b""]`` (vLLM's end marker).

Publishing never blocks the caller on a subscriber: a PUB socket drops what a slow subscriber
cannot take (that subscriber sees a gap and replays), and the core's queue overflow is counted
and repaired by a resynchronisation (`EventRecorder`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Literal

import zmq

from prefixkv import _core
from prefixkv.errors import InvalidInputError
from prefixkv.events.recorder import DEFAULT_CAPACITY, EventRecorder, TokenIds
from prefixkv.events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
    batch_payload,
    encode_batch,
)

if TYPE_CHECKING:
    from prefixkv._core import CoreEvent
    from prefixkv.cache import PrefixCache
    from prefixkv.group_cache import GroupedPrefixCache
    from prefixkv.kv_groups import KVGroupSpec

HashForm = Literal["int64", "bytes"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def wire_events(
    events: list[CoreEvent],
    *,
    block_size: int,
    hashes: HashForm = "int64",
    medium: str | None,
    group: KVGroupSpec | None = None,
) -> list[KVEvent]:
    """The core's events as vLLM's event structs; with `group`, tagged with the KV group
    (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) as vLLM tags
    the events of a hybrid model."""
    group_idx = None if group is None else group.index
    if hashes not in ("int64", "bytes"):
        raise InvalidInputError(f"hashes must be 'int64' or 'bytes', got {hashes!r}")
    out: list[KVEvent] = []
    for event in events:
        kind = event.kind
        keys: list[ExternalBlockHash]
        if kind == "cleared":
            out.append(AllBlocksCleared())
            continue
        keys = list(event.hashes64) if hashes == "int64" else list(event.keys)
        if kind == "removed":
            out.append(BlockRemoved(block_hashes=keys, medium=medium, group_idx=group_idx))
            continue
        parent = event.parent
        parent_hash: ExternalBlockHash | None = None
        if parent is not None:
            parent_hash = int.from_bytes(parent[-8:], "big") if hashes == "int64" else parent
        token_ids = event.token_ids
        extras = event.extras
        # Extra keys travel with the tokens: a block published by key alone reveals neither.
        extra_keys: list[tuple[bytes, ...] | None] | None = None
        if token_ids and any(extras):
            extra_keys = [(e,) if e else None for e in extras]
        adapter = event.adapter
        out.append(
            BlockStored(
                block_hashes=keys,
                parent_block_hash=parent_hash,
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None,
                medium=medium,
                lora_name=adapter.decode("utf-8", "replace") if adapter is not None else None,
                extra_keys=extra_keys,
                group_idx=group_idx,
                kv_cache_spec_kind=None if group is None else group.kind,
                kv_cache_spec_sliding_window=None if group is None else group.sliding_window,
            )
        )
    return out


class ZmqEventPublisher:
    """A PUB socket for batches and a ROUTER socket (served by a thread) for replays.

    Args:
        endpoint: PUB address; bound when it contains ``*``, ``::`` or is ``ipc://`` /
            ``inproc://`` (vLLM's rule), else connected.
        replay_endpoint: ROUTER address to bind, or None for no replay.
        topic: sent as the first frame (llm-d's convention is ``kv@<pod>@<model>``).
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise InvalidInputError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._next_seq = 0
        self.sent_batches = 0
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if any(m in endpoint for m in ("*", "::")) or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint: str | None = None
        self._running = True
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            replay = self._context.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            # A ROUTER drops what passes its send high-water mark (ZMQ's default: 1000), so a
            # consumer that reads a replay later than it asked would lose most of it and the
            # end marker. Room for two whole replays, as vLLM sizes it: 2 * (buffer_steps + 1).
            replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            replay.bind(replay_endpoint)
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(replay,), daemon=True, name="prefixkv-replay"
            )
            self._replay_thread.start()

    @property
    def next_sequence(self) -> int:
        """The sequence number the next batch gets."""
        return self._next_seq

    def publish(self, events: list[KVEvent], ts: float | None = None) -> int:
        """Sends one batch of `events`; returns its sequence number."""
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts, events=events, data_parallel_rank=self._rank
        )
        return self.publish_payload(encode_batch(batch))

    def publish_encoded(self, events_msgpack: bytes, ts: float | None = None) -> int:
        """Sends one batch whose events are already encoded (`_core.encode_events`)."""
        ts = time.time() if ts is None else ts
        return self.publish_payload(batch_payload(ts, events_msgpack, self._rank))

    def publish_payload(self, payload: bytes) -> int:
        """Sends one encoded batch; returns its sequence number."""
        if not self._running:
            raise InvalidInputError("the publisher is closed")
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            # PUB never blocks: a subscriber past its high-water mark misses this batch and
            # replays it.
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self.sent_batches += 1
        return seq

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        try:
            while self._running:
                if not poller.poll(50):
                    continue
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request; a subscriber cannot break the publisher
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self._lock:
                    kept = [(s, p) for s, p in self._buffer if s >= first]
                for seq, payload in kept:
                    replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
                replay.send_multipart((client, b"", b"", END_SEQ, b""))
        finally:
            replay.close(linger=0)

    def close(self) -> None:
        """Stops the replay thread and closes the sockets."""
        if not self._running:
            return
        self._running = False
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2.0)
        with self._lock:
            self._pub.close(linger=0)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVEventPublisher:
    """Records a `PrefixCache`'s KV events and publishes them in vLLM's format.

    A `GroupedPrefixCache` (a hybrid model's KV groups) is recorded group by group, and each
    event says its group (``group_idx`` and the group's spec), as vLLM's events do.

    Call `flush()` once per scheduler step (after the step's commits and finishes): it drains
    what the cache recorded and sends it as one batch (nothing when nothing changed).

    Args:
        cache: the cache whose events to publish.
        endpoint, replay_endpoint, topic, buffer_steps, hwm: see `ZmqEventPublisher`.
        hashes: ``"int64"`` (64-bit block hashes, `hash64`; what vLLM sends with
            `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) or ``"bytes"`` (the full 32-byte SHA-256
            block key).
        medium: the `medium` field of every event.
        token_ids, capacity: see `EventRecorder`.
    """

    def __init__(
        self,
        cache: PrefixCache | GroupedPrefixCache,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        hashes: HashForm = "int64",
        medium: str | None = MEDIUM_GPU,
        token_ids: TokenIds = "all",
        capacity: int = DEFAULT_CAPACITY,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        from prefixkv.group_cache import GroupedPrefixCache

        if hashes not in ("int64", "bytes"):
            raise InvalidInputError(f"hashes must be 'int64' or 'bytes', got {hashes!r}")
        self.hashes: HashForm = hashes
        self.medium = medium
        #: One recorder per KV group (with its spec), for a `GroupedPrefixCache`.
        self.group_recorders: list[tuple[KVGroupSpec, EventRecorder]] = []
        if isinstance(cache, GroupedPrefixCache):
            self.group_recorders = [
                (spec, EventRecorder(group, capacity=capacity, token_ids=token_ids))
                for spec, group in zip(cache.specs, cache.groups, strict=True)
            ]
            self.recorder = self.group_recorders[0][1]
        else:
            self.recorder = EventRecorder(cache, capacity=capacity, token_ids=token_ids)
        self.socket = ZmqEventPublisher(
            endpoint,
            replay_endpoint,
            topic=topic,
            buffer_steps=buffer_steps,
            hwm=hwm,
            data_parallel_rank=data_parallel_rank,
        )
        self.resynchronisations = 0
        self.dropped_blocks = 0

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (the bound port when asked for port 0 or ``*``)."""
        return self.socket.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's bound address, if any."""
        return self.socket.replay_endpoint

    def flush(self) -> int:
        """Publishes what the cache recorded since the last flush as one batch; returns the
        number of events sent."""
        if self.group_recorders:
            return self._flush_groups()
        drain = self.recorder.drain()
        self.dropped_blocks = drain.dropped_blocks
        if drain.resynchronised:
            self.resynchronisations += 1
        if not drain.events:
            return 0
        # Encoded in Rust: byte for byte what `wire_events` and msgspec give
        # (tests/test_events_wire.py), at a fraction of the cost.
        encoded = _core.encode_events(
            drain.events, self.recorder.block_size, self.hashes, self.medium
        )
        self.socket.publish_encoded(encoded)
        return len(drain.events)

    def _flush_groups(self) -> int:
        # Built as structs (not `_core.encode_events`, which knows no groups): each event gets
        # its group's fields.
        events: list[KVEvent] = []
        dropped = 0
        for spec, recorder in self.group_recorders:
            drain = recorder.drain()
            dropped += drain.dropped_blocks
            if drain.resynchronised:
                self.resynchronisations += 1
            events += wire_events(
                drain.events,
                block_size=recorder.block_size,
                hashes=self.hashes,
                medium=self.medium,
                group=spec,
            )
        self.dropped_blocks = dropped
        if not events:
            return 0
        self.socket.publish(events)
        return len(events)

    def close(self) -> None:
        """Publishes what is pending, stops recording, closes the sockets."""
        try:
            self.flush()
        finally:
            for recorder in [r for _, r in self.group_recorders] or [self.recorder]:
                recorder.close()
            self.socket.close()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
