"""vLLM's own scheduler over prefixkv's block manager schedules exactly as over vLLM's.

Each example draws a scheduler setup (block size, a small pool, batch budget, watermark,
speculative tokens) and a workload (requests sharing prefixes, arriving together or apart, with
and without cache salts), runs it through vLLM's real `Scheduler` twice, once with vLLM's
`KVCacheManager` and once with `PrefixKVCacheManager`, with the same fake model runner
(`harness.py`), and requires the two runs to agree on every step: the requests scheduled and
their token counts, new versus running, preemptions, draft tokens, each request's computed and
cached tokens and block ids per group, free blocks, usage and vLLM's prefix-cache stats.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

from tests.vllm.harness import (
    VOCAB,
    RequestSpec,
    SchedulerSetup,
    StepRecord,
    Workload,
    drive,
    make_scheduler,
    model_token,
)


@st.composite
def setups(
    draw: st.DrawFn,
    *,
    spec_decode: bool | None = None,
    async_scheduling: bool | None = False,
    covering_window: bool = False,
    short_window: bool = False,
    hybrid: bool = False,
) -> SchedulerSetup:
    block_size = draw(st.sampled_from([4, 8, 16]))
    # A hybrid layout (issue 22): besides the first group, sliding groups of one window
    # (gpt-oss: one; Gemma 3: several) or of two, short or covering the context.
    windows = st.sampled_from([2, 5, 8, 17, 32, 64, 512, 1000])
    hybrid_windows: tuple[int, ...] = ()
    if hybrid:
        shape = draw(st.sampled_from(["one", "same", "two"]))
        first = draw(windows)
        hybrid_windows = {
            "one": (first,),
            "same": (first,) * draw(st.integers(2, 3)),
            "two": (first, draw(windows)),
        }[shape]
    # Each group takes its own blocks of the one pool: scale it so requests fit.
    groups = 1 + len(hybrid_windows)
    if spec_decode is None:
        spec_decode = draw(st.booleans())
    if async_scheduling is None:
        async_scheduling = draw(st.booleans())
    return SchedulerSetup(
        # Hybrid pools start smaller: evictions across groups need pressure.
        num_blocks=draw(st.integers(6 if hybrid else 10, 40)) * groups,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([32, 64, 128, 512])),
        max_model_len=512,
        num_speculative_tokens=draw(st.integers(1, 3)) if spec_decode else 0,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        async_scheduling=async_scheduling,
        # A sliding-window group whose window covers max_model_len (the only one served).
        sliding_window=(
            draw(st.sampled_from([512, 513, 1000]))
            if covering_window
            # A window shorter than the context: blocks leave it as requests advance.
            else draw(st.sampled_from([2, 5, 8, 17, 32, 64]))
            if short_window or (hybrid and draw(st.integers(0, 3)) == 0)
            else None
        ),
        hybrid_windows=hybrid_windows,
    )


@st.composite
def workloads(draw: st.DrawFn, setup: SchedulerSetup) -> Workload:
    # A few shared prefixes (system prompts, few-shot examples) that prompts start from, so
    # requests hit each other's blocks, in the same step and later.
    tokens = st.integers(0, VOCAB - 1)
    prefixes = draw(
        st.lists(
            st.lists(tokens, min_size=2 * setup.block_size, max_size=4 * setup.block_size),
            min_size=1,
            max_size=3,
        )
    )
    # Keep each request within half the pool, so every one can run (vLLM would hold a request
    # that can never fit in the queue forever, in both runs alike).
    budget = (setup.num_blocks - 1) // (1 + len(setup.hybrid_windows)) * setup.block_size // 2
    specs = []
    for i in range(draw(st.integers(2, 8))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(tokens, min_size=0, max_size=24))
        prompt = (prefix + suffix)[: max(budget - 24, 1)]
        if draw(st.booleans()):
            # Whole blocks (with an empty suffix, a prompt other requests repeat): a full hit,
            # whose recomputed last block deduplicates against the cached one
            # (`test_full_hit_dedup_divergence`).
            prompt = prompt[: len(prompt) // setup.block_size * setup.block_size] or prompt
        if specs and draw(st.integers(0, 3)) == 0:
            # An earlier request's prompt again: a full hit once that one is cached (whole
            # blocks: its recomputed last block is a second copy, kept as vLLM keeps it), or,
            # arriving in the same step, two requests computing the same blocks at once.
            prompt = list(draw(st.sampled_from(specs)).prompt)
        specs.append(
            RequestSpec(
                request_id=f"r{i}",
                prompt=tuple(prompt),
                max_tokens=draw(st.integers(1, min(40, budget - len(prompt)))),
                arrival_step=draw(st.sampled_from([0, 0, 1, 2, 5])),
                cache_salt=draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
            )
        )
    return Workload(requests=tuple(specs), draft_accuracy=draw(st.sampled_from([0, 500, 1000])))


def _compare(tiny_model: Path, setup: SchedulerSetup, workload: Workload) -> list[StepRecord]:
    stock = drive(make_scheduler(tiny_model, setup, "stock"), workload, setup.block_size)
    ours_scheduler = make_scheduler(tiny_model, setup, "prefixkv")
    ours = drive(ours_scheduler, workload, setup.block_size)
    assert len(stock) == len(ours), "the runs took a different number of steps"
    for step, (want, got) in enumerate(zip(stock, ours, strict=True)):
        assert got == want, f"step {step} differs:\nstock    {want}\nprefixkv {got}"
    ours_scheduler.kv_cache_manager.prefix_cache.check_invariants()
    return ours


def _overlaps(record: StepRecord) -> bool:
    """A request of this step still had an earlier step in flight when it was scheduled."""
    return any(record.in_flight[rid] > n for rid, n in record.scheduled.items())


def _record_events(ours: list[StepRecord], workload: Workload) -> None:
    """What the example exercised (pytest --hypothesis-show-statistics)."""
    event(f"preemptions: {any(s.preempted for s in ours)}")
    event(f"prefix hits: {any(n for s in ours for n, _ in s.num_cached_tokens.values())}")
    prompts = [spec.prompt for spec in workload.requests]
    event(f"repeated prompts: {len(prompts) > len(set(prompts))}")
    prefill_steps: dict[str, int] = {}
    for record in ours:
        for rid, n in record.scheduled.items():
            if n > 1 + len(record.spec_tokens.get(rid, ())):
                prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
    event(f"prefill over several steps: {any(n > 1 for n in prefill_steps.values())}")
    event(f"drafts scheduled: {any(s.spec_tokens for s in ours)}")
    event(f"steps overlapped: {any(_overlaps(s) for s in ours)}")
    event(f"unfinished at max_steps: {sum(len(s.finished) for s in ours) < len(workload.requests)}")


@given(data=st.data())
def test_schedules_match_stock(tiny_model: Path, data: st.DataObject) -> None:
    setup = data.draw(setups())
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_spec_decode_schedules_match_stock(tiny_model: Path, data: st.DataObject) -> None:
    setup = data.draw(setups(spec_decode=True))
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_async_scheduler_schedules_match_stock(tiny_model: Path, data: st.DataObject) -> None:
    """vLLM's AsyncScheduler with two steps in flight, as its EngineCore runs it
    (`step_with_batch_queue`): step N+1 is scheduled, with placeholders for the tokens step N
    has not sampled yet (and, with speculative decoding, for drafts proposed on the worker),
    before step N's output is applied. Both managers must agree on every step."""
    setup = data.draw(setups(async_scheduling=True))
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_block_core_schedules_match_stock(tiny_model: Path, data: st.DataObject) -> None:
    """The same comparison with prefixkv's block core (``additional_config={"prefixkv":
    {"core": "blocks"}}``) where the default ("auto") picks the run core: drafts or not, async
    or not, a window covering the context or full attention; every step as vLLM's, free
    blocks and usage included."""
    setup = data.draw(
        setups(spec_decode=None, async_scheduling=None, covering_window=data.draw(st.booleans()))
    )
    setup = replace(setup, core="blocks")
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_window_covering_the_context_matches_stock(tiny_model: Path, data: st.DataObject) -> None:
    """A `SlidingWindowSpec` group whose window is at least max_model_len (a model served with
    a context no longer than its window): vLLM's `SlidingWindowManager` and prefixkv's manager
    agree on every step, synchronous or async, with and without drafts."""
    setup = data.draw(setups(spec_decode=None, async_scheduling=None, covering_window=True))
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_short_window_matches_stock(tiny_model: Path, data: st.DataObject) -> None:
    """A `SlidingWindowSpec` group whose window is shorter than the context (issue 22): the
    core publishes at allocation and releases out-of-window blocks only where vLLM's
    `remove_skipped_blocks` frees them (`window_release="explicit"`), so both managers agree
    on every step, synchronous or async, with and without drafts."""
    setup = data.draw(setups(spec_decode=None, async_scheduling=None, short_window=True))
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


@given(data=st.data())
def test_hybrid_layout_matches_stock(tiny_model: Path, data: st.DataObject) -> None:
    """A hybrid layout (issue 22): a full-attention group (or a short window) beside sliding
    groups of one or two windows, all in one block pool, against vLLM's
    `HybridKVCacheCoordinator`: one lane per group in one prefixkv cache agrees on every step,
    synchronous or async, with and without drafts, salts and preemption under small pools."""
    setup = data.draw(setups(spec_decode=None, async_scheduling=None, hybrid=True))
    workload = data.draw(workloads(setup))
    note(f"{setup=}\n{workload=}")
    _record_events(_compare(tiny_model, setup, workload), workload)


def test_hybrid_hits_referenced_before_any_group_allocates(tiny_model: Path) -> None:
    """A request whose hit is cached in both groups and whose new blocks must come from
    eviction: vLLM touches every group's hit blocks before allocating any group's new ones, so
    the full group's new blocks evict the next cached blocks, not the sliding group's hit. Here
    "a" leaves its prompt's blocks in both groups at the head of the eviction order (full
    group's first, as vLLM frees group by group), "d" fills the rest of the pool with cached
    blocks, and "b" hits "a"'s prompt. Allocating group by group, the full group's new block
    evicted the sliding group's hit, and "b"'s sliding lane then matched less than vLLM's hit
    (an `InvalidInputError` at its commit)."""
    setup = SchedulerSetup(
        num_blocks=17, block_size=4, max_num_seqs=1, max_model_len=512, hybrid_windows=(8,)
    )
    prompt = tuple(range(8))
    other = tuple(range(20, 44))
    workload = Workload(
        requests=(
            RequestSpec("a", prompt, max_tokens=1),
            RequestSpec("d", other, max_tokens=1, arrival_step=2),
            RequestSpec("b", (*prompt, 50, 51, 52, 53), max_tokens=1, arrival_step=4),
            RequestSpec("e", (*other, 60), max_tokens=1, arrival_step=6),
        )
    )
    ours = _compare(tiny_model, setup, workload)
    cached = {rid: n for s in ours for rid, (n, _) in s.num_cached_tokens.items()}
    assert cached["b"] == 8, "b hit a's prompt in both groups"
    # b's two new blocks evicted d's last two full-group blocks: e re-hits 4 of d's 6.
    assert cached["e"] == 16


def test_short_window_preempted_request_rehits_its_blocks(tiny_model: Path) -> None:
    """Found by hypothesis (ci profile, seed 1): r4 is preempted at step 9 holding its two
    cached blocks and a partial one. vLLM 0.32 puts the partial block (no hash) at the head of
    its free queue and the cached ones at the tail, so r2, r3 and r0 then take the partial
    block and older blocks, and r4 re-hits 8 tokens. prefixkv queued uncached blocks behind
    cached ones, r0 took r4's second block, and r4 re-hit 4 (step 12's prefix stats)."""
    setup = SchedulerSetup(
        num_blocks=15, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=512, async_scheduling=True, scheduler_reserve_full_isl=False,
        sliding_window=17,
    )  # fmt: skip
    tokens = {"r0": 14, "r1": 1, "r2": 12, "r3": 12, "r4": 8}
    requests = tuple(
        RequestSpec(rid, (0, 0, 0, 0), max_tokens=n, cache_salt=f"own-{rid}")
        for rid, n in tokens.items()
    )
    ours = _compare(tiny_model, setup, Workload(requests=requests, draft_accuracy=0))
    assert any("r4" in s.preempted for s in ours), "the case needs r4 preempted"


def test_short_window_cached_tokens_count_held_blocks_only(tiny_model: Path) -> None:
    """Found by hypothesis (ci profile, seed 3): r1's last prefill chunk starts at 33, so the
    allocation for it releases both of its full blocks (window 2) before the prefill ends.
    vLLM's `estimate_cached_tokens` reads the hashes of the blocks the request still holds
    (none: null blocks and a partial one) and reports no cache-creation tokens; prefixkv's
    manager reported its 32 published tokens."""
    setup = SchedulerSetup(
        num_blocks=16, block_size=16, max_num_seqs=2, max_num_batched_tokens=32,
        max_model_len=512, scheduler_reserve_full_isl=False, sliding_window=2,
    )  # fmt: skip
    workload = Workload(
        requests=(
            RequestSpec("r0", tuple(range(30)), max_tokens=4),
            RequestSpec("r1", tuple(range(100, 139)), max_tokens=2),
        )
    )
    ours = _compare(tiny_model, setup, workload)
    created = {rid: c for s in ours for rid, (_, c) in s.num_cached_tokens.items()}
    assert created["r1"] == 0


def test_short_window_releases_verified_drafts_before_caching_them(tiny_model: Path) -> None:
    """Found by hypothesis (window 3, one draft per step): vLLM's processed count at an
    allocation includes the drafts it verified last step, which it caches only at the end of
    that allocation, so `remove_skipped_blocks` frees blocks of them it never caches. The
    manager capped the count at what it had committed and released a block later than vLLM,
    which then counted one free block more (step 5)."""
    setup = SchedulerSetup(
        num_blocks=17, block_size=4, max_num_seqs=1, max_num_batched_tokens=32,
        max_model_len=512, num_speculative_tokens=1, scheduler_reserve_full_isl=False,
        sliding_window=3,
    )  # fmt: skip
    workload = Workload(requests=(RequestSpec("r0", (0,) * 8, max_tokens=8),), draft_accuracy=500)
    ours = _compare(tiny_model, setup, workload)
    assert any(s.spec_tokens for s in ours)


def test_short_window_keeps_duplicate_copies_cached(tiny_model: Path) -> None:
    """Found by hypothesis (seed 1, ci profile): six requests of one whole-block prompt each
    compute their own copy of its block; vLLM keeps every copy cached under the hash, and
    prefixkv's sliding cache freed all but the canonical one at release. Once that one was
    evicted, the preempted r0 hit 4 tokens in vLLM and none here (step 14). Sliding caches now
    keep a request's own copy as a duplicate (`request/publish.rs`), as full attention does."""
    setup = SchedulerSetup(
        num_blocks=15, block_size=4, max_num_seqs=4, max_num_batched_tokens=32,
        max_model_len=512, scheduler_reserve_full_isl=False, sliding_window=17,
    )  # fmt: skip
    prompt = (0, 0, 0, 0)
    tokens = {"r0": 6, "r1": 1, "r2": 12, "r3": 12, "r4": 1, "r5": 11}
    requests = tuple(
        RequestSpec(rid, prompt, max_tokens=n, arrival_step=5 if rid == "r0" else 0)
        for rid, n in tokens.items()
    )
    _compare(tiny_model, setup, Workload(requests=requests, draft_accuracy=0))


def _duplicate_setup(sliding_window: int | None) -> SchedulerSetup:
    return SchedulerSetup(
        num_blocks=16,
        block_size=8,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        max_model_len=512,
        sliding_window=sliding_window,
    )


#: Found by hypothesis on the covering-window test; full attention diverges the same way. r6
#: caches tenant-a's blocks A0 A1 and finishes (A1 joins vLLM's free queue early); r2's prompt
#: is A0 A1 exactly, so it hits A0 and recomputes A1 as a duplicate. At step 22 vLLM evicts A1
#: for r3's new block (it was released before r0's blocks); prefixkv evicted one of r0's instead,
#: so at step 23 r4 (tenant-a) hit A1's canonical copy off the free list: 5 free blocks, not 6.
_DUPLICATE_WORKLOAD = Workload(
    requests=(
        RequestSpec("r0", (0,) * 17, max_tokens=21),
        RequestSpec("r1", (0,) * 17, max_tokens=23, arrival_step=1),
        RequestSpec("r2", (0,) * 16, max_tokens=4, arrival_step=1, cache_salt="tenant-a"),
        RequestSpec("r3", (0,) * 17, max_tokens=1, arrival_step=1),
        RequestSpec("r4", (0,) * 17, max_tokens=1, arrival_step=1, cache_salt="tenant-a"),
        RequestSpec("r5", (0,) * 17, max_tokens=21, cache_salt="tenant-b"),
        RequestSpec("r6", (0,) * 17, max_tokens=1, cache_salt="tenant-a"),
    )
)


@pytest.mark.parametrize("sliding_window", [None, 512], ids=["full", "covering-window"])
def test_canonical_copy_of_a_duplicate_evicted_in_release_order(
    tiny_model: Path, sliding_window: int | None
) -> None:
    """Found on the covering-window test: stock vLLM's `SlidingWindowManager` and
    `FullAttentionManager` give this workload the same schedule (hits, free counts), and
    prefixkv diverged from both at step 23: committing r2's duplicate touched the canonical
    copy A1 (moving it behind r0's blocks in the LRU order), where vLLM leaves it at its
    release position and evicts it first."""
    _compare(tiny_model, _duplicate_setup(sliding_window), _DUPLICATE_WORKLOAD)


def test_stock_window_covering_the_context_schedules_as_full_attention(tiny_model: Path) -> None:
    """Stock vLLM's own schedules for the duplicate workload agree between a covering window
    and full attention (so prefixkv's divergence on it is not a sliding-window mapping)."""
    full = drive(
        make_scheduler(tiny_model, _duplicate_setup(None), "stock"), _DUPLICATE_WORKLOAD, 8
    )
    window = drive(
        make_scheduler(tiny_model, _duplicate_setup(512), "stock"), _DUPLICATE_WORKLOAD, 8
    )
    assert window == full


def test_core_evicts_a_duplicated_canonical_copy_in_release_order() -> None:
    """The core alone: x's blocks are released before y's; z recomputes x's second block as a
    duplicate. vLLM's free queue then evicts x's second block first (released earliest, and not
    referenced). The core evicted y's instead: committing z's copy touched x's second block,
    though z reads its own copy (`rust/core/src/request/publish.rs`)."""
    from prefixkv.cache import PrefixCache
    from prefixkv.context import CacheContext

    cache = PrefixCache(6, context=CacheContext(block_size=2, extra={"engine": "test"}))

    def run(rid: str, tokens: list[int], computed: int = 0) -> list[int]:
        cache.add_request(rid, tokens)
        cache.allocate_slots(rid, len(tokens) - computed)
        cache.commit(rid, len(tokens))
        return cache.block_table(rid)

    x = run("x", [1] * 5)
    cache.finish("x")
    run("y", [2] * 5)
    cache.finish("y")
    assert cache.lookup([1] * 4).num_cached_tokens == 2  # the full hit recomputes x's 2nd block
    z = run("z", [1] * 4, computed=2)
    assert z[1] != x[1], "z holds its own copy of x's second block"
    w = run("w", [3] * 4)
    assert x[1] in w, "x's second block, released first, is taken first"
    assert not set(w) & set(x[:1] + z), "nothing held is taken"
    # Its content stays cached in z's copy (the entry moved, as vLLM keeps z's block under the
    # hash): a lookup still matches both blocks, the second in z's copy.
    assert cache.lookup([1] * 5).block_ids == [x[0], z[1]]
    cache.check_invariants()


def test_canonical_copy_evicted_before_a_finished_duplicates_successor(tiny_model: Path) -> None:
    """r1 is a full hit on r0's prompt P (two blocks): it recomputes P's second block B1 into
    its own copy and decodes a third block C on it. r2 then needs two blocks more than the free
    ones: vLLM takes r0's B1 (released first; the hash stays cached in r1's copy) and r1's
    partial block, so r3 (P, C's tokens, one more) hits 12 tokens. prefixkv used to hand C to
    B1 at r1's finish, so B1 waited for C, C went instead and r3 hit 8; now r1's copy keeps C
    as a spare (rust/core/src/pool.rs) and B1 goes first."""
    prompt = (1, 2, 3, 4, 5, 6, 7, 8)
    decoded = tuple(model_token("r1", position) for position in range(8, 12))
    setup = SchedulerSetup(num_blocks=16, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    workload = Workload(
        requests=(
            RequestSpec("r0", prompt, max_tokens=1),
            RequestSpec("r1", prompt, max_tokens=6, arrival_step=2),
            RequestSpec("r2", tuple(40 + i % 20 for i in range(48)), 1, arrival_step=12),
            RequestSpec("r3", (*prompt, *decoded, 9), max_tokens=1, arrival_step=18),
        )
    )
    _compare(tiny_model, setup, workload)


#: Found by the CI profile (seed 15133524906804359150) on the change that made a released
#: duplicate keep its decoded successor: seven requests with one two-block prompt arrive
#: together, so the later ones compute copies of the first one's blocks in the same step and
#: decode on them. Once one of them finishes, its copy of the prompt's last block is free in
#: vLLM (its hash stays cached in the original, which a running request holds), while prefixkv
#: counted it blocked above its decoded successor, which that running request had reached
#: through the original: at step 20 it preempted r6 where vLLM scheduled it.
_TWIN_PROMPT = (0,) * 16


@pytest.mark.parametrize(
    ("num_blocks", "max_num_seqs", "max_tokens"),
    [(13, 4, (22, 21, 1, 1, 1, 1, 18)), (12, 3, (18, 18, 1, 1, 1, 1, 13))],
)
def test_a_spare_copy_is_free_while_its_successor_is_held(
    tiny_model: Path, num_blocks: int, max_num_seqs: int, max_tokens: tuple[int, ...]
) -> None:
    setup = SchedulerSetup(
        num_blocks=num_blocks,
        block_size=8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=32,
        num_speculative_tokens=1,
        scheduler_reserve_full_isl=False,
    )
    workload = Workload(
        requests=tuple(
            RequestSpec(f"r{i}", _TWIN_PROMPT, max_tokens=n) for i, n in enumerate(max_tokens)
        ),
        draft_accuracy=0,
    )
    _compare(tiny_model, setup, workload)


def test_async_steps_overlap(tiny_model: Path) -> None:
    """The harness keeps two steps in flight under async scheduling: a decoding request is
    scheduled again before its previous step's token is applied (its in-flight tokens exceed
    the step's), its placeholder is computed as lookahead, and both managers agree."""
    setup = SchedulerSetup(num_blocks=24, block_size=4, max_num_seqs=2, async_scheduling=True)
    prefix = tuple(range(9))
    workload = Workload(
        requests=(
            RequestSpec("a", (*prefix, 40), max_tokens=9),
            RequestSpec("b", (*prefix, 50, 51), max_tokens=7, arrival_step=1),
        )
    )
    ours = _compare(tiny_model, setup, workload)
    overlapped = [s for s in ours if _overlaps(s)]
    assert len(overlapped) >= 8, "decode steps should be scheduled with one step in flight"
    # Each request generated all its tokens (placeholders were resolved, none lost).
    finished = [rid for s in ours for rid in s.finished]
    assert sorted(finished) == ["a", "b"]
    # b arrived while a's first step was in flight and hit a's published prefix blocks.
    cached = {rid: n for s in ours for rid, (n, _) in s.num_cached_tokens.items()}
    assert cached == {"a": 0, "b": 8}


def test_async_spec_decode_overlap(tiny_model: Path) -> None:
    """Async scheduling with speculative decoding: drafts are placeholders proposed on the
    worker, some accepted and some rejected while the next step is already scheduled."""
    setup = SchedulerSetup(
        num_blocks=32, block_size=4, max_num_seqs=3, async_scheduling=True, num_speculative_tokens=2
    )
    workload = Workload(
        requests=tuple(
            RequestSpec(f"r{i}", tuple(range(i, i + 11)), max_tokens=12, arrival_step=i)
            for i in range(3)
        ),
        draft_accuracy=500,
    )
    ours = _compare(tiny_model, setup, workload)
    assert any(_overlaps(s) and s.spec_tokens for s in ours)
    assert sorted(rid for s in ours for rid in s.finished) == ["r0", "r1", "r2"]


def test_failed_allocation_publishes_nothing(tiny_model: Path) -> None:
    """A running request whose drafts were verified last step, then fails to get room this step
    (and is preempted), has not had those tokens' blocks cached by vLLM: vLLM caches them only
    at the end of a successful allocation. prefixkv must not publish them either, or the
    request's re-admission hits one block more than under vLLM (found by hypothesis, async
    scheduling with drafts: r2's preempted hit was 24 tokens instead of 20)."""
    setup = SchedulerSetup(
        num_blocks=30,
        block_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=64,
        num_speculative_tokens=2,
        async_scheduling=True,
        scheduler_reserve_full_isl=False,
    )
    shared = (0, 24, 29) + (0,) * 13
    workload = Workload(
        requests=(
            RequestSpec("r0", (*shared, *(0,) * 7), 33, cache_salt="tenant-a"),
            RequestSpec("r1", (*shared, 0), 1),
            RequestSpec("r2", (*shared, 0), 10, arrival_step=5),
            RequestSpec("r3", (*shared, *(0,) * 18), 19),
            RequestSpec("r4", (*shared, 0), 1),
            RequestSpec("r5", (*shared, 1, 1, 1, *(0,) * 6), 12, arrival_step=2),
        ),
        draft_accuracy=0,
    )
    ours = _compare(tiny_model, setup, workload)
    assert any("r2" in s.preempted for s in ours), "r2 should be preempted"


def test_scheduler_cls_picks_async(tiny_model: Path) -> None:
    """One setting serves both: `Scheduler` builds prefixkv's AsyncScheduler when the config
    asks for async scheduling, vLLM's default where the platform supports it."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler

    from prefixkv.integrations.vllm import PrefixKVCacheManager

    scheduler = make_scheduler(tiny_model, SchedulerSetup(async_scheduling=True), "prefixkv")
    assert isinstance(scheduler, VllmAsyncScheduler)
    assert isinstance(scheduler.kv_cache_manager, PrefixKVCacheManager)
    sync = make_scheduler(tiny_model, SchedulerSetup(), "prefixkv")
    assert not isinstance(sync, VllmAsyncScheduler)
    assert isinstance(sync.kv_cache_manager, PrefixKVCacheManager)


def test_same_step_shared_prefix_hits(tiny_model: Path) -> None:
    """Two requests with one 3-block prefix arrive in the same step: the second hits the
    blocks the first is about to compute, as in vLLM (blocks are published at allocation)."""
    setup = SchedulerSetup(num_blocks=32, block_size=4, max_num_batched_tokens=256)
    prefix = tuple(range(12))
    workload = Workload(
        requests=(
            RequestSpec("a", (*prefix, 40, 41), max_tokens=2),
            RequestSpec("b", (*prefix, 50, 51), max_tokens=2),
        )
    )
    ours = drive(make_scheduler(tiny_model, setup, "prefixkv"), workload, setup.block_size)
    first = ours[0]
    assert first.new_request_ids == ["a", "b"]
    assert {rid: n for rid, (n, _) in first.num_cached_tokens.items()} == {"a": 0, "b": 12}
    assert first.scheduled == {"a": 14, "b": 2}
    _compare(tiny_model, setup, workload)


def test_preemption_under_a_small_pool(tiny_model: Path) -> None:
    """A pool too small for every running request to decode: vLLM preempts, the request
    resumes with its prefix hit from the blocks it published, and both managers agree."""
    setup = SchedulerSetup(num_blocks=10, block_size=4, max_num_seqs=4)
    workload = Workload(
        requests=tuple(
            RequestSpec(f"r{i}", tuple(range(i, i + 8)), max_tokens=10) for i in range(4)
        )
    )
    ours = drive(make_scheduler(tiny_model, setup, "prefixkv"), workload, setup.block_size)
    assert any(step.preempted for step in ours), "the workload should preempt"
    _compare(tiny_model, setup, workload)


def test_salts_isolate(tiny_model: Path) -> None:
    """Same prompt, different cache_salt: no hit across salts, a hit within one."""
    setup = SchedulerSetup(num_blocks=32, block_size=4)
    prompt = tuple(range(17))
    workload = Workload(
        requests=(
            RequestSpec("a", prompt, max_tokens=1, cache_salt="x"),
            RequestSpec("b", prompt, max_tokens=1, arrival_step=3, cache_salt="y"),
            RequestSpec("c", prompt, max_tokens=1, arrival_step=6, cache_salt="x"),
        )
    )
    ours = drive(make_scheduler(tiny_model, setup, "prefixkv"), workload, setup.block_size)
    cached = {rid: n for step in ours for rid, (n, _) in step.num_cached_tokens.items()}
    assert cached == {"a": 0, "b": 0, "c": 16}
    _compare(tiny_model, setup, workload)


def test_watermark_holds_admissions_back(tiny_model: Path) -> None:
    """With a watermark, vLLM admits a waiting request only if the pool keeps that many
    blocks free afterwards; prefixkv's manager holds the same requests back."""
    workload = Workload(
        requests=tuple(
            RequestSpec(f"r{i}", tuple(range(10 * i, 10 * i + 24)), max_tokens=12, arrival_step=i)
            for i in range(3)
        )
    )
    plain = SchedulerSetup(num_blocks=20, block_size=4, max_num_seqs=4)
    held = SchedulerSetup(num_blocks=20, block_size=4, max_num_seqs=4, watermark=0.3)
    without = drive(make_scheduler(tiny_model, plain, "stock"), workload, plain.block_size)
    with_watermark = drive(make_scheduler(tiny_model, held, "stock"), workload, held.block_size)
    assert [s.scheduled for s in without] != [s.scheduled for s in with_watermark]
    _compare(tiny_model, held, workload)


def test_full_hit_dedup_divergence(tiny_model: Path) -> None:
    """Issue 22: after a full prompt hit the request's recomputed last block is a private
    duplicate of the cached one. prefixkv chained the request's later blocks on the cached
    original and never evicted a block with a held descendant, so once the original's holder
    finished, vLLM counted it free and allocated where prefixkv preempted. Now the later blocks
    chain on the request's own copy, and evicting the original moves its entry into that copy
    (`rust/core/src/pool.rs`)."""
    setup = SchedulerSetup(
        num_blocks=21,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        scheduler_reserve_full_isl=False,
        async_scheduling=True,
    )
    prompt = (0, 0, 0, 0, 0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0)
    workload = Workload(
        requests=(
            RequestSpec("r0", prompt, 4),
            RequestSpec("r1", prompt, 6, arrival_step=1),
            RequestSpec("r2", prompt, 10),
            RequestSpec("r3", prompt, 10),
            RequestSpec("r4", prompt, 9, cache_salt="tenant-a"),
        )
    )
    _compare(tiny_model, setup, workload)


def test_verified_drafts_are_cached_only_when_the_allocation_succeeds(tiny_model: Path) -> None:
    """A draft verified at a block boundary fills the block. vLLM caches it at the request's
    next successful `allocate_slots`; prefixkv's manager committed it before allocating, so a
    request preempted in that step (its allocation failed) left the block cached, and its
    resumption hit one block more than vLLM's (found by the CI profile once the random
    workloads drew prompts of whole blocks)."""
    setup = SchedulerSetup(
        num_blocks=10,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        num_speculative_tokens=1,
    )
    prompt = tuple((7 * i + 3) % 61 for i in range(48))
    workload = Workload(
        requests=(
            RequestSpec("r0", prompt, 3, arrival_step=1),
            RequestSpec("r1", prompt, 19, cache_salt="tenant-a"),
            RequestSpec("r2", prompt, 13, arrival_step=1),
            RequestSpec("r3", prompt, 23),
            RequestSpec("r4", prompt, 1),
            RequestSpec("r5", prompt, 1),
            RequestSpec("r6", prompt, 1),
        ),
        draft_accuracy=1000,
    )
    ours = _compare(tiny_model, setup, workload)
    assert any(s.preempted for s in ours), "the case needs a preemption"
