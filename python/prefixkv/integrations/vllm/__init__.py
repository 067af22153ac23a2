"""prefixkv inside an unmodified vLLM.

- ``scheduler_cls="prefixkv.integrations.vllm.Scheduler"``: vLLM's own scheduler with prefixkv's
  block manager (`PrefixKVCacheManager`) in place of vLLM's `KVCacheManager` (``docs/vllm.md``).
- ``kv_connector_module_path="prefixkv.integrations.vllm.connector"``: `PrefixKVConnector`, the
  verified Valkey/Redis store shared by every engine that points at it (the connector's modules
  are the ``connector*.py`` files here).

Supported vLLM versions are named in `_versions.py` and checked when this package is imported;
the block manager interface is compared with the installed vLLM's when the block manager is
(`signatures.py`). Exports load on first use, so importing the package costs only the check.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefixkv.integrations.vllm._versions import SUPPORTED_SERIES, check_vllm_version

VLLM_VERSION = check_vllm_version()

if TYPE_CHECKING:
    from prefixkv.integrations.vllm.block_manager import PrefixKVCacheManager
    from prefixkv.integrations.vllm.connector import PrefixKVConnector
    from prefixkv.integrations.vllm.hybrid import HybridPrefixKVCacheManager
    from prefixkv.integrations.vllm.scheduler import (
        AsyncScheduler,
        Scheduler,
        install_block_manager,
        make_block_manager,
    )

__all__ = [
    "SUPPORTED_SERIES",
    "VLLM_VERSION",
    "AsyncScheduler",
    "HybridPrefixKVCacheManager",
    "PrefixKVCacheManager",
    "PrefixKVConnector",
    "Scheduler",
    "install_block_manager",
    "make_block_manager",
]

_LAZY = {
    "HybridPrefixKVCacheManager": "prefixkv.integrations.vllm.hybrid",
    "PrefixKVCacheManager": "prefixkv.integrations.vllm.block_manager",
    "PrefixKVConnector": "prefixkv.integrations.vllm.connector",
    "Scheduler": "prefixkv.integrations.vllm.scheduler",
    "AsyncScheduler": "prefixkv.integrations.vllm.scheduler",
    "install_block_manager": "prefixkv.integrations.vllm.scheduler",
    "make_block_manager": "prefixkv.integrations.vllm.scheduler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixkv.integrations.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
