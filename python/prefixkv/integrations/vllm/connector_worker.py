"""The connector's worker side: block KV between vLLM's paged KV cache and the tiers (the
worker's host pool, `connector_host`, and the store).

vLLM hands the worker one tensor per attention layer, its logical per-layer view
``[blocks, kv_heads, tokens_per_block, head_size + head_size_v]`` whatever the physical
`KVCacheLayout` (when the attention kernel uses smaller blocks than the scheduler, the first
dimension counts kernel blocks, several per scheduler block). A stored value is one scheduler
block of every layer, ``[layers, kv_heads, block_size, head_size + head_size_v]``.

* Loads (`load`, from `start_load_kv`, before the step's forward): per request, its first
  claimed blocks from the host pool (each slot checked: generation, record, digest), then the
  rest with one ``MGET`` from the store (each value verified again, `prefixkv.tiers.format`);
  the verified run is copied into the request's blocks with one ``index_copy_`` per layer. A
  block that fails, and every claimed block after it, is reported by `take_load_errors`, and
  vLLM recomputes them (``kv_load_failure_policy="recompute"``).
* Saves (`save`, from `wait_for_save`, after the forward wrote the step's KV): the blocks of
  the step's save jobs are gathered once into a fresh host tensor (one ``index_select`` per
  layer), copied into their host slots (one ``index_copy_``; their digests are queued for the
  pool's thread) and queued for the store's writer thread; a full queue drops the block and
  counts it (`RemoteStats.dropped`, `HostPoolStats.dropped`). The copies are taken before the
  step returns, so vLLM may free or reuse the blocks at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector_host import HostPool, HostReport
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, RequestKeys
from prefixkv.integrations.vllm.connector_scheduler import BlockJob
from prefixkv.tiers import BlockRecord, RemoteTier

__all__ = ["WorkerSide", "WorkerStats"]

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Blocks moved by one worker."""

    loaded_blocks: int = 0
    #: Of `loaded_blocks`, those from the host pool.
    host_loaded_blocks: int = 0
    #: Claimed blocks the worker could not load (missing, failed verification, store down).
    load_error_blocks: int = 0
    #: Blocks handed to the writer queue (`RemoteStats` counts what reached the store).
    queued_save_blocks: int = 0
    #: Blocks copied into host slots (`HostPoolStats` counts those whose digest was taken).
    host_save_blocks: int = 0


class WorkerSide:
    """One worker's (one tensor-parallel rank's) view of the KV cache and the store."""

    def __init__(
        self,
        keys: RequestKeys,
        remote: RemoteTier | None,
        *,
        host_capacity: int | None = None,
        host_queue_size: int = 64,
    ) -> None:
        self.keys = keys
        #: The store; None without a remote tier.
        self.remote = remote
        #: The host pool, made by `register_kv_caches` (pinned if the cache is on a GPU).
        self.host: HostPool | None = None
        self._host_capacity = host_capacity
        self._host_queue_size = host_queue_size
        self.geometry: BlockGeometry = keys.identity.geometry
        self.stats = WorkerStats()
        self._layers: list[torch.Tensor] = []
        self._kernel_blocks = 1
        self._load_errors: set[int] = set()

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str], num_blocks: int
    ) -> None:
        """Keep each layer's cache, in the order of `layer_names` (the KV cache group's)."""
        g = self.geometry
        layers = []
        for name in layer_names:
            if name not in kv_caches:
                raise InvalidInputError(f"register_kv_caches: no KV cache for layer {name!r}")
            cache = kv_caches[name]
            if cache.dim() != 4 or cache.shape[0] % num_blocks:
                raise InvalidInputError(
                    f"layer {name!r}: expected a [blocks, heads, tokens, head dims] view of "
                    f"{num_blocks} blocks, got shape {tuple(cache.shape)}"
                )
            ratio = cache.shape[0] // num_blocks
            expected = (g.num_kv_heads, g.block_size // ratio, g.head_size + g.head_size_v)
            if tuple(cache.shape[1:]) != expected or cache.dtype != g.dtype:
                raise InvalidInputError(
                    f"layer {name!r}: KV cache view {tuple(cache.shape)} {cache.dtype} does not "
                    f"match the KV cache spec ([*, {expected}] {g.dtype})"
                )
            self._kernel_blocks = ratio
            layers.append(cache.unflatten(0, (num_blocks, ratio)))
        self._layers = layers
        if self._host_capacity is not None and self.host is None:
            self.host = HostPool(
                g,
                self._host_capacity,
                queue_size=self._host_queue_size,
                pin_memory=layers[0].device.type == "cuda",
            )

    # -- block copies --------------------------------------------------------------------

    def _read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of blocks, ``[n, layers, heads, block_size, head dims]``."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self._layers[0].device)
        per_layer = []
        for cache in self._layers:
            blocks = cache.index_select(0, index)  # [n, kernel blocks, H, N', C]
            per_layer.append(blocks.transpose(1, 2).flatten(2, 3))  # [n, H, N, C]
        return torch.stack(per_layer, dim=1).to("cpu")

    def _write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        device = self._layers[0].device
        index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        data = data.to(device)
        ratio = self._kernel_blocks
        for layer, cache in enumerate(self._layers):
            blocks = data[:, layer]  # [n, H, N, C]
            blocks = blocks.unflatten(2, (ratio, blocks.shape[2] // ratio)).transpose(1, 2)
            cache.index_copy_(0, index, blocks)

    # -- one step ------------------------------------------------------------------------

    def load(self, jobs: Sequence[BlockJob]) -> None:
        g = self.geometry
        for job in jobs:
            records = self._records(job)
            num_host = min(len(job.host), job.num_blocks)
            served = 0
            if num_host and self.host is not None:
                kvs = self.host.fetch(job.host[:num_host], records[:num_host])
                served = len(kvs)
                if served:
                    self._write_blocks(job.block_ids[:served], torch.stack(kvs))
                    self.stats.host_loaded_blocks += served
            if served == num_host < job.num_blocks and self.remote is not None:
                kvs = self.remote.fetch(
                    records[served : job.num_blocks], self.keys.fingerprint, g.dtype, g.value_shape
                )
                count = min(len(kvs), job.num_blocks - served)
                if count:
                    self._write_blocks(
                        job.block_ids[served : served + count], torch.stack(kvs[:count])
                    )
                    served += count
            self.stats.loaded_blocks += served
            if served < job.num_blocks:
                failed = job.block_ids[served:]
                self._load_errors.update(failed)
                self.stats.load_error_blocks += len(failed)
                logger.warning(
                    "prefixkv: %d of %d claimed blocks of request %s could not be loaded "
                    "(missing, failed verification, store down or host slot lost); vLLM "
                    "recomputes them",
                    len(failed),
                    job.num_blocks,
                    job.req_id,
                )

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save(self, jobs: Sequence[BlockJob], host_jobs: Sequence[BlockJob] = ()) -> None:
        """Store saves `jobs`, host saves `host_jobs`: each block gathered once."""
        if not jobs and not host_jobs:
            return
        rows: dict[int, int] = {}
        for job in (*jobs, *host_jobs):
            for block in job.block_ids:
                rows.setdefault(block, len(rows))
        kv = self._read_blocks(list(rows))
        for job in jobs:
            if self.remote is None:
                raise InvalidInputError("a store save job on a worker without a store")
            for record, block in zip(self._records(job), job.block_ids, strict=True):
                self.remote.put(record, self.keys.fingerprint, kv[rows[block]])
            self.stats.queued_save_blocks += job.num_blocks
        for job in host_jobs:
            if self.host is None:
                raise InvalidInputError("a host save job on a worker without a host pool")
            index = torch.tensor([rows[block] for block in job.block_ids], dtype=torch.long)
            self.host.save(job.host, self._records(job), kv.index_select(0, index))
            self.stats.host_save_blocks += job.num_blocks

    def _records(self, job: BlockJob) -> list[BlockRecord]:
        return self.keys.records(
            job.tokens, job.first_block + job.num_blocks, salt=job.salt, adapter=job.adapter
        )[job.first_block :]

    def take_host_report(self) -> HostReport | None:
        """Host slots to forget since the last call (the scheduler's index drops them)."""
        return None if self.host is None else self.host.take_report()

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
