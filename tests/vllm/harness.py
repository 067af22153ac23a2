"""vLLM's real scheduler driven by a fake model runner, for conformance tests and the bench.

`make_scheduler` builds vLLM's own `Scheduler` (or `AsyncScheduler`) over a mocked
`KVCacheConfig` (one full-attention group, `num_blocks` blocks), with vLLM's block manager
(``"stock"``) or prefixkv's (``"prefixkv"``). `drive` runs a `Workload` through it step by step:
requests arrive at their step, the "model" samples a token that depends only on the request and
position (so both schedulers see the same tokens as long as their schedules agree), and with
speculative decoding it proposes drafts, some right and some wrong, of which the runner
accepts the right prefix. Every step is recorded as a `StepRecord`: what a scheduler decided
and what its block manager reports.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as StockAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from prefixkv.integrations.vllm import Scheduler

#: The fake model's vocabulary: small, so generated text repeats and shares prefixes.
VOCAB = 64
EOS = VOCAB + 1

# A Llama config small enough to write anywhere: vLLM's ModelConfig reads config.json only
# (the tokenizer is skipped and no weights are loaded by a scheduler).
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
}


def tiny_model_dir(root: Path) -> Path:
    path = root / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    return path


@dataclass(frozen=True)
class SchedulerSetup:
    num_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    watermark: float = 0.0
    async_scheduling: bool = False
    enable_kv_cache_events: bool = False
    scheduler_reserve_full_isl: bool = True
    #: A sliding-window KV group of this many tokens instead of full attention.
    sliding_window: int | None = None


def _spec(setup: SchedulerSetup, dtype: Any) -> Any:
    if setup.sliding_window is None:
        return FullAttentionSpec(
            block_size=setup.block_size, num_kv_heads=1, head_size=1, dtype=dtype
        )
    return SlidingWindowSpec(
        block_size=setup.block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=dtype,
        sliding_window=setup.sliding_window,
    )


def make_scheduler(model_dir: Path, setup: SchedulerSetup, kind: str) -> Any:
    """vLLM's scheduler with `kind` ("stock" or "prefixkv") block manager."""
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=setup.max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        async_scheduling=setup.async_scheduling,
        is_encoder_decoder=False,
        watermark=setup.watermark,
        scheduler_reserve_full_isl=setup.scheduler_reserve_full_isl,
    )
    cache_config = CacheConfig(
        block_size=setup.block_size, cache_dtype="auto", enable_prefix_caching=True
    )
    speculative_config = None
    if setup.num_speculative_tokens:
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=setup.num_speculative_tokens
        )
    kv_events_config = None
    if setup.enable_kv_cache_events:
        kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        kv_events_config=kv_events_config,
    )
    # vLLM's CPU platform turns async scheduling off; the GPU default is on. The scheduler
    # itself runs the same either way, so the harness restores what the setup asks for.
    vllm_config.scheduler_config.async_scheduling = setup.async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], _spec(setup, model_config.dtype))],
    )
    cache_config.num_gpu_blocks = setup.num_blocks
    if kind == "stock":
        cls: Any = StockAsyncScheduler if setup.async_scheduling else StockScheduler
    elif kind == "prefixkv":
        # prefixkv's Scheduler turns itself into its AsyncScheduler when the config asks.
        cls = Scheduler
    else:
        raise ValueError(f"kind must be 'stock' or 'prefixkv', got {kind!r}")
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=setup.block_size,
        log_stats=True,
    )


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    #: Per-mille chance that a proposed draft token is right (spec decode only).
    draft_accuracy: int = 600
    max_steps: int = 400


def model_token(request_id: str, position: int) -> int:
    """The token the fake model samples at `position` of a request: a function of the
    request and the position only."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


def _draft(request_id: str, position: int, accuracy: int) -> int:
    right = model_token(request_id, position)
    if zlib.crc32(f"draft:{request_id}:{position}".encode()) % 1000 < accuracy:
        return right
    return (right + 1) % VOCAB


@dataclass
class StepRecord:
    scheduled: dict[str, int]
    new_request_ids: list[str]
    resumed_or_running_ids: list[str]
    preempted: list[str]
    spec_tokens: dict[str, list[int]]
    num_computed: dict[str, int]
    table_lengths: dict[str, int]
    free_blocks: int
    usage: float
    finished: list[str] = field(default_factory=list)
    #: vLLM's PrefillStats of the requests whose prefill ended this step:
    #: (num_cached_tokens, num_cache_creation_tokens), as the engine reports them.
    num_cached_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: vLLM's PrefixCacheStats of the step: (requests, queries, hits, preempted_requests,
    #: preempted_queries, preempted_hits, reset).
    prefix_stats: tuple[Any, ...] | None = None


_HASHER_READY = False


def make_request(spec: RequestSpec, block_size: int) -> Request:
    global _HASHER_READY
    if not _HASHER_READY:
        init_none_hash(sha256)
        _HASHER_READY = True
    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    return Request(
        request_id=spec.request_id,
        prompt_token_ids=list(spec.prompt),
        sampling_params=params,
        pooling_params=None,
        cache_salt=spec.cache_salt,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def runner_output_for(scheduler: Any, out: Any) -> ModelRunnerOutput:
    """What the fake model returns for the step `out` scheduled: a sampled token for every
    request whose prompt is done, and for each draft the token the model would sample there,
    stopping after the first wrong draft (so the accepted drafts are the right prefix)."""
    requests = scheduler.requests
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = requests[rid]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])  # a prefill chunk that does not end the prompt
            continue
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        # The first scheduled position samples the token after the known ones; each draft
        # is accepted while it equals what the model samples at its position.
        position = request.num_tokens
        tokens = []
        for draft in drafts:
            right = model_token(rid, position)
            tokens.append(right)
            position += 1
            if draft != right:
                break
        else:
            tokens.append(model_token(rid, position))
        sampled.append(tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def drive(scheduler: Any, workload: Workload, block_size: int) -> list[StepRecord]:
    """Run `workload` to completion (or `max_steps`) and record every step."""
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)
    records: list[StepRecord] = []
    manager = scheduler.kv_cache_manager
    spec_k = scheduler.num_spec_tokens
    for step in range(workload.max_steps):
        while pending and pending[0].arrival_step <= step:
            scheduler.add_request(make_request(pending.pop(0), block_size))
        if not pending and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        requests = scheduler.requests
        cached = out.scheduled_cached_reqs
        record = StepRecord(
            scheduled=dict(out.num_scheduled_tokens),
            new_request_ids=[r.req_id for r in out.scheduled_new_reqs],
            resumed_or_running_ids=list(cached.req_ids),
            preempted=sorted(out.preempted_req_ids or ()),
            spec_tokens={k: list(v) for k, v in out.scheduled_spec_decode_tokens.items()},
            num_computed={
                rid: requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens
            },
            table_lengths={
                rid: len(manager.get_block_ids(rid)[0]) for rid in out.num_scheduled_tokens
            },
            free_blocks=manager.block_pool.get_num_free_blocks(),
            usage=manager.usage,
        )
        records.append(record)
        runner_output = runner_output_for(scheduler, out)
        engine_outputs = scheduler.update_from_output(out, runner_output)
        for outputs in engine_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                p = stats.prefix_cache_stats
                record.prefix_stats = (
                    p.requests,
                    p.queries,
                    p.hits,
                    p.preempted_requests,
                    p.preempted_queries,
                    p.preempted_hits,
                    p.reset,
                )
            for output in outputs.outputs:
                if output.prefill_stats is not None:
                    record.num_cached_tokens[output.request_id] = (
                        output.prefill_stats.num_cached_tokens,
                        output.prefill_stats.num_cache_creation_tokens,
                    )
                if output.finish_reason is not None:
                    record.finished.append(output.request_id)
        if spec_k:
            running = [r for r in scheduler.running if not r.is_finished()]
            scheduler.update_draft_token_ids(
                DraftTokenIds(
                    [r.request_id for r in running],
                    [
                        [
                            _draft(r.request_id, r.num_tokens + i, workload.draft_accuracy)
                            for i in range(spec_k)
                        ]
                        for r in running
                    ],
                )
            )
    return records
