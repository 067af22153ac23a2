"""The host tier: KV of blocks evicted from the device pool, in a host-memory pool with its own
LRU.

The pool is a `PagedKVCache` on the CPU with the device pool's geometry (pinned when the device
pool is on CUDA, so copies in both directions are one batched DMA each). An entry is keyed by
the block's SHA-256 key (which already binds the context fingerprint, the salt and every token
before it) and remembers its parent key and tokens, which a load checks again: a host block is
served only to a request whose own key chain and tokens name it.

Blocks move, they are not copied twice: a block saved here leaves the device pool (it was
evicted), and a block loaded back to the device leaves the host pool (the device copy is the
cached one again; its next eviction brings it back).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.kv.pages import PagedKVCache

__all__ = ["BlockRecord", "HostTier", "held_run"]

T = TypeVar("T")


@dataclass(frozen=True)
class BlockRecord:
    """What identifies the KV of one published block."""

    key: bytes
    #: The previous block's key; None for a first block.
    parent: bytes | None
    tokens: tuple[int, ...]


class HostTier:
    """An LRU of block KV in host memory, `capacity_bytes` at most."""

    def __init__(self, device_pool: PagedKVCache, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidInputError(f"host_tier_bytes must be an int, got {capacity_bytes!r}")
        num_blocks = capacity_bytes // device_pool.bytes_per_block
        if num_blocks < 1:
            raise InvalidInputError(
                f"host_tier_bytes={capacity_bytes} holds no block; one block takes "
                f"{device_pool.bytes_per_block} bytes"
            )
        self.pool = PagedKVCache(
            device_pool.num_layers,
            num_blocks,
            device_pool.block_size,
            device_pool.num_kv_heads,
            device_pool.head_dim,
            dtype=device_pool.dtype,
            device="cpu",
            pin_memory=device_pool.device.type == "cuda",
        )
        self._entries: OrderedDict[bytes, tuple[BlockRecord, int]] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.saved_blocks = 0
        self.evicted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def save(self, device_pool: PagedKVCache, records: Sequence[tuple[int, BlockRecord]]) -> None:
        """Copy device blocks into the pool, one batched copy; the least recently used host
        blocks make room. Returns nothing: the host tier is best effort."""
        todo = [(block, record) for block, record in records if record.key not in self._entries]
        todo = todo[-self.pool.num_blocks :]  # the newest, when more than the pool holds
        if not todo:
            return
        while len(self._free) < len(todo):
            _, (_, slot) = self._entries.popitem(last=False)
            self._free.append(slot)
            self.evicted_blocks += 1
        # Lowest free slots, ascending: a batch lands in runs of consecutive slots, which the
        # copies move with one strided operation per run (and a later load reads in runs).
        self._free.sort(reverse=True)
        slots = [self._free.pop() for _ in todo]
        for (_, record), slot in zip(todo, slots, strict=True):
            self._entries[record.key] = (record, slot)
        _copy_blocks(device_pool, [block for block, _ in todo], self.pool, slots)
        self.saved_blocks += len(todo)

    def match(self, records: Sequence[BlockRecord]) -> int:
        """How many of `records` (consecutive blocks of one request) the pool holds, from the
        first, with the same parent and tokens."""
        return len(held_run(self._entries, records))

    def load(
        self, device_pool: PagedKVCache, records: Sequence[BlockRecord], block_ids: Sequence[int]
    ) -> None:
        """Move the blocks `records` (all matched) into device blocks `block_ids`."""
        slots = [self._entries[record.key][1] for record in records]
        _copy_blocks(self.pool, slots, device_pool, list(block_ids))
        for record, slot in zip(records, slots, strict=True):
            del self._entries[record.key]
            self._free.append(slot)

    def block_kv(self, key: bytes) -> torch.Tensor:
        """The KV of one held block, ``[2, num_layers, block_size, heads, head_dim]`` (a view)."""
        return self.pool.storage[:, :, self._entries[key][1]]

    def clear(self) -> None:
        self._free.extend(slot for _, slot in self._entries.values())
        self._entries.clear()


def held_run(
    entries: Mapping[bytes, tuple[BlockRecord, T]], records: Sequence[BlockRecord]
) -> list[T]:
    """The values `entries` (block key -> record and value) holds for `records[:n]`, the
    longest run from the first whose entry is the same record: the same key is not enough, the
    parent and tokens must be the request's own too."""
    held = []
    for record in records:
        entry = entries.get(record.key)
        if entry is None or entry[0] != record:
            break
        held.append(entry[1])
    return held


def _copy_blocks(
    source: PagedKVCache, source_ids: list[int], target: PagedKVCache, target_ids: list[int]
) -> None:
    """Blocks ``source[source_ids[i]] -> target[target_ids[i]]``. Across devices: the pool's
    batched copy (one gather, one transfer, one scatter). Host to host: one strided copy per
    run of consecutive target blocks (`index_select` into the run), which reads and writes each byte once: a gather and a scatter would move it twice
    (benches/RESULTS-tiers.md)."""
    if source.device.type != "cpu" or target.device.type != "cpu":
        source.copy_blocks_to(target, source_ids, target_ids)
        return
    source_view, target_view = source._blocks_view(), target._blocks_view()
    # index_copy_ out of a run would be one pass too, but is several times slower on CPU.
    for start, stop in _runs(target_ids):
        if stop - start == 1:  # a lone block: a plain strided copy costs less to set up
            target_view[:, target_ids[start]].copy_(source_view[:, source_ids[start]])
            continue
        index = torch.tensor(source_ids[start:stop], dtype=torch.long)
        first = target_ids[start]
        out = target_view[:, first : first + stop - start]
        torch.index_select(source_view, 1, index, out=out)


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive ids (``ids[i + 1] == ids[i] + 1``)."""
    runs = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs
