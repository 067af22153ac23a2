"""Subscribing to N instances' KV events and keeping a `PrefixIndex` in step with them.

One SUB socket per instance (so every frame is known to come from its instance) and one DEALER
socket per instance for replay. Per instance the subscriber expects sequence numbers in order:

- the next one: applied;
- a gap (a batch dropped by ZMQ, or the subscriber just started): the missing batches are asked
  for on the replay socket and applied in order before anything newer;
- one it has already applied: ignored (replays overlap live traffic);
- a gap the publisher can no longer replay (it kept fewer batches): the instance's view is
  cleared and rebuilt from what follows, so the index may miss blocks but never claims one the
  instance does not hold; counted in `unrecoverable_gaps`;
- sequence 0 after a higher one: the publisher restarted; its view is cleared first (a restart
  whose sequence 0 was lost is not recognised: vLLM's format has no publisher epoch);
- a payload that does not decode: the view is cleared (`decode_errors`), never guessed.

It resumes from `index.applied_seq`, so a subscriber killed and started again on the same index
loses nothing while the publishers still keep the batches in between. After a quiet spell it
asks the replay sockets for anything newer, so a batch lost last (no later batch shows the gap)
is not lost for good.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from prefixkv.errors import InvalidInputError
from prefixkv.events.index import PrefixIndex
from prefixkv.events.wire import AllBlocksCleared, KVEventBatch, decode_batch


@dataclass(frozen=True)
class Endpoint:
    """Where one instance publishes: its PUB address and its replay (ROUTER) address."""

    events: str
    replay: str | None = None
    topic: str = ""


class EventSubscriber:
    """Feeds `index` from the instances in `endpoints` (name → `Endpoint`) on a thread.

    Args:
        index: the index to keep in step; its instance names must include every endpoint's.
        endpoints: each instance's addresses.
        replay_timeout: seconds to wait for a replay to end before giving up on it.
        idle_replay: when no batch has come for this many seconds, ask each instance's replay
            socket for anything newer (the last batches before a quiet spell may have been
            dropped, or sent before the subscription landed, and no later batch reveals the
            gap). None: never.
    """

    def __init__(
        self,
        index: PrefixIndex,
        endpoints: dict[str, Endpoint],
        *,
        replay_timeout: float = 5.0,
        idle_replay: float | None = 0.5,
    ) -> None:
        unknown = set(endpoints) - set(index.instances)
        if unknown:
            raise InvalidInputError(f"instances {sorted(unknown)} are not in the index")
        self.index = index
        self.endpoints = dict(endpoints)
        self.replay_timeout = replay_timeout
        self.idle_replay = idle_replay
        self.applied_batches = 0
        self.replayed_batches = 0
        self.unrecoverable_gaps = 0
        self.decode_errors = 0
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="prefixkv-subscriber")
        self._thread.start()
        self._ready.wait(5.0)

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        subs: dict[zmq.Socket[bytes], str] = {}
        poller = zmq.Poller()
        try:
            for name, endpoint in self.endpoints.items():
                sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode("utf-8"))
                sub.connect(endpoint.events)
                poller.register(sub, zmq.POLLIN)
                subs[sub] = name
            self._ready.set()
            # Catch up on whatever was published before we connected (or since we last ran).
            for name in self.endpoints:
                self._replay(name)
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                ready = poller.poll(50)
                for sub, _ in ready:
                    frames = sub.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.decode_errors += 1
                        continue
                    self._receive(subs[sub], int.from_bytes(frames[1], "big"), frames[2])
                now = time.monotonic()
                if ready:
                    quiet_since = now
                elif self.idle_replay is not None and now - quiet_since >= self.idle_replay:
                    for name in self.endpoints:
                        self._replay(name)
                    quiet_since = now
        finally:
            self._ready.set()
            for sub in subs:
                sub.close(linger=0)

    def _receive(self, name: str, seq: int, payload: bytes) -> None:
        last = self.index.applied_seq[name]
        if seq == 0 and last is not None and last > 0:
            # The publisher restarted: what it held before is gone with it.
            self.index.clear(name)
            self.index.applied_seq[name] = last = None
        expected = 0 if last is None else last + 1
        if seq < expected:
            return
        if seq > expected:
            self._replay(name)
            last = self.index.applied_seq[name]
            expected = 0 if last is None else last + 1
            if seq < expected:
                return
            if seq > expected:
                self._lost(name)
        self._apply(name, seq, payload)

    def _apply(self, name: str, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except InvalidInputError:
            # Its changes are unknown: start the view again rather than guess.
            self.decode_errors += 1
            self._lost(name)
            batch = KVEventBatch(ts=0.0, events=[])
        self.index.apply(name, batch, seq)
        self.applied_batches += 1

    def _lost(self, name: str) -> None:
        """Batches are missing for good: start this instance's view again from empty."""
        self.unrecoverable_gaps += 1
        self.index.apply(name, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))

    def _replay(self, name: str) -> None:
        """Asks `name`'s replay socket for everything after the last applied batch."""
        endpoint = self.endpoints[name]
        if endpoint.replay is None:
            return
        last = self.index.applied_seq[name]
        start = 0 if last is None else last + 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint.replay)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(int(self.replay_timeout * 1000)):
                frames = dealer.recv_multipart()
                # [b"", topic, seq, payload] (vLLM) or [b"", seq, payload] (SGLang, older vLLM).
                seq_bytes, payload = frames[-2], frames[-1]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    return
                applied = self.index.applied_seq[name]
                expected = 0 if applied is None else applied + 1
                if seq < expected:
                    continue
                if seq > expected:
                    self._lost(name)
                self._apply(name, seq, payload)
                self.replayed_batches += 1
        finally:
            dealer.close(linger=0)

    # ------------------------------------------------------------------ control

    def wait_for(self, instance: str, seq: int, timeout: float = 10.0) -> bool:
        """Waits until `instance`'s batch `seq` has been applied; False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            applied = self.index.applied_seq[instance]
            if applied is not None and applied >= seq:
                return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.0005)

    def close(self) -> None:
        """Stops the thread (the index keeps its state and `applied_seq`)."""
        self._stop.set()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
