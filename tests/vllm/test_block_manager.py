"""prefixkv's vLLM block manager on its own: version and interface checks, what it refuses by
name, block ids both ways, the cache context's fingerprint and KV events in vLLM's types."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from prefixkv.cache import PrefixCache
from prefixkv.errors import (
    InvalidInputError,
    UnsupportedEngineVersionError,
    UnsupportedFeatureError,
)
from prefixkv.integrations.vllm import PrefixKVCacheManager, hybrid, make_block_manager
from prefixkv.integrations.vllm._versions import check_vllm_version
from prefixkv.integrations.vllm.context import vllm_cache_context
from prefixkv.integrations.vllm.hybrid import HybridPrefixKVCacheManager
from prefixkv.integrations.vllm.pool_view import BlockIds
from prefixkv.integrations.vllm.scheduler import prefixkv_settings
from prefixkv.integrations.vllm.signatures import interface_differences, missing_attributes
from tests.vllm.harness import (
    RequestSpec,
    SchedulerSetup,
    Workload,
    drive,
    make_request,
    make_scheduler,
    runner_output_for,
)


def _config(*specs: object, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def _full(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def _manager(**overrides: object) -> PrefixKVCacheManager:
    args: dict[str, object] = {
        "kv_cache_config": _config(_full()),
        "max_model_len": 256,
        "scheduler_block_size": 4,
        "hash_block_size": 4,
    }
    args.update(overrides)
    return make_block_manager(**args)


# -- versions and interface ----------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1+cpu", "0.32.0rc2"])
def test_supported_versions_accepted(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_unsupported_versions_refused_by_name(version: str) -> None:
    with pytest.raises(UnsupportedEngineVersionError, match=r"0\.32\.x"):
        check_vllm_version(version)


def test_interface_matches_installed_vllm() -> None:
    assert interface_differences(KVCacheManager, PrefixKVCacheManager) == []
    assert missing_attributes(KVCacheManager, _manager()) == []


def test_a_new_argument_in_vllm_is_reported() -> None:
    class Upgraded(KVCacheManager):
        def allocate_slots(
            self,
            request,
            num_new_tokens,
            num_new_computed_tokens=0,
            new_computed_blocks=None,
            num_lookahead_tokens=0,
            num_external_computed_tokens=0,
            delay_cache_blocks=False,
            num_encoder_tokens=0,
            full_sequence_must_fit=False,
            reserved_blocks=0,
            has_scheduled_reqs=True,
            skip_zeroing_group_ids=(),
            pin_blocks=False,
        ):  # type: ignore[no-untyped-def,override]
            raise AssertionError

        def warm_up(self) -> None:
            raise AssertionError

    problems = interface_differences(Upgraded, PrefixKVCacheManager)
    assert any(p.startswith("allocate_slots: missing parameter 'pin_blocks'") for p in problems)
    assert "warm_up: not implemented" in problems


# -- refusals ---------------------------------------------------------------------------------
def _window(window: int = 8, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=window,
    )


def test_one_group_manager_refuses_several_groups_by_name() -> None:
    """`PrefixKVCacheManager` serves one group; a hybrid config built with it directly is
    refused, naming the factory that serves it."""
    config = _config(_full(), _window())
    with pytest.raises(UnsupportedFeatureError, match=r"2 KV cache groups.*make_block_manager"):
        PrefixKVCacheManager(config, 256, 4, 4)


def test_hybrid_layouts_served_by_lanes() -> None:
    """Several groups make a `HybridPrefixKVCacheManager`: one lane per group in one cache."""
    manager = _manager(kv_cache_config=_config(_full(), _window(), _window()))
    assert isinstance(manager, HybridPrefixKVCacheManager)
    assert len(manager.coordinator.single_type_managers) == 3
    assert manager.empty_kv_cache_blocks.blocks == ((), (), ())
    cache = manager.prefix_cache
    assert cache.window_release == "explicit" and cache.num_blocks == 15


@pytest.mark.parametrize(
    ("specs", "overrides", "name"),
    [
        ((_full(), _window(block_size=8)), {}, r"block sizes \[4, 8\]"),
        ((_full(), _window(window=1)), {}, "sliding_window=1"),
        ((_full(), _window()), {"enable_kv_cache_events": True}, "enable_kv_cache_events"),
        ((_full(), _window()), {"use_eagle": True}, "use_eagle"),
    ],
)
def test_hybrid_layouts_refused_by_name(
    specs: tuple[object, ...], overrides: dict[str, object], name: str
) -> None:
    with pytest.raises(UnsupportedFeatureError, match=name):
        _manager(kv_cache_config=_config(*specs), **overrides)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"hash_block_size": 2}, "partial-block hits"),
        ({"use_eagle": True}, "use_eagle"),
        ({"enable_caching": False}, "enable_caching=False"),
        ({"enable_mamba_shared_prefix_checkpoint": True}, "Mamba"),
        ({"dcp_world_size": 2}, "dcp_world_size"),
    ],
)
def test_unsupported_settings_refused_by_name(overrides: dict[str, object], name: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=name):
        _manager(**overrides)


# -- the run core (additional_config={"prefixkv": {"core": "runs"}}) ---------------------------
def test_run_core_served_through_additional_config(tiny_model: Path) -> None:
    setup = SchedulerSetup(num_blocks=16, block_size=4, max_model_len=64, core="runs")
    manager = make_scheduler(tiny_model, setup, "prefixkv").kv_cache_manager
    assert manager.prefix_cache.core == "runs"
    # Free blocks come from the run core's count, not a walk of its blocks.
    assert manager.block_pool.get_num_free_blocks() == 15
    blocks = make_scheduler(tiny_model, dataclasses.replace(setup, core="blocks"), "prefixkv")
    assert blocks.kv_cache_manager.prefix_cache.core == "blocks"


@pytest.mark.parametrize(
    ("setup", "core"),
    [
        (SchedulerSetup(), "runs"),
        # A window covering the whole context is full attention: the run core serves it.
        (SchedulerSetup(sliding_window=64), "runs"),
        (SchedulerSetup(sliding_window=8), "blocks"),
        (SchedulerSetup(hybrid_windows=(8,)), "blocks"),
    ],
    ids=["full-attention", "covering-window", "sliding-window", "hybrid"],
)
def test_the_default_core_is_the_run_core_where_it_serves_the_layout(
    tiny_model: Path, setup: SchedulerSetup, core: str
) -> None:
    """No ``core`` setting ("auto"): the run core for one full-attention group, the block core
    for a sliding window or several groups, which the run core does not serve yet."""
    setup = dataclasses.replace(setup, num_blocks=32, block_size=4, max_model_len=64)
    assert setup.core == "auto"
    manager = make_scheduler(tiny_model, setup, "prefixkv").kv_cache_manager
    assert manager.prefix_cache.core == core


@pytest.mark.parametrize(
    ("setup", "name"),
    [
        (SchedulerSetup(sliding_window=8), "a sliding window of 8 tokens"),
        (SchedulerSetup(hybrid_windows=(8,)), "a layout of 2 KV cache groups"),
    ],
    ids=["sliding-window", "hybrid"],
)
def test_run_core_refuses_what_it_does_not_serve_by_name(
    tiny_model: Path, setup: SchedulerSetup, name: str
) -> None:
    setup = dataclasses.replace(setup, num_blocks=32, block_size=4, max_model_len=64, core="runs")
    with pytest.raises(UnsupportedFeatureError, match=rf"{name} with prefixkv's run core"):
        make_scheduler(tiny_model, setup, "prefixkv")


@pytest.mark.parametrize("core", ["blocks", "runs"])
def test_reset_prefix_cache_with_requests_waiting_or_preempted(core: str) -> None:
    """vLLM resets the prefix cache (a weights update) with requests waiting, or after
    preempting the running ones (`reset_running_requests=True`): none holds a block, so it
    resets. A review found the run core refusing then (`InvalidInputError`)."""
    manager = _manager(core=core)
    preempted = make_request(RequestSpec("a", tuple(range(1, 11)), max_tokens=4), 4)
    manager.get_computed_blocks(preempted)
    assert manager.allocate_slots(preempted, 10) is not None
    preempted.status = RequestStatus.PREEMPTED
    manager.free(preempted)
    waiting = make_request(RequestSpec("b", tuple(range(1, 11)), max_tokens=4), 4)
    manager.get_computed_blocks(waiting)  # looked up, not given slots yet
    assert manager.prefix_cache.stats().blocks_in_use == 0
    assert manager.reset_prefix_cache() is True
    # Nothing cached any more, for either request.
    _, hit, _ = manager.get_computed_blocks(preempted)
    assert hit == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prefixkv": {"core": "radix"}}, r'\["prefixkv"\]\["core"\] must be one of .*radix'),
        ({"prefixkv": {"cores": "runs"}}, r"unknown prefixkv setting\(s\).*cores"),
        ({"prefixkv": "runs"}, r'\["prefixkv"\] must be a dict, not str'),
    ],
)
def test_unknown_or_bad_prefixkv_settings_refused_by_name(
    extra: dict[str, object], message: str
) -> None:
    config = types.SimpleNamespace(additional_config=extra)
    with pytest.raises(InvalidInputError, match=message):
        prefixkv_settings(config)


def test_prefixkv_settings_default_and_other_plugins_left_alone() -> None:
    for extra in ({}, {"other_plugin": {"x": 1}}, None):
        config = types.SimpleNamespace(additional_config=extra)
        assert prefixkv_settings(config) == {"core": "auto"}
    with pytest.raises(InvalidInputError, match="core must be one of"):
        _manager(core="radix")


def test_sliding_window_extra_retained_tokens_refused_by_name() -> None:
    # Multi-module MTP keeps tokens below the window alive: not what the core releases.
    spec = SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=8,
        extra_retained_tokens=2,
    )
    with pytest.raises(UnsupportedFeatureError, match="extra_retained_tokens=2"):
        _manager(kv_cache_config=_config(spec))


def test_hybrid_scheduler_served(tiny_model: Path) -> None:
    # gpt-oss's layout (full attention + one sliding group) and Gemma 3's (+ several).
    for windows in ((8,), (8, 8, 8)):
        setup = SchedulerSetup(num_blocks=16, block_size=4, hybrid_windows=windows)
        manager = make_scheduler(tiny_model, setup, "prefixkv").kv_cache_manager
        assert isinstance(manager, HybridPrefixKVCacheManager)
        assert manager.num_kv_cache_groups == 1 + len(windows)


def test_window_covering_the_context_served(tiny_model: Path) -> None:
    """A sliding window at least max_model_len long never slides in vLLM: served, with vLLM's
    spec, kind and window in its events and views."""
    setup = SchedulerSetup(
        num_blocks=16,
        block_size=4,
        max_model_len=64,
        sliding_window=64,
        enable_kv_cache_events=True,
    )
    scheduler = make_scheduler(tiny_model, setup, "prefixkv")
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, PrefixKVCacheManager)
    assert type(manager.coordinator.single_type_managers[0].kv_cache_spec) is SlidingWindowSpec
    assert manager.kv_cache_event_metadata == (("sliding_window", 64),)
    assert manager.prefix_cache.sliding_window is None, "served as full attention"
    # A shorter window is served by a sliding-window cache that releases when told.
    short = make_scheduler(tiny_model, dataclasses.replace(setup, sliding_window=63), "prefixkv")
    cache = short.kv_cache_manager.prefix_cache
    assert (cache.sliding_window, cache.window_release) == (63, "explicit")
    # vLLM caches no block of a one-token window: refused by name.
    with pytest.raises(UnsupportedFeatureError, match="sliding_window=1"):
        make_scheduler(tiny_model, dataclasses.replace(setup, sliding_window=1), "prefixkv")


# -- what vLLM does with windows and hybrid layouts (the reasons for the refusals above) ------------
# If one of these starts failing after a vLLM upgrade, the refusals may be liftable (or need new
# reasons): docs/vllm.md, "Hybrid and sliding-window layouts", says what each one rests on.
def _schedule_one(scheduler: Any, spec: RequestSpec) -> list[tuple[list[int], ...]]:
    """Schedule `spec` alone step by step; the request's block ids per group after each
    `schedule()` (vLLM's null block is id 0)."""
    scheduler.add_request(make_request(spec, 4))
    tables = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        tables.append(scheduler.kv_cache_manager.get_block_ids(spec.request_id))
        scheduler.update_from_output(out, runner_output_for(scheduler, out))
    return tables


def test_vllm_sliding_window_frees_at_the_next_allocation(tiny_model: Path) -> None:
    """vLLM frees a block that left the window when it next allocates for the request (on the
    count of processed tokens); prefixkv's sliding cache at the commit that publishes it, which
    the manager makes at the allocation that schedules the tokens."""
    setup = SchedulerSetup(num_blocks=16, block_size=4, max_model_len=64, sliding_window=8)
    prompt = tuple(range(20))
    tables = _schedule_one(
        make_scheduler(tiny_model, setup, "stock"), RequestSpec("r", prompt, max_tokens=3)
    )
    nulls = [ids[0].count(0) for ids in tables]
    # Step 0 schedules all 20 prompt tokens into 5 blocks and frees nothing; step 1 (decoding
    # position 20) first frees the blocks wholly before 20 + 1 - 8 = 13: three.
    assert [len(ids[0]) for ids in tables] == [5, 6, 6]
    assert nulls == [0, 3, 3]

    cache = PrefixCache(15, block_size=4, sliding_window=8)
    cache.add_request("r", list(prompt))
    cache.allocate_slots("r", 20)
    cache.commit("r", 20)  # what the manager does at step 0's allocation, to publish
    assert cache.block_table("r").count(cache.null_block) == 3

    # With explicit release the core follows vLLM's schedule: step 0's commit publishes and
    # frees nothing; step 1 releases with vLLM's processed count (20) before allocating.
    explicit = PrefixCache(15, block_size=4, sliding_window=8, window_release="explicit")
    explicit.add_request("r", list(prompt))
    explicit.allocate_slots("r", 20)
    explicit.commit("r", 20)
    counts = [explicit.block_table("r").count(explicit.null_block)]
    explicit.append_tokens("r", [20])
    explicit.release_out_of_window("r", 20)
    explicit.allocate_slots("r", 1)
    explicit.commit("r", 21)
    counts.append(explicit.block_table("r").count(explicit.null_block))
    explicit.append_tokens("r", [21])
    explicit.release_out_of_window("r", 21)
    explicit.allocate_slots("r", 1)
    counts.append(explicit.block_table("r").count(explicit.null_block))
    assert counts == nulls
    assert len(explicit.block_table("r")) == len(tables[-1][0])


def test_vllm_hybrid_groups_share_one_pool(tiny_model: Path) -> None:
    """vLLM's KV cache groups take their blocks from one pool: one id space (a block id is
    held by one group at a time, the KV tensors being shared by a layer of each group) and one
    free count. prefixkv's GroupedPrefixCache has a pool per group."""
    setup = SchedulerSetup(num_blocks=16, block_size=4, max_model_len=64, hybrid_windows=(8,))
    scheduler = make_scheduler(tiny_model, setup, "stock")
    spec = RequestSpec("r", tuple(range(20)), max_tokens=1)
    scheduler.add_request(make_request(spec, 4))
    scheduler.schedule()
    full, window = scheduler.kv_cache_manager.get_block_ids("r")
    assert len(full) == len(window) == 5
    assert not set(full) & set(window)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15 - 10


def test_spec_subclasses_refused_by_name() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SinkLike(FullAttentionSpec):
        pass

    spec = SinkLike(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32)
    with pytest.raises(UnsupportedFeatureError, match="SinkLike"):
        _manager(kv_cache_config=_config(spec))


def test_connector_only_calls_refused(tiny_model: Path) -> None:
    scheduler = make_scheduler(tiny_model, SchedulerSetup(num_blocks=16, block_size=4), "prefixkv")
    manager = scheduler.kv_cache_manager
    request = make_request(RequestSpec("r", tuple(range(10)), max_tokens=1), 4)
    with pytest.raises(UnsupportedFeatureError, match="external computed tokens"):
        manager.allocate_slots(request, 4, num_external_computed_tokens=4)
    with pytest.raises(UnsupportedFeatureError, match="pop_blocks_for_free"):
        manager.pop_blocks_for_free(request)
    with pytest.raises(UnsupportedFeatureError, match="free_blocks"):
        manager.block_pool.free_blocks([])
    # Nothing was taken by the refused calls.
    assert manager.block_pool.get_num_free_blocks() == 15


# -- block ids ----------------------------------------------------------------------------------
def test_block_ids_both_ways() -> None:
    ids = BlockIds(8)
    # prefixkv's 0..6 are vLLM's 1..7; prefixkv's null block (7, one past its pool) is vLLM's 0.
    assert [b.block_id for b in ids.to_vllm([0, 3, 6, 7])] == [1, 4, 7, 0]
    assert ids.to_vllm([7])[0].is_null and ids.null_block.block_id == 0
    assert not any(b.is_null for b in ids.blocks[1:])


def test_tables_never_hold_the_null_block(tiny_model: Path) -> None:
    setup = SchedulerSetup(num_blocks=12, block_size=4, max_num_seqs=3)
    scheduler = make_scheduler(tiny_model, setup, "prefixkv")
    seen: set[int] = set()
    original = scheduler.kv_cache_manager.allocate_slots

    def spy(*args: object, **kwargs: object) -> object:
        blocks = original(*args, **kwargs)
        if blocks is not None:
            seen.update(blocks.get_block_ids()[0])
        return blocks

    scheduler.kv_cache_manager.allocate_slots = spy
    workload = Workload(
        requests=tuple(RequestSpec(f"r{i}", tuple(range(i, i + 9)), max_tokens=6) for i in range(4))
    )
    drive(scheduler, workload, setup.block_size)
    assert seen and 0 not in seen and max(seen) <= 11


# -- the cache context ---------------------------------------------------------------------------
def test_fingerprint_names_the_model(tiny_model: Path) -> None:
    setup = SchedulerSetup(num_blocks=16, block_size=4)
    config = make_scheduler(tiny_model, setup, "stock").vllm_config
    base = vllm_cache_context(config, 4).fingerprint()
    assert vllm_cache_context(config, 8).fingerprint() != base
    config.cache_config.cache_dtype = "fp8"
    assert vllm_cache_context(config, 4).fingerprint() != base
    config.cache_config.cache_dtype = "auto"
    config.model_config.hf_config.num_hidden_layers += 1
    assert vllm_cache_context(config, 4).fingerprint() != base
    config.model_config.hf_config.num_hidden_layers -= 1
    config.model_config.revision = "v2"
    assert vllm_cache_context(config, 4).fingerprint() != base
    config.model_config.revision = None
    assert vllm_cache_context(config, 4).fingerprint() == base


def test_length_dependent_rope_refused(tiny_model: Path) -> None:
    config = make_scheduler(
        tiny_model, SchedulerSetup(num_blocks=16, block_size=4), "stock"
    ).vllm_config
    config.model_config.hf_config.rope_parameters = {
        "rope_type": "dynamic",
        "factor": 2.0,
        "rope_theta": 10000.0,
    }
    assert not vllm_cache_context(config, 4).reuse_is_safe


# -- events ---------------------------------------------------------------------------------
@pytest.mark.parametrize("core", ["blocks", "runs"])
def test_events_in_vllms_types(tiny_model: Path, core: str) -> None:
    setup = SchedulerSetup(num_blocks=16, block_size=4, enable_kv_cache_events=True, core=core)
    scheduler = make_scheduler(tiny_model, setup, "prefixkv")
    # vLLM's scheduler takes the events every step and hands them to its publisher.
    published: list[object] = []
    scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    workload = Workload(requests=(RequestSpec("a", tuple(range(9)), max_tokens=1),))
    drive(scheduler, workload, setup.block_size)
    events = published
    stored = [e for e in events if isinstance(e, BlockStored)]
    # One event for the two full blocks published together, chained from the root, as vLLM's.
    assert len(stored) == 1
    (event,) = stored
    assert list(event.token_ids) == list(range(8)) and len(event.block_hashes) == 2
    assert event.parent_block_hash is None
    assert (event.block_size, event.group_idx, event.kv_cache_spec_kind) == (4, 0, "full_attention")
    assert scheduler.kv_cache_manager.take_events() == []
    assert scheduler.reset_prefix_cache()
    assert any(isinstance(e, AllBlocksCleared) for e in scheduler.kv_cache_manager.take_events())


def test_hybrid_hit_is_the_fixed_point_over_groups() -> None:
    """vLLM's `find_longest_cache_hit` across groups: the cap falls to each group's answer until
    a whole pass keeps it. Here the full group caches blocks 0-3, the 8-token window (two
    blocks for a hit) blocks 2-3 and the 5-token window (one block) blocks 0-2. One pass gives
    16, 16, then 12; at 12 the 8-token window needs blocks 1-2 (block 1 is missing) and its
    leading run is empty, so the hit is 0. A single pass answered 12."""
    config = _config(_full(), _window(8), _window(5), num_blocks=32)
    manager = _manager(kv_cache_config=config)
    assert isinstance(manager, HybridPrefixKVCacheManager)
    cache = manager.prefix_cache
    request = make_request(RequestSpec("probe", tuple(range(17)), max_tokens=1), 4)
    tokens = list(range(17))

    def publish(group: int, window: int, processed: int, upto: int) -> None:
        # A lane request publishing blocks below `upto`, less the ones a window of `window`
        # released once `processed` tokens were computed (released before their commit).
        seed = f"seed\x1f{group}"
        cache.add_request(seed, tokens, extras=hybrid._lane_extras(request, group))
        cache.set_request_window(seed, window)
        cache.allocate_slots(seed, 16)
        cache.release_out_of_window(seed, processed)
        cache.commit(seed, upto)
        cache.finish(seed)

    publish(0, 257, 0, 16)  # full: blocks 0-3
    publish(1, 2, 9, 16)  # 8-token window: blocks 2-3
    publish(2, 257, 0, 12)  # 5-token window: blocks 0-2
    window_8 = manager._lanes[1].window
    assert (
        cache.lookup_in_window(
            tokens, window_8, extras=hybrid._lane_extras(request, 1)
        ).num_cached_tokens
        == 16
    )
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert hit == 0
    assert blocks.blocks == ((), (), ())
