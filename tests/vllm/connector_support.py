"""vLLM's own objects for the connector tests: a real `Scheduler` over a mocked `KVCacheConfig`,
the CPU backend's real KV cache views (`allocate_kv_cache`), requests and model-runner outputs.

The model is a tiny Llama config written to a temporary directory (vLLM reads it with
transformers, as it reads any local model); no weights are loaded, since no forward runs: the
worker side's "computed" KV is random data written into the blocks, which is what a forward
would leave there as far as the connector can tell.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch

with warnings.catch_warnings():
    # Importing vLLM imports torch.utils.mkldnn, which warns that torch.jit is deprecated
    # (torch's deprecation, not vLLM's or ours); the suite turns warnings into errors.
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
    from vllm import SamplingParams
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache

from prefixkv.integrations.vllm.connector import PrefixKVConnector
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, EngineIdentity

EOS = 2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
KV_HEADS = 2
HEAD_SIZE = 32

_ids = count(1)
init_none_hash(sha256)


def write_model_dir(root: Path, *, hidden_size: int = 128, weights: bytes = b"w1") -> Path:
    """A local model directory vLLM accepts: a Llama config and a (never loaded) weights file,
    whose bytes the connector's model digest reads."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_SIZE,
        "num_hidden_layers": len(LAYERS),
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "torch_dtype": "float16",
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(weights)
    return root


def vllm_config(
    model_dir: Path,
    redis_url: str | None,
    *,
    block_size: int = 16,
    dtype: str = "float16",
    policy: str = "recompute",
    prefix_caching: bool = True,
    **extra: Any,
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True, max_model_len=4096
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    transfer = KVTransferConfig(
        kv_connector="PrefixKVConnector",
        kv_connector_module_path="prefixkv.integrations.vllm.connector",
        kv_role="kv_both",
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
        kv_connector_extra_config={
            **({} if redis_url is None else {"redis_url": redis_url}),
            **extra,
        },
    )
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(config: VllmConfig, num_blocks: int = 64) -> KVCacheConfig:
    return _kv_cache_config(config.cache_config.block_size, config.model_config.dtype, num_blocks)


def _kv_cache_config(block_size: int, dtype: torch.dtype, num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(LAYERS),
        layers=list(LAYERS),
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def cpu_kv_caches(
    *, block_size: int, num_blocks: int, kernel_block_size: int, dtype: torch.dtype, dtype_name: str
) -> tuple[dict[str, torch.Tensor], EngineIdentity]:
    """The CPU backend's real KV cache views (`allocate_kv_cache`, kernel blocks of
    `kernel_block_size` tokens) of `num_blocks` blocks of every layer, without a scheduler, and
    an engine identity of their geometry (`dtype_name` as the identity's dtype), for a
    `WorkerSide` built by hand."""
    config = _kv_cache_config(block_size, dtype, num_blocks)
    caches = allocate_kv_cache(
        config, torch.device("cpu"), KVCacheLayout.LBHNC, [kernel_block_size]
    )
    geometry = BlockGeometry.from_kv_cache_config(config)
    identity = EngineIdentity(
        "sha256:test", "cfg", dtype_name, "auto", "None", 2, 1, "cpu/CPU_ATTN/0.32", geometry
    )
    return caches, identity


def block_in_token_order(
    caches: dict[str, torch.Tensor], num_blocks: int, block_id: int
) -> torch.Tensor:
    """Block `block_id` of `cpu_kv_caches`'s views in token order, ``[layers, heads, block,
    head dims]`` (the kernel blocks it is split into put back together)."""
    return torch.stack(
        [
            caches[name].unflatten(0, (num_blocks, -1))[block_id].transpose(0, 1).flatten(1, 2)
            for name in LAYERS
        ]
    )


@dataclass
class Engine:
    """One engine's scheduler and one worker, each with its own connector, as vLLM builds them."""

    config: VllmConfig
    scheduler: Scheduler
    worker: PrefixKVConnector
    kv_caches: dict[str, torch.Tensor]
    outputs: list[SchedulerOutput] = field(default_factory=list)

    @property
    def connector(self) -> PrefixKVConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, PrefixKVConnector)
        return connector

    def step(
        self, *, fill: bool = True, invalid: set[int] | None = None, token: int = 7
    ) -> SchedulerOutput:
        """One scheduler step and the worker's part of it. `fill` writes random KV into every
        block a new token of this step lands in, after the load and before the save, as a
        forward would. Worker load errors and worker metadata go back to the scheduler, like
        the model runner's."""
        output = self.scheduler.schedule()
        self.outputs.append(output)
        self.worker.bind_connector_metadata(output.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        if fill:
            self._fill(output)
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors() | (invalid or set())
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        req_ids = list(output.num_scheduled_tokens)
        connector_output = KVConnectorOutput(
            invalid_block_ids=errors, kv_connector_worker_meta=worker_meta
        )
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
            kv_connector_output=None if connector_output.is_empty() else connector_output,
        )
        self.scheduler.update_from_output(output, runner)
        return output

    def _fill(self, output: SchedulerOutput) -> None:
        block_size = self.config.cache_config.block_size
        for req_id, num in output.num_scheduled_tokens.items():
            # schedule() has already advanced num_computed_tokens past this step's tokens.
            start = self.scheduler.requests[req_id].num_computed_tokens - num
            blocks = self.block_ids(req_id)
            for position in range(start, start + num):
                block = blocks[position // block_size]
                offset = position % block_size
                for cache in self.kv_caches.values():
                    cache[block, :, offset] = torch.randn(cache.shape[1], cache.shape[3]).to(
                        cache.dtype
                    )

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def block_kv(self, block_id: int) -> torch.Tensor:
        return torch.stack([self.kv_caches[name][block_id] for name in LAYERS])


def make_engine(config: VllmConfig, num_blocks: int = 64) -> Engine:
    kv_config = kv_cache_config(config, num_blocks)
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=config.cache_config.block_size,
        log_stats=True,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = PrefixKVConnector(config, KVConnectorRole.WORKER, kv_config)
    caches = allocate_kv_cache(
        kv_config,
        torch.device("cpu"),
        KVCacheLayout.LBHNC,
        [config.cache_config.block_size],
    )
    worker.register_kv_caches(caches)
    return Engine(config, scheduler, worker, caches)


def make_request(
    prompt: list[int], *, max_tokens: int = 1, block_size: int = 16, **kwargs: Any
) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        **kwargs,
    )


def prompt_of(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=generator).tolist()


# -- fixtures shared by the engine tests (import them by name) -----------------------------------

_LIVE: list[Engine] = []


def live_engine(config: VllmConfig) -> Engine:
    """`make_engine(config)`, shut down after the test by `shutdown_engines`."""
    made = make_engine(config)
    _LIVE.append(made)
    return made


@pytest.fixture(autouse=True)
def shutdown_engines() -> Iterator[None]:
    yield
    while _LIVE:
        made = _LIVE.pop()
        made.connector.shutdown()
        made.worker.shutdown()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model")


def run_to_completion(engine: Engine, request: Request, **step: Any) -> Iterator[SchedulerOutput]:
    engine.scheduler.add_request(request)
    for _ in range(64):
        if request.request_id not in engine.scheduler.requests:
            return
        yield engine.step(**step)
    raise AssertionError(f"{request.request_id} did not finish in 64 steps")
