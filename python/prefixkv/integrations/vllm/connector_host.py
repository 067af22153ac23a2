"""The connector's host tier: block KV in each worker's host memory, indexed by the scheduler.

vLLM runs the connector's scheduler side and its worker side in different processes (the
engine core and one per tensor-parallel rank), and the scheduler must answer "how many blocks
can you load?" without reading the workers' memory. So the host tier is split in two, the way
vLLM's own `OffloadingConnector` splits its CPU tier:

* `HostIndex`, in the scheduler: which block is in which slot. It alone allocates slots (an
  LRU over ``capacity`` slots), so what it says a slot holds is what the workers were told to
  write there. A block is claimed from the index as soon as its save is planned: every worker
  runs the steps' plans in order, so the save has run before any later step's load reads it.
* `HostPool`, in each worker: ``capacity`` slots of one block each, in the stored value's layout
  ``[layers, kv_heads, block_size, head_size + head_size_v]`` (pinned when the KV cache is on a
  GPU), and per slot what was written there: the slot's generation, the block's record (its
  key, parent key and tokens, under this rank's context) and a SHA-256 of its bytes.

Why not `prefixkv.tiers.HostTier`: it moves blocks between two `PagedKVCache` pools of
prefixkv's own layout within one process; here the index and the bytes live in different
processes and the bytes in vLLM's layout. The `BlockRecord` check is the same (`held_run`).

What the worker checks before a host block reaches the KV cache: the slot holds the generation
the scheduler planned, the record is this request's own (this rank's key chain and tokens), and
the bytes hash to the digest taken when they were saved. Anything else (a save dropped, a slot
written since, corrupted bytes) is a load error: vLLM recomputes the block (the connector
requires ``kv_load_failure_policy="recompute"``), and the worker reports the slot in its
`HostReport` so that the scheduler stops claiming it. A claim is therefore exact in the end:
never wrong KV, at worst one recomputation per slot that went bad.

Saving never stalls a step on the checksum: the step copies the blocks into their slots (the
one copy a save needs before vLLM may reuse the blocks) and queues the digest for a background
thread, in a bounded queue; a full queue drops the save (the slot is marked empty, reported,
counted). A load of a slot whose digest is still queued waits for it, which only a block saved
in the previous step can need.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector_keys import BlockGeometry
from prefixkv.tiers import BlockRecord
from prefixkv.tiers.background import BackgroundQueue
from prefixkv.tiers.host import held_run

__all__ = ["HostIndex", "HostPool", "HostPoolStats", "HostReport", "HostSlot", "host_capacity"]


def host_capacity(host_tier_bytes: int, geometry: BlockGeometry) -> int:
    """Slots of one block that `host_tier_bytes` holds (each rank holds its own blocks)."""
    slots = host_tier_bytes // geometry.value_bytes
    if slots < 1:
        raise InvalidInputError(
            f"kv_connector_extra_config['host_tier_bytes']={host_tier_bytes} holds no block; "
            f"one block takes {geometry.value_bytes} bytes"
        )
    return slots


@dataclass(frozen=True)
class HostSlot:
    """A slot of the host pool and the generation of its content: the scheduler gives every
    save a new generation, so a report about an older content is recognised as stale."""

    slot: int
    generation: int


@dataclass
class HostReport:
    """What one worker tells the scheduler after a step: slots it does not hold as planned
    (a dropped save, a failed check at load). Carried by the connector's worker metadata."""

    forget: list[HostSlot] = field(default_factory=list)

    def merge(self, other: HostReport) -> HostReport:
        return HostReport(self.forget + other.forget)


# -- the scheduler's index ---------------------------------------------------------------------


@dataclass
class HostIndexStats:
    """Blocks counted by the scheduler's host index."""

    hit_blocks: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0
    #: Entries dropped because a worker reported their slot (dropped save, failed load).
    forgotten_blocks: int = 0


class HostIndex:
    """Which block each of `capacity` host slots holds, least recently used first."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidInputError(f"host tier capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.stats = HostIndexStats()
        self._entries: OrderedDict[bytes, tuple[BlockRecord, HostSlot]] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self._generation = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def match(self, records: Sequence[BlockRecord]) -> list[HostSlot]:
        """The slots of `records[:n]`, the longest run from the first the index holds with the
        same parent and tokens. The run becomes the most recently used."""
        slots = held_run(self._entries, records)
        self._touch(records[: len(slots)])
        return slots

    def reserve(self, records: Sequence[BlockRecord]) -> list[HostSlot]:
        """Slots for `records` (blocks of one chain), evicting the least recently used
        entries; when more than the pool holds, the first blocks of the chain (a prefix is
        what a later request can hit). A record the index holds already gets a new slot."""
        records = list(records[: self.capacity])
        for record in records:
            held = self._entries.pop(record.key, None)
            if held is not None:
                self._free.append(held[1].slot)
        slots = []
        for record in records:
            if not self._free:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._free.append(evicted.slot)
                self.stats.evicted_blocks += 1
            self._generation += 1
            slot = HostSlot(self._free.pop(), self._generation)
            self._entries[record.key] = (record, slot)
            slots.append(slot)
        self._touch(records)
        self.stats.saved_blocks += len(slots)
        return slots

    def forget(self, slots: Iterable[HostSlot]) -> None:
        """Drop the entries whose slot and generation a worker reported (stale reports, about
        a slot written again since, change nothing)."""
        reported = set(slots)
        if not reported:
            return
        for key, (_, slot) in list(self._entries.items()):
            if slot in reported:
                del self._entries[key]
                self._free.append(slot.slot)
                self.stats.forgotten_blocks += 1

    def clear(self) -> None:
        self._free.extend(slot.slot for _, slot in self._entries.values())
        self._entries.clear()

    def _touch(self, records: Sequence[BlockRecord]) -> None:
        # Newest last, the chain's first block newest of all: every request that uses a block
        # of the chain also uses its first one, and evicting that one would strand the rest.
        for record in reversed(records):
            self._entries.move_to_end(record.key)


# -- the worker's pool -------------------------------------------------------------------------


@dataclass(frozen=True)
class _SlotContent:
    generation: int
    record: BlockRecord
    #: SHA-256 of the slot's bytes; None while the digest thread has not taken it yet.
    digest: bytes | None


@dataclass
class HostPoolStats:
    """Blocks counted by one worker's host pool."""

    saved_blocks: int = 0
    #: Saves dropped because the digest queue was full (the slot is reported and left empty).
    dropped: int = 0
    loaded_blocks: int = 0
    #: Claimed blocks the pool did not hold as planned (never saved here, dropped, written
    #: since) or whose bytes failed their digest: load errors, recomputed by vLLM.
    invalid: int = 0
    #: Digests the thread could not take (an exception, counted; the slot is reported).
    errors: int = 0


def _digest(kv: torch.Tensor) -> bytes:
    # hashlib releases the GIL on large buffers: the digest thread runs beside the step.
    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().data).digest()


class HostPool:
    """One worker's host slots (`capacity` blocks of `geometry`) and what each holds."""

    #: Seconds a load waits for a digest still in the queue before it counts the block failed.
    DIGEST_WAIT = 10.0

    def __init__(
        self,
        geometry: BlockGeometry,
        capacity: int,
        *,
        queue_size: int = 64,
        pin_memory: bool = False,
    ) -> None:
        self.geometry = geometry
        self.stats = HostPoolStats()
        self._contents: list[_SlotContent | None] = [None] * capacity
        self._lock = threading.Lock()
        self._forget: list[HostSlot] = []
        # First, so that a bad queue_size is refused before the slots are allocated. Its
        # thread holds what it writes to, not the pool, so a pool nobody holds is collected
        # and the thread stops.
        self._digests: BackgroundQueue[tuple[HostSlot, torch.Tensor]] = BackgroundQueue(
            functools.partial(_take_digests, self._contents, self._lock, self._forget, self.stats),
            queue_size=queue_size,
            name="prefixkv-host-digests",
        )
        # Uncommitted until written (on CPU): a slot is never read before a save fills it.
        self.slots = torch.empty(
            (capacity, *geometry.value_shape), dtype=geometry.dtype, pin_memory=pin_memory
        )

    @property
    def capacity(self) -> int:
        return len(self._contents)

    def save(
        self, slots: Sequence[HostSlot], records: Sequence[BlockRecord], kv: torch.Tensor
    ) -> None:
        """Copy blocks ``kv[i]`` (a host tensor ``[n, *value_shape]`` nobody changes
        afterwards) into `slots[i]`, under `records[i]`; their digests are queued."""
        if not (len(slots) == len(records) == kv.shape[0]):
            raise InvalidInputError(
                f"host save: {len(slots)} slots, {len(records)} records, {kv.shape[0]} blocks"
            )
        for slot in slots:
            if not 0 <= slot.slot < self.capacity:
                raise InvalidInputError(f"host slot {slot.slot} outside 0..{self.capacity - 1}")
        if not slots:
            return
        with self._lock:
            for slot in slots:  # stale until the new bytes and their digest are in
                self._contents[slot.slot] = None
        index = torch.tensor([slot.slot for slot in slots], dtype=torch.long)
        self.slots.index_copy_(0, index, kv.to(self.slots.dtype))
        for i, (slot, record) in enumerate(zip(slots, records, strict=True)):
            with self._lock:
                self._contents[slot.slot] = _SlotContent(slot.generation, record, None)
            if not self._digests.offer((slot, kv[i])):
                with self._lock:
                    self._contents[slot.slot] = None
                    self._forget.append(slot)
                self.stats.dropped += 1

    def fetch(
        self, slots: Sequence[HostSlot], records: Sequence[BlockRecord]
    ) -> list[torch.Tensor]:
        """Views of the slots of `records[:n]`, the longest run from the first that holds
        what the scheduler planned and passes its digest. The first slot that fails is
        reported (the scheduler forgets it); the views are valid until the next `save`."""
        served: list[torch.Tensor] = []
        for slot, record in zip(slots, records, strict=False):
            content = self._content(slot)
            if (
                content is None
                or content.record != record
                or content.digest != _digest(self.slots[slot.slot])
            ):
                self.stats.invalid += 1
                with self._lock:
                    self._forget.append(slot)
                break
            served.append(self.slots[slot.slot])
        self.stats.loaded_blocks += len(served)
        return served

    def _content(self, slot: HostSlot) -> _SlotContent | None:
        """What `slot` holds if it is the generation asked for, its digest taken (waiting
        for the digest thread if it is still queued)."""
        if not 0 <= slot.slot < self.capacity:
            return None
        deadline = time.monotonic() + self.DIGEST_WAIT
        while True:
            content = self._contents[slot.slot]
            if content is None or content.generation != slot.generation:
                return None
            if content.digest is not None or time.monotonic() > deadline:
                return content if content.digest is not None else None
            time.sleep(0.0005)

    def take_report(self) -> HostReport | None:
        """Slots to forget since the last call; None when there are none."""
        with self._lock:
            forget, self._forget[:] = list(self._forget), []
        return HostReport(forget) if forget else None

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued digest was taken; False on timeout."""
        return self._digests.flush(timeout)

    def close(self) -> None:
        self._digests.close()


def _take_digests(
    contents: list[_SlotContent | None],
    lock: threading.Lock,
    forget: list[HostSlot],
    stats: HostPoolStats,
    blocks: list[tuple[HostSlot, torch.Tensor]],
) -> None:
    """Takes each queued block's digest and records it, unless the slot was written again
    since (its generation changed). Never raises: an error is counted and the slot reported."""
    for slot, kv in blocks:
        try:
            digest = _digest(kv)
        except Exception:  # a digest thread must outlive any one block
            with lock:
                if (content := contents[slot.slot]) and content.generation == slot.generation:
                    contents[slot.slot] = None
                forget.append(slot)
            stats.errors += 1
            continue
        with lock:
            content = contents[slot.slot]
            if content is not None and content.generation == slot.generation:
                contents[slot.slot] = replace(content, digest=digest)
                stats.saved_blocks += 1
