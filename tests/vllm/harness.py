"""vLLM's real scheduler driven by a fake model runner, for conformance tests and the bench.

`make_scheduler` builds vLLM's own `Scheduler` (or `AsyncScheduler`) over a mocked
`KVCacheConfig` (`num_blocks` blocks; one full-attention group, one sliding-window group, or a
hybrid layout of both), with vLLM's block manager
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
from collections import deque
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
    #: A hybrid layout: besides the first group, one sliding-window group per window listed
    #: (gpt-oss: one; Gemma 3: several of one window), all drawing from the one block pool.
    hybrid_windows: tuple[int, ...] = ()
    #: prefixkv's core (``additional_config["prefixkv"]["core"]``): "auto" (the default, set
    #: by giving none), "blocks" or "runs".
    core: str = "auto"


def _window_spec(setup: SchedulerSetup, dtype: Any, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=setup.block_size, num_kv_heads=1, head_size=1, dtype=dtype, sliding_window=window
    )


def _groups(setup: SchedulerSetup, dtype: Any) -> list[KVCacheGroupSpec]:
    if setup.sliding_window is None:
        first: Any = FullAttentionSpec(
            block_size=setup.block_size, num_kv_heads=1, head_size=1, dtype=dtype
        )
    else:
        first = _window_spec(setup, dtype, setup.sliding_window)
    specs = [first, *(_window_spec(setup, dtype, w) for w in setup.hybrid_windows)]
    return [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]


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
        # vLLM allows async scheduling only with drafters that run on the worker (n-gram on
        # the GPU, EAGLE, draft models); the scheduler reads only the number of drafts.
        speculative_config = SpeculativeConfig(
            method="ngram_gpu" if setup.async_scheduling else "ngram",
            num_speculative_tokens=setup.num_speculative_tokens,
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
        additional_config={"prefixkv": {"core": setup.core}} if setup.core != "auto" else {},
    )
    # vLLM's CPU platform turns async scheduling off; the GPU default is on. The scheduler
    # itself runs the same either way, so the harness restores what the setup asks for.
    vllm_config.scheduler_config.async_scheduling = setup.async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=setup.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=_groups(setup, model_config.dtype),
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
    #: Block ids per KV cache group (vLLM's ids: prefixkv hands out the very blocks vLLM
    #: does, so which block an allocation takes and which one eviction reaches are compared).
    block_ids: dict[str, list[list[int]]]
    free_blocks: int
    usage: float
    #: vLLM's tokens in flight per scheduled request after this step was scheduled (this
    #: step's included): more than its scheduled count when an earlier step is still running.
    in_flight: dict[str, int] = field(default_factory=dict)
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


def runner_output_for(scheduler: Any, out: Any, draft_accuracy: int = 600) -> ModelRunnerOutput:
    """What the fake model returns for the step `out` scheduled, read from the scheduler's state
    right after `schedule()` (as a worker reads its step from the scheduler output): a sampled
    token for every request whose prompt is done, and for each draft the token the model would
    sample there, stopping after the first wrong draft (so the accepted drafts are the right
    prefix).

    The first sampled position is the request's computed count after scheduling less its
    scheduled drafts: with async scheduling the request's own token list lags behind by the
    steps in flight, so it is not read. Under async scheduling the drafts in `out` are
    placeholders (-1), proposed on the worker; the fake drafter's guess is `_draft` at each
    position, as the synchronous harness proposes it through `update_draft_token_ids`."""
    requests = scheduler.requests
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        request = requests[rid]
        if request.is_prefill_chunk:
            sampled.append([])  # a prefill chunk that does not end the prompt
            continue
        drafts = list(out.scheduled_spec_decode_tokens.get(rid, []))
        position = request.num_computed_tokens - len(drafts)
        tokens = []
        for draft in drafts:
            if draft < 0:
                draft = _draft(rid, position, draft_accuracy)
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


def _record_schedule(scheduler: Any, out: Any) -> StepRecord:
    manager = scheduler.kv_cache_manager
    requests = scheduler.requests
    cached = out.scheduled_cached_reqs
    return StepRecord(
        scheduled=dict(out.num_scheduled_tokens),
        new_request_ids=[r.req_id for r in out.scheduled_new_reqs],
        resumed_or_running_ids=list(cached.req_ids),
        preempted=sorted(out.preempted_req_ids or ()),
        spec_tokens={k: list(v) for k, v in out.scheduled_spec_decode_tokens.items()},
        num_computed={rid: requests[rid].num_computed_tokens for rid in out.num_scheduled_tokens},
        block_ids={
            rid: [list(ids) for ids in manager.get_block_ids(rid)]
            for rid in out.num_scheduled_tokens
        },
        free_blocks=manager.block_pool.get_num_free_blocks(),
        usage=manager.usage,
        in_flight={rid: requests[rid].num_in_flight_tokens for rid in out.num_scheduled_tokens},
    )


def _record_outputs(record: StepRecord, engine_outputs: Any) -> None:
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


def drive(scheduler: Any, workload: Workload, block_size: int) -> list[StepRecord]:
    """Run `workload` to completion (or `max_steps` engine iterations) and record every
    scheduled step.

    The loop is vLLM's `EngineCore`: `step` (schedule, execute, update) for a synchronous
    scheduler, and `step_with_batch_queue` for an `AsyncScheduler`, whose engine keeps
    `max_concurrent_batches` (2) steps in flight: step N+1 is scheduled before step N's output
    is applied, with placeholders for the tokens step N has not sampled yet. Each iteration
    either schedules a step (while the queue has room) or applies the oldest step's output.
    Requests arrive at the start of their iteration; a step's outputs are recorded on that
    step's record."""
    pending = sorted(workload.requests, key=lambda r: r.arrival_step)
    records: list[StepRecord] = []
    spec_k = scheduler.num_spec_tokens
    overlapped = isinstance(scheduler, StockAsyncScheduler)
    queue_size = scheduler.vllm_config.max_concurrent_batches if overlapped else 1
    # (scheduler output, the runner's output for it, its record), newest on the left.
    queue: deque[tuple[Any, ModelRunnerOutput, StepRecord]] = deque()
    for iteration in range(workload.max_steps):
        while pending and pending[0].arrival_step <= iteration:
            scheduler.add_request(make_request(pending.pop(0), block_size))
        if scheduler.has_requests():
            out = scheduler.schedule()
            record = _record_schedule(scheduler, out)
            records.append(record)
            # The worker runs the step now, from what the scheduler output says.
            runner_output = runner_output_for(scheduler, out, workload.draft_accuracy)
            queue.appendleft((out, runner_output, record))
            executed = out.total_num_scheduled_tokens > 0
            if len(queue) < queue_size and (executed or scheduler.has_requests()):
                continue  # fill the queue before waiting on the oldest step
        elif not queue:
            if not pending:
                break
            continue
        out, runner_output, record = queue.pop()
        _record_outputs(record, scheduler.update_from_output(out, runner_output))
        if spec_k and not overlapped:
            # EngineCore.post_step: the synchronous engine hands the drafter's proposals to
            # the scheduler; under async scheduling they stay on the worker (placeholders).
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
