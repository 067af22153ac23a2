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
- sequence 0 after a higher one, or a number more than `replay_window` away from the last one
  applied (either way): the publisher restarted, or the number is not one a replay could
  explain. The view is cleared and rebuilt from the publisher's replay (a resynchronisation,
  counted); a frame even that replay does not reach is dropped (`rejected_frames`), so one
  absurd number (2**63) cannot make every later genuine batch look old;
- a payload that does not decode: the view is cleared (`decode_errors`), never guessed; a
  frame of the wrong shape (no sequence number) is counted (`malformed_frames`) and ignored.

It resumes from `index.applied_seq`, so a subscriber killed and started again on the same index
loses nothing while the publishers still keep the batches in between. After a quiet spell it
asks the replay sockets for anything newer, so a batch lost last (no later batch shows the gap)
is not lost for good.

The frames are untrusted input and the thread is the index's only feeder, so it never dies of
a frame and never waits unboundedly: every frame is handled inside a catch-all that clears the
instance's view and records the error (`status().last_error`); every replay ends within
`replay_timeout` seconds and `replay_window + 1` replies. If the thread does stop on its own
(its sockets failed), `status()` says so and `wait_for` raises `SubscriberFailedError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import zmq

from prefixkv.errors import InvalidInputError, SubscriberFailedError
from prefixkv.events.index import PrefixIndex
from prefixkv.events.wire import AllBlocksCleared, KVEventBatch, decode_batch

State = Literal["starting", "running", "stopped", "failed"]

#: The longest error text kept in the status (an error may quote a hostile frame).
_ERROR_CHARS = 300


@dataclass(frozen=True)
class Endpoint:
    """Where one instance publishes: its PUB address and its replay (ROUTER) address."""

    events: str
    replay: str | None = None
    topic: str = ""


@dataclass(frozen=True)
class SubscriberStatus:
    """A snapshot of an `EventSubscriber`: whether its thread runs, and its counters."""

    #: "starting" (sockets not yet up), "running", "stopped" (closed) or "failed" (the thread
    #: ended on its own; `error` says why).
    state: State
    #: Why the thread failed (state "failed"), else None.
    error: str | None
    #: The last frame the thread refused or could not handle, and why (None: none yet).
    last_error: str | None
    #: Live messages handled (applied, ignored or refused).
    received_frames: int
    applied_batches: int
    replayed_batches: int
    unrecoverable_gaps: int
    decode_errors: int
    malformed_frames: int
    resynchronisations: int
    rejected_frames: int
    replay_timeouts: int
    frame_errors: int


class EventSubscriber:
    """Feeds `index` from the instances in `endpoints` (name → `Endpoint`) on a thread.

    Args:
        index: the index to keep in step; its instance names must include every endpoint's.
        endpoints: each instance's addresses.
        replay_timeout: seconds one replay may take in all (request to end marker); a replay
            still running then is abandoned and counted (`replay_timeouts`).
        idle_replay: when no batch has come for this many seconds, ask each instance's replay
            socket for anything newer (the last batches before a quiet spell may have been
            dropped, or sent before the subscription landed, and no later batch reveals the
            gap). None: never.
        replay_window: at least the most batches a publisher keeps for replay (its
            `buffer_steps`; 10,000 by default in vLLM and prefixkv). A sequence number further
            than this from the last one applied resynchronises the instance, and a replay
            ends after this many batches.
    """

    def __init__(
        self,
        index: PrefixIndex,
        endpoints: dict[str, Endpoint],
        *,
        replay_timeout: float = 5.0,
        idle_replay: float | None = 0.5,
        replay_window: int = 100_000,
    ) -> None:
        unknown = set(endpoints) - set(index.instances)
        if unknown:
            raise InvalidInputError(f"instances {sorted(unknown)} are not in the index")
        if not (isinstance(replay_timeout, int | float) and replay_timeout > 0):
            raise InvalidInputError(f"replay_timeout must be > 0 seconds, got {replay_timeout!r}")
        if isinstance(replay_window, bool) or not isinstance(replay_window, int):
            raise InvalidInputError(f"replay_window must be an int, got {replay_window!r}")
        if replay_window < 1:
            raise InvalidInputError(f"replay_window must be >= 1, got {replay_window}")
        self.index = index
        self.endpoints = dict(endpoints)
        self.replay_timeout = float(replay_timeout)
        self.idle_replay = idle_replay
        self.replay_window = replay_window
        self.received_frames = 0
        self.applied_batches = 0
        self.replayed_batches = 0
        self.unrecoverable_gaps = 0
        self.decode_errors = 0
        self.malformed_frames = 0
        self.resynchronisations = 0
        self.rejected_frames = 0
        self.replay_timeouts = 0
        self.frame_errors = 0
        self.last_error: str | None = None
        self._failure: BaseException | None = None
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
                subs[sub] = name
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, endpoint.topic.encode("utf-8"))
                sub.connect(endpoint.events)
                poller.register(sub, zmq.POLLIN)
            self._ready.set()
            # Catch up on whatever was published before we connected (or since we last ran).
            for name in self.endpoints:
                self._guarded(name, self._replay, name)
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                ready = poller.poll(50)
                for sub, _ in ready:
                    frames = sub.recv_multipart()
                    self._guarded(subs[sub], self._frame, subs[sub], frames)
                    self.received_frames += 1  # counted once handled, so a caller can wait
                now = time.monotonic()
                if ready:
                    quiet_since = now
                elif self.idle_replay is not None and now - quiet_since >= self.idle_replay:
                    for name in self.endpoints:
                        self._guarded(name, self._replay, name)
                    quiet_since = now
        except BaseException as exc:  # the sockets themselves failed: say so to the caller
            self._failure = exc
        finally:
            self._ready.set()
            for sub in subs:
                sub.close(linger=0)

    def _guarded(self, name: str, handler: Callable[..., None], *args: object) -> None:
        """Runs `handler(*args)` for `name`; whatever it raises clears `name`'s view (its
        state is unknown) and is recorded, never ending the thread."""
        try:
            handler(*args)
        except zmq.ContextTerminated:
            raise
        except Exception as exc:
            self.frame_errors += 1
            self._note(f"{name}: {type(exc).__name__}: {exc}")
            self._lost(name)

    def _note(self, error: str) -> None:
        self.last_error = error[:_ERROR_CHARS]

    def _frame(self, name: str, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed_frames += 1
            self._note(f"{name}: a frame of {len(frames)} parts is not [topic, seq, payload]")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq < 0:
            # Sequence numbers are signed 64-bit on the replay channel (-1 ends a replay): one
            # at 2**63 or above is no publisher's.
            self.malformed_frames += 1
            self._note(f"{name}: sequence number {seq + 2**64} is past 2**63")
            return
        self._receive(name, seq, frames[2])

    def _receive(self, name: str, seq: int, payload: bytes) -> None:
        last = self.index.applied_seq[name]
        if last is not None and ((seq == 0 < last) or abs(seq - last) > self.replay_window):
            # The publisher restarted (what it held is gone with it), or this number is one no
            # replay explains: start the view again from what the publisher keeps.
            self._resynchronise(name)
            last = None
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
                if last is not None and seq - last > self.replay_window:
                    # Even the publisher's own replay ends far before it.
                    self.rejected_frames += 1
                    self._note(f"{name}: sequence {seq} is past the replay window after {last}")
                    return
                self._lost(name)
        self._apply(name, seq, payload)

    def _apply(self, name: str, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except InvalidInputError as exc:
            # Its changes are unknown: start the view again rather than guess.
            self.decode_errors += 1
            self._note(f"{name}: batch {seq}: {exc}")
            self._lost(name)
            batch = KVEventBatch(ts=0.0, events=[])
        self.index.apply(name, batch, seq)
        self.applied_batches += 1

    def _lost(self, name: str) -> None:
        """Batches are missing for good: start this instance's view again from empty."""
        self.unrecoverable_gaps += 1
        self.index.apply(name, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))

    def _resynchronise(self, name: str) -> None:
        """Forgets `name`'s view and position; the next replay rebuilds both."""
        self.resynchronisations += 1
        self.index.clear(name)
        self.index.applied_seq[name] = None

    def _replay(self, name: str) -> None:
        """Asks `name`'s replay socket for everything after the last applied batch; bounded
        by `replay_timeout` in all and by `replay_window + 1` replies."""
        endpoint = self.endpoints[name]
        if endpoint.replay is None:
            return
        last = self.index.applied_seq[name]
        start = 0 if last is None else last + 1
        if start >= 2**63:  # past what the request can say (an index fed by hand)
            self._resynchronise(name)
            start = 0
        deadline = time.monotonic() + self.replay_timeout
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint.replay)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            for _ in range(self.replay_window + 1):
                if not self._await(dealer, deadline):
                    self.replay_timeouts += 1
                    self._note(f"{name}: the replay did not end within {self.replay_timeout} s")
                    return
                frames = dealer.recv_multipart()
                # [b"", topic, seq, payload] (vLLM) or [b"", seq, payload] (SGLang, older vLLM).
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    self.malformed_frames += 1
                    self._note(f"{name}: a replay reply of {len(frames)} parts")
                    return
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    return
                applied = self.index.applied_seq[name]
                expected = 0 if applied is None else applied + 1
                if seq < expected:
                    continue
                if seq > expected:
                    if applied is not None and seq - applied > self.replay_window:
                        self.rejected_frames += 1
                        self._note(f"{name}: replayed sequence {seq} is past the window")
                        return
                    self._lost(name)
                self._apply(name, seq, frames[-1])
                self.replayed_batches += 1
            self.malformed_frames += 1
            self._note(f"{name}: the replay sent more than {self.replay_window} batches")
        finally:
            dealer.close(linger=0)

    def _await(self, socket: zmq.Socket[bytes], deadline: float) -> bool:
        """Waits for a reply until `deadline`, in short slices so `close()` is not kept."""
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if socket.poll(max(1, min(50, int(remaining * 1000)))):
                return True
        return False

    # ------------------------------------------------------------------ control

    def status(self) -> SubscriberStatus:
        """Whether the thread runs, why it stopped if it did, and the counters."""
        state: State
        if self._failure is not None:
            state = "failed"
        elif self._thread.is_alive():
            state = "running" if self._ready.is_set() else "starting"
        else:
            state = "stopped"
        failure = self._failure
        return SubscriberStatus(
            state=state,
            error=None if failure is None else f"{type(failure).__name__}: {failure}",
            last_error=self.last_error,
            received_frames=self.received_frames,
            applied_batches=self.applied_batches,
            replayed_batches=self.replayed_batches,
            unrecoverable_gaps=self.unrecoverable_gaps,
            decode_errors=self.decode_errors,
            malformed_frames=self.malformed_frames,
            resynchronisations=self.resynchronisations,
            rejected_frames=self.rejected_frames,
            replay_timeouts=self.replay_timeouts,
            frame_errors=self.frame_errors,
        )

    def _check_alive(self) -> None:
        failure = self._failure
        if failure is not None:
            raise SubscriberFailedError(
                f"the event subscriber stopped: {type(failure).__name__}: {failure}"
            ) from failure

    def wait_for(self, instance: str, seq: int, timeout: float = 10.0) -> bool:
        """Waits until `instance`'s batch `seq` has been applied; False on timeout or after
        `close()`; `SubscriberFailedError` if the thread stopped on its own."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            applied = self.index.applied_seq[instance]
            if applied is not None and applied >= seq:
                return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                self._check_alive()
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
