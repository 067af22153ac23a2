"""CUDA-only check of hybrid models on KV groups: the Engine on the GPU, with sliding groups
releasing blocks behind their null block, equals a full recompute on the same device.

Collected only where CUDA is available (see tests/conftest.py); `benches/gpu.sh` runs them.
"""

from __future__ import annotations

import pytest
import torch

from prefixkv.engine.facade import Engine
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.text.tokenizers import ByteTokenizer

FULL, SLIDING = "full_attention", "sliding_attention"


@pytest.mark.parametrize("layer_types", [(SLIDING, FULL, SLIDING, FULL), (SLIDING,) * 3])
def test_kv_groups_on_cuda_equal_full_recompute(layer_types: tuple[str, ...]) -> None:
    config = ModelConfig(
        vocab_size=ByteTokenizer().vocab_size,
        num_layers=len(layer_types),
        sliding_window=6,
        layer_types=layer_types if len(set(layer_types)) > 1 else None,
    )
    model = LlamaModel.random(config, seed=2)
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(0, 256, (21,), generator=generator).tolist()
    prompts = [system + torch.randint(0, 256, (9,), generator=generator).tolist() for _ in range(3)]
    pools = (24, 8) if len(set(layer_types)) > 1 else (8,)
    engine = Engine(
        model,
        kv_group_blocks=pools,
        block_size=4,
        max_num_batched_tokens=8,
        device="cuda",
        dtype=torch.float32,
    )
    for _ in range(2):  # the second round hits the cache
        results = engine.generate(prompts, max_new_tokens=8, check_exactness=True)
        for result in results:
            assert result.tokens_match
            assert result.max_logit_diff is not None and result.max_logit_diff < 1e-3
    assert any(result.cached_tokens > 0 for result in results)
    assert engine.cache.stats().blocks_released > 0
    engine.cache.check_invariants()
