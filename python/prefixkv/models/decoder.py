"""A small Llama-style decoder that runs on paged KV storage: the reference model of prefixkv.

size: the full-recompute oracle and the paged path side by side, so that a reader compares
them layer step by layer step.

Why it exists: prefix caching is only correct if the KV of a cached prefix, read back from the
pages, gives the same logits as recomputing the whole prompt. This module supplies both sides of
that comparison:

* `LlamaModel.prefill` / `decode_step` compute only the tokens that are not cached yet, write
  their K/V into a `PagedKVCache` and attend over the pages through `paged_prefill_attention`.
* `LlamaModel.forward_full` recomputes everything with contiguous K/V and a plain causal
  softmax. It shares the weights and the RoPE frequency table (`rope_inverse_frequencies`,
  tested on its own against the published formulas) and nothing else: its RoPE rotation, mask,
  head grouping and attention are written independently, so a bug in the paged path shows up as
  a difference between the two.

What a cached KV block depends on, besides the tokens before it (the cache key must cover all of
these, and the negative tests in `tests/test_model_negative.py` show each one matters):

* the weights, including the active LoRA adapter (it changes the k/v projections);
* `rope_theta` and `rope_scaling` (YaRN's attention factor too: it scales the rotated keys);
* `position_offset` (the absolute position of token 0);
* which layers apply RoPE at all (`ModelConfig.rope_layers`: SmolLM3's NoPE layers do not);
* for dynamic NTK scaling only, the *total* length of the sequence being computed: the RoPE base
  grows with it once it exceeds `max_position_embeddings`, so KV computed for a shorter prompt is
  not the KV a full recompute of the longer prompt would give.
  `ModelConfig.position_encoding_is_length_dependent` says when this applies; a cache must then
  refuse reuse (or limit it to lengths within `max_position_embeddings`, where the base does not
  move).

The random weights (`LlamaModel.random`) make attention sharp on purpose: query and key
projections are scaled so that a typical attention row puts most of its mass on a few keys. With
the usual small init attention is close to uniform, and an off-by-one position or a wrong mask
then barely moves the logits, which would let a broken cache pass its tests.

Parameter names follow Hugging Face Llama (`model.layers.N.self_attn.q_proj.weight`, ...) and
RoPE follows HF's `rotate_half` convention, so `from_pretrained` loads a local HF checkpoint.
Qwen3's per-head q/k norms (`ModelConfig.qk_norm`) sit between the projections and RoPE on both
paths (`SelfAttention.normalize_heads`). Gemma 2 / 3 (`ModelConfig.gemma`, `prefixkv.models.gemma`)
take the same paths through hooks: the scaled embedding (`DecoderStack.embed`), the sandwich
(`DecoderLayer.add_attention_and_mlp`), the attention scale and cap (`ModelConfig.attention_scale`
/ `attention_softcap`, handed to the kernels), Gemma 3's local RoPE table for sliding layers and
the final logit cap. Starcoder2's LayerNorms and plain MLP (`ModelConfig.layer_norm` /
`plain_mlp_activation`, `prefixkv.models.starcoder2`) are other modules behind the same calls.

The model tells a cache what its KV depends on through public methods: `cache_context` (with
`weights_digest`), `adapter_digest` (the per-block key of the active adapter), and the cheap
change tokens `weights_version` / `adapter_version` an engine checks every step.

The decoder is this module: the model class, its two forward paths (the paged one and its
oracle, read side by side) and what its KV depends on. The rest of the journey has its own:
`layers` (the layer modules and the seeded random init), `config` (settings), `hf_config` (HF
``config.json``), `rope` (position math), `batch` (request types and packing), `lora`
(adapters), `hf_weights` (HF weights). The loaders (`checkpoint`, `gguf`) sit above it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError
from prefixkv.kv.decode import DecodeReads, paged_decode_attention, plan_decode_reads
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache

# `LlamaModel` is what most callers import from here; the configuration, RoPE math, request
# types, adapters and checkpoint I/O live in their own modules and are re-exported so that
# `from prefixkv.models.decoder import ModelConfig` (and the rest) keeps working.
from prefixkv.kv.prefill import AttentionBackend, paged_prefill_attention
from prefixkv.models.batch import (
    BlockTable,
    DecodeRequest,
    PackedBatch,
    PrefillRequest,
    TokenIds,
    check_kv_cache,
    pack_prefill_batch,
    token_tensor,
)
from prefixkv.models.config import ModelConfig, RopeScaling, model_context
from prefixkv.models.gemma import softcap
from prefixkv.models.hf_weights import load_pretrained, save_pretrained
from prefixkv.models.layers import DecoderLayer, DecoderStack, draw_random_weights
from prefixkv.models.lora import AdapterSet, random_adapter
from prefixkv.models.rope import apply_rotate_half_rope as _apply_rotate_half_rope
from prefixkv.models.rope import rope_attention_factor, rope_inverse_frequencies, rotate_half_tables

if TYPE_CHECKING:
    from prefixkv.text.tokenizers import ChatTemplate, Tokenizer

__all__ = [
    "DecodeRequest",
    "LlamaModel",
    "ModelConfig",
    "PrefillRequest",
    "RopeScaling",
    "rope_inverse_frequencies",
]

#: Kept under its old private name: tests plant bugs by subclassing `LlamaModel._pack`.
_PackedBatch = PackedBatch

# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class LlamaModel(nn.Module):
    """Llama-style decoder with a paged-KV forward (`prefill`, `decode_step`) and a cache-free
    oracle (`forward_full`). Build one with `random`, `from_pretrained` or the constructor
    (which leaves PyTorch's default init; `random` is what tests want)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._adapters = AdapterSet(self._projection_weight)
        self.to(dtype=config.dtype)
        self.requires_grad_(False)

    # ---------------------------------------------------------------- construction

    @classmethod
    def random(
        cls, config: ModelConfig | None = None, seed: int = 0, *, attention_sharpness: float = 8.0
    ) -> LlamaModel:
        """A model with seeded random weights, in `config.dtype` (drawn in float32 first, so the
        same seed gives the same weights, up to rounding, in every dtype).

        `attention_sharpness` is the typical standard deviation of a pre-softmax attention score:
        q/k projections are drawn with ``std = sqrt(sharpness / hidden_size)`` (a score is a sum
        of ``hidden_size``-scaled products, then divided by ``sqrt(head_dim)``), so rows of the
        attention matrix are far from uniform and mask or position bugs move the logits.
        Configs that differ only in position settings (theta, scaling, offset, window) get
        identical weights for the same seed.
        """
        config = config or ModelConfig()
        model = cls(config.replace(dtype=torch.float32))
        draw_random_weights(model.model, model.lm_head, config, seed, attention_sharpness)
        model.config = config
        return model.to(dtype=config.dtype)

    def with_config(self, **changes: Any) -> LlamaModel:
        """A model with these config changes and the same weights (copied) and adapters.

        Only settings that leave every weight shape alone may change (position encoding, offset,
        sliding window, dtype...). Tests use it to compute KV under one setting and reuse it
        under another.
        """
        config = self.config.replace(**changes)
        other = type(self)(config)
        try:
            other.load_state_dict(self.state_dict())  # copies, casting to config.dtype
        except RuntimeError as exc:
            raise InvalidInputError(f"config change alters weight shapes: {exc}") from exc
        other = other.to(device=self.device)
        self._adapters.copy_into(other._adapters)
        return other

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---------------------------------------------------------------- HF checkpoints

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in Hugging Face Llama layout
        (`prefixkv.models.hf_weights.save_pretrained`; adapters are not saved)."""
        save_pretrained(self, directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        **config_overrides: Any,
    ) -> LlamaModel:
        """Load a local Hugging Face Llama checkpoint: ``config.json`` plus ``*.safetensors``
        (`prefixkv.models.hf_weights.load_pretrained`: strict, offline; a tied-embedding checkpoint
        that also stores ``lm_head.weight`` loads as transformers loads it)."""
        return load_pretrained(cls, directory, dtype=dtype, device=device, **config_overrides)

    # ---------------------------------------------------------------- adapters

    @staticmethod
    def random_adapter(
        config: ModelConfig, seed: int = 0, std: float = 0.5
    ) -> dict[str, torch.Tensor]:
        """Seeded LoRA weights for every q/k/v/o projection, named as `load_adapter` expects
        (`prefixkv.models.lora.random_adapter`: both factors non-zero, so K and V visibly change)."""
        return random_adapter(config, seed, std)

    def load_adapter(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Register a LoRA adapter under `name` (it is not activated; see `set_adapter`).

        Keys name a layer and projection and end in ``lora_A`` / ``lora_B`` (optionally
        ``.weight``); PEFT names work, and a projection may be left out. The update is
        ``(lora_alpha / lora_rank) * B @ A`` (`prefixkv.models.lora.AdapterSet.load`).
        """
        self._adapters.load(self.config, name, weights)

    def set_adapter(self, name: str | None) -> None:
        """Activate a loaded adapter for every later forward call, or None for the base model."""
        self._adapters.activate(name)

    @property
    def active_adapter(self) -> str | None:
        """Name of the adapter in use (part of what a cached KV block depends on)."""
        return self._adapters.active

    @property
    def adapter_names(self) -> list[str]:
        return self._adapters.names

    def _projection_weight(self, layer: int, projection: str) -> torch.Tensor:
        weight: torch.Tensor = getattr(self.model.layers[layer].self_attn, projection).weight
        return weight

    # ---------------------------------------------------------------- what the KV depends on

    def weights_digest(self) -> str:
        """SHA-256 over every parameter's name, dtype, shape and bytes, plus the config.

        Hashing the loaded tensors (not the files) covers random weights, checkpoints and
        in-memory edits alike; a config field that changes KV without changing a weight
        (RMSNorm eps, head layout) changes the digest too. Reads every weight: call it when the
        weights change (`weights_version` says when), not per request.
        """
        digest = hashlib.sha256()
        digest.update(json.dumps(self.config.describe(), sort_keys=True, default=str).encode())
        for name, tensor in sorted(self.state_dict().items()):
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().data)
        return digest.hexdigest()

    def adapter_digest(self) -> str | None:
        """The active adapter as a per-block cache key (its name and a digest of its weights),
        or None for the base model."""
        return self._adapters.digest()

    def cache_context(
        self,
        block_size: int,
        *,
        model_id: str = "",
        tokenizer: Tokenizer | None = None,
        chat_template: ChatTemplate | None = None,
        weights_digest: str | None = None,
    ) -> CacheContext:
        """The `CacheContext` of this model's KV (`prefixkv.models.config.model_context`): the
        weights digest (computed unless given), position encoding, mask, KV dtype, and the
        tokenizer and chat template that turn requests into its tokens."""
        return model_context(
            self.config,
            weights=self.weights_digest() if weights_digest is None else weights_digest,
            block_size=block_size,
            model_id=model_id,
            tokenizer=tokenizer,
            chat_template=chat_template,
        )

    def weights_version(self) -> Hashable | None:
        """A cheap token that changes whenever a base weight or the config may have changed.

        Built from each parameter's identity, storage address and autograd version counter
        (every in-place op, ``copy_``, ``load_state_dict`` and optimiser step bumps the counter;
        ``.data =`` and ``.to()`` move the storage), plus the config. Costs a walk over the
        parameters, no reads of their values. Edits torch cannot see return an unchanged token:
        writes through ``.numpy()`` or another view of the storage, and parameters that are
        inference tensors (created under ``torch.inference_mode``), which have no version
        counter; then this returns None, meaning "cannot tell".
        """
        try:
            tensors = tuple(
                (id(parameter), parameter.data_ptr(), parameter._version)
                for parameter in self.parameters()
            )
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None
        return (self.config, tensors)

    def adapter_version(self) -> Hashable | None:
        """Like `weights_version`, for the active adapter (`prefixkv.models.lora.AdapterSet.version`)."""
        return self._adapters.version()

    def _project(self, layer_index: int, projection: str, hidden: torch.Tensor) -> torch.Tensor:
        """A q/k/v/o projection plus the active adapter's low-rank update, if any."""
        linear: nn.Linear = getattr(self.model.layers[layer_index].self_attn, projection)
        output = linear(hidden)
        delta = self._adapters.delta(self.config, layer_index, projection, hidden)
        return output if delta is None else output + delta

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Half-precision logits are returned in float32 (what sampling wants); float64 stays.
        logits = self.lm_head(self.model.norm(hidden))
        cap = None if self.config.gemma is None else self.config.gemma.final_logit_softcapping
        if cap is not None:
            logits = softcap(logits, cap)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    # ---------------------------------------------------------------- oracle: full recompute

    def forward(self, token_ids: TokenIds) -> torch.Tensor:
        """``model(token_ids)`` is `forward_full`: the module's plain, cache-free forward."""
        return self.forward_full(token_ids)

    def forward_full(self, token_ids: TokenIds) -> torch.Tensor:
        """Logits ``[n, vocab]`` for every position of one sequence, recomputed from scratch: no
        cache, no pages. The oracle the paged path is tested against. Float32 (float64 for a
        float64 model)."""
        logits, _, _ = self.forward_full_with_kv(token_ids)
        return logits

    @torch.no_grad()
    def forward_full_with_kv(
        self, token_ids: TokenIds
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """`forward_full` plus each layer's keys and values ``[n, num_kv_heads, head_dim]``
        (keys after RoPE): exactly what a correct paged prefill writes into the pages."""
        config = self.config
        tokens = token_tensor(token_ids, config.vocab_size, "token_ids").to(self.device)
        n = tokens.numel()
        if n == 0:
            raise InvalidInputError("token_ids is empty")
        # Written independently of the paged path on purpose: [heads, n, dim] layout, rotation
        # by explicit halves, GQA by repeating KV heads, a dense boolean mask.
        positions = torch.arange(n, dtype=torch.float64) + config.position_offset
        # One table per RoPE setting: Gemma 3's sliding layers have their own base.
        tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        for local, rope in ((False, config), (True, config.local_rope)):
            if rope is None:
                continue
            angles = positions[:, None] * rope_inverse_frequencies(rope, config.position_offset + n)
            # YaRN's attention factor scales cos and sin (1 for every other RoPE).
            attention_factor = rope_attention_factor(rope)
            tables[local] = (
                (torch.cos(angles) * attention_factor).to(self.device, self.dtype),  # [n, dim/2]
                (torch.sin(angles) * attention_factor).to(self.device, self.dtype),
            )
        query_index = torch.arange(n, device=self.device)[:, None]
        key_index = torch.arange(n, device=self.device)[None, :]
        causal = key_index <= query_index
        # One mask per distinct window (hybrid models have two: full and sliding).
        masks = {
            window: causal if window is None else causal & (key_index > query_index - window)
            for window in set(config.layer_sliding_windows)
        }
        half = config.head_dim // 2
        compute_dtype = torch.promote_types(self.dtype, torch.float32)

        def rotate(x: torch.Tensor, local: bool) -> torch.Tensor:  # x: [heads, n, dim]
            cos, sin = tables[local]
            first, second = x[..., :half], x[..., half:]
            return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

        hidden = self.model.embed(tokens)
        keys_per_layer: list[torch.Tensor] = []
        values_per_layer: list[torch.Tensor] = []
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            normed = layer.input_layernorm(hidden)
            query = self._project(index, "q_proj", normed).view(n, config.num_heads, -1)
            key = self._project(index, "k_proj", normed).view(n, config.num_kv_heads, -1)
            value = self._project(index, "v_proj", normed).view(n, config.num_kv_heads, -1)
            query, key = layer.self_attn.normalize_heads(query, key)
            query, key = query.transpose(0, 1), key.transpose(0, 1)
            if config.layer_applies_rope(index):  # not on SmolLM3's NoPE layers
                local = config.layer_uses_local_rope(index)
                query, key = rotate(query, local), rotate(key, local)
            value = value.transpose(0, 1)
            keys_per_layer.append(key.transpose(0, 1).contiguous())
            values_per_layer.append(value.transpose(0, 1).contiguous())
            key = key.repeat_interleave(config.num_query_groups, dim=0).to(compute_dtype)
            value = value.repeat_interleave(config.num_query_groups, dim=0).to(compute_dtype)
            # Scores, softmax and the weighted sum in float32 (at least), only the output rounded
            # to the model dtype: what SDPA, FlashAttention and the paged backends do, so in half
            # precision both paths round at the same points. HF's "eager" attention also rounds
            # scores and weights to the model dtype; with sharp bfloat16 attention, on a row near
            # a tie between two keys, that difference alone decided which path landed nearer the
            # float32 oracle (tests/test_model_paged.py, BF16_NEAR_TIE).
            scores = torch.matmul(query.to(compute_dtype), key.transpose(1, 2))
            scores = scores * config.attention_scale
            if config.attention_softcap is not None:  # Gemma 2: capped before the mask
                scores = torch.tanh(scores / config.attention_softcap) * config.attention_softcap
            allowed = masks[config.layer_sliding_window(index)]
            scores = scores.masked_fill(~allowed, float("-inf"))
            sinks = layer.self_attn.sinks
            if sinks is None:
                weights = torch.softmax(scores, dim=-1)
            else:  # gpt-oss: a column of the head's sink logit joins the softmax, then goes
                sink_column = sinks.to(compute_dtype)[:, None, None].expand(-1, n, 1)
                weights = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)
                weights = weights[..., :-1]
            attended = torch.matmul(weights, value).to(self.dtype)
            attended = attended.transpose(0, 1).reshape(n, -1)
            hidden = layer.add_attention_and_mlp(hidden, self._project(index, "o_proj", attended))
        return self._logits(hidden), keys_per_layer, values_per_layer

    @torch.no_grad()
    def generate_greedy_full(self, token_ids: TokenIds, max_new_tokens: int) -> list[int]:
        """Greedy continuation by repeated full recompute (the oracle for `generate_greedy`)."""
        tokens = token_tensor(token_ids, self.config.vocab_size, "token_ids").tolist()
        generated: list[int] = []
        for _ in range(max_new_tokens):
            next_token = int(self.forward_full(tokens + generated)[-1].argmax())
            generated.append(next_token)
        return generated

    # ---------------------------------------------------------------- paged path

    @overload
    def prefill(
        self,
        kv_cache: PagedKVCache | GroupedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: Literal[False] = False,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor: ...

    @overload
    def prefill(
        self,
        kv_cache: PagedKVCache | GroupedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: Literal[True],
        attention_backend: AttentionBackend = "auto",
    ) -> list[torch.Tensor]: ...

    @torch.no_grad()
    def prefill(
        self,
        kv_cache: PagedKVCache | GroupedKVCache,
        batch: Sequence[PrefillRequest],
        *,
        return_all_logits: bool = False,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor | list[torch.Tensor]:
        """Compute the uncached positions of every request, reading the cached prefix from pages.

        For request b, positions ``m_b .. end_b - 1`` are computed (``m_b`` =
        `num_cached_tokens`, ``end_b`` = `num_tokens` or ``len(token_ids)``), all requests in
        one packed batch with one attention call per layer. Each layer writes the new K/V into
        the request's pages (unless ``write_kv`` is False) *before* attention, which then reads
        keys ``0 .. end_b - 1`` from the pages.

        Every request is validated before any page is written, so a rejected call leaves the
        cache as it was. Returns the logits of each request's last computed position,
        ``[len(batch), vocab]`` (float32, or float64 for a float64 model), or with
        ``return_all_logits=True`` a list of ``[end_b - m_b, vocab]`` tensors.
        """
        packed = self._pack(kv_cache, batch)
        config = self.config
        total = packed.tokens.numel()
        # Once per call, not per layer (YaRN's attention factor is in them); Gemma 3's sliding
        # layers have their own.
        tables = {
            False: rotate_half_tables(packed.cos, packed.sin),
            True: (
                None
                if packed.local_cos is None or packed.local_sin is None
                else rotate_half_tables(packed.local_cos, packed.local_sin)
            ),
        }
        # A decode step (every request computes one position) takes the batched decode path
        # (`prefixkv.kv.decode`) where the torch backend would run; explicit
        # "reference" / "triton" and CUDA's auto choice keep theirs.
        one_query_each = all(length == 1 for length in packed.query_lens) and (
            attention_backend == "torch"
            or (attention_backend == "auto" and packed.tokens.device.type == "cpu")
        )
        # Where each decode request's keys are read, per (KV group, window): shared by layers.
        decode_reads: dict[tuple[int, int | None], DecodeReads] = {}

        hidden = self.model.embed(packed.tokens)
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            normed = layer.input_layernorm(hidden)
            query = self._project(index, "q_proj", normed).view(total, config.num_heads, -1)
            key = self._project(index, "k_proj", normed).view(total, config.num_kv_heads, -1)
            value = self._project(index, "v_proj", normed).view(total, config.num_kv_heads, -1)
            query, key = layer.self_attn.normalize_heads(query, key)
            if config.layer_applies_rope(index):  # not on SmolLM3's NoPE layers
                rope_tables = tables[config.layer_uses_local_rope(index)]
                assert rope_tables is not None
                cos, sin = rope_tables
                query = _apply_rotate_half_rope(query, cos, sin)
                key = _apply_rotate_half_rope(key, cos, sin)
            # A layer's pages, its index in them, and its group's slots and block tables.
            if isinstance(kv_cache, GroupedKVCache):
                pages, page_layer, group = kv_cache.layer_pages(index)
                slot_mapping = packed.group_slot_mappings[group]
                block_tables = packed.group_block_tables[group]
            else:
                pages, page_layer, group = kv_cache, index, 0
                slot_mapping, block_tables = packed.slot_mapping, packed.block_tables
            if packed.written_rows is None:
                pages.write(page_layer, key, value, slot_mapping, check_bounds=False)
            elif packed.written_rows.numel() > 0:
                rows = packed.written_rows
                pages.write(page_layer, key[rows], value[rows], slot_mapping, check_bounds=False)
            if one_query_each:
                window = config.layer_sliding_window(index)
                reads = decode_reads.get((group, window))
                if reads is None:
                    reads = plan_decode_reads(
                        block_tables,
                        packed.seq_lens,
                        pages.block_size,
                        sliding_window=window,
                        device=query.device,
                    )
                    decode_reads[(group, window)] = reads
                attended = paged_decode_attention(
                    query,
                    pages.key_pages[page_layer],
                    pages.value_pages[page_layer],
                    block_tables,
                    packed.seq_lens,
                    scale=config.attention_scale,
                    sliding_window=window,
                    sinks=layer.self_attn.sinks,
                    softcap=config.attention_softcap,
                    reads=reads,
                )
            else:
                attended = paged_prefill_attention(
                    query,
                    pages.key_pages[page_layer],
                    pages.value_pages[page_layer],
                    block_tables,
                    packed.query_lens,
                    packed.seq_lens,
                    scale=config.attention_scale,
                    sliding_window=config.layer_sliding_window(index),
                    sinks=layer.self_attn.sinks,
                    softcap=config.attention_softcap,
                    backend=attention_backend,
                    check_bounds=False,
                )
            attention_output = self._project(index, "o_proj", attended.reshape(total, -1))
            hidden = layer.add_attention_and_mlp(hidden, attention_output)

        if return_all_logits:
            return list(self._logits(hidden).split(packed.query_lens))
        last_rows = torch.tensor(packed.query_lens).cumsum(0).sub(1).to(hidden.device)
        return self._logits(hidden[last_rows])

    def decode_step(
        self,
        kv_cache: PagedKVCache | GroupedKVCache,
        batch: Sequence[DecodeRequest],
        *,
        attention_backend: AttentionBackend = "auto",
    ) -> torch.Tensor:
        """Append one token per request: its K/V goes into the pages, the result is next-token
        logits ``[len(batch), vocab]``. Every earlier token's KV must already be in the pages."""
        if isinstance(batch, DecodeRequest) or not isinstance(batch, Sequence):
            raise InvalidInputError("batch must be a sequence of DecodeRequest")
        requests = []
        for position, request in enumerate(batch):
            if not isinstance(request, DecodeRequest):
                raise InvalidInputError(f"batch[{position}] is not a DecodeRequest: {request!r}")
            tokens = token_tensor(
                request.token_ids, self.config.vocab_size, f"batch[{position}].token_ids"
            )
            if tokens.numel() == 0:
                raise InvalidInputError(f"batch[{position}] needs at least one token")
            requests.append(
                PrefillRequest(
                    tokens,
                    request.block_table,
                    num_cached_tokens=tokens.numel() - 1,
                    group_block_tables=request.group_block_tables,
                )
            )
        return self.prefill(kv_cache, requests, attention_backend=attention_backend)

    def generate_greedy(
        self,
        kv_cache: PagedKVCache,
        token_ids: TokenIds,
        block_table: BlockTable,
        max_new_tokens: int,
        *,
        num_cached_tokens: int = 0,
        attention_backend: AttentionBackend = "auto",
    ) -> list[int]:
        """Greedy continuation on the paged path: prefill from `num_cached_tokens`, then one
        `decode_step` per token. `block_table` must cover ``n + max_new_tokens - 1`` positions
        (the last generated token is returned, not written).
        """
        tokens = token_tensor(token_ids, self.config.vocab_size, "token_ids").tolist()
        if max_new_tokens <= 0:
            return []
        logits = self.prefill(
            kv_cache,
            [PrefillRequest(tokens, block_table, num_cached_tokens=num_cached_tokens)],
            attention_backend=attention_backend,
        )
        generated = [int(logits[0].argmax())]
        while len(generated) < max_new_tokens:
            logits = self.decode_step(
                kv_cache,
                [DecodeRequest(tokens + generated, block_table)],
                attention_backend=attention_backend,
            )
            generated.append(int(logits[0].argmax()))
        return generated

    # ---------------------------------------------------------------- paged path helpers

    def _pack(
        self, kv_cache: PagedKVCache | GroupedKVCache, batch: Sequence[PrefillRequest]
    ) -> PackedBatch:
        """Validate the cache and every request, and lay the batch out as packed tensors
        (`prefixkv.models.batch.pack_prefill_batch`)."""
        check_kv_cache(self.config, kv_cache, dtype=self.dtype, device=self.device)
        return pack_prefill_batch(
            self.config, kv_cache, batch, device=self.device, dtype=self.dtype
        )
