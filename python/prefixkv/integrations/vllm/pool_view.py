"""What vLLM reads of a block manager's pool and coordinator, answered from prefixkv's pool.

vLLM's `KVCacheManager` exposes its `BlockPool` (`block_pool`) and its coordinator
(`coordinator`, with one single-type manager per KV cache group); the scheduler, EngineCore and
KV connectors read a few of their members. prefixkv's pool is the Rust core's, so these views
answer those reads from it: free-block counts, usage, the block objects by id, the group's spec.
They own nothing. The members vLLM uses only to *change* a pool behind the manager's back
(freeing blocks a request popped, evicting by id) are refused by name: with prefixkv every
block change goes through the manager, which is what keeps refcounts exact.

Block ids: vLLM's block 0 is its null block (never allocated; sliding-window tables hold it at
positions outside the window); blocks 1..N-1 are prefixkv's blocks 0..N-2, and prefixkv's own
null block (id N-1, one past its pool) is vLLM's block 0. `BlockIds` holds both directions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from prefixkv.errors import UnsupportedFeatureError

if TYPE_CHECKING:
    from prefixkv.cache import PrefixCache


class BlockIds:
    """vLLM's `KVCacheBlock` objects, indexed by prefixkv block id (`of_prefixkv`) and by vLLM
    block id (`blocks`), for a vLLM pool of `num_vllm_blocks` blocks."""

    def __init__(self, num_vllm_blocks: int) -> None:
        if num_vllm_blocks < 2:
            raise UnsupportedFeatureError(
                f"kv_cache_config.num_blocks is {num_vllm_blocks}: vLLM keeps block 0 as its "
                "null block, so prefixkv needs at least 2"
            )
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_vllm_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        # prefixkv id p is vLLM id p + 1; prefixkv's null block (num_vllm_blocks - 1) is 0.
        self.of_prefixkv = [*self.blocks[1:], self.null_block]

    def to_vllm(self, prefixkv_ids: list[int]) -> list[KVCacheBlock]:
        of = self.of_prefixkv
        return [of[i] for i in prefixkv_ids]


class BlockPoolView:
    """The members of vLLM's `BlockPool` that the scheduler, EngineCore and connectors read."""

    def __init__(self, cache: PrefixCache, ids: BlockIds, manager: Any) -> None:
        self._cache = cache
        self._manager = manager
        self.blocks = ids.blocks
        self.null_block = ids.null_block
        self.num_gpu_blocks = len(ids.blocks)
        self.enable_caching = True
        self.medium = "GPU"

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation could take now: free ones plus cached ones no request holds.

        That is vLLM's free queue (it holds cached blocks with no reference too). For full
        attention every unreferenced cached block is evictable, so this is the pool less the
        blocks some request references. The run core keeps that count as it goes
        (`blocks_obtainable`), where its `stats()` would walk every block each step."""
        if self._cache.core == "runs":
            return self._cache.blocks_obtainable()
        return self._cache.num_blocks - self._cache.stats().blocks_in_use

    def get_usage(self) -> float:
        # As BlockPool.get_usage: the null block is neither free nor counted.
        total = self.num_gpu_blocks - 1
        if not total:
            return 0
        return 1.0 - (self.get_num_free_blocks() / total)

    def take_events(self) -> list[Any]:
        return self._manager.take_events()

    def reset_prefix_cache(self) -> bool:
        return bool(self._manager.reset_prefix_cache())

    def free_blocks(self, ordered_blocks: Any) -> None:
        raise UnsupportedFeatureError(
            "BlockPool.free_blocks: with prefixkv's block manager blocks are returned only "
            "through KVCacheManager.free (deferred frees and copy-on-write retentions, used by "
            "KV connectors and Mamba alignment, are not supported)"
        )

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise UnsupportedFeatureError(
            "BlockPool.evict_blocks (a KV connector's failed-load recovery) is not supported by "
            "prefixkv's block manager"
        )


class SingleTypeManagerView:
    """What is read of vLLM's per-group manager: its group, block size and spec."""

    def __init__(
        self, kv_cache_spec: Any, block_size: int, block_pool: BlockPoolView, group_id: int = 0
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = block_size
        self.kv_cache_group_id = group_id
        self.block_pool = block_pool
        self.retains_longer_hit = False
        self.records_new_block_ids = False


class CoordinatorView:
    """The members of vLLM's `KVCacheCoordinator` read outside the manager."""

    def __init__(
        self, manager: Any, specs: tuple[Any, ...], block_size: int, pool: BlockPoolView
    ) -> None:
        self._manager = manager
        self.block_pool = pool
        self.single_type_managers = tuple(
            SingleTypeManagerView(spec, block_size, pool, group_id)
            for group_id, spec in enumerate(specs)
        )
        self.block_size = block_size
        # prefixkv serves whole blocks only: no partial-block hits, no eagle groups, no
        # multi-token-prediction re-prefill.
        self.enable_partial_hash_hits = False
        self.eagle_group_ids: tuple[int, ...] = ()
        self.num_reprefillable_tokens = 0

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the request would still take to hold `num_tokens` slots (the scheduler asks
        this of running requests only, with no new computed blocks)."""
        if any(new_computed_blocks) or num_encoder_tokens:
            raise UnsupportedFeatureError(
                "coordinator.get_num_blocks_to_allocate with new computed blocks or encoder "
                "tokens is not supported by prefixkv's block manager"
            )
        return int(self._manager.blocks_to_allocate(request_id, num_tokens, apply_admission_cap))

    def new_step_starts(self) -> None:
        return None
