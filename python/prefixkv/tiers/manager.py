"""`KVTiers`: the device pool's lower tiers as the engine drives them.

The engine calls three things, in this order within a step:

1. `record` after each `commit` (and `accept_drafts`) that publishes blocks: it remembers, for
   each published device block id, the block's key, parent key and tokens (the core keys its
   table by a short hash; a tier needs the SHA-256 key chain). With write-through it also
   queues the block for the remote store.
2. `save_evicted` right after every allocation, with the block ids the allocation evicted
   (`PrefixCache.drain_evicted`): their pages still hold the evicted KV, since nothing writes
   the fresh blocks before the step's model call. They move to the host tier (and, with
   write-back, to the remote queue).
3. `load` on admission, after `allocate_slots` matched the device prefix: the request's next
   blocks are looked up in the host tier, then the rest in the remote store (one round trip),
   and copied into the request's own fresh blocks; the engine then counts them computed and
   commits, which publishes them on the device.

Correctness does not depend on the tiers: a block is served only when its SHA-256 key (which
binds context, salt, adapter and every earlier token), its parent key and its tokens are the
request's own, and anything else is a miss that the model recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixkv.cache import PrefixCache
from prefixkv.errors import InvalidInputError
from prefixkv.kv import PagedKVCache
from prefixkv.tiers.host import BlockRecord, HostTier
from prefixkv.tiers.remote import RemoteTier

__all__ = ["WRITE_POLICIES", "KVTiers", "TierStats"]

#: When a block goes to the remote store: as soon as it is published on the device, or when
#: it leaves the device (evicted).
WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class TierStats:
    """Blocks served by each lower tier (the remote tier keeps its own detailed counters)."""

    host_hit_blocks: int = 0
    remote_hit_blocks: int = 0
    #: Evicted device blocks with no record (never published through the engine): not saved.
    unrecorded_evictions: int = 0


class KVTiers:
    """A host tier and/or a remote tier under one device pool."""

    def __init__(
        self,
        device_pool: PagedKVCache,
        *,
        host_tier_bytes: int | None = None,
        remote: RemoteTier | None = None,
        write_policy: str = "write_through",
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise InvalidInputError(
                f"remote_write must be one of {WRITE_POLICIES}, got {write_policy!r}"
            )
        self.device_pool = device_pool
        self.host = None if host_tier_bytes is None else HostTier(device_pool, host_tier_bytes)
        self.remote = remote
        self.write_policy = write_policy
        self.stats = TierStats()
        self._records: dict[int, BlockRecord] = {}
        bs = device_pool.block_size
        self.block_shape = (
            2,
            device_pool.num_layers,
            bs,
            device_pool.num_kv_heads,
            device_pool.head_dim,
        )

    @property
    def needs_eviction_log(self) -> bool:
        return self.host is not None or (
            self.remote is not None and self.write_policy == "write_back"
        )

    def _blocks_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of device blocks, ``[n, 2, layers, block_size, heads, head_dim]``."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device_pool.device)
        kv = self.device_pool.storage.index_select(2, index)
        return kv.permute(2, 0, 1, 3, 4, 5).to("cpu")

    def _write_remote(self, blocks: list[tuple[int, BlockRecord]], context: bytes) -> None:
        """Queue these device blocks' KV for the remote tier (one gather for all of them)."""
        if self.remote is None:
            return
        kv = self._blocks_kv([block for block, _ in blocks])
        for i, (_, record) in enumerate(blocks):
            self.remote.put(record, context, kv[i])

    def record(
        self,
        block_table: Sequence[int],
        keys: Sequence[bytes],
        tokens: Sequence[int],
        first: int,
        last: int,
        context: bytes,
        *,
        from_remote: bool = False,
    ) -> None:
        """Blocks ``first .. last - 1`` of a request were published (or were already cached)."""
        last = min(last, len(keys), len(block_table))
        if first >= last:
            return
        bs = self.device_pool.block_size
        new: list[tuple[int, BlockRecord]] = []
        for j in range(first, last):
            record = BlockRecord(
                keys[j], keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs])
            )
            self._records[block_table[j]] = record
            new.append((block_table[j], record))
        if self.write_policy == "write_through" and not from_remote:
            self._write_remote(new, context)

    def save_evicted(self, block_ids: Sequence[int], context: bytes) -> None:
        if not block_ids:
            return
        saved: list[tuple[int, BlockRecord]] = []
        for block in block_ids:
            record = self._records.pop(block, None)
            if record is None:
                self.stats.unrecorded_evictions += 1
            else:
                saved.append((block, record))
        if not saved:
            return
        if self.write_policy == "write_back":
            self._write_remote(saved, context)
        if self.host is not None:
            self.host.save(self.device_pool, saved)

    def load(
        self,
        block_table: Sequence[int],
        keys: Sequence[bytes],
        tokens: Sequence[int],
        first: int,
        last: int,
        context: bytes,
    ) -> tuple[int, int]:
        """Fill blocks ``first ..`` (before `last`) of a request from the host tier, then the
        remote tier; returns how many blocks each served (consecutive from `first`)."""
        last = min(last, len(keys), len(block_table))
        if first >= last:
            return 0, 0
        bs = self.device_pool.block_size
        records = [
            BlockRecord(keys[j], keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs]))
            for j in range(first, last)
        ]
        num_host = 0
        if self.host is not None:
            num_host = self.host.match(records)
            if num_host:
                self.host.load(
                    self.device_pool, records[:num_host], block_table[first : first + num_host]
                )
        num_remote = 0
        if self.remote is not None and num_host < len(records):
            kvs = self.remote.fetch(
                records[num_host:], context, self.device_pool.dtype, self.block_shape
            )
            num_remote = len(kvs)
            if kvs:
                start = first + num_host
                index = torch.tensor(
                    block_table[start : start + num_remote],
                    dtype=torch.long,
                    device=self.device_pool.device,
                )
                stacked = torch.stack(kvs, dim=2).to(self.device_pool.device, non_blocking=True)
                self.device_pool.storage.index_copy_(2, index, stacked)
        self.stats.host_hit_blocks += num_host
        self.stats.remote_hit_blocks += num_remote
        return num_host, num_remote

    # -- what the engine calls, per request (the cache holds the request's table and keys) --

    def save_evicted_by(self, cache: PrefixCache) -> None:
        """Right after an allocation: the blocks it evicted still hold their KV (nothing is
        written before the step's model call), so they go to the host tier now."""
        if self.needs_eviction_log:
            evicted = cache.drain_evicted()
            if evicted:
                self.save_evicted(evicted, cache.context.fingerprint())

    def load_request(
        self, cache: PrefixCache, request_id: str, tokens: Sequence[int], start: int, num_new: int
    ) -> int:
        """Extends a fresh admission's device hit (computing starts at `start`, `num_new`
        tokens scheduled) with host, then remote blocks, loaded into its own fresh blocks and
        committed; returns where computing starts now. At least one token of the chunk is left
        to compute (its logits, or the next chunk)."""
        bs = self.device_pool.block_size
        first, last = start // bs, (start + num_new - 1) // bs
        if start % bs or last <= first:
            return start
        keys = cache.request_block_keys(request_id)
        table = cache.block_table(request_id)
        context = cache.context.fingerprint()
        num_host, num_remote = self.load(table, keys, tokens, first, last, context)
        if not num_host + num_remote:
            return start
        start = (first + num_host + num_remote) * bs
        cache.commit(request_id, start)
        self.record(table, keys, tokens, first, start // bs, context, from_remote=True)
        return start

    def record_request(
        self, cache: PrefixCache, request_id: str, tokens: Sequence[int], start: int, end: int
    ) -> None:
        """Blocks ``start // block_size .. end // block_size - 1`` of a request were just
        published."""
        bs = self.device_pool.block_size
        first, last = start // bs, end // bs
        if last <= first:
            return
        self.record(
            cache.block_table(request_id),
            cache.request_block_keys(request_id),
            tokens,
            first,
            last,
            cache.context.fingerprint(),
        )

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
