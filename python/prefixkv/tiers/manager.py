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
3. `probe_request` before a waiting request's admission, with its device hit known: its next
   blocks, up to the block of its last token, are looked up in the host tier, then the rest in
   the remote store (one round trip, values fetched and verified). The engine allocates room
   for the whole hit plus its first chunk (a hit longer than a step's token budget is loaded
   whole: loading costs no compute), then `load_request` copies the hit into the request's own
   fresh blocks and commits, which publishes them on the device.

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
from prefixkv.kv.pages import PagedKVCache
from prefixkv.tiers.host import BlockRecord, HostTier
from prefixkv.tiers.remote import RemoteStore, RemoteTier

__all__ = ["WRITE_POLICIES", "KVTiers", "TierHit", "TierStats"]

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


@dataclass
class TierHit:
    """What the lower tiers hold of one request's blocks, from block `first` on: the first
    `num_host` of `records` in the host tier, the rest fetched from the remote store
    (`remote_kv`, verified, one per record)."""

    first: int
    records: list[BlockRecord]
    num_host: int
    remote_kv: list[torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return len(self.records)


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

    @classmethod
    def build(
        cls,
        device_pool: PagedKVCache,
        *,
        host_tier_bytes: int | None,
        remote_store: RemoteStore | None,
        remote_namespace: str,
        remote_queue_size: int,
        write_policy: str,
    ) -> KVTiers:
        """The tiers an `Engine` asks for: a host tier of `host_tier_bytes`, and a `RemoteTier`
        over `remote_store` (created last, once the other settings were accepted)."""
        tiers = cls(device_pool, host_tier_bytes=host_tier_bytes, write_policy=write_policy)
        if remote_store is not None:
            tiers.remote = RemoteTier(
                remote_store, namespace=remote_namespace, queue_size=remote_queue_size
            )
        return tiers

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

    def probe(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[int],
        first: int,
        last: int,
        context: bytes,
    ) -> TierHit:
        """Blocks ``first ..`` (before `last`) of a request that the host tier holds, then the
        run after them that the remote store holds and verifies (fetched now: one round trip)."""
        bs = self.device_pool.block_size
        records = [
            BlockRecord(keys[j], keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs]))
            for j in range(first, min(last, len(keys)))
        ]
        num_host = self.host.match(records) if self.host is not None else 0
        remote_kv: list[torch.Tensor] = []
        if self.remote is not None and num_host < len(records):
            remote_kv = self.remote.fetch(
                records[num_host:], context, self.device_pool.dtype, self.block_shape
            )
        return TierHit(first, records[: num_host + len(remote_kv)], num_host, remote_kv)

    def apply(self, hit: TierHit, block_table: Sequence[int]) -> tuple[int, int]:
        """Copy a probed hit into the request's blocks (as many as `block_table` has); returns
        how many blocks the host and the remote tier served (consecutive from ``hit.first``).
        Host blocks are matched again: saving evicted blocks since the probe may have pushed
        some out, and then nothing after them is served."""
        limit = max(0, min(hit.num_blocks, len(block_table) - hit.first))
        host_records = hit.records[: min(hit.num_host, limit)]
        num_host = self.host.match(host_records) if self.host is not None else 0
        if num_host:
            assert self.host is not None
            targets = block_table[hit.first : hit.first + num_host]
            self.host.load(self.device_pool, host_records[:num_host], targets)
        num_remote = 0
        if num_host == hit.num_host:
            num_remote = max(0, min(len(hit.remote_kv), limit - num_host))
        if num_remote:
            start = hit.first + num_host
            index = torch.tensor(
                block_table[start : start + num_remote],
                dtype=torch.long,
                device=self.device_pool.device,
            )
            stacked = torch.stack(hit.remote_kv[:num_remote], dim=2)
            self.device_pool.storage.index_copy_(
                2, index, stacked.to(self.device_pool.device, non_blocking=True)
            )
        self.stats.host_hit_blocks += num_host
        self.stats.remote_hit_blocks += num_remote
        return num_host, num_remote

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
        last = min(last, len(block_table))
        if first >= last:
            return 0, 0
        return self.apply(self.probe(keys, tokens, first, last, context), block_table)

    # -- what the engine calls, per request (the cache holds the request's table and keys) --

    def save_evicted_by(self, cache: PrefixCache) -> None:
        """Right after an allocation: the blocks it evicted still hold their KV (nothing is
        written before the step's model call), so they go to the host tier now."""
        if self.needs_eviction_log:
            evicted = cache.drain_evicted()
            if evicted:
                self.save_evicted(evicted, cache.context.fingerprint())

    def probe_request(
        self, cache: PrefixCache, request_id: str, tokens: Sequence[int], start: int
    ) -> TierHit | None:
        """Before a waiting request's admission, with computing to start at `start`: what the
        tiers hold of its blocks from there up to the block of its last token (kept: its
        logits are computed). None when `start` is inside a block or nothing is held. The
        engine sizes the admission's allocation to take the whole hit, however many steps'
        budgets it spans: loaded blocks cost no compute."""
        bs = self.device_pool.block_size
        first, last = start // bs, (len(tokens) - 1) // bs
        if start % bs or last <= first:
            return None
        keys = cache.request_block_keys(request_id)
        hit = self.probe(keys, tokens, first, last, cache.context.fingerprint())
        return hit if hit.num_blocks else None

    def load_request(
        self,
        cache: PrefixCache,
        request_id: str,
        tokens: Sequence[int],
        start: int,
        hit: TierHit,
        end: int,
    ) -> int:
        """After the admission's allocation (of tokens up to `end`) and `save_evicted_by`: copy
        the probed hit into the request's fresh blocks, as many as lie before the block of
        token ``end - 1`` (left to compute), and commit them; returns where computing starts
        now. Nothing is loaded unless computing starts where the hit does and its keys are
        still the request's own."""
        bs = self.device_pool.block_size
        keys = cache.request_block_keys(request_id)
        probed = [record.key for record in hit.records]
        if start != hit.first * bs or keys[hit.first : hit.first + len(probed)] != probed:
            return start
        table = cache.block_table(request_id)
        num_host, num_remote = self.apply(hit, table[: (end - 1) // bs])
        if not num_host + num_remote:
            return start
        loaded = start + (num_host + num_remote) * bs
        cache.commit(request_id, loaded)
        context = cache.context.fingerprint()
        self.record(table, keys, tokens, hit.first, loaded // bs, context, from_remote=True)
        return loaded

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
