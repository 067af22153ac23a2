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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.kv import PagedKVCache

__all__ = ["BlockRecord", "HostTier"]


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
        slots = []
        for _, record in todo:
            if not self._free:
                _, (_, slot) = self._entries.popitem(last=False)
                self._free.append(slot)
                self.evicted_blocks += 1
            slot = self._free.pop()
            self._entries[record.key] = (record, slot)
            slots.append(slot)
        device_pool.copy_blocks_to(self.pool, [block for block, _ in todo], slots)
        self.saved_blocks += len(todo)

    def match(self, records: Sequence[BlockRecord]) -> int:
        """How many of `records` (consecutive blocks of one request) the pool holds, from the
        first, with the same parent and tokens."""
        count = 0
        for record in records:
            entry = self._entries.get(record.key)
            if entry is None or entry[0] != record:
                break
            count += 1
        return count

    def load(
        self, device_pool: PagedKVCache, records: Sequence[BlockRecord], block_ids: Sequence[int]
    ) -> None:
        """Move the blocks `records` (all matched) into device blocks `block_ids`."""
        slots = [self._entries[record.key][1] for record in records]
        self.pool.copy_blocks_to(device_pool, slots, list(block_ids))
        for record, slot in zip(records, slots, strict=True):
            del self._entries[record.key]
            self._free.append(slot)

    def block_kv(self, key: bytes) -> torch.Tensor:
        """The KV of one held block, ``[2, num_layers, block_size, heads, head_dim]`` (a view)."""
        return self.pool.storage[:, :, self._entries[key][1]]

    def clear(self) -> None:
        self._free.extend(slot for _, slot in self._entries.values())
        self._entries.clear()
