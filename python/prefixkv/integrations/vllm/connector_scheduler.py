"""The connector's scheduler side: which blocks a request loads from the tiers, which it saves.

Two tiers, probed in this order: the workers' host pools (`connector_host`: the scheduler holds
their index) and the Valkey/Redis store (`connector_probe`). Either may be absent.

Life of a request, as vLLM's `Scheduler` drives it:

1. `get_num_new_matched_tokens` on admission, after vLLM's own prefix-cache match: the blocks
   that follow the local hit are looked up in the host index, and those after the host's run
   are probed in the store, one round trip per tensor-parallel rank (by default **every value
   is verified** before a hit is claimed). A missing, foreign or corrupted value ends the run
   there; the store's hit is the shortest run over the ranks. The last prompt token is never
   claimed (vLLM must compute it for its logits). Nothing but the host index's LRU order
   changes here: vLLM may call it again for the same request.
2. `update_state_after_alloc`: the claimed blocks get their device block ids; a load job is
   queued for the next step's metadata (its first blocks from the host, the rest from the store).
3. `build_connector_meta`, once per step: the queued load jobs, and per scheduled request and
   tier a save job for the prompt blocks this step completes (not those it loaded or hit
   locally): to the store the blocks this process did not save recently, to the host the blocks
   its index does not hold, into slots the index allocates. Saves are prompt blocks only;
   generated tokens are not stored.
4. `request_finished`: the request's state is dropped. Saves were copied out of the KV cache
   during the step (`connector_worker`), so the blocks are freed at once (returns False).

The worker verifies each block again when it loads it: a store value evicted or overwritten
between the probe and the load, a host slot whose save was dropped or whose bytes fail their
digest, is reported as a load error, and vLLM recomputes those blocks (the connector requires
``kv_load_failure_policy="recompute"``; see `connector`). Workers report the host slots that
failed (`HostReport`, through vLLM's worker metadata) and `forget_host_slots` drops them from
the index, so a bad slot costs one recomputation, not one per request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from prefixkv.integrations.vllm.connector_host import HostIndex, HostSlot
from prefixkv.integrations.vllm.connector_keys import RequestKeys, adapter_identity
from prefixkv.integrations.vllm.connector_probe import BlockProbe

__all__ = ["BlockJob", "ConnectorPlan", "SchedulerSide"]


@dataclass(frozen=True)
class BlockJob:
    """Blocks ``first_block ..`` of one request, to load into or save from `block_ids`.

    Carries the request's tokens up to the last block (the key chain starts at the first
    token) and its key extras; each worker computes its own rank's keys from them. `host`
    names host slots: in a load, the first ``len(host)`` blocks come from them (the rest from
    the store); in a host save, block ``i`` goes to ``host[i]``."""

    req_id: str
    first_block: int
    block_ids: tuple[int, ...]
    tokens: tuple[int, ...]
    salt: str | None
    adapter: str | None
    host: tuple[HostSlot, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class ConnectorPlan:
    """One step's work for the workers (the connector's `KVConnectorMetadata` payload)."""

    loads: list[BlockJob] = field(default_factory=list)
    #: Saves to the store.
    saves: list[BlockJob] = field(default_factory=list)
    #: Saves to the workers' host pools (each job's `host` names the slots).
    host_saves: list[BlockJob] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Any
    salt: str | None
    adapter: str | None
    #: Blocks claimed by the last probe, from `probe_first`.
    probe_first: int = 0
    probe_hit: int = 0
    #: The host slots of the first blocks of that claim.
    probe_host: tuple[HostSlot, ...] = ()
    #: The next prompt block a save job may cover; None until the first step.
    next_save_block: int | None = None


@dataclass
class SchedulerStats:
    """Blocks (not tokens) counted by the scheduler side."""

    probed_blocks: int = 0
    #: Blocks claimed, from either tier (`host_hit_blocks` of them from the host).
    hit_blocks: int = 0
    host_hit_blocks: int = 0
    load_jobs: int = 0
    #: Blocks planned for the store (the host index counts its own).
    save_blocks: int = 0
    #: Blocks not saved because this process saved them recently.
    skipped_known_blocks: int = 0


class SchedulerSide:
    """State of the scheduler-side connector, one per vLLM scheduler."""

    #: How many recently saved keys the scheduler remembers, to skip saving them again.
    KNOWN_KEYS = 1 << 16

    def __init__(
        self,
        keys_per_rank: list[RequestKeys],
        probe: BlockProbe | None,
        host: HostIndex | None = None,
    ) -> None:
        self.keys_per_rank = keys_per_rank
        #: The store's probe; None without a store.
        self.probe = probe
        #: The workers' host pools' index, keyed by rank 0's keys (every rank's pool holds
        #: its own rank's block in the same slot); None without a host tier.
        self.host = host
        self.geometry = keys_per_rank[0].identity.geometry
        self.block_size = self.geometry.block_size
        self.stats = SchedulerStats()
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockJob] = []
        self._known: OrderedDict[bytes, None] = OrderedDict()

    # -- admission -----------------------------------------------------------------------

    def _state(self, request: Any) -> _RequestState | None:
        """The request's state; None for a request the connector does not key."""
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if request.mm_features or request.prompt_embeds is not None:
            return None
        if not request.prompt_token_ids:
            return None
        salt = request.cache_salt
        state = _RequestState(request, salt, adapter_identity(request.lora_request))
        self._requests[request.request_id] = state
        return state

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        state = self._state(request)
        if state is None:
            return 0
        state.probe_first = state.probe_hit = 0
        state.probe_host = ()
        bs = self.block_size
        prompt = request.prompt_token_ids
        # The last prompt token is always computed: its logits sample the first output.
        last = (len(prompt) - 1) // bs
        first = num_computed_tokens // bs
        if first >= last:
            return 0
        host: list[HostSlot] = []
        if self.host is not None:
            records = self.keys_per_rank[0].records(
                prompt, last, salt=state.salt, adapter=state.adapter
            )
            host = self.host.match(records[first:])
        start = first + len(host)
        remote = 0
        if self.probe is not None and start < last:
            remote = last - start
            for keys in self.keys_per_rank:
                records = keys.records(
                    prompt, start + remote, salt=state.salt, adapter=state.adapter
                )
                remote = min(remote, self.probe(records[start:], keys.fingerprint))
                if remote == 0:
                    break
        hit = len(host) + remote
        self.stats.probed_blocks += last - first
        self.stats.hit_blocks += hit
        self.stats.host_hit_blocks += len(host)
        state.probe_first, state.probe_hit, state.probe_host = first, hit, tuple(host)
        return hit * bs

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        state = self._requests.get(request.request_id)
        if state is None:  # only a request the connector keys can have been given a hit
            return
        bs = self.block_size
        # vLLM only lowers a claim, by whole blocks. Were that to change, rounding up makes
        # the worker load (and verify) every block vLLM counts as loaded, or report it failed.
        num_blocks = -(-num_external_tokens // bs)
        first = state.probe_first
        tokens = tuple(request.prompt_token_ids[: (first + num_blocks) * bs])
        job = BlockJob(
            request.request_id,
            first,
            tuple(block_ids[first : first + num_blocks]),
            tokens,
            state.salt,
            state.adapter,
            state.probe_host[:num_blocks],
        )
        if self.host is not None:
            self.host.stats.hit_blocks += len(job.host)
        self._pending_loads.append(job)
        self.stats.load_jobs += 1
        # Loaded keys are not remembered as stored: if the load fails, vLLM rolls the request
        # back and recomputes the blocks, and their save then repairs the store.

    # -- one step ------------------------------------------------------------------------

    def build_plan(self, scheduler_output: Any) -> ConnectorPlan:
        plan = ConnectorPlan(loads=self._pending_loads)
        self._pending_loads = []
        block_state = scheduler_output.kv_connector_block_state
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or block_state is None:
                continue
            self._save_jobs(plan, state, num_scheduled, block_state.get_block_ids(req_id))
        return plan

    def _save_jobs(
        self,
        plan: ConnectorPlan,
        state: _RequestState,
        num_scheduled: int,
        block_ids: tuple[list[int], ...] | None,
    ) -> None:
        request = state.request
        bs = self.block_size
        computed = request.num_computed_tokens
        if state.next_save_block is None or computed < state.next_save_block * bs:
            # First step, or resumed after a preemption that reset its progress.
            state.next_save_block = computed // bs
        prompt = request.prompt_token_ids
        done = min(computed + num_scheduled, len(prompt)) // bs
        first = state.next_save_block
        if done <= first or block_ids is None:
            return
        state.next_save_block = done
        records = self.keys_per_rank[0].records(
            prompt, done, salt=state.salt, adapter=state.adapter
        )[first:]

        def job(start: int, stop: int, host: tuple[HostSlot, ...] = ()) -> BlockJob:
            return BlockJob(
                request.request_id,
                start,
                tuple(block_ids[0][start:stop]),
                tuple(prompt[: stop * bs]),
                state.salt,
                state.adapter,
                host,
            )

        if self.probe is not None:
            # Blocks this process saved recently are in the store already (or being written).
            skip = 0
            while skip < len(records) and records[skip].key in self._known:
                skip += 1
            self.stats.skipped_known_blocks += skip
            if skip < len(records):
                self._remember(records[skip:])
                self.stats.save_blocks += len(records) - skip
                plan.saves.append(job(first + skip, done))
        if self.host is not None:
            held = len(self.host.match(records))
            slots = self.host.reserve(records[held:])
            if slots:
                start = first + held
                plan.host_saves.append(job(start, start + len(slots), tuple(slots)))

    def forget_host_slots(self, slots: list[HostSlot]) -> None:
        """Slots a worker reported it does not hold as planned (`HostReport`)."""
        if self.host is not None:
            self.host.forget(slots)

    def _remember(self, records: list[Any]) -> None:
        for record in records:
            self._known[record.key] = None
            self._known.move_to_end(record.key)
        while len(self._known) > self.KNOWN_KEYS:
            self._known.popitem(last=False)

    def request_finished(self, request: Any) -> None:
        self._requests.pop(request.request_id, None)
