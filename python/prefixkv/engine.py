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

Scheduling, one `LlamaModel.prefill` call per step (prefill and decode mixed, varlen):

* Admit waiting requests in order while the pool can hold them *and* every admitted request's
  remaining generation (so decode never runs out of blocks mid-flight). A request that would
  compute a block another request admitted in the same step is also computing waits one step:
  the other's commit then turns that block into a hit, so requests running together compute a
  shared prefix once.
* A new request computes positions ``num_cached_tokens .. n-1``; a full hit computes only the
  last position and writes nothing (its KV is in a shared, read-only block). A decoding request
  computes its newest token. Full blocks are committed after every step, generated ones too, so
  a conversation's next turn reuses the previous answer.
* Greedy decoding; a request ends after `max_new_tokens` or a stop token, then `finish` hands its
  blocks back (they stay cached, evictable).

Time to first token is measured from the `generate` call to the step that produced the token,
so it includes queueing behind other requests of the same call.

Requests become token ids in `prefixkv.engine_inputs` (with the chat-template and stop-token
policy); a checkpoint's settings come from `prefixkv.checkpoint`. This module is a little over
600 lines because admission, the step and the weight-change checks share the engine's state
and read best in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from prefixkv.cache import PrefixCache, Request
from prefixkv.checkpoint import checkpoint_eos_token_ids
from prefixkv.context import CacheContext
from prefixkv.engine_inputs import EngineInput, encode_request, resolve_chat_template, stop_tokens
from prefixkv.errors import InvalidInputError, OutOfBlocksError
from prefixkv.kv import PagedKVCache
from prefixkv.model import LlamaModel, ModelConfig, PrefillRequest
from prefixkv.model_config import model_context
from prefixkv.text import ByteTokenizer, ChatTemplate, Tokenizer

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

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Sequence:
    """A request being served."""

    index: int
    prompt: list[int]
    request: Request
    block_table: list[int]
    tokens: list[int]
    cached_tokens: int
    full_hit: bool
    prefilled: bool = False
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    first_token_time: float = 0.0


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
        geometry = (config.num_layers, block_size, config.num_kv_heads, config.head_dim)
        if kv_memory_bytes is not None:
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
        self.cache = PrefixCache(
            self.kv_cache.num_blocks,
            context=self._cache_context(),
            vocab_size=config.vocab_size,
        )

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
        a request computed from scratch, so the engine serves with prefix reuse off: it never
        commits a block (nothing is ever published, so every lookup misses) and uses the cache
        only as its block allocator, under this stand-in context marked ``prefix_reuse: off``.
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
        ``*.safetensors``), served as the checkpoint says it should be:

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
        from prefixkv.checkpoint import CHECKPOINT_TEMPLATE_SOURCES, find_chat_template
        from prefixkv.text import HFTokenizer

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
        """Serve a batch of requests; results in request order.

        A request ends after `max_new_tokens` or at a stop token: `stop_token_ids` when given
        (``()`` for none), else the engine's `stop_token_ids` (a checkpoint's EOS tokens for
        `from_pretrained`).

        `on_finish(index, result)` is called as each request completes (for progress bars).
        Raises `OutOfBlocksError` when one request alone cannot fit the pool.
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
            needed = self._blocks_for(len(prompt) + max_new_tokens - 1)
            if needed > self.kv_cache.num_blocks:
                raise OutOfBlocksError(
                    f"request {index}: {len(prompt)} prompt tokens plus {max_new_tokens} new "
                    f"need {needed} blocks of {self.kv_cache.block_size} tokens; the KV pool has "
                    f"{self.kv_cache.num_blocks} (raise num_blocks or kv_memory_bytes)"
                )
        if stop_token_ids is None:
            stops = set(self.stop_token_ids)
        else:
            stops = set(stop_tokens(stop_token_ids, self.model.config.vocab_size, "stop_token_ids"))
        waiting = list(range(len(prompts)))
        running: list[_Sequence] = []
        results: list[RequestResult | None] = [None] * len(prompts)
        # Every cache request begun and not yet finished, by id: whatever goes wrong (a model
        # error, an on_finish callback raising, Ctrl-C), exactly these are finished on the way out.
        live: dict[int, Request] = {}
        try:
            while waiting or running:
                if self._sync_with_model() and running:
                    # The weights changed under requests in flight (a callback edited them):
                    # their KV is stale, so they start again from their prompts.
                    for sequence in running:
                        del live[sequence.request.id]
                        self.cache.finish(sequence.request)
                    waiting = sorted(waiting + [sequence.index for sequence in running])
                    running = []
                adapter = self._adapter_key
                admitted = self._admit(waiting, prompts, running, max_new_tokens, adapter, live)
                if not admitted and not running:
                    stats = self.cache.stats()  # only pinned or leaked blocks get here
                    raise OutOfBlocksError(
                        f"cannot admit request {waiting[0]}: it needs "
                        f"{self._blocks_for(len(prompts[waiting[0]]) + max_new_tokens - 1)} "
                        f"blocks and the pool cannot supply them ({stats.blocks_free} free, "
                        f"{stats.blocks_pinned} pinned, {stats.blocks_in_use} in use)"
                    )
                running.extend(admitted)
                self._step(running, start, check_exactness)
                still_running = []
                for sequence in running:
                    last = sequence.generated[-1]
                    if len(sequence.generated) < max_new_tokens and last not in stops:
                        sequence.block_table.extend(self.cache.append(sequence.request, [last]))
                        sequence.tokens.append(last)
                        still_running.append(sequence)
                        continue
                    del live[sequence.request.id]
                    self.cache.finish(sequence.request)
                    result = self._result(sequence, check_exactness)
                    results[sequence.index] = result
                    if on_finish is not None:
                        on_finish(sequence.index, result)
                running = still_running
        except BaseException:
            for request in live.values():
                self.cache.finish(request)
            raise
        return [result for result in results if result is not None]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv_cache.block_size)

    def _can_obtain(self, count: int) -> bool:
        """Whether the pool can hand out `count` more blocks now: free ones plus every cached
        block eviction can reach (`PrefixCache.blocks_obtainable`, capped at `count` so it
        stays cheap). Not `stats().blocks_evictable`: that counts only the leaves evictable at
        once, so a chain of six cached blocks would count one."""
        return count <= 0 or self.cache.blocks_obtainable(count) >= count

    def _admit(
        self,
        waiting: list[int],
        prompts: list[list[int]],
        running: list[_Sequence],
        max_new_tokens: int,
        adapter: str | None,
        live: dict[int, Request],
    ) -> list[_Sequence]:
        """Begin as many waiting requests as fit; removes them from `waiting`, records each
        begun request in `live` at once."""
        # Blocks the running requests will still allocate while they decode.
        reserved = sum(
            self._blocks_for(len(s.prompt) + max_new_tokens - 1) - len(s.block_table)
            for s in running
        )
        in_flight: set[bytes] = set()  # keys of blocks that requests admitted now will compute
        reuse = self.prefix_reuse
        admitted: list[_Sequence] = []
        for index in list(waiting):
            if len(running) + len(admitted) >= self.max_batch_size:
                break
            prompt = prompts[index]
            keys: list[bytes] = []
            if reuse:
                keys = self.cache.block_keys(prompt, adapter=adapter)
                cached_blocks = len(self.cache.lookup(prompt, adapter=adapter).block_ids)
                if cached_blocks < len(keys) and keys[cached_blocks] in in_flight:
                    continue  # an earlier request computes this block now: reuse it next step
            try:
                request = self.cache.begin(prompt, adapter=adapter)
            except OutOfBlocksError:
                break
            live[request.id] = request
            growth = self._blocks_for(len(prompt) + max_new_tokens - 1) - len(request.block_table)
            if not self._can_obtain(reserved + growth):
                del live[request.id]
                self.cache.finish(request)  # would starve a decode later: wait for blocks
                break
            reserved += growth
            in_flight.update(keys[request.num_cached_tokens // self.kv_cache.block_size :])
            waiting.remove(index)
            admitted.append(
                _Sequence(
                    index=index,
                    prompt=prompt,
                    request=request,
                    block_table=list(request.block_table),
                    tokens=list(prompt),
                    cached_tokens=request.num_cached_tokens,
                    full_hit=request.full_hit,
                )
            )
        return admitted

    def _step(self, running: list[_Sequence], start: float, check_exactness: bool) -> None:
        """One model call: prefill the new requests, decode one token for the others."""
        batch = []
        for sequence in running:
            if sequence.prefilled:
                cached = len(sequence.tokens) - 1
                write_kv = True
            else:
                cached = sequence.cached_tokens
                write_kv = not sequence.full_hit
            batch.append(
                PrefillRequest(
                    sequence.tokens,
                    sequence.block_table,
                    num_cached_tokens=cached,
                    write_kv=write_kv,
                )
            )
        logits = self.model.prefill(self.kv_cache, batch)
        reuse = self.prefix_reuse
        now = time.perf_counter()
        next_tokens = logits.argmax(dim=-1).tolist()
        for sequence, row, token in zip(running, logits, next_tokens, strict=True):
            if not sequence.prefilled:
                sequence.prefilled = True
                sequence.first_token_time = now - start
            if check_exactness:
                sequence.logits.append(row.detach().to("cpu", torch.float64))
            sequence.generated.append(int(token))
            # Every position now has KV in the pages: publish the blocks that are full (unless
            # reuse is off, when nothing is ever published; see `_cache_context`).
            if reuse:
                self.cache.commit(sequence.request, len(sequence.tokens))

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
        )
        if check_exactness:
            # One full recompute over prompt + output[:-1] gives the logits of every step.
            full = self.model.forward_full(sequence.tokens).to("cpu", torch.float64)
            ours = torch.stack(sequence.logits)
            reference = full[len(sequence.prompt) - 1 :]
            result.max_logit_diff = float((ours - reference).abs().max())
            result.tokens_match = reference.argmax(dim=-1).tolist() == sequence.generated
        return result

    def __repr__(self) -> str:
        return (
            f"Engine(model={self.context.model_id or 'LlamaModel'}, "
            f"num_blocks={self.kv_cache.num_blocks}, block_size={self.kv_cache.block_size})"
        )
