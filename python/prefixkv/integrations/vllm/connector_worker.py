"""The connector's worker side: block KV between vLLM's paged KV cache and the store.

vLLM hands the worker one tensor per attention layer, its logical per-layer view
``[blocks, kv_heads, tokens_per_block, head_size + head_size_v]`` whatever the physical
`KVCacheLayout` (when the attention kernel uses smaller blocks than the scheduler, the first
dimension counts kernel blocks, several per scheduler block). A stored value is one scheduler
block of every layer, ``[layers, kv_heads, block_size, head_size + head_size_v]``.

* Loads (`load`, from `start_load_kv`, before the step's forward): one ``MGET`` per request for
  its claimed blocks; each value is verified again (`prefixkv.tiers.format`), and the verified
  run is copied into the request's blocks with one ``index_copy_`` per layer. A block whose
  value is missing or fails verification is reported by `take_load_errors`, and vLLM
  recomputes it (``kv_load_failure_policy="recompute"``).
* Saves (`save`, from `wait_for_save`, after the forward wrote the step's KV): the blocks are
  gathered into a fresh host tensor (one ``index_select`` per layer, the only work on the
  step's path) and queued for the tier's writer thread; a full queue drops the block and
  counts it (`RemoteStats.dropped`). The copy is taken before the step returns, so vLLM may
  free or reuse the blocks at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, RequestKeys
from prefixkv.integrations.vllm.connector_scheduler import BlockJob
from prefixkv.tiers import RemoteTier

__all__ = ["WorkerSide", "WorkerStats"]

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Blocks moved by one worker."""

    loaded_blocks: int = 0
    #: Claimed blocks the worker could not load (missing, failed verification, store down).
    load_error_blocks: int = 0
    #: Blocks handed to the writer queue (`RemoteStats` counts what reached the store).
    queued_save_blocks: int = 0


class WorkerSide:
    """One worker's (one tensor-parallel rank's) view of the KV cache and the store."""

    def __init__(self, keys: RequestKeys, remote: RemoteTier) -> None:
        self.keys = keys
        self.remote = remote
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
            records = self.keys.records(
                job.tokens, job.first_block + job.num_blocks, salt=job.salt, adapter=job.adapter
            )[job.first_block :]
            kvs = self.remote.fetch(records, self.keys.fingerprint, g.dtype, g.value_shape)
            served = min(len(kvs), job.num_blocks)
            if served:
                self._write_blocks(job.block_ids[:served], torch.stack(kvs[:served]))
                self.stats.loaded_blocks += served
            if served < job.num_blocks:
                failed = job.block_ids[served:]
                self._load_errors.update(failed)
                self.stats.load_error_blocks += len(failed)
                logger.warning(
                    "prefixkv: %d of %d claimed blocks of request %s could not be loaded "
                    "(missing, failed verification or store down); vLLM recomputes them",
                    len(failed),
                    job.num_blocks,
                    job.req_id,
                )

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save(self, jobs: Sequence[BlockJob]) -> None:
        for job in jobs:
            records = self.keys.records(
                job.tokens, job.first_block + job.num_blocks, salt=job.salt, adapter=job.adapter
            )[job.first_block :]
            kv = self._read_blocks(job.block_ids[: len(records)])
            for i, record in enumerate(records):
                self.remote.put(record, self.keys.fingerprint, kv[i])
            self.stats.queued_save_blocks += len(records)
