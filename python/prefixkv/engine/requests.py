"""A request inside the `Engine`: its state while served (`ServedRequest`) and what serving it
produced (`RequestResult`).

The engine keeps its own view of each request beside the cache's: the prompt, the tokens the
cache holds for it (prompt, generated and pending draft tokens), how far its KV is computed,
its pending drafts, and what it cost (cached tokens, preemptions, drafts). Preemption drops its
KV and drafts but keeps what it generated; a weight change sends it back to its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prefixkv.cache import Slots
from prefixkv.group_cache import GroupSlots
from prefixkv.models.decoder import LlamaModel
from prefixkv.text.tokenizers import Tokenizer

__all__ = ["RequestResult", "ServedRequest"]


@dataclass
class RequestResult:
    """What serving one request produced, and what it cost.

    A *full hit* (`full_hit`) is a prompt whose every block was cached (its length a multiple
    of the block size). Its last token must still be computed for its logits; how depends on
    the engine's ``full_hit`` mode:

    * ``"recompute_last_block"`` (the default): the last block is recomputed into a private
      block (its KV written there; the copy deduplicates at commit), so `cached_tokens` is
      ``prompt_tokens - block_size`` and `computed_tokens` is ``block_size``.
    * ``"reuse_last_block"``: every block is shared and only the last token is computed,
      reading its KV from the shared block and writing nothing: `cached_tokens` is
      ``prompt_tokens - 1``.

    `cached_tokens` counts the first admission's hit: blocks matched on the device plus blocks
    loaded from the host or remote tier. A request preempted and resumed recomputes what it
    lost without changing it.
    """

    prompt_token_ids: list[int]
    #: Prompt tokens whose KV was read from the cache or a lower tier at the first admission
    #: (for a full hit, see above: all but the last block by default).
    cached_tokens: int
    #: Prompt positions the model computed at the first admission
    #: (``prompt_tokens - cached_tokens``, at least 1).
    computed_tokens: int
    #: Seconds from the `generate` call to this request's first output token.
    time_to_first_token: float
    output_token_ids: list[int]
    #: The output decoded by the engine's tokenizer (None without one).
    output_text: str | None
    #: Every prompt block was cached (see above for what was computed and written).
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
class ServedRequest:
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
    #: The tenant (`EngineRequest.salt`): part of every block key of the request.
    salt: str | bytes | None = None

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

    def result(
        self, model: LlamaModel, tokenizer: Tokenizer | None, check_exactness: bool
    ) -> RequestResult:
        """What serving it produced (with `check_exactness`, against a full recompute)."""
        sequence = self
        result = RequestResult(
            prompt_token_ids=sequence.prompt,
            cached_tokens=sequence.cached_tokens,
            computed_tokens=len(sequence.prompt) - sequence.cached_tokens,
            time_to_first_token=sequence.first_token_time,
            output_token_ids=list(sequence.generated),
            output_text=(None if tokenizer is None else tokenizer.decode(sequence.generated)),
            full_hit=sequence.full_hit,
            preemptions=sequence.preemptions,
            draft_tokens=sequence.draft_tokens,
            accepted_draft_tokens=sequence.accepted_draft_tokens,
        )
        if check_exactness:
            # One full recompute over prompt + output[:-1] gives the logits of every step.
            full_sequence = sequence.prompt + sequence.generated[:-1]
            full = model.forward_full(full_sequence).to("cpu", torch.float64)
            ours = torch.stack(sequence.logits)
            reference = full[len(sequence.prompt) - 1 :]
            result.max_logit_diff = float((ours - reference).abs().max())
            result.tokens_match = reference.argmax(dim=-1).tolist() == sequence.generated
        return result
