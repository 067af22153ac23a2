"""A small serving engine over the prefix cache: `Engine`.

It ties the pieces together the way an inference engine does, and is what `prefixkv demo` runs:

* `PrefixCache` decides which KV blocks a request may reuse; `PagedKVCache` holds them;
  `LlamaModel.prefill` computes only the uncached suffix of every prompt over those pages.
* The `CacheContext` is built from everything that changes KV: a digest of the weights (and of
  the model config), the tokenizer and chat template digests, RoPE theta / scaling / offset,
  the sliding window, the KV dtype and the block size. The active LoRA adapter is part of every
  block key (named by a digest of its weights), so switching adapters never reuses KV.
* Before every `generate` and every step the engine compares the parameters' version counters
  (`LlamaModel.weights_version`, reading no values); on a change it recomputes the weights
  digest and switches the cache to the new context, and requests in flight restart.
* A length-dependent position encoding (dynamic NTK RoPE) makes reuse unsafe but the model
  still exact: such an engine serves with prefix reuse off (`Engine.prefix_reuse` is False,
  the reason is logged once), every request computed from its first token.

Serving is continuous batching over the cache's step-by-step API: one `LlamaModel.prefill`
call per step over a token budget, decode tokens and prompt chunks mixed, blocks published as
they fill (generated ones too, so a conversation's next turn reuses the previous answer),
requests preempted and resumed from their cached blocks when the pool is short, prompt-lookup
drafts with `num_speculative_tokens`. The loop of one `generate` call is
`prefixkv.engine.loop.GenerateRun`; the policy (ordering, fairness, drafts) is
`prefixkv.engine.scheduler`'s; the pools and what a request needs of them are `prefixkv.engine.pools`';
a request's state while served and its `RequestResult` are `prefixkv.engine.requests`'.
Requests become token ids in `prefixkv.engine.inputs` (with the chat-template and stop-token
policy); a checkpoint's settings come from `prefixkv.models.checkpoint`.

size: one class, the engine's public surface (constructor checks, `generate`, checkpoints,
tiers); the per-step work is in `prefixkv.engine.loop`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from prefixkv.cache import FULL_HIT_MODES, PrefixCache
from prefixkv.context import CacheContext
from prefixkv.engine.inputs import (
    EngineInput,
    EngineRequest,
    encode_request,
    positive_int,
    request_options,
    resolve_chat_template,
    stop_tokens,
)
from prefixkv.engine.loop import serve
from prefixkv.engine.pools import build_kv_cache, check_fits, pool_sizes
from prefixkv.engine.requests import RequestResult
from prefixkv.engine.scheduler import SCHEDULING_POLICIES, SchedulerStats
from prefixkv.engine.threads import configure_torch_threads
from prefixkv.errors import InvalidInputError
from prefixkv.group_cache import GroupedPrefixCache
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import kv_group_specs
from prefixkv.models.checkpoint import checkpoint_eos_token_ids
from prefixkv.models.config import model_context
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.text.tokenizers import ByteTokenizer, ChatTemplate, Tokenizer
from prefixkv.tiers.manager import KVTiers
from prefixkv.tiers.remote import RemoteStore

__all__ = [
    "Engine",
    "EngineRequest",
    "RequestResult",
    "checkpoint_eos_token_ids",
    "model_context",
    "weights_digest",
]


_log = logging.getLogger(__name__)


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
            (chat requests are then refused; see `prefixkv.engine.inputs.resolve_chat_template`).
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
        self.max_batch_size = positive_int(max_batch_size, "max_batch_size")
        self.max_num_batched_tokens = positive_int(max_num_batched_tokens, "max_num_batched_tokens")
        self.max_passes = positive_int(max_passes, "max_passes")
        self.num_speculative_tokens = positive_int(
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
        self.kv_cache = build_kv_cache(
            config,
            self.kv_groups,
            grouped=self.grouped,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            kv_group_blocks=kv_group_blocks,
            block_size=block_size,
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
                # The block core: `weights_changed` switches the context while requests are
                # scheduled (they restart after it), which the run core refuses.
                core="blocks",
            )
        if watermark_blocks is None:
            watermark_blocks = max(1, min(pool_sizes(self.kv_cache)) // 100)
        self.watermark_blocks = positive_int(watermark_blocks, "watermark_blocks", minimum=0)
        # -- lower tiers (prefixkv.tiers): off unless asked for
        self.tiers: KVTiers | None = None
        if host_tier_bytes is not None or remote_store is not None:
            assert isinstance(self.kv_cache, PagedKVCache) and isinstance(self.cache, PrefixCache)
            self.tiers = KVTiers.build(
                self.kv_cache,
                host_tier_bytes=host_tier_bytes,
                remote_store=remote_store,
                remote_namespace=remote_namespace,
                remote_queue_size=remote_queue_size,
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
    def prefix_reuse_limit(self) -> int | None:
        """With reuse off, the longest request (prompt, ``max_new_tokens`` and the drafts
        verified past them) that still shares prefixes, or None: LongRoPE uses its short
        factors up to the original context, so requests that never pass it compute all their
        KV under one setting and share it among themselves (`ModelConfig.prefix_reuse_limit`).
        """
        if self.context.reuse_is_safe:
            return None
        return self.model.config.prefix_reuse_limit

    @property
    def prefix_reuse_off_reason(self) -> str | None:
        """Why prefix reuse is off, or None when it is on."""
        if self.context.reuse_is_safe:
            return None
        kind = self.context.position_encoding.rope_scaling
        reason = (
            f"RoPE scaling {kind!r} depends on the total sequence length, so the KV of a prefix "
            "computed for one request is not what a full recompute of another gives"
        )
        limit = self.prefix_reuse_limit
        if limit is not None:
            reason += (
                f"; requests of at most {limit} tokens (prompt, max_new_tokens and drafts) "
                "still share prefixes among themselves"
            )
        return reason

    def _cache_context(self) -> CacheContext:
        """The context the `PrefixCache` runs under.

        Normally `context` itself. Under a length-dependent position encoding (dynamic NTK)
        reuse is unsafe and `PrefixCache` refuses such a context; the model is still exact for
        a request computed from scratch, so the engine serves with prefix reuse off, under this
        stand-in context marked ``prefix_reuse: off``: each request's blocks are keyed under a
        salt of its own (`GenerateRun._add`), so no other request ever matches them. It still commits
        what it computes, which is how the cache knows how far a request got: its next slots,
        and what a sliding-window group may release. A preempted request may read its own
        blocks again, exactly the KV it would have kept had it not been preempted.
        `context` keeps the true position encoding. Said once per engine in the log.

        LongRoPE has a `prefix_reuse_limit` (its original context): a request that can never
        pass it (`GenerateRun._shares_prefixes`) shares blocks, unsalted, with the others that
        cannot, under this context marked with the limit; one that may pass it is salted as
        above, so short-factor KV never meets long-factor KV; when its own tokens pass the limit
        it is computed again from its first token (`GenerateRun._keep_one_rope_setting`), as
        transformers' Phi-3 generation drops its cache there. Dynamic NTK could do the same
        within `max_position_embeddings` (its base does not move there); not implemented.

        Approximate, as in transformers' cached generation: past `max_position_embeddings`,
        each decoded token is rotated with the base of its own step's length, so decode logits
        differ from a full recompute (``use_cache=False``); the prompt's prefill is exact.
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
        limit = self.prefix_reuse_limit
        # With a limit, the requests within it share blocks under this context: the RoPE
        # parameters stay in it (rope_scaling None only to pass `PrefixCache`'s check), and
        # the limit is named, so no block of another setting or limit is ever matched.
        stand_in = replace(
            context.position_encoding,
            rope_scaling=None,
            rope_scaling_params=()
            if limit is None
            else context.position_encoding.rope_scaling_params,
        )
        return replace(
            context,
            position_encoding=stand_in,
            extra={
                **context.extra,
                "prefix_reuse": "off" if limit is None else f"within {limit} tokens",
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
        * chat template: the checkpoint's (`prefixkv.models.checkpoint.find_chat_template`: the
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
        (`prefixkv.engine.inputs.encode_request`)."""
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

        A request is token ids, text or chat (`prefixkv.engine.inputs`), bare or wrapped in an
        `EngineRequest` naming its tenant (`salt`: tenants never share KV blocks) and LoRA
        adapter (served with it; requests of different adapters are served one adapter after
        another, since the model runs one at a time).

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
        positive_int(max_new_tokens, "max_new_tokens")
        start = time.perf_counter()
        parsed = [request_options(request, self.model.adapter_names) for request in requests]
        prompts = [self.encode(request.prompt) for request in parsed]
        check_fits(
            prompts,
            max_new_tokens,
            kv_cache=self.kv_cache,
            kv_groups=self.kv_groups,
            grouped=self.grouped,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )
        stops = frozenset(
            self.stop_token_ids
            if stop_token_ids is None
            else stop_tokens(stop_token_ids, self.model.config.vocab_size, "stop_token_ids")
        )
        self.last_stats = SchedulerStats()
        return serve(
            self,
            prompts,
            parsed,
            self.last_stats,
            max_new_tokens=max_new_tokens,
            stops=stops,
            start=start,
            check_exactness=check_exactness,
            on_finish=on_finish,
        )

    def __repr__(self) -> str:
        pools = pool_sizes(self.kv_cache)
        return (
            f"Engine(model={self.context.model_id or 'LlamaModel'}, "
            f"num_blocks={pools[0] if len(pools) == 1 else pools}, "
            f"block_size={self.kv_cache.block_size})"
        )
