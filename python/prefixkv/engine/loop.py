"""One `Engine.generate` call, step by step: `serve` and `GenerateRun`.

`serve` splits the call's requests by LoRA adapter (the model runs one at a time) and serves
each group as a `GenerateRun`. A run holds two queues, *waiting* and *running*, and repeats one step until both are empty:

1. **schedule**: running requests first (a decode token plus drafts, or a prompt's next chunk),
   preempting the newest running request when the pool is short; then waiting requests, in the
   order `prefixkv.engine.scheduler.order_waiting` gives, while the step's token budget and the pool
   allow. Admission matches the request's cached prefix (`PrefixCache.allocate_slots`) and
   extends it from the lower tiers (`prefixkv.tiers.KVTiers`), the whole tier hit at once
   however many steps' budgets it spans. Room for draft tokens is optional: a request gives
   it up before it would preempt itself or wait alone.
2. **step**: one `LlamaModel.prefill` over every scheduled chunk (decode tokens and prompt
   chunks mixed, varlen), then `commit`, which publishes the blocks that filled.
3. **sample**: greedy; under speculative decoding the drafts are verified first
   (`accept_drafts`) and new ones proposed (`prefixkv.engine.scheduler.ngram_drafts`).
4. **finish**: at `max_new_tokens` or a stop token the request's blocks go back to the cache
   (cached, evictable) and its `RequestResult` is handed to the caller.

Every request added to the cache and not yet finished is in `live`; if anything goes wrong
(a model error, a callback raising, Ctrl-C) `abandon` finishes exactly those. The policy
(ordering, fairness, drafts) is `prefixkv.engine.scheduler`'s; docs/scheduling.md explains both.

Time to first token is measured from the `generate` call to the step that produced the token,
so it includes queueing behind other requests of the same call.

size: one run's state machine (schedule, admit, step, verify drafts, finish); its parts share
the run's queues and cache, which a split would have to pass around.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prefixkv.cache import PrefixCache, Slots
from prefixkv.engine.inputs import EngineRequest
from prefixkv.engine.requests import RequestResult, ServedRequest
from prefixkv.engine.scheduler import SchedulerStats, WaitingCandidate, ngram_drafts, order_waiting
from prefixkv.errors import OutOfBlocksError
from prefixkv.group_cache import GroupedCacheStats, GroupedPrefixCache, GroupSlots
from prefixkv.kv.grouped import GroupedKVCache
from prefixkv.kv.pages import PagedKVCache
from prefixkv.kv_groups import KVGroupSpec
from prefixkv.models.decoder import LlamaModel, PrefillRequest
from prefixkv.text.tokenizers import Tokenizer
from prefixkv.tiers.manager import KVTiers, TierHit


class Engine(Protocol):
    """What the loop reads of the `prefixkv.engine.facade.Engine` that runs it. Named
    structurally, so that the loop does not import the facade above it (the facade imports the
    loop); mypy checks that the Engine has every member, with these types."""

    @property
    def model(self) -> LlamaModel: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...
    @property
    def cache(self) -> PrefixCache | GroupedPrefixCache: ...
    @property
    def kv_cache(self) -> PagedKVCache | GroupedKVCache: ...
    @property
    def kv_groups(self) -> tuple[KVGroupSpec, ...]: ...
    @property
    def tiers(self) -> KVTiers | None: ...
    @property
    def prefix_reuse(self) -> bool: ...
    @property
    def prefix_reuse_limit(self) -> int | None: ...
    @property
    def scheduling(self) -> str: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_passes(self) -> int: ...
    @property
    def max_waiting_considered(self) -> int: ...
    @property
    def num_speculative_tokens(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
    @property
    def _adapter_key(self) -> str | None: ...
    def flush_kv_events(self) -> None: ...
    def _sync_with_model(self) -> bool: ...
    def _new_request_id(self) -> str: ...


__all__ = ["GenerateRun", "serve"]


@dataclass
class _Scheduled:
    """One request's share of a step: compute positions ``start .. start + num_new - 1``."""

    sequence: ServedRequest
    start: int
    num_new: int


def serve(
    engine: Engine,
    prompts: Sequence[list[int]],
    requests: Sequence[EngineRequest],
    stats: SchedulerStats,
    **run_options: Any,
) -> list[RequestResult]:
    """Serve one `generate` call; results in request order.

    The model runs one LoRA adapter at a time, so requests naming different adapters are served
    one adapter after another (first named first), each group as a `GenerateRun` with its
    adapter active; the model's own active adapter is put back afterwards. Each adapter is part
    of its requests' block keys, so no group ever reads another's blocks."""
    model = engine.model
    active = model.active_adapter
    groups: dict[str | None, list[tuple[int, list[int], str | bytes | None]]] = {}
    for index, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
        adapter = active if request.adapter is None else request.adapter
        groups.setdefault(adapter, []).append((index, prompt, request.salt))
    results: list[RequestResult | None] = [None] * len(prompts)
    try:
        for adapter, group in groups.items():
            if model.active_adapter != adapter:
                model.set_adapter(adapter)
                engine._sync_with_model()  # its key for the blocks of this group
            run = GenerateRun(
                engine=engine, requests=group, results=results, stats=stats, **run_options
            )
            try:
                run.serve()
            except BaseException:
                run.abandon()
                raise
    finally:
        if model.active_adapter != active:
            model.set_adapter(active)
            engine._sync_with_model()
    return [result for result in results if result is not None]


class GenerateRun:
    """The requests of one `generate` call that share an adapter: the queues, the steps, and
    the cache calls that go with them."""

    def __init__(
        self,
        *,
        engine: Engine,
        requests: Sequence[tuple[int, list[int], str | bytes | None]],
        results: list[RequestResult | None],
        stats: SchedulerStats,
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
        self.stats = stats
        self.sequences = [
            ServedRequest(
                index=i, request_id=engine._new_request_id(), prompt=p, tokens=list(p), salt=salt
            )
            for i, p, salt in requests
        ]
        self.waiting: list[ServedRequest] = list(self.sequences)
        self.running: list[ServedRequest] = []
        #: Indexed by request (`ServedRequest.index`), shared by the runs of one call.
        self.results = results
        # Every request added to the cache and not yet finished: exactly these are finished if
        # anything goes wrong (a model error, an on_finish callback raising, Ctrl-C).
        self.live: dict[str, ServedRequest] = {}
        self.block_size = engine.kv_cache.block_size
        #: (request id, start, what the tiers held) of the last probe (`_tiers_probe`).
        self.last_probe: tuple[str, int, TierHit | None] | None = None
        #: Requests whose KV is all computed past `Engine.prefix_reuse_limit` (LongRoPE's long
        #: factors), under a salt of their own for that setting (`_recompute_past_rope_limit`).
        self.past_rope_limit: set[str] = set()

    # -- the loop ------------------------------------------------------------------------

    def serve(self) -> None:
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

    def abandon(self) -> None:
        for sequence in self.live.values():
            self.cache.finish(sequence.request_id)
        self.live.clear()
        self.engine.flush_kv_events()

    # -- cache bookkeeping ---------------------------------------------------------------

    def _shares_prefixes(self, sequence: ServedRequest) -> bool:
        """Whether `sequence` reads and publishes shared blocks: always with reuse on; under a
        length-dependent RoPE only if no length it can reach (prompt, every token it may
        generate, the drafts verified past them) exceeds `Engine.prefix_reuse_limit`, so all
        its KV is computed under the one RoPE setting every other such request uses."""
        engine = self.engine
        if engine.prefix_reuse:
            return True
        limit = engine.prefix_reuse_limit
        longest = len(sequence.prompt) + self.max_new_tokens + engine.num_speculative_tokens
        return limit is not None and longest <= limit

    def _add(self, sequence: ServedRequest) -> None:
        # Not sharing prefixes: a salt of the request's own, so nothing it publishes is shared
        # and it matches nothing another request published; one per RoPE setting, so after
        # `_recompute_past_rope_limit` it never reads its own blocks of the other setting.
        salt = sequence.salt
        limit = self.engine.prefix_reuse_limit
        if limit is not None and len(sequence.tokens) - len(sequence.drafts) > limit:
            self.past_rope_limit.add(sequence.request_id)
        if not self._shares_prefixes(sequence):
            salt = f"prefix-reuse-off:{sequence.request_id}"
            if sequence.request_id in self.past_rope_limit:
                salt += ":past-rope-limit"
        self.cache.add_request(
            sequence.request_id, sequence.tokens, adapter=self.engine._adapter_key, salt=salt
        )
        self.live[sequence.request_id] = sequence

    def _restart_all(self) -> None:
        """The weights changed under requests in flight: their KV is stale, and so is what
        they generated from it, so each starts again from its prompt, under the new context."""
        self.last_probe = None
        for sequence in list(self.live.values()):
            self.cache.finish(sequence.request_id)
            del self.live[sequence.request_id]
            self.past_rope_limit.discard(sequence.request_id)
            sequence.reset()
        self.waiting = sorted(self.waiting + self.running, key=lambda s: s.index)
        self.running = []
        for sequence in self.waiting:
            self._add(sequence)

    def _preempt(self, sequence: ServedRequest) -> None:
        if self._crossed_rope_limit(sequence):
            # Its own kept blocks hold the other setting's KV: recomputed, not resumed.
            self._recompute_past_rope_limit(sequence)
            sequence.preemptions += 1
        else:
            self.cache.preempt(sequence.request_id)
            sequence.preempted()
            self.running.remove(sequence)
            self.waiting.insert(0, sequence)
        self.stats.preemptions += 1

    def _crossed_rope_limit(self, sequence: ServedRequest) -> bool:
        """Whether `sequence` computed KV within `Engine.prefix_reuse_limit` (LongRoPE's short
        factors) and its tokens, drafts aside, now pass it."""
        limit = self.engine.prefix_reuse_limit
        return (
            limit is not None
            and sequence.request_id not in self.past_rope_limit
            and len(sequence.tokens) - len(sequence.drafts) > limit
        )

    def _keep_one_rope_setting(self, sequence: ServedRequest) -> bool:
        """Before a running request's step: never compute KV under LongRoPE's long factors on
        top of KV computed under its short ones. Drafts that would pass the limit are dropped;
        a request whose own tokens pass it is recomputed from its first token, as transformers'
        Phi-3 ``prepare_inputs_for_generation`` drops its cache at that step. True when the
        request went back to the queue."""
        limit = self.engine.prefix_reuse_limit
        if limit is None or sequence.request_id in self.past_rope_limit:
            return False
        if self._crossed_rope_limit(sequence):
            self._recompute_past_rope_limit(sequence)
            return True
        if len(sequence.tokens) > limit:
            self._drop_drafts(sequence)
        return False

    def _recompute_past_rope_limit(self, sequence: ServedRequest) -> None:
        """Drop every block of `sequence` (computed under the short factors) and queue it to be
        computed again, all of it under the long ones, keyed under a salt of that setting."""
        self.cache.finish(sequence.request_id)
        del self.live[sequence.request_id]
        del sequence.tokens[len(sequence.tokens) - len(sequence.drafts) :]
        sequence.drafts = []
        sequence.num_computed = 0
        self.running.remove(sequence)
        self.waiting.insert(0, sequence)
        self._add(sequence)

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
            if self._keep_one_rope_setting(sequence):
                continue  # queued to be recomputed: admitted in step 2 if there is room
            num_new = len(sequence.tokens) - sequence.num_computed
            if num_new > budget and sequence.drafts:
                self._drop_drafts(sequence)  # verification is never split across steps
                num_new = len(sequence.tokens) - sequence.num_computed
            num_new = min(num_new, budget)
            room = lookahead
            while True:
                try:
                    self.cache.allocate_slots(
                        sequence.request_id, num_new, num_lookahead_tokens=room
                    )
                    self._tiers_save_evicted()
                    break
                except OutOfBlocksError:
                    victim = self.running[-1]
                    if victim is sequence and (room or sequence.drafts):
                        # Drafts are optional room: given up before the request's own place.
                        room = 0
                        if sequence.drafts:
                            self._drop_drafts(sequence)
                            num_new = min(len(sequence.tokens) - sequence.num_computed, budget)
                        continue
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
        admitted: list[ServedRequest] = []
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
            # A tier hit is loaded whole at admission, past this step's budget if it is longer
            # (loading costs no compute); without room for all of it, the chunk alone.
            hit = self._tiers_probe(sequence, cached)
            hit_tokens = hit.num_blocks * self.block_size if hit is not None else 0
            num_new = min(len(sequence.tokens) - cached - hit_tokens, budget)
            sizes = [hit_tokens + num_new]
            if hit_tokens:
                sizes.append(min(len(sequence.tokens) - cached, budget))
            # Room for drafts is optional: a request alone is admitted without it if need be.
            rooms = [lookahead, 0] if lookahead and not self.running else [lookahead]
            slots = None
            for room, size in ((room, size) for room in rooms for size in sizes):
                try:
                    slots = self.cache.allocate_slots(
                        sequence.request_id,
                        size,
                        num_lookahead_tokens=room,
                        watermark_blocks=engine.watermark_blocks if self.running else 0,
                    )
                except OutOfBlocksError:
                    continue  # nothing changed
                end = slots.num_computed_tokens + size
                break
            if slots is None:
                break  # wait for blocks
            self._tiers_save_evicted()
            sequence.admitted(slots)
            start = self._tiers_load(sequence, slots, hit, end)
            num_new = min(end - start, budget)
            self.stats.admitted_tokens += len(sequence.tokens)
            self.stats.cached_tokens += start - slots.num_computed_tokens + slots.num_cached_tokens
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
        """Right after an allocation: the blocks it evicted go to the host tier."""
        if self.engine.tiers is not None:
            assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
            self.engine.tiers.save_evicted_by(self.cache)

    def _tiers_probe(self, sequence: ServedRequest, start: int) -> TierHit | None:
        """What the lower tiers hold of a waiting request's blocks from `start` on
        (`KVTiers.probe_request`). The last probe is kept while its request waits (one, so a
        long queue holds no fetched KV): a blocked request is not probed again every step. A
        remote value never changes under its key, and `KVTiers.load_request` checks the keys
        are still the request's own."""
        tiers = self.engine.tiers
        if tiers is None or not self.engine.prefix_reuse:
            return None
        if self.last_probe is not None and self.last_probe[:2] == (sequence.request_id, start):
            return self.last_probe[2]
        assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
        hit = tiers.probe_request(self.cache, sequence.request_id, sequence.tokens, start)
        self.last_probe = (sequence.request_id, start, hit)
        return hit

    def _tiers_load(
        self, sequence: ServedRequest, slots: Slots | GroupSlots, hit: TierHit | None, end: int
    ) -> int:
        """Extends a fresh admission's device hit with a probed tier hit, loaded into its own
        fresh blocks (those before the block of token ``end - 1``: at least one allocated
        token is left to compute), counted computed and committed; returns where computing
        starts."""
        self.last_probe = None
        tiers = self.engine.tiers
        start = slots.num_computed_tokens
        if tiers is None or hit is None or slots.last_token_shared:
            return start
        assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
        loaded = tiers.load_request(
            self.cache, sequence.request_id, sequence.tokens, start, hit, end
        )
        if loaded != start:
            sequence.num_computed = loaded
            if sequence.admissions == 1:
                sequence.cached_tokens = loaded
        return loaded

    def _tiers_record(self, sequence: ServedRequest, start: int, end: int) -> None:
        """Blocks ``start // block_size .. end // block_size - 1`` were just published."""
        if self.engine.tiers is not None:
            assert isinstance(self.cache, PrefixCache)  # no tiers with KV groups
            self.engine.tiers.record_request(
                self.cache, sequence.request_id, sequence.tokens, start, end
            )

    def _drop_drafts(self, sequence: ServedRequest) -> None:
        verified = len(sequence.tokens) - len(sequence.drafts)
        self.cache.truncate(sequence.request_id, verified)
        del sequence.tokens[verified:]
        sequence.drafts = []

    def _candidate(self, sequence: ServedRequest, in_flight: set[bytes]) -> WaitingCandidate:
        cached = 0
        if self._shares_prefixes(sequence):
            # From the request's kept keys: a waiting request is not rehashed every step.
            cached = self.cache.start_position(sequence.request_id)
        return WaitingCandidate(
            arrival=sequence.index,
            cached_tokens=cached,
            next_block_in_flight=self._next_block_in_flight(sequence, cached, in_flight),
            passes=sequence.passes,
        )

    def _next_block_in_flight(
        self, sequence: ServedRequest, cached_tokens: int, in_flight: set[bytes]
    ) -> bool:
        """Whether the first block `sequence` would compute is computed this step by another
        request (the block keys come from the cache, each hashed once per request)."""
        if not in_flight or not self._shares_prefixes(sequence):
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
        self, sequence: ServedRequest, start: int, num_new: int
    ) -> set[bytes]:
        """Keys of the full prompt blocks this step computes for `sequence`."""
        if not self._shares_prefixes(sequence) or sequence.prefilled:
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

    def _record_kv_held(self) -> None:
        """Update the peak KV the running requests hold (`SchedulerStats.peak_kv_bytes`)."""
        engine = self.engine
        stats = self.cache.stats()
        per_group = stats.groups if isinstance(stats, GroupedCacheStats) else (stats,)
        config, kv = engine.model.config, engine.kv_cache
        element = torch.empty((), dtype=kv.dtype).element_size()
        block_layer = 2 * kv.block_size * config.num_kv_heads * config.head_dim * element
        held = full = 0
        has_full = False
        for group, spec in zip(per_group, engine.kv_groups, strict=True):
            held += int(group.blocks_in_use) * len(spec.layers) * block_layer
            if spec.sliding_window is None:
                has_full = True
                full = max(full, int(group.blocks_in_use) * config.num_layers * block_layer)
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, held)
        if has_full:
            self.stats.peak_kv_bytes_all_full = max(self.stats.peak_kv_bytes_all_full or 0, full)

    def _step(self, scheduled: list[_Scheduled]) -> None:
        engine = self.engine
        self.stats.steps += 1
        self._record_kv_held()
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

    def _sample(self, sequence: ServedRequest, logits: torch.Tensor, now: float) -> None:
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

    def _finish(self, sequence: ServedRequest) -> None:
        self.cache.finish(sequence.request_id)
        del self.live[sequence.request_id]
        self.running.remove(sequence)
        result = sequence.result(self.engine.model, self.engine.tokenizer, self.check_exactness)
        self.results[sequence.index] = result
        if self.on_finish is not None:
            self.on_finish(sequence.index, result)
