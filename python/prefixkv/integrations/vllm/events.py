"""The Rust core's KV events as vLLM's own event structs, for vLLM's event publisher.

The core records every block it publishes, evicts or clears (`rust/core/src/events/`); the
block manager drains that record in `take_events` and vLLM's scheduler hands the result to its
`EventPublisher` as it would its own. Block hashes are prefixkv's keys (`docs/events.md`): the
32-byte key, or its 64-bit form when vLLM is told to send integers
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read through `vllm.envs` as vLLM reads it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import vllm.envs as envs
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from prefixkv._core import CoreEvent

#: Where the blocks live, as vLLM's GPU block pool says it (`BlockPool.medium`).
MEDIUM = "GPU"


def vllm_events(
    events: list[CoreEvent],
    *,
    block_size: int,
    kind: str | None,
    sliding_window: int | None,
) -> list[Any]:
    """`events` as `BlockStored` / `BlockRemoved` / `AllBlocksCleared` of KV cache group 0,
    annotated with the group's spec kind and window as `KVCacheManager.take_events` does."""
    use_int = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    out: list[Any] = []
    for event in events:
        if event.kind == "cleared":
            out.append(AllBlocksCleared())
            continue
        hashes: list[Any] = list(event.hashes64) if use_int else list(event.keys)
        if event.kind == "removed":
            out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0))
            continue
        parent = event.parent
        parent_hash: Any = None
        if parent is not None:
            parent_hash = int.from_bytes(parent[-8:], "big") if use_int else parent
        extras = event.extras
        token_ids = event.token_ids
        adapter = event.adapter
        out.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent_hash,
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=adapter.decode("utf-8", "replace") if adapter is not None else None,
                extra_keys=(
                    [(e,) if e else None for e in extras] if token_ids and any(extras) else None
                ),
                group_idx=0,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=sliding_window,
            )
        )
    return out
