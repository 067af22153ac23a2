"""`PrefixKVConnector`: prefixkv's host tier and verified remote tier as a vLLM v1 KV connector.

Plugged in the way LMCache is, through vLLM's ``kv_transfer_config``::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(
        model="/models/llama",
        kv_transfer_config=KVTransferConfig(
            kv_connector="PrefixKVConnector",
            kv_connector_module_path="prefixkv.integrations.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "host_tier_bytes": 8 << 30,  # per worker; omit for the store alone
                "redis_url": "redis://cache:6379/0",  # omit for the host tier alone
            },
        ),
    )

vLLM builds two instances: the scheduler's (`connector_scheduler.SchedulerSide`: probes,
plans, the host tier's index) and one per worker (`connector_worker.WorkerSide`: copies, the
host tier's bytes). This class only routes vLLM's calls to the side its role names and converts
vLLM's arguments; the keys are in `connector_keys`, the settings in `connector_config`, the host
tier's two halves in `connector_host`. Workers tell the scheduler which host slots went bad
through vLLM's worker metadata (`PrefixKVWorkerMetadata`).

Failure policy: the scheduler verifies every store value before claiming a hit, so a corrupted
or foreign value in the store is a miss. A value can still vanish or change between the probe
and the load (the store evicts it, another writer replaces it, the store goes down), and a host
slot is claimed from the scheduler's index and checked by the worker at load (its save may have
been dropped, its bytes may fail their digest); the worker then reports the blocks as load
errors. Under vLLM's default ``kv_load_failure_policy="fail"`` that fails the user's request,
so the connector refuses to start under it: set ``"recompute"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from prefixkv.errors import InvalidInputError
from prefixkv.integrations.vllm.connector_config import ConnectorSettings
from prefixkv.integrations.vllm.connector_host import HostIndex, HostReport, host_capacity
from prefixkv.integrations.vllm.connector_keys import BlockGeometry, EngineIdentity, RequestKeys
from prefixkv.integrations.vllm.connector_probe import make_probe
from prefixkv.integrations.vllm.connector_scheduler import ConnectorPlan, SchedulerSide
from prefixkv.integrations.vllm.connector_worker import WorkerSide
from prefixkv.tiers import RedisStore, RemoteTier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PrefixKVConnector", "PrefixKVConnectorMetadata", "PrefixKVWorkerMetadata"]


@dataclass
class PrefixKVConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler side to every worker."""

    plan: ConnectorPlan


@dataclass
class PrefixKVWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's host slots that a worker does not hold as planned, back to the scheduler
    (vLLM aggregates the workers' with `aggregate`)."""

    report: HostReport

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, PrefixKVWorkerMetadata):
            raise InvalidInputError(
                f"PrefixKVWorkerMetadata aggregated with {type(other).__name__}"
            )
        return PrefixKVWorkerMetadata(self.report.merge(other.report))


class PrefixKVConnector(KVConnectorBase_V1):
    """vLLM KV connector over prefixkv's host tier and verified remote store (Valkey/Redis)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise InvalidInputError(
                "PrefixKVConnector needs kv_transfer_config.kv_load_failure_policy='recompute': "
                "a block evicted from the store between probe and load would otherwise fail "
                f"the request (got {transfer.kv_load_failure_policy!r})"
            )
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        self.geometry = BlockGeometry.from_kv_cache_config(kv_cache_config)
        self.identity = EngineIdentity.from_vllm_config(
            vllm_config, self.geometry, model_fingerprint=self.settings.model_fingerprint
        )
        s = self.settings
        capacity = None
        if s.host_tier_bytes is not None:
            capacity = host_capacity(s.host_tier_bytes, self.geometry)
        self.store: RedisStore | None = None
        self.remote: RemoteTier | None = None
        if s.redis_url is not None:
            self.store = RedisStore(s.redis_url, timeout=s.timeout, ttl=s.ttl)
            self.remote = RemoteTier(
                self.store,
                namespace=s.namespace,
                queue_size=s.queue_size,
                retry_after=s.retry_after,
                max_probe_blocks=s.max_probe_blocks,
            )
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self._probe: Any = None
        if role == KVConnectorRole.SCHEDULER:
            ranks = range(self.identity.tensor_parallel_size)
            if self.remote is not None and s.redis_url is not None:
                self._probe = make_probe(
                    s.probe, self.remote, self.geometry, s.redis_url, s.timeout
                )
            self.scheduler_side = SchedulerSide(
                [RequestKeys(self.identity, rank) for rank in ranks],
                self._probe,
                None if capacity is None else HostIndex(capacity),
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank() if self.identity.tensor_parallel_size > 1 else 0
            self.worker_side = WorkerSide(
                RequestKeys(self.identity, rank),
                self.remote,
                host_capacity=capacity,
                host_queue_size=s.queue_size,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a future miss, not an error.
        return False

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise InvalidInputError("a scheduler-side call on the worker-side connector")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise InvalidInputError("a worker-side call on the scheduler-side connector")
        return self.worker_side

    # -- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        self._scheduler().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return PrefixKVConnectorMetadata(self._scheduler().build_plan(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves were copied out during their step: the blocks may be freed now.
        self._scheduler().request_finished(request)
        return False, None

    def reset_cache(self) -> bool | None:
        # vLLM's reset_prefix_cache(reset_connector=True). The host tier is this engine's own
        # cache: its index is emptied (the workers' bytes become unreachable, and generations
        # keep counting, so no later plan names them). The store is shared with other engines
        # and is left alone, so a store-only connector reports that it reset nothing.
        side = self._scheduler()
        if side.host is None:
            return None
        side.host.clear()
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, PrefixKVWorkerMetadata):
            raise InvalidInputError(
                f"PrefixKVConnector got {type(meta).__name__} worker metadata from a worker"
            )
        self._scheduler().forget_host_slots(meta.report.forget)

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group = self._kv_cache_config.kv_cache_groups[0]
        # The key names the backend vLLM's selector resolves; a layer built with another one
        # (an override this connector does not know of) would store bytes read another way.
        layers = self._vllm_config.compilation_config.static_forward_context
        reader = self.identity.kv_reader.split("/")[1]
        for name in group.layer_names:
            backend = getattr(layers.get(name), "attn_backend", None)
            if backend is not None and backend.get_name() != reader:
                raise InvalidInputError(
                    f"layer {name!r} uses attention backend {backend.get_name()}, the connector's "
                    f"keys name {reader}"
                )
        self._worker().register_kv_caches(
            kv_caches, group.layer_names, self._kv_cache_config.num_blocks
        )

    def _plan(self) -> ConnectorPlan | None:
        if not self.has_connector_metadata():
            return None
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, PrefixKVConnectorMetadata):
            raise InvalidInputError(
                f"PrefixKVConnector got {type(metadata).__name__} metadata from the scheduler"
            )
        return metadata.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and plan.loads:
            self._worker().load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads complete inside start_load_kv, before the forward reads any layer.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saved once per step in wait_for_save, every layer in one gather per layer: the
        # step's KV is complete then, and nothing overwrites it before the step returns.
        return

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is not None and (plan.saves or plan.host_saves):
            self._worker().save(plan.saves, plan.host_saves)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker().take_host_report()
        return None if report is None else PrefixKVWorkerMetadata(report)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Loads are synchronous and saves are copied out in their step: nothing is pending.
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.remote is not None:
            self.remote.close()
        if self.store is not None:
            self.store.close()
        if hasattr(self._probe, "close"):
            self._probe.close()
