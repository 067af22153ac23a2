"""CUDA-only checks of paged KV storage: pinned host tiers and non-blocking device copies.

Collected only where CUDA is available (see tests/conftest.py); `benches/gpu.sh` runs them.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.kv.pages import KVIndexError, PagedKVCache

# -- device tiers (CUDA only) --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_swap_between_cuda_and_pinned_host(dtype: torch.dtype) -> None:
    device_cache = PagedKVCache(2, 6, 4, 2, 8, dtype=dtype, device="cuda")
    host_cache = PagedKVCache(2, 5, 4, 2, 8, dtype=dtype, pin_memory=True)
    assert host_cache.is_pinned
    device_cache.storage.copy_(torch.randn(device_cache.storage.shape, device="cuda").to(dtype))
    original = device_cache.storage.clone()
    device_cache.swap_out([4, 1], host_cache, [0, 3])
    assert torch.equal(host_cache.storage[:, :, 0], original[:, :, 4].cpu())
    assert torch.equal(host_cache.storage[:, :, 3], original[:, :, 1].cpu())
    device_cache.swap_in(host_cache, torch.tensor([3, 0]), torch.tensor([5, 2], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(device_cache.storage[:, :, 5], original[:, :, 1])
    assert torch.equal(device_cache.storage[:, :, 2], original[:, :, 4])
    # Ids already on the GPU skip the range check by default (it would cost a sync) ...
    slots = torch.tensor([0, 1], device="cuda")
    device_cache.write(0, *(torch.zeros(2, 2, 8, dtype=dtype, device="cuda"),) * 2, slots)
    # ... and pay for it when asked.
    with pytest.raises(KVIndexError):
        device_cache.copy_blocks(torch.tensor([9], device="cuda"), [0], check_bounds=True)
