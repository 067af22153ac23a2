"""A small serving engine over the prefix cache: `Engine`.

It ties the pieces together the way an inference engine does, and is what `prefixkv demo` runs:

* `PrefixCache` decides which KV blocks a request may reuse; `PagedKVCache` holds them;
  `LlamaModel.prefill` computes only the uncached suffix of every prompt over those pages.
* The `CacheContext` is built from everything that changes KV: a digest of the weights (and of
  the model config), the tokenizer and chat template digests, RoPE theta / scaling / offset,
  the sliding window, the KV dtype and the block size. The active LoRA adapter is part of every
  block key (named by a digest of its weights), so switching adapters never reuses KV.
* The weights digest is not taken once: before every `generate` and every step the engine
  compares the parameters' version counters (`LlamaModel.weights_version`, a walk over the
  parameters that reads no values) and, on a change, recomputes the digest and switches the
  cache to the new context; requests in flight restart. `Engine.weights_changed` says so by
  hand for edits torch does not record.
* A length-dependent position encoding (dynamic NTK RoPE) makes reuse unsafe but the model
  still exact: such an engine serves with prefix reuse off (`Engine.prefix_reuse` is False,
  the reason is logged once), every request computed from its first token.

Scheduling is continuous batching over the cache's step-by-step API (`prefixkv.engine.scheduler` has
the policy): one `LlamaModel.prefill` call per step over a token budget, decode tokens and
prompt chunks mixed (varlen). Each request is added to the cache under the engine's own id;
`allocate_slots` matches its cached prefix and makes room for each chunk as it is scheduled,
`commit` publishes blocks as they fill (generated ones too, so a conversation's next turn
reuses the previous answer), a request that cannot get blocks waits, and a running one is
preempted (its cached blocks stay, so it resumes mostly from cache) when a running request
older than it needs room. With `num_speculative_tokens`, decode proposes prompt-lookup drafts,
verifies them in one step and keeps the accepted ones (`accept_drafts`); a rejected draft is
never published. Greedy decoding; a request ends after `max_new_tokens` or a stop token, then
`finish` hands its blocks back (they stay cached, evictable).

Time to first token is measured from the `generate` call to the step that produced the token,
so it includes queueing behind other requests of the same call.

Requests become token ids in `prefixkv.engine.inputs` (with the chat-template and stop-token
policy); a checkpoint's settings come from `prefixkv.models.checkpoint`. The scheduling loop of one
`generate` call is `_Run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from prefixkv.cache import FULL_HIT_MODES, PrefixCache, Slots
from prefixkv.context import CacheContext
from prefixkv.engine.inputs import EngineInput, encode_request, resolve_chat_template, stop_tokens
from prefixkv.engine.scheduler import (
    SCHEDULING_POLICIES,
    SchedulerStats,
    WaitingCandidate,
    ngram_drafts,
    order_waiting,
)
from prefixkv.engine.threads import configure_torch_threads
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.group_cache import GroupedCacheStats, GroupedPrefixCache, GroupSlots
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import KVGroupSpec, kv_group_specs
from prefixkv.models.checkpoint import checkpoint_eos_token_ids
from prefixkv.models.config import model_context
from prefixkv.models.decoder import LlamaModel, ModelConfig, PrefillRequest
from prefixkv.text.tokenizers import ByteTokenizer, ChatTemplate, Tokenizer
from prefixkv.tiers.manager import KVTiers
from prefixkv.tiers.remote import RemoteStore, RemoteTier

__all__ = [
    "Engine",
    "RequestResult",
    "checkpoint_eos_token_ids",
    "model_context",
    "weights_digest",
]

_DEFAULT_NUM_BLOCKS = 1024

_log = logging.getLogger(__name__)


@dataclass
class RequestResult:
    """What serving one request produced, and what it cost."""

    prompt_token_ids: list[int]
    #: Prompt tokens whose KV was read from the cache (for a full hit: all but the last).
    cached_tokens: int
    #: Prompt positions the model computed (``prompt_tokens - cached_tokens``, at least 1).
    computed_tokens: int
    #: Seconds from the `generate` call to this request's first output token.
    time_to_first_token: float
    output_token_ids: list[int]
    #: The output decoded by the engine's tokenizer (None without one).
    output_text: str | None
    #: Every prompt block was cached: only the last token was recomputed, nothing written.
    full_hit: bool
    #: With ``check_exactness=True``: the largest |logit difference| between what the engine
    #: computed (prefill and every decode step) and a full recompute without cache.
    max_logit_diff: float | None = None
    #: With ``check_exactness=True``: the greedy tokens of the full recompute's logits equal ours.
    tokens_match: bool | None = None
    #: Times the scheduler preempted it for memory (it resumed from its cached blocks).
    preemptions: int = 0
    #: Draft tokens proposed for it, and how many the model accepted (speculative decoding).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Sequence:
    """A request being served, as the engine sees it (the cache keeps its own view)."""

    index: int
    request_id: str
    prompt: list[int]
    #: Prompt, generated and pending draft tokens (what the cache holds for the request).
    tokens: list[int]
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    prefilled: bool = False
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    first_token_time: float = 0.0
    #: The first admission's hit (a resume after preemption does not change it).
    cached_tokens: int = 0
    full_hit: bool = False
    admissions: int = 0
    #: Position whose KV is already in a shared block (a reuse-last-block full hit): computed
    #: without writing KV.
    shared_position: int | None = None
    #: Steps in which a later arrival was admitted before it.
    passes: int = 0
    preemptions: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    scheduled_tokens: int = 0

    def admitted(self, slots: Slots | GroupSlots) -> None:
        if self.admissions == 0:
            self.cached_tokens = slots.num_cached_tokens
            self.full_hit = slots.full_hit
        self.admissions += 1
        self.num_computed = slots.num_computed_tokens
        self.shared_position = slots.num_computed_tokens if slots.last_token_shared else None
        self.passes = 0

    def preempted(self) -> None:
        """The cache dropped its KV and its drafts."""
        del self.tokens[len(self.tokens) - len(self.drafts) :]
        self.drafts = []
        self.num_computed = 0
        self.preemptions += 1

    def reset(self) -> None:
        """Back to the prompt alone (the weights changed under it)."""
        self.tokens = list(self.prompt)
        self.num_computed = 0
        self.drafts = []
        self.prefilled = False
        self.generated = []
        self.logits = []
        self.admissions = 0


@dataclass
class _Scheduled:
    """One request's share of a step: compute positions ``start .. start + num_new - 1``."""

    sequence: _Sequence
    start: int
    num_new: int


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {value}")
    return value


def weights_digest(model: LlamaModel) -> str:
    """SHA-256 of a model's weights and config (`LlamaModel.weights_digest`)."""
    return model.weights_digest()


class Engine:
    """Batched greedy generation with exact prefix caching over paged KV.

    Args:
        model: a `LlamaModel`; None builds a small seeded random one over the byte vocabulary.
        tokenizer: turns text requests into ids and outputs back into text; default the
            `ByteTokenizer` when it fits the model's vocabulary.
        chat_template: renders chat requests: a `ChatTemplate`, a template file, a checkpoint
            directory, or ``"simple"`` for the built-in `SimpleChatTemplate`. Default: the
            built-in one with the built-in `ByteTokenizer`, none with any other tokenizer
            (chat requests are then refused; see `prefixkv.engine_inputs.resolve_chat_template`).
        stop_token_ids: tokens that end a request unless `generate` is given its own.
        num_blocks / kv_memory_bytes: size of the KV pool (give at most one; default
            1024 blocks).
        block_size: tokens per block.
        device / dtype: where and in what precision to run (the model is moved or converted).
        model_id: a human-readable name that goes into the cache context.
        max_batch_size: most requests in flight at once.
        max_num_batched_tokens: the token budget of one step (prefill chunks and decode
            tokens together); a longer prompt is prefilled in chunks over several steps.
        scheduling: ``"cache_aware"`` (default) or ``"fcfs"``; see `prefixkv.engine.scheduler`.
        max_passes: how many steps a waiting request may be passed over by later arrivals
            before it goes first (cache-aware ordering's fairness bound).
        num_speculative_tokens: draft tokens per decode step (prompt-lookup n-gram drafts,
            verified by the model: greedy outputs are unchanged); 0 turns drafting off.
        watermark_blocks: blocks kept obtainable for running requests when admitting a new
            one (default 1% of the pool).
        full_hit: how a fully cached prompt is served (`PrefixCache`'s ``full_hit``).
        kv_group_blocks: for a model with sliding-window layers (docs/hybrid.md), the blocks
            of each KV group's pool (`kv_group_specs` order: full attention first). Default:
            the pool's memory split so that every group has as many blocks as the pool would
            have for all layers; moving memory from the sliding group to the full one is what
            lets more long requests run at once (`benches/bench_hybrid.py`).
        host_tier_bytes: host memory for blocks evicted from the pool (docs/tiers.md);
            None: no host tier.
        remote_store: a shared `prefixkv.tiers.RemoteStore` (e.g. `RedisStore`) for blocks;
            None: no remote tier. ``remote_namespace`` prefixes its keys,
            ``remote_write`` is ``"write_through"`` (on commit) or ``"write_back"`` (on
            eviction), ``remote_queue_size`` bounds the background write queue.
    """

    def __init__(
        self,
        model: LlamaModel | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | str | None = None,
        stop_token_ids: Sequence[int] = (),
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        model_id: str = "",
        max_batch_size: int = 64,
        max_num_batched_tokens: int = 2048,
        scheduling: str = "cache_aware",
        max_passes: int = 16,
        num_speculative_tokens: int = 0,
        watermark_blocks: int | None = None,
        full_hit: str = "recompute_last_block",
        kv_group_blocks: Sequence[int] | None = None,
        host_tier_bytes: int | None = None,
        remote_store: RemoteStore | None = None,
        remote_namespace: str = "prefixkv",
        remote_write: str = "write_through",
        remote_queue_size: int = 256,
        _no_chat_template: str | None = None,
    ) -> None:
        if model is None:
            byte_vocab = ByteTokenizer().vocab_size
            model = LlamaModel.random(ModelConfig(vocab_size=byte_vocab), seed=0)
            model_id = model_id or "prefixkv-random-tiny"
        if not isinstance(model, LlamaModel):
            raise InvalidInputError(f"model must be a LlamaModel, got {type(model).__name__}")
        if dtype is not None and dtype != model.dtype:
            model = model.with_config(dtype=dtype)
        self.model = model.to(device=torch.device(device))
        if self.model.device.type == "cpu":
            # torch's default (one thread per core) on a machine other work also uses can make
            # one prefill 100x slower; use the idle cores only (`prefixkv.engine.threads`).
            configure_torch_threads()
        config = self.model.config
        if tokenizer is None:
            byte_tokenizer = ByteTokenizer()
            if byte_tokenizer.vocab_size <= config.vocab_size:
                tokenizer = byte_tokenizer
        elif tokenizer.vocab_size > config.vocab_size:
            raise InvalidInputError(
                f"the tokenizer has {tokenizer.vocab_size} ids, the model only {config.vocab_size}"
            )
        self.tokenizer = tokenizer
        self.chat_template, self._no_chat_template = resolve_chat_template(
            chat_template, tokenizer, _no_chat_template
        )
        self.stop_token_ids = stop_tokens(stop_token_ids, config.vocab_size, "stop_token_ids")
        if num_blocks is not None and kv_memory_bytes is not None:
            raise InvalidInputError("give num_blocks or kv_memory_bytes, not both")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise InvalidInputError(f"max_batch_size must be an int, got {max_batch_size!r}")
        if max_batch_size < 1:
            raise InvalidInputError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = _positive_int(
            max_num_batched_tokens, "max_num_batched_tokens"
        )
        self.max_passes = _positive_int(max_passes, "max_passes")
        self.num_speculative_tokens = _positive_int(
            num_speculative_tokens, "num_speculative_tokens", minimum=0
        )
        if scheduling not in SCHEDULING_POLICIES:
            raise InvalidInputError(
                f"scheduling must be one of {SCHEDULING_POLICIES}, got {scheduling!r}"
            )
        if full_hit not in FULL_HIT_MODES:
            raise InvalidInputError(f"full_hit must be one of {FULL_HIT_MODES}, got {full_hit!r}")
        self.scheduling = scheduling
        #: Waiting requests looked at per step for cache-aware ordering (each costs a lookup).
        self.max_waiting_considered = 64
        self.last_stats = SchedulerStats()
        self._request_counter = 0
        #: The KV event publisher, once `publish_kv_events` started one.
        self.kv_events: Any = None
        geometry = (config.num_layers, block_size, config.num_kv_heads, config.head_dim)
        self.kv_groups = kv_group_specs(config)
        #: True when the layers form KV groups (any sliding-window layer): one pool per group.
        self.grouped = len(self.kv_groups) > 1 or self.kv_groups[0].sliding_window is not None
        self.kv_cache: PagedKVCache | GroupedKVCache
        if self.grouped:
            if full_hit != "recompute_last_block":
                raise InvalidInputError(
                    "a model with sliding-window layers is served with "
                    "full_hit='recompute_last_block' only (its KV groups must agree on which "
                    "token's KV is written)"
                )
            if host_tier_bytes is not None or remote_store is not None:
                raise InvalidInputError(
                    "host and remote KV tiers do not support models with sliding-window layers "
                    "(KV groups) yet"
                )
            group_blocks = self._group_blocks(
                kv_group_blocks, num_blocks, kv_memory_bytes, geometry, self.model.dtype
            )
            self.kv_cache = GroupedKVCache(
                self.kv_groups,
                group_blocks,
                block_size,
                config.num_kv_heads,
                config.head_dim,
                dtype=self.model.dtype,
                device=self.model.device,
            )
        elif kv_group_blocks is not None:
            raise InvalidInputError(
                "kv_group_blocks applies to models with sliding-window layers; this one has "
                "one KV group (give num_blocks or kv_memory_bytes)"
            )
        elif kv_memory_bytes is not None:
            self.kv_cache = PagedKVCache.from_memory_budget(
                kv_memory_bytes, *geometry, dtype=self.model.dtype, device=self.model.device
            )
        else:
            self.kv_cache = PagedKVCache(
                config.num_layers,
                _DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks,
                block_size,
                config.num_kv_heads,
                config.head_dim,
                dtype=self.model.dtype,
                device=self.model.device,
            )
        self._model_id = model_id
        self._weights_version = self.model.weights_version()
        self._adapter_version = self.model.adapter_version()
        self._adapter_key = self.model.adapter_digest()
        self._reuse_warning_given = False
        self.context = self._build_context()
        self.cache: PrefixCache | GroupedPrefixCache
        if isinstance(self.kv_cache, GroupedKVCache):
            self.cache = GroupedPrefixCache(
                self.kv_groups,
                self.kv_cache.num_blocks,
                context=self._cache_context(),
                vocab_size=config.vocab_size,
            )
        else:
            self.cache = PrefixCache(
                self.kv_cache.num_blocks,
                context=self._cache_context(),
                vocab_size=config.vocab_size,
                full_hit=full_hit,
            )
        if watermark_blocks is None:
            watermark_blocks = max(1, min(self._pool_sizes()) // 100)
        self.watermark_blocks = _positive_int(watermark_blocks, "watermark_blocks", minimum=0)
        # -- lower tiers (prefixkv.tiers): off unless asked for
        self.tiers: KVTiers | None = None
        if host_tier_bytes is not None or remote_store is not None:
            remote = None
            if remote_store is not None:
                remote = RemoteTier(
                    remote_store, namespace=remote_namespace, queue_size=remote_queue_size
                )
            assert isinstance(self.kv_cache, PagedKVCache) and isinstance(self.cache, PrefixCache)
            self.tiers = KVTiers(
                self.kv_cache,
                host_tier_bytes=host_tier_bytes,
                remote=remote,
                write_policy=remote_write,
            )
            self.cache.set_eviction_log(self.tiers.needs_eviction_log)

    # ---------------------------------------------------------------- observability

    def publish_kv_events(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str | None = None,
        token_ids: str = "all",
        hashes: str = "int64",
    ) -> Any:
        """Publish this engine's KV events in vLLM's format (`prefixkv.events`, needs the
        ``events`` extra): a ZMQ PUB socket at `endpoint`, replays at `replay_endpoint`, one
        batch per scheduler step. `topic` defaults to llm-d's ``kv@<host>@<model_id>``;
        `token_ids` (``"all"``, ``"unsalted"``, ``"none"``) limits what tenants' events reveal.
        Returns the `KVEventPublisher` (also `kv_events`); `close()` stops it."""
        import socket

        from prefixkv.events import KVEventPublisher

        if self.kv_events is not None:
            raise InvalidInputError("this engine already publishes KV events (close() first)")
        self.kv_events = KVEventPublisher(
            self.cache,
            endpoint,
            replay_endpoint,
            topic=topic if topic is not None else f"kv@{socket.gethostname()}@{self._model_id}",
            medium="GPU" if self.model.device.type == "cuda" else "CPU",
            token_ids=token_ids,  # type: ignore[arg-type]
            hashes=hashes,  # type: ignore[arg-type]
        )
        return self.kv_events

    def metrics_collector(self, labels: Mapping[str, str] | None = None) -> Any:
        """A Prometheus collector of this engine's cache figures (`prefixkv.metrics`, needs the
        ``metrics`` extra), with the event counters when events are published; register it
        with ``prometheus_client.REGISTRY.register(...)``."""
        from prefixkv.metrics import PrefixCacheCollector

        return PrefixCacheCollector(
            self.cache,
            publisher=self.kv_events,
            labels=dict(labels) if labels is not None else {"model_name": self._model_id},
        )

    def flush_kv_events(self) -> None:
        """Send what the cache recorded since the last step (the engine does it every step)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def close(self) -> None:
        """Stop publishing KV events and stop the KV tiers' background writer (pending remote
        writes are flushed or dropped as `KVTiers.close` says)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self.tiers is not None:
            self.tiers.close()

    def _new_request_id(self) -> str:
        self._request_counter += 1
        return f"req-{self._request_counter}"

    # ---------------------------------------------------------------- weights

    def _build_context(self) -> CacheContext:
        return self.model.cache_context(
            self.kv_cache.block_size,
            model_id=self._model_id,
            tokenizer=self.tokenizer,
            chat_template=self.chat_template,
        )

    @property
    def prefix_reuse(self) -> bool:
        """False when this engine serves every request from scratch (see
        `prefix_reuse_off_reason`)."""
        return self.context.reuse_is_safe

    @property
    def prefix_reuse_off_reason(self) -> str | None:
        """Why prefix reuse is off, or None when it is on."""
        if self.context.reuse_is_safe:
            return None
        kind = self.context.position_encoding.rope_scaling
        return (
            f"RoPE scaling {kind!r} depends on the total sequence length, so the KV of a prefix "
            "computed for one request is not what a full recompute of another gives"
        )

    def _cache_context(self) -> CacheContext:
        """The context the `PrefixCache` runs under.

        Normally `context` itself. Under a length-dependent position encoding (dynamic NTK)
        reuse is unsafe and `PrefixCache` refuses such a context; the model is still exact for
        a request computed from scratch, so the engine serves with prefix reuse off, under this
        stand-in context marked ``prefix_reuse: off``: each request's blocks are keyed under a
        salt of its own (`_Run._add`), so no other request ever matches them. It still commits
        what it computes, which is how the cache knows how far a request got: its next slots,
        and what a sliding-window group may release. A preempted request may read its own
        blocks again, exactly the KV it would have kept had it not been preempted.
        `context` keeps the true position encoding. Said once per engine in the log.

        A finer policy is possible (the base does not move while every length stays within
        `max_position_embeddings`) but not implemented: off is the simple correct choice.

        What stays approximate, as in transformers' cached generation: once a request's length
        passes `max_position_embeddings`, each decoded token is rotated with the base of the
        length at its own step while earlier positions keep theirs, so decode logits there
        differ from a full recompute of the whole sequence (``use_cache=False``); the prompt's
        prefill, computed in one pass, is exact.
        """
        context = self.context
        if context.reuse_is_safe:
            return context
        if not self._reuse_warning_given:
            self._reuse_warning_given = True
            _log.warning(
                "prefix reuse is off for %s: %s; every request is computed in full",
                context.model_id or "this engine",
                self.prefix_reuse_off_reason,
            )
        stand_in = replace(context.position_encoding, rope_scaling=None, rope_scaling_params=())
        return replace(
            context,
            position_encoding=stand_in,
            extra={
                **context.extra,
                "prefix_reuse": "off",
                "rope_scaling": str(context.position_encoding.rope_scaling),
            },
        )

    @property
    def detects_weight_changes(self) -> bool:
        """Whether in-place weight edits are noticed on their own (see `weights_changed`)."""
        return self._weights_version is not None

    def weights_changed(self) -> None:
        """Say that the model's weights (or config, or the active adapter's weights) changed.

        Recomputes the weights digest and adapter key and switches the cache to the new
        context, which makes every cached block unreachable: KV computed under the old weights
        is never served again.

        When it is required: the engine checks, cheaply, before every `generate` and every
        step, whether any parameter was edited through torch (in-place ops, ``copy_``,
        ``load_state_dict``, optimiser steps, ``.data =``, a replaced `nn.Parameter`, a new
        config, `load_adapter` / `set_adapter`), and acts on it by itself. Call this after
        edits torch cannot see: writes through ``.numpy()`` or another alias of the storage,
        and any edit when the parameters are inference tensors (made under
        ``torch.inference_mode``; then `detects_weight_changes` is False and this call is the
        only way).
        """
        self._weights_version = self.model.weights_version()
        self._adapter_version = self.model.adapter_version()
        self._adapter_key = self.model.adapter_digest()
        self.context = self._build_context()
        self.cache.set_context(self._cache_context())
        self.flush_kv_events()  # routers drop this instance's blocks now, not at the next step

    def _sync_with_model(self) -> bool:
        """Act on a weight or adapter change torch recorded since the last check; True if
        there was one (KV computed before it must not be used any more)."""
        if self.model.weights_version() != self._weights_version:
            self.weights_changed()
            return True
        adapter_version = self.model.adapter_version()
        if adapter_version != self._adapter_version:
            # Adapters go in each block's extra key, not in the context: no need to clear.
            self._adapter_version = adapter_version
            self._adapter_key = self.model.adapter_digest()
            return True
        return False

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | str | None = None,
        stop_token_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        **engine_options: Any,
    ) -> Engine:
        """An engine over a local Hugging Face Llama checkpoint (``config.json`` plus
        ``*.safetensors``) or a ``.gguf`` file (`prefixkv.models.gguf`; its tokenizer, chat template
        and stop tokens come from its metadata), served as the checkpoint says it should be:

        * tokenizer: ``tokenizer.json`` when none is given (needs ``prefixkv[hf]``);
        * chat template: the checkpoint's (`prefixkv.checkpoint.find_chat_template`: the
          ``chat_template.jinja`` file, named templates, or ``tokenizer_config.json``'s entry)
          when none is given. A checkpoint without one gets *no* template: chat requests are
          refused with an error naming what was looked for, text and token requests are
          served. Pass ``chat_template="simple"`` to chat through the built-in template anyway;
          rendering a model's conversations with another model's template is a wrong prompt,
          so this is never done silently.
        * stop tokens: ``eos_token_id`` of ``generation_config.json`` (or of ``config.json``
          without one; an int or a list) when `stop_token_ids` is None. Any explicit value,
          ``()`` included, wins.
        """
        from prefixkv.models.checkpoint import (
            CHECKPOINT_TEMPLATE_SOURCES,
            find_chat_template,
            load_checkpoint,
        )
        from prefixkv.models.gguf import is_gguf
        from prefixkv.text.tokenizers import HFTokenizer

        if is_gguf(directory):
            # A .gguf file: weights, tokenizer, chat template and stop tokens from its metadata.
            checkpoint = load_checkpoint(directory, dtype=dtype, device=device)
            options = checkpoint.engine_options()
            for name, value in (
                ("tokenizer", tokenizer),
                ("chat_template", chat_template),
                ("stop_token_ids", stop_token_ids),
            ):
                if value is not None:
                    options[name] = value  # an explicit argument wins
            if options["chat_template"] is None:
                options["_no_chat_template"] = f"the GGUF file {directory} has no chat template"
            options["model_id"] = engine_options.pop("model_id", options["model_id"])
            return cls(device=device, **options, **engine_options)
        directory = Path(directory)
        model = LlamaModel.from_pretrained(directory, dtype=dtype, device=device)
        if tokenizer is None and (directory / "tokenizer.json").is_file():
            tokenizer = HFTokenizer(directory / "tokenizer.json")
        missing = None
        if chat_template is None:
            chat_template = find_chat_template(directory)
            if chat_template is None:
                missing = (
                    f"the checkpoint {directory} has no chat template (looked for "
                    f"{', '.join(CHECKPOINT_TEMPLATE_SOURCES)})"
                )
        if stop_token_ids is None:
            stop_token_ids = checkpoint_eos_token_ids(directory)
        engine_options.setdefault("model_id", directory.name)
        return cls(
            model,
            tokenizer=tokenizer,
            chat_template=chat_template,
            stop_token_ids=stop_token_ids,
            device=device,
            _no_chat_template=missing,
            **engine_options,
        )

    # ---------------------------------------------------------------- inputs

    def encode(self, request: EngineInput) -> list[int]:
        """The prompt token ids of a request: ids as given, text tokenized, chat rendered
        (`prefixkv.engine_inputs.encode_request`)."""
        return encode_request(
            request,
            tokenizer=self.tokenizer,
            chat_template=self.chat_template,
            no_template_reason=self._no_chat_template,
            vocab_size=self.model.config.vocab_size,
        )

    # ---------------------------------------------------------------- serving

    def generate(
        self,
        requests: Sequence[EngineInput],
        max_new_tokens: int = 16,
        *,
        check_exactness: bool = False,
        stop_token_ids: Sequence[int] | None = None,
        on_finish: Callable[[int, RequestResult], None] | None = None,
    ) -> list[RequestResult]:
        """Serve a batch of requests by continuous batching; results in request order.

        A request ends after `max_new_tokens` or at a stop token: `stop_token_ids` when given
        (``()`` for none), else the engine's `stop_token_ids` (a checkpoint's EOS tokens for
        `from_pretrained`).

        `on_finish(index, result)` is called as each request completes (for progress bars).
        Raises `OutOfBlocksError` only for a request that could never fit the pool, however
        long it waited; every other request waits, or is preempted and resumed, until it fits.
        `last_stats` then says what the scheduler did.
        """
        if isinstance(requests, (str, Mapping)) or not isinstance(requests, Sequence):
            raise InvalidInputError("requests must be a list of requests")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidInputError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        start = time.perf_counter()
        prompts = [self.encode(request) for request in requests]
        for index, prompt in enumerate(prompts):
            total = len(prompt) + max_new_tokens - 1 + self.num_speculative_tokens
            for spec, pool in zip(self.kv_groups, self._pool_sizes(), strict=True):
                needed = self._blocks_for(total, spec.sliding_window)
                if needed > pool:
                    raise OutOfBlocksError(
                        f"request {index}: {len(prompt)} prompt tokens plus {max_new_tokens} new "
                        f"need {needed} blocks of {self.kv_cache.block_size} tokens; the KV pool "
                        f"{self._pool_name(spec)}has {pool} (raise num_blocks or kv_memory_bytes)"
                    )
        if stop_token_ids is None:
            stops = frozenset(self.stop_token_ids)
        else:
            stops = frozenset(
                stop_tokens(stop_token_ids, self.model.config.vocab_size, "stop_token_ids")
            )
        run = _Run(
            engine=self,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            stops=stops,
            start=start,
            check_exactness=check_exactness,
            on_finish=on_finish,
        )
        self.last_stats = run.stats
        try:
            return run.serve()
        except BaseException:
            run.abandon()
            raise

    def _blocks_for(self, num_tokens: int, sliding_window: int | None = None) -> int:
        """Blocks one request of `num_tokens` holds at most: all of them, or for a sliding
        group (which releases what its window passed) the window, the largest step's tokens
        and a block of slack on each side."""
        size = self.kv_cache.block_size
        blocks = -(-num_tokens // size)
        if sliding_window is None:
            return blocks
        step = self.max_num_batched_tokens + self.num_speculative_tokens
        return min(blocks, -(-(sliding_window - 1 + step) // size) + 2)

    def _pool_sizes(self) -> tuple[int, ...]:
        """Blocks of each KV group's pool (one pool for a model without KV groups)."""
        if isinstance(self.kv_cache, GroupedKVCache):
            return self.kv_cache.num_blocks
        return (self.kv_cache.num_blocks,)

    def _pool_name(self, spec: KVGroupSpec) -> str:
        if not self.grouped:
            return ""
        return f"of KV group {spec.index} ({spec.kind}) "

    def _group_blocks(
        self,
        kv_group_blocks: Sequence[int] | None,
        num_blocks: int | None,
        kv_memory_bytes: int | None,
        geometry: tuple[int, int, int, int],
        dtype: torch.dtype,
    ) -> tuple[int, ...]:
        """Blocks of each KV group's pool: as given, or every group the blocks the whole
        pool would have for all layers (the same memory: each group's block holds only its
        own layers)."""
        if kv_group_blocks is not None:
            if num_blocks is not None or kv_memory_bytes is not None:
                raise InvalidInputError(
                    "give kv_group_blocks, or num_blocks / kv_memory_bytes, not both"
                )
            if isinstance(kv_group_blocks, (str, bytes)) or len(kv_group_blocks) != len(
                self.kv_groups
            ):
                raise InvalidInputError(
                    f"kv_group_blocks must give one count per KV group ({len(self.kv_groups)}: "
                    f"{', '.join(spec.kind for spec in self.kv_groups)}), got {kv_group_blocks!r}"
                )
            return tuple(
                _positive_int(count, f"kv_group_blocks[{index}]")
                for index, count in enumerate(kv_group_blocks)
            )
        if kv_memory_bytes is not None:
            count = PagedKVCache.blocks_in_budget(kv_memory_bytes, *geometry, dtype=dtype)
        else:
            count = _DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks
        return (count,) * len(self.kv_groups)

    def _result(self, sequence: _Sequence, check_exactness: bool) -> RequestResult:
        result = RequestResult(
            prompt_token_ids=sequence.prompt,
            cached_tokens=sequence.cached_tokens,
            computed_tokens=len(sequence.prompt) - sequence.cached_tokens,
            time_to_first_token=sequence.first_token_time,
            output_token_ids=list(sequence.generated),
            output_text=(
                None if self.tokenizer is None else self.tokenizer.decode(sequence.generated)
            ),
            full_hit=sequence.full_hit,
            preemptions=sequence.preemptions,
            draft_tokens=sequence.draft_tokens,
            accepted_draft_tokens=sequence.accepted_draft_tokens,
        )
        if check_exactness:
            # One full recompute over prompt + output[:-1] gives the logits of every step.
            full_sequence = sequence.prompt + sequence.generated[:-1]
            full = self.model.forward_full(full_sequence).to("cpu", torch.float64)
            ours = torch.stack(sequence.logits)
            reference = full[len(sequence.prompt) - 1 :]
            result.max_logit_diff = float((ours - reference).abs().max())
            result.tokens_match = reference.argmax(dim=-1).tolist() == sequence.generated
        return result

    def __repr__(self) -> str:
        pools = self._pool_sizes()
        return (
            f"Engine(model={self.context.model_id or 'LlamaModel'}, "
            f"num_blocks={pools[0] if len(pools) == 1 else pools}, "
            f"block_size={self.kv_cache.block_size})"
        )


class _Run:
    """One `generate` call: the queues, the steps, and the cache calls that go with them."""

    def __init__(
        self,
        *,
        engine: Engine,
        prompts: list[list[int]],
        max_new_tokens: int,
        stops: frozenset[int],
        start: float,
        check_exactness: bool,
        on_finish: Callable[[int, RequestResult], None] | None,
    ) -> None:
        self.engine = engine
        self.cache = engine.cache
        self.max_new_tokens = max_new_tokens
        self.stops = stops
        self.start = start
        self.check_exactness = check_exactness
        self.on_finish = on_finish
        self.stats = SchedulerStats()
        self.sequences = [
            _Sequence(index=i, request_id=engine._new_request_id(), prompt=p, tokens=list(p))
            for i, p in enumerate(prompts)
        ]
        self.waiting: list[_Sequence] = list(self.sequences)
        self.running: list[_Sequence] = []
        self.results: list[RequestResult | None] = [None] * len(prompts)
        # Every request added to the cache and not yet finished: exactly these are finished if
        # anything goes wrong (a model error, an on_finish callback raising, Ctrl-C).
        self.live: dict[str, _Sequence] = {}
        self.block_size = engine.kv_cache.block_size

    # -- the loop ------------------------------------------------------------------------

    def serve(self) -> list[RequestResult]:
        engine = self.engine
        for sequence in self.waiting:
            self._add(sequence)
        while self.waiting or self.running:
            if engine._sync_with_model():
                self._restart_all()
            scheduled = self._schedule()
            if not scheduled:
                self._refuse_stuck()
            self._step(scheduled)
            engine.flush_kv_events()
        return [result for result in self.results if result is not None]

    def abandon(self) -> None:
        for sequence in self.live.values():
            self.cache.finish(sequence.request_id)
        self.live.clear()
        self.engine.flush_kv_events()

    # -- cache bookkeeping ---------------------------------------------------------------

    def _add(self, sequence: _Sequence) -> None:
        # Prefix reuse off: a salt of the request's own, so nothing it publishes is shared.
        salt = None if self.engine.prefix_reuse else f"prefix-reuse-off:{sequence.request_id}"
        self.cache.add_request(
            sequence.request_id, sequence.tokens, adapter=self.engine._adapter_key, salt=salt
        )
        self.live[sequence.request_id] = sequence

    def _restart_all(self) -> None:
        """The weights changed under requests in flight: their KV is stale, and so is what
        they generated from it, so each starts again from its prompt, under the new context."""
        for sequence in list(self.live.values()):
            self.cache.finish(sequence.request_id)
            del self.live[sequence.request_id]
            sequence.reset()
        self.waiting = sorted(self.waiting + self.running, key=lambda s: s.index)
        self.running = []
        for sequence in self.waiting:
            self._add(sequence)

    def _preempt(self, sequence: _Sequence) -> None:
        self.cache.preempt(sequence.request_id)
        sequence.preempted()
        self.running.remove(sequence)
        self.waiting.insert(0, sequence)
        self.stats.preemptions += 1

    # -- scheduling ----------------------------------------------------------------------

    def _schedule(self) -> list[_Scheduled]:
        engine = self.engine
        budget = engine.max_num_batched_tokens
        lookahead = engine.num_speculative_tokens
        scheduled: list[_Scheduled] = []
        # 1. Running requests, oldest first; preempt the newest when the pool runs short.
        for sequence in list(self.running):
            if sequence not in self.running or budget == 0:
                continue  # preempted below to make room for an older one
            num_new = len(sequence.tokens) - sequence.num_computed
            if num_new > budget and sequence.drafts:
                self._drop_drafts(sequence)  # verification is never split across steps
                num_new = len(sequence.tokens) - sequence.num_computed
            num_new = min(num_new, budget)
            while True:
                try:
                    self.cache.allocate_slots(
                        sequence.request_id, num_new, num_lookahead_tokens=lookahead
                    )
                    self._tiers_save_evicted()
                    break
                except OutOfBlocksError:
                    victim = self.running[-1]
                    if victim in (s.sequence for s in scheduled):
                        scheduled = [s for s in scheduled if s.sequence is not victim]
                        budget += victim.scheduled_tokens
                    self._preempt(victim)
                    if victim is sequence:
                        break
            if sequence in self.running:
                sequence.scheduled_tokens = num_new
                scheduled.append(_Scheduled(sequence, sequence.num_computed, num_new))
                budget -= num_new
        # 2. Waiting requests, in the policy's order, while budget and blocks allow.
        in_flight = self._blocks_in_flight(scheduled)
        candidates = self.waiting[: engine.max_waiting_considered]
        infos = [self._candidate(s, in_flight) for s in candidates]
        order = order_waiting(infos, engine.scheduling, engine.max_passes)
        admitted: list[_Sequence] = []
        for position in order:
            sequence = candidates[position]
            if budget == 0 or len(self.running) >= engine.max_batch_size:
                break
            info = infos[position]
            if (
                engine.scheduling == "cache_aware"
                and info.passes < engine.max_passes
                and self._next_block_in_flight(sequence, info.cached_tokens, in_flight)
            ):
                continue  # computed by a request scheduled now: a hit next step
            # Asked again, not taken from `info`: an earlier admission this step may have evicted
            # blocks, or published some from a tier (one call, no rehashing).
            cached = self.cache.start_position(sequence.request_id)
            num_new = min(len(sequence.tokens) - cached, budget)
            try:
                slots = self.cache.allocate_slots(
                    sequence.request_id,
                    num_new,
                    num_lookahead_tokens=lookahead,
                    watermark_blocks=engine.watermark_blocks if self.running else 0,
                )
            except OutOfBlocksError:
                break  # wait for blocks; nothing changed
            self._tiers_save_evicted()
            sequence.admitted(slots)
            start = self._tiers_load(sequence, slots, num_new)
            self.stats.admitted_tokens += len(sequence.tokens)
            self.stats.cached_tokens += start - slots.num_computed_tokens + slots.num_cached_tokens
            num_new -= start - slots.num_computed_tokens
            self.waiting.remove(sequence)
            self.running.append(sequence)
            admitted.append(sequence)
            sequence.scheduled_tokens = num_new
            scheduled.append(_Scheduled(sequence, start, num_new))
            budget -= num_new
            in_flight |= self._sequence_blocks_in_flight(sequence, start, num_new)
        # Whoever was passed over by a later arrival this step is one step closer to the front.
        if admitted:
            newest = max(s.index for s in admitted)
            for sequence in self.waiting:
                if sequence.index < newest:
                    sequence.passes += 1
        return scheduled

    # -- lower tiers (prefixkv.tiers; docs/tiers.md) ---------------------------------------

    def _tiers_save_evicted(self) -> None:
        """Right after an allocation: the blocks it evicted still hold their KV (nothing is
        written before the step's model call), so they go to the host tier now."""
        tiers = self.engine.tiers
        if tiers is not None and tiers.needs_eviction_log:
            assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
            evicted = self.cache.drain_evicted()
            if evicted:
                tiers.save_evicted(evicted, self.cache.context.fingerprint())

    def _tiers_load(self, sequence: _Sequence, slots: Slots | GroupSlots, num_new: int) -> int:
        """Extends a fresh admission's device hit with host, then remote blocks, loaded into
        its own fresh blocks, counted computed and committed; returns where computing starts.
        At least one token of the chunk is left to compute (its logits, or the next chunk)."""
        tiers = self.engine.tiers
        start = slots.num_computed_tokens
        if tiers is None or not self.engine.prefix_reuse or slots.last_token_shared:
            return start
        first, last = start // self.block_size, (start + num_new - 1) // self.block_size
        if start % self.block_size or last <= first:
            return start
        request_id = sequence.request_id
        assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
        keys = self.cache.request_block_keys(request_id)
        table = self.cache.block_table(request_id)
        context = self.cache.context.fingerprint()
        num_host, num_remote = tiers.load(table, keys, sequence.tokens, first, last, context)
        if not num_host + num_remote:
            return start
        start = (first + num_host + num_remote) * self.block_size
        self.cache.commit(request_id, start)
        tiers.record(
            table, keys, sequence.tokens, first, start // self.block_size, context, from_remote=True
        )
        sequence.num_computed = start
        if sequence.admissions == 1:
            sequence.cached_tokens = start
        return start

    def _tiers_record(self, sequence: _Sequence, start: int, end: int) -> None:
        """Blocks ``start // block_size .. end // block_size - 1`` were just published."""
        tiers = self.engine.tiers
        first, last = start // self.block_size, end // self.block_size
        if tiers is None or last <= first:
            return
        request_id = sequence.request_id
        assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
        tiers.record(
            self.cache.block_table(request_id),
            self.cache.request_block_keys(request_id),
            sequence.tokens,
            first,
            last,
            self.cache.context.fingerprint(),
        )

    def _drop_drafts(self, sequence: _Sequence) -> None:
        verified = len(sequence.tokens) - len(sequence.drafts)
        self.cache.truncate(sequence.request_id, verified)
        del sequence.tokens[verified:]
        sequence.drafts = []

    def _candidate(self, sequence: _Sequence, in_flight: set[bytes]) -> WaitingCandidate:
        cached = 0
        if self.engine.prefix_reuse:
            # From the request's kept keys: a waiting request is not rehashed every step.
            cached = self.cache.start_position(sequence.request_id)
        return WaitingCandidate(
            arrival=sequence.index,
            cached_tokens=cached,
            next_block_in_flight=self._next_block_in_flight(sequence, cached, in_flight),
            passes=sequence.passes,
        )

    def _next_block_in_flight(
        self, sequence: _Sequence, cached_tokens: int, in_flight: set[bytes]
    ) -> bool:
        """Whether the first block `sequence` would compute is computed this step by another
        request (the block keys come from the cache, each hashed once per request)."""
        if not in_flight or not self.engine.prefix_reuse:
            return False
        keys = self.cache.request_block_keys(sequence.request_id)
        next_block = cached_tokens // self.block_size
        return next_block < len(keys) and keys[next_block] in in_flight

    def _blocks_in_flight(self, scheduled: list[_Scheduled]) -> set[bytes]:
        keys: set[bytes] = set()
        for item in scheduled:
            keys |= self._sequence_blocks_in_flight(item.sequence, item.start, item.num_new)
        return keys

    def _sequence_blocks_in_flight(
        self, sequence: _Sequence, start: int, num_new: int
    ) -> set[bytes]:
        """Keys of the full prompt blocks this step computes for `sequence`."""
        if not self.engine.prefix_reuse or sequence.prefilled:
            return set()
        keys = self.cache.request_block_keys(sequence.request_id)
        first = start // self.block_size
        last = (start + num_new) // self.block_size
        return set(keys[first:last])

    def _refuse_stuck(self) -> None:
        """Nothing could be scheduled: only blocks that never come back (pins, or references
        held outside the engine) can cause it, since a lone request always fits the pool."""
        sequence = self.waiting[0]
        stats = self.cache.stats()
        pools = "; ".join(
            f"{pool.blocks_free} free, {pool.blocks_pinned} pinned, {pool.blocks_in_use} in use"
            for pool in (stats.groups if isinstance(stats, GroupedCacheStats) else (stats,))
        )
        raise OutOfBlocksError(
            f"cannot schedule request {sequence.index}: the pool cannot supply its blocks "
            f"({pools}) and nothing running can be preempted"
        )

    # -- one model call ------------------------------------------------------------------

    def _step(self, scheduled: list[_Scheduled]) -> None:
        engine = self.engine
        self.stats.steps += 1
        self.stats.tokens_per_step.append(sum(item.num_new for item in scheduled))
        batch = []
        for item in scheduled:
            sequence = item.sequence
            end = item.start + item.num_new
            # A reuse-last-block full hit: the last token's KV is already in a shared block.
            write_kv = item.start != sequence.shared_position
            sequence.shared_position = None
            if isinstance(self.cache, GroupedPrefixCache):
                # One table per KV group; a sliding group's starts with null blocks.
                request = PrefillRequest(
                    sequence.tokens,
                    (),
                    num_cached_tokens=item.start,
                    num_tokens=end,
                    group_block_tables=self.cache.block_tables(sequence.request_id),
                )
            else:
                request = PrefillRequest(
                    sequence.tokens,
                    self.cache.block_table(sequence.request_id),
                    num_cached_tokens=item.start,
                    num_tokens=end,
                    write_kv=write_kv,
                )
            batch.append(request)
            if not sequence.prefilled:
                self.stats.prefill_chunks += 1
        rows: Sequence[torch.Tensor]
        if engine.num_speculative_tokens:
            # Drafts are verified from the logits of every position they follow.
            rows = engine.model.prefill(engine.kv_cache, batch, return_all_logits=True)
        else:
            # Only the last position's logits: a vocabulary-wide projection of every prompt
            # position would cost more than the attention.
            last = engine.model.prefill(engine.kv_cache, batch)
            rows = [last[i : i + 1] for i in range(len(batch))]
        now = time.perf_counter()
        reuse = engine.prefix_reuse
        for item, logits in zip(scheduled, rows, strict=True):
            sequence = item.sequence
            sequence.num_computed = item.start + item.num_new
            # Also with reuse off: the cache learns how far the request got (`_cache_context`).
            self.cache.commit(sequence.request_id, sequence.num_computed)
            if reuse:
                self._tiers_record(sequence, item.start, sequence.num_computed)
            if sequence.num_computed < len(sequence.tokens):
                continue  # a prompt chunk: nothing to sample yet
            self._sample(sequence, logits, now)

    def _sample(self, sequence: _Sequence, logits: torch.Tensor, now: float) -> None:
        """Greedy sampling of a request that computed its last known token; under speculative
        decoding, verification of its drafts first."""
        engine = self.engine
        num_drafts = len(sequence.drafts)
        rows = logits[-(num_drafts + 1) :]
        predicted = rows.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < num_drafts and predicted[accepted] == sequence.drafts[accepted]:
            accepted += 1
        new_tokens = [*sequence.drafts[:accepted], int(predicted[accepted])]
        if num_drafts:
            self.cache.accept_drafts(sequence.request_id, accepted)
            sequence.tokens = sequence.tokens[: len(sequence.tokens) - num_drafts + accepted]
            sequence.num_computed = len(sequence.tokens)
            if engine.prefix_reuse:  # accepted drafts may complete published blocks
                self._tiers_record(
                    sequence, sequence.num_computed - accepted - 1, sequence.num_computed
                )
            sequence.draft_tokens += num_drafts
            sequence.accepted_draft_tokens += accepted
            self.stats.draft_tokens += num_drafts
            self.stats.accepted_draft_tokens += accepted
            sequence.drafts = []
        if not sequence.prefilled:
            sequence.prefilled = True
            sequence.first_token_time = now - self.start
        done = False
        kept: list[int] = []
        for row, token in zip(rows[: len(new_tokens)], new_tokens, strict=True):
            kept.append(token)
            if self.check_exactness:
                sequence.logits.append(row.detach().to("cpu", torch.float64))
            if len(sequence.generated) + len(kept) >= self.max_new_tokens or token in self.stops:
                done = True
                break
        sequence.generated.extend(kept)
        if done:
            self._finish(sequence)
            return
        # The accepted drafts are in the KV already; the new token is not (computed next step).
        bonus = kept[-1]
        self.cache.append_tokens(sequence.request_id, [bonus])
        sequence.tokens.append(bonus)
        if engine.num_speculative_tokens:
            room = self.max_new_tokens - len(sequence.generated) - 1
            drafts = ngram_drafts(sequence.tokens, min(engine.num_speculative_tokens, room))
            if drafts:
                self.cache.append_tokens(sequence.request_id, drafts, draft=True)
                sequence.tokens.extend(drafts)
                sequence.drafts = drafts

    def _finish(self, sequence: _Sequence) -> None:
        self.cache.finish(sequence.request_id)
        del self.live[sequence.request_id]
        self.running.remove(sequence)
        result = self.engine._result(sequence, self.check_exactness)
        self.results[sequence.index] = result
        if self.on_finish is not None:
            self.on_finish(sequence.index, result)
