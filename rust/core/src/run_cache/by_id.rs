//! The run cache as an engine calls it (`RunPrefixCache`): requests named by the engine's ids,
//! keys rooted in the execution context and a salt, token ids checked against the vocabulary,
//! the writer behind one lock so that threads share it, lookups lock-free beside it (a router
//! probing while the scheduler allocates: they read only the run table), and the counters
//! `CacheStats` reports.
//! [`crate::PrefixCache`]'s API where the run cache serves it (the request cycle and the step
//! API); what it does not serve yet is refused by the binding, by name.
//!
//! size: one type, the engine-facing API of the run cache by id: each method a few lines that
//! take the lock, find the request and call `RunCache`; splitting them would scatter one
//! object's surface (as `python/prefixkv/cache.py`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use super::{lookup_in, Held, Origin, RunCache, RunLookup, RunRequest, RunSlots};
use crate::cache::{block_extras, FullHit, Reset};
use crate::error::{CacheError, Result};
use crate::events::{EventConfig, EventCounters, EventDrain};
use crate::key::{block_key_with, run_root, BlockKey, RequestExtras};
use crate::pins::Pins;
use crate::pool::BlockId;
use crate::request::RequestId;
use crate::run_table::RunTable;
use crate::stats::CacheStats;
use crate::sync::Context;

/// Seeds the run table's index hashes (fixed: the index is private to a process).
const SEED: u64 = 0x7072_6566_6978_6b76;

/// The run cache and its live requests, by id, behind one lock (see the module docs).
pub struct RunPrefixCache {
    state: Mutex<State>,
    /// What lookups read without the writer's lock: the table and the context its blocks are
    /// keyed under (both replaced together by `reset`).
    reader: RwLock<(Arc<RunTable>, Context)>,
    /// Lookups, counted apart from the state (they do not take its lock).
    probes: AtomicU64,
    num_blocks: u32,
    block_size: usize,
    vocab_size: Option<u32>,
    /// How full hits are served (lookups shape theirs without the writer's lock).
    full_hit: FullHit,
}

struct State {
    cache: RunCache,
    requests: HashMap<RequestId, Live, foldhash::quality::RandomState>,
    /// Next id `begin` tries when given none.
    next_auto: i64,
    /// The context, with its unsalted root computed once (`sync::Context`).
    context: Context,
    counters: Counters,
    /// The live pins, each with the runs' ranges it pinned.
    pins: Pins<Vec<Held>>,
}

/// A live request (what its block keys chain from is its `Origin`).
struct Live {
    request: RunRequest,
    /// Its tenant salt, to key it again under a new context (`reset`).
    salt: Vec<u8>,
}

#[derive(Default)]
struct Counters {
    lookups: u64,
    lookup_tokens: u64,
    hit_tokens: u64,
    committed_blocks: u64,
    /// Evictions and copies of the caches `clear` replaced.
    evictions_before: u64,
    copies_before: u64,
}

impl RunPrefixCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens under `context`; token ids at or
    /// above `vocab_size` are refused; full hits served as `full_hit` says. Refused when the
    /// sizes are out of range or the metadata would take more than the cache's bound on memory
    /// allocated up front.
    pub fn new(
        num_blocks: u32,
        block_size: usize,
        context: BlockKey,
        vocab_size: Option<u32>,
        full_hit: FullHit,
    ) -> Result<Self> {
        // Refused by name before anything is reserved, as the block core refuses them; once,
        // here: a reset builds its fresh structure without reading the environment again.
        crate::cache::check_block_size(block_size)?;
        crate::hugepages::from_env().map_err(CacheError::InvalidInput)?;
        let cache = fresh(num_blocks, block_size, full_hit)?;
        Ok(Self {
            reader: RwLock::new((cache.shared_table(), Context::new(context))),
            probes: AtomicU64::new(0),
            state: Mutex::new(State {
                cache,
                requests: HashMap::default(),
                next_auto: 1,
                context: Context::new(context),
                counters: Counters::default(),
                pins: Pins::default(),
            }),
            num_blocks,
            block_size,
            vocab_size,
            full_hit,
        })
    }

    #[must_use]
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The lock. A panic inside the run cache is a bug, raised once as one; the state it left
    /// is not trusted after it, so every later call is refused.
    fn state(&self) -> Result<MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| poisoned())
    }

    /// Refuses token ids outside the vocabulary, by position.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(vocab) = self.vocab_size {
            if let Some((index, token)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab) {
                return Err(CacheError::InvalidInput(format!(
                    "token id {token} at position {index} is outside the vocabulary (size {vocab})"
                )));
            }
        }
        Ok(())
    }

    fn check_prompt(&self, tokens: &[u32]) -> Result<()> {
        self.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Err(CacheError::InvalidInput(
                "a request needs at least one token".into(),
            ));
        }
        Ok(())
    }

    /// The cached prefix of `tokens` under `salt`, without taking references: lock-free,
    /// beside the writer (its read lock is held only to clone the table's pointer).
    pub fn lookup(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> Result<RunLookup> {
        self.check_tokens(tokens)?;
        self.lookup_checked(tokens, salt, extras)
    }

    /// `lookup` of tokens that already passed `check_tokens` (a batch checks every prompt
    /// before its first lookup: `lookup_many`), not scanned again.
    pub fn lookup_checked(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<RunLookup> {
        let tags = extras.run_tags(0..tokens.len() / self.block_size, self.block_size);
        let (table, context) = {
            let reader = self.reader.read().map_err(|_| poisoned())?;
            (Arc::clone(&reader.0), reader.1)
        };
        self.probes.fetch_add(1, Ordering::Relaxed);
        let root = run_root(&context.root(salt), extras.adapter.as_deref());
        Ok(lookup_in(&table, &root, tokens, &tags, self.full_hit))
    }

    /// Pins the cached prefix of `tokens` (under `salt` and `extras`) so that eviction never
    /// takes it, as the core's `pin`: a pin id for `unpin`, and the blocks pinned.
    pub fn pin(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> Result<(u64, usize)> {
        self.check_tokens(tokens)?;
        let tags = extras.run_tags(0..tokens.len() / self.block_size, self.block_size);
        let mut guard = self.state()?;
        let state = &mut *guard;
        let root = run_root(&state.context.root(salt), extras.adapter.as_deref());
        let (held, count) = state.cache.pin(&root, tokens, &tags);
        Ok((state.pins.add(held), count))
    }

    /// Drops pin `pin_id`; `UnknownPin`, saying why, if it is not live (nothing changes then).
    pub fn unpin(&self, pin_id: u64) -> Result<()> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let held = state.pins.take(pin_id)?;
        state.cache.unpin(&held);
        Ok(())
    }

    /// Registers a request under the engine's id, waiting: no blocks, nothing matched.
    pub fn add_request(
        &self,
        id: RequestId,
        tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<()> {
        self.check_prompt(&tokens)?;
        let mut state = self.state()?;
        if state.requests.contains_key(&id) {
            return Err(CacheError::DuplicateRequest(id));
        }
        let live = state.live(tokens, salt, extras, priority);
        state.requests.insert(id, live);
        Ok(())
    }

    /// `add_request` and slots for the whole prompt in one step (`id` `None`: an unused int).
    /// Returns the id and the slots; refused with nothing changed.
    pub fn begin(
        &self,
        id: Option<RequestId>,
        tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<(RequestId, RunSlots)> {
        self.check_prompt(&tokens)?;
        let mut guard = self.state()?;
        let state = &mut *guard;
        if let Some(id) = &id {
            if state.requests.contains_key(id) {
                return Err(CacheError::DuplicateRequest(id.clone()));
            }
        }
        let mut live = state.live(tokens, salt, extras, priority);
        let slots = state.schedule(&mut live.request, None, 0, 0)?;
        let id = id.unwrap_or_else(|| state.auto_id());
        state.requests.insert(id.clone(), live);
        Ok((id, slots))
    }

    /// See [`RunCache::allocate_slots`].
    pub fn allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<RunSlots> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let request = get_mut(&mut state.requests, id)?;
        let was_waiting = !request.is_scheduled();
        let slots =
            state
                .cache
                .allocate_slots(request, num_new_tokens, num_lookahead_tokens, watermark)?;
        if was_waiting {
            state.counters.count_match(request, &slots);
        }
        Ok(slots)
    }

    /// `allocate_slots`, unless the call is large by `is_large(tokens)` (the tokens it covers:
    /// its new and lookahead ones, and a waiting request's whole prompt, which its match
    /// walks): then nothing changes and the answer is `Ok(None)`. For a caller that runs large
    /// calls elsewhere (the binding releases the GIL for them) and decides under the one lock
    /// the call takes. A refused call is refused here as by `allocate_slots`.
    pub fn allocate_slots_unless_large(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
        is_large: impl Fn(usize) -> bool,
    ) -> Result<Option<RunSlots>> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let request = get_mut(&mut state.requests, id)?;
        let waiting = !request.is_scheduled();
        if is_large(num_new_tokens.saturating_add(num_lookahead_tokens))
            || (waiting && is_large(request.num_tokens()))
        {
            return Ok(None);
        }
        let slots =
            state
                .cache
                .allocate_slots(request, num_new_tokens, num_lookahead_tokens, watermark)?;
        if waiting {
            state.counters.count_match(request, &slots);
        }
        Ok(Some(slots))
    }

    /// Whether `allocate_slots` would succeed now; changes nothing.
    pub fn can_allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<bool> {
        let state = self.state()?;
        let request = get(&state.requests, id)?;
        match state.cache.check_allocate_slots(
            request,
            num_new_tokens,
            num_lookahead_tokens,
            watermark,
        ) {
            Ok(()) => Ok(true),
            Err(CacheError::OutOfBlocks { .. }) => Ok(false),
            Err(other) => Err(other),
        }
    }

    /// See [`RunCache::blocks_needed`].
    pub fn blocks_needed(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<usize> {
        let state = self.state()?;
        state.cache.blocks_needed(
            get(&state.requests, id)?,
            num_new_tokens,
            num_lookahead_tokens,
        )
    }

    /// See [`RunCache::start_position`].
    pub fn start_position(&self, id: &RequestId) -> Result<usize> {
        let state = self.state()?;
        Ok(state.cache.start_position(get(&state.requests, id)?))
    }

    /// See [`RunRequest::limit_cached_prefix`].
    pub fn limit_cached_prefix(
        &self,
        id: &RequestId,
        max_cached_tokens: Option<usize>,
    ) -> Result<()> {
        let mut state = self.state()?;
        get_mut(&mut state.requests, id)?.limit_cached_prefix(max_cached_tokens);
        Ok(())
    }

    /// See [`RunRequest::append_tokens`].
    pub fn append_tokens(&self, id: &RequestId, tokens: &[u32], draft: bool) -> Result<()> {
        self.check_tokens(tokens)?;
        let mut state = self.state()?;
        get_mut(&mut state.requests, id)?.append_tokens(tokens, draft)
    }

    /// See [`RunCache::append`].
    pub fn append(&self, id: &RequestId, tokens: &[u32]) -> Result<Vec<BlockId>> {
        self.check_tokens(tokens)?;
        let mut guard = self.state()?;
        let state = &mut *guard;
        state
            .cache
            .append(get_mut(&mut state.requests, id)?, tokens)
    }

    /// Publishes the full verified blocks among the first `num_computed_tokens`; returns the
    /// leading positions now cached.
    pub fn commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<usize> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let request = get_mut(&mut state.requests, id)?;
        let before = Published::of(&state.cache, request);
        state.cache.commit(request, num_computed_tokens)?;
        Ok(state.count_published(id, before))
    }

    /// `commit`, unless it would publish more than `max_blocks` blocks: then nothing changes
    /// and the answer is `Ok(None)` (the core's `commit_at_most`: for a caller that runs large
    /// commits elsewhere and decides under the one lock the call takes).
    pub fn commit_at_most(
        &self,
        id: &RequestId,
        num_computed_tokens: usize,
        max_blocks: usize,
    ) -> Result<Option<usize>> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let request = get_mut(&mut state.requests, id)?;
        // Refused here as `commit` refuses, before anything is decided.
        RunCache::check_commit(request, num_computed_tokens, self.block_size)?;
        let target = num_computed_tokens
            .max(request.num_computed_tokens())
            .min(request.num_verified())
            / self.block_size;
        if target.saturating_sub(request.cached_positions()) > max_blocks {
            return Ok(None);
        }
        let before = Published::of(&state.cache, request);
        state.cache.commit(request, num_computed_tokens)?;
        Ok(Some(state.count_published(id, before)))
    }

    /// See [`RunCache::accept_drafts`].
    pub fn accept_drafts(&self, id: &RequestId, num_accepted: usize) -> Result<usize> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let request = get_mut(&mut state.requests, id)?;
        let before = Published::of(&state.cache, request);
        state.cache.accept_drafts(request, num_accepted)?;
        Ok(state.count_published(id, before))
    }

    /// See [`RunCache::truncate`].
    pub fn truncate(&self, id: &RequestId, num_tokens: usize) -> Result<Vec<BlockId>> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        state
            .cache
            .truncate(get_mut(&mut state.requests, id)?, num_tokens)
    }

    /// See [`RunCache::preempt`].
    pub fn preempt(&self, id: &RequestId) -> Result<()> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        state.cache.preempt(get_mut(&mut state.requests, id)?);
        Ok(())
    }

    /// Ends a request: drops its references; its cached blocks stay, evictable.
    pub fn finish(&self, id: &RequestId) -> Result<()> {
        let mut state = self.state()?;
        let request = state
            .requests
            .remove(id)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))?;
        state.cache.finish(request.request);
        Ok(())
    }

    /// A live request's block table (empty while it waits).
    pub fn block_table(&self, id: &RequestId) -> Result<Vec<BlockId>> {
        Ok(get(&self.state()?.requests, id)?.blocks().to_vec())
    }

    /// A live request's tokens, drafts included.
    pub fn num_tokens(&self, id: &RequestId) -> Result<usize> {
        Ok(get(&self.state()?.requests, id)?.num_tokens())
    }

    /// A live request's tokens with KV written.
    pub fn num_computed_tokens(&self, id: &RequestId) -> Result<usize> {
        Ok(get(&self.state()?.requests, id)?.num_computed_tokens())
    }

    /// The 32-byte key of every full block of `tokens` under `salt` (what the per-block
    /// cache's `block_keys` gives: the same chain from the same root).
    pub fn block_keys(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<Vec<BlockKey>> {
        self.check_tokens(tokens)?;
        let root = self.state()?.context.root(salt);
        Ok(key_chain(root, extras, tokens, self.block_size))
    }

    /// The key of every full block of a live request's verified tokens.
    pub fn request_block_keys(&self, id: &RequestId) -> Result<Vec<BlockKey>> {
        let state = self.state()?;
        let request = get(&state.requests, id)?;
        Ok(key_chain(
            request.origin.root,
            &request.origin.extras,
            &request.tokens[..request.num_verified()],
            self.block_size,
        ))
    }

    /// Turns KV event recording on (or changes its settings), as the core's `enable_events`:
    /// the first drain then yields a snapshot of every block already cached.
    pub fn enable_events(&self, config: EventConfig) -> Result<()> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        state
            .cache
            .enable_events(config, &state.context.fingerprint());
        Ok(())
    }

    /// Turns event recording off (queued events discarded, counters kept).
    pub fn disable_events(&self) -> Result<()> {
        self.state()?.cache.disable_events();
        Ok(())
    }

    /// Whether events are being recorded.
    pub fn events_enabled(&self) -> Result<bool> {
        Ok(self.state()?.cache.events_enabled())
    }

    /// The recorder's counters (kept across disable, enable and resets).
    pub fn event_counters(&self) -> Result<EventCounters> {
        Ok(self.state()?.cache.event_counters())
    }

    /// The events recorded since the last drain (empty when events are off).
    pub fn drain_events(&self) -> Result<EventDrain> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        Ok(state.cache.drain_events(&state.context.fingerprint()))
    }

    /// The SHA-256 block key of every cached block, in no particular order.
    pub fn cached_keys(&self) -> Result<Vec<BlockKey>> {
        Ok(self.state()?.cache.cached_keys())
    }

    /// Turns the eviction log on (emptied) or off, as the core's `set_eviction_log`.
    pub fn set_eviction_log(&self, enabled: bool) -> Result<()> {
        self.state()?.cache.eviction_log = enabled.then(Vec::new);
        Ok(())
    }

    /// The blocks evicted since the last drain, oldest first (empty when the log is off).
    pub fn drain_evicted(&self) -> Result<Vec<BlockId>> {
        Ok(self
            .state()?
            .cache
            .eviction_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default())
    }

    /// Blocks an allocation could obtain now, capped at `up_to`.
    pub fn blocks_obtainable(&self, up_to: usize) -> Result<usize> {
        Ok(self.state()?.cache.obtainable().min(up_to))
    }

    /// Forgets every cached block, under `context` from now on (`None`: the same). Requests
    /// waiting (added, or preempted) stay, keyed under the new context, and match again when
    /// scheduled, as the core's do. Refused while a request is scheduled: the run cache cannot
    /// yet keep a request's blocks while it drops their runs (vLLM's `reset_prefix_cache`
    /// does not reset while a block is in use either).
    pub fn reset(&self, context: Option<BlockKey>) -> Result<()> {
        let mut guard = self.state()?;
        let state = &mut *guard;
        let scheduled = state
            .requests
            .values()
            .filter(|live| live.request.is_scheduled())
            .count();
        if scheduled > 0 {
            return Err(CacheError::InvalidInput(format!(
                "the run core resets (clear, set_context) only while no request is scheduled; \
                 {scheduled} are (finish or preempt them first)"
            )));
        }
        let mut cache = fresh(self.num_blocks, self.block_size, self.full_hit)?;
        // The log stays on, emptied: blocks evicted under the old context must not reach a
        // tier now (the core's `clear`).
        cache.eviction_log = state.cache.eviction_log.as_ref().map(|_| Vec::new());
        // The blocks that held cached content join the free list as the core's `clear` frees
        // them (the next allocations take the same blocks).
        cache.order.free = state.cache.free_order_after_reset();
        let table = cache.shared_table();
        let old = std::mem::replace(&mut state.cache, cache);
        state.counters.evictions_before += old.counters().evictions;
        state.counters.copies_before += old.counters().copies;
        // The recorder goes on, its consumers told that every block is gone.
        state.cache.events = old.events;
        state.pins.drop_all(if context.is_some() {
            Reset::SetContext
        } else {
            Reset::Clear
        });
        if let Some(context) = context {
            state.context = Context::new(context);
        }
        state.cache.events.cleared(&state.context.fingerprint());
        // The requests left wait, holding nothing: only their keys depend on the context.
        for live in state.requests.values_mut() {
            let origin = Origin {
                root: state.context.root(&live.salt),
                extras: live.request.origin.extras.clone(),
            };
            live.request.rekey(Arc::new(origin));
        }
        // Under the writer's lock still: no request can begin under the old context meanwhile.
        *self.reader.write().map_err(|_| poisoned())? = (table, state.context);
        Ok(())
    }

    /// Counters since creation and block states now (walks the runs: O(blocks)).
    pub fn stats(&self) -> Result<CacheStats> {
        let state = self.state()?;
        let counts = state.cache.block_counts();
        let c = &state.counters;
        // Distinct blocks the live requests hold (a shared prefix is in several tables):
        // sorted and deduplicated, O(held log held), where a map of every block would cost
        // O(blocks) a call even with nothing held.
        let mut in_use: Vec<BlockId> = state
            .requests
            .values()
            .flat_map(|live| live.request.blocks().iter().copied())
            .collect();
        in_use.sort_unstable();
        in_use.dedup();
        Ok(CacheStats {
            lookups: c.lookups,
            lookup_tokens: c.lookup_tokens,
            hit_tokens: c.hit_tokens,
            probes: self.probes.load(Ordering::Relaxed),
            evictions: c.evictions_before + state.cache.counters().evictions,
            committed_blocks: c.committed_blocks,
            deduplicated_blocks: c.copies_before + state.cache.counters().copies,
            collisions: 0,
            blocks_released: 0,
            blocks_total: self.num_blocks as usize,
            blocks_free: counts.free,
            blocks_cached: counts.cached,
            blocks_in_use: in_use.len(),
            blocks_pinned: state.cache.num_pinned(),
            // Every cached block nobody holds: eviction reaches each of them (a run gives its
            // blocks up tail first).
            blocks_evictable: counts.obtainable - counts.free,
            blocks_obtainable: counts.obtainable,
            requests_live: state.requests.len(),
        })
    }

    /// References live requests hold on `block` (one per block-table position).
    pub fn ref_count(&self, block: BlockId) -> Result<u32> {
        self.check_block(block)?;
        let state = self.state()?;
        let held = state
            .requests
            .values()
            .map(|live| {
                live.request
                    .blocks()
                    .iter()
                    .filter(|&&b| b == block)
                    .count()
            })
            .sum::<usize>();
        Ok(u32::try_from(held).expect("fewer references than blocks times requests"))
    }

    /// Whether `block` holds cached content (a run's block, or a spare copy).
    pub fn is_cached(&self, block: BlockId) -> Result<bool> {
        self.check_block(block)?;
        Ok(self.state()?.cache.is_cached(block))
    }

    fn check_block(&self, block: BlockId) -> Result<()> {
        if block >= self.num_blocks {
            return Err(CacheError::InvalidBlock {
                block,
                reason: "outside the pool",
            });
        }
        Ok(())
    }

    /// Checks every invariant (tests); panics on a broken one. Besides the run cache's own:
    /// every block is exactly one of free (on the free list), cached, or held private (in a
    /// live request's table and not cached), so none is lost or counted twice.
    pub fn check_invariants(&self) -> Result<()> {
        let state = self.state()?;
        state.cache.check_invariants();
        state
            .cache
            .check_block_states(state.requests.values().map(|live| live.request.blocks()));
        Ok(())
    }
}

/// A request's cached positions and the cache's copies before a commit (`count_published`).
struct Published {
    positions: usize,
    copies: u64,
}

impl Published {
    fn of(cache: &RunCache, request: &RunRequest) -> Self {
        Self {
            positions: request.cached_positions(),
            copies: cache.counters().copies,
        }
    }
}

impl State {
    /// Counts what a commit of request `id` published, as the core counts it: its newly cached
    /// positions less the copies of blocks published first (those are `deduplicated_blocks`).
    /// Returns the request's cached positions.
    fn count_published(&mut self, id: &RequestId, before: Published) -> usize {
        let after = get(&self.requests, id).map_or(0, RunRequest::cached_positions);
        let copies = self.cache.counters().copies - before.copies;
        self.counters.committed_blocks += after.saturating_sub(before.positions) as u64 - copies;
        after
    }

    /// A waiting request under this state's context.
    fn live(&self, tokens: Vec<u32>, salt: &[u8], extras: RequestExtras, priority: i32) -> Live {
        let origin = Origin {
            root: self.context.root(salt),
            extras,
        };
        Live {
            request: self.cache.add_from(Arc::new(origin), tokens, priority),
            salt: salt.to_vec(),
        }
    }

    /// Schedules a request not yet in the map (`begin`), counting its match.
    fn schedule(
        &mut self,
        request: &mut RunRequest,
        num_new: Option<usize>,
        lookahead: usize,
        watermark: usize,
    ) -> Result<RunSlots> {
        let done = self
            .cache
            .schedule(request, num_new, lookahead, watermark)?;
        let slots = RunSlots {
            block_ids: request.blocks().to_vec(),
            num_computed_tokens: done.start,
            num_cached_tokens: done.num_cached,
            full_hit: done.full_hit,
            last_token_shared: done.last_token_shared,
        };
        self.counters.count_match(request, &slots);
        Ok(slots)
    }

    /// The id `begin` gives a request that came without one: never a live id.
    fn auto_id(&mut self) -> RequestId {
        loop {
            let id = RequestId::Int(self.next_auto);
            self.next_auto += 1;
            if !self.requests.contains_key(&id) {
                return id;
            }
        }
    }
}

impl Counters {
    fn count_match(&mut self, request: &RunRequest, slots: &RunSlots) {
        self.lookups += 1;
        self.lookup_tokens += request.num_verified() as u64;
        self.hit_tokens += slots.num_cached_tokens as u64;
    }
}

/// Each full block's key, chained from `root` with the request's `extras` (the per-block
/// cache's `block_keys`).
fn key_chain(
    root: BlockKey,
    extras: &RequestExtras,
    tokens: &[u32],
    block_size: usize,
) -> Vec<BlockKey> {
    let mut parent = root;
    let mut buffer = Vec::new();
    let mut extras_buffer = Vec::new();
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, chunk)| {
            let block_extras = block_extras(extras, i, block_size, &mut extras_buffer);
            parent = block_key_with(&mut buffer, &parent, chunk, block_extras);
            parent
        })
        .collect()
}

fn poisoned() -> CacheError {
    CacheError::InvalidInput(
        "this run cache panicked in an earlier call; its state is not trusted".into(),
    )
}

fn fresh(num_blocks: u32, block_size: usize, full_hit: FullHit) -> Result<RunCache> {
    RunCache::new(num_blocks, block_size, SEED)
        .map(|cache| cache.with_full_hit(full_hit))
        .ok_or_else(|| {
            CacheError::InvalidInput(format!(
                "num_blocks {num_blocks} of block_size {block_size} tokens: the run cache's \
                 metadata would take more bytes up front than the {} allowed, or the memory \
                 is not there",
                crate::cache::MAX_UP_FRONT_BYTES,
            ))
        })
}

fn get<'a>(
    requests: &'a HashMap<RequestId, Live, foldhash::quality::RandomState>,
    id: &RequestId,
) -> Result<&'a RunRequest> {
    get_live(requests, id).map(|live| &live.request)
}

fn get_live<'a>(
    requests: &'a HashMap<RequestId, Live, foldhash::quality::RandomState>,
    id: &RequestId,
) -> Result<&'a Live> {
    requests
        .get(id)
        .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
}

fn get_mut<'a>(
    requests: &'a mut HashMap<RequestId, Live, foldhash::quality::RandomState>,
    id: &RequestId,
) -> Result<&'a mut RunRequest> {
    requests
        .get_mut(id)
        .map(|live| &mut live.request)
        .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
}

#[cfg(test)]
mod tests {
    use super::RunPrefixCache;
    use crate::cache::{FullHit, MAX_BLOCK_SIZE};
    use crate::error::CacheError;
    use crate::key::context_fingerprint;

    fn build(num_blocks: u32, block_size: usize) -> Result<RunPrefixCache, CacheError> {
        let context = context_fingerprint(b"run-cache-sizes");
        RunPrefixCache::new(
            num_blocks,
            block_size,
            context,
            None,
            FullHit::RecomputeLastBlock,
        )
    }

    /// A size the run cache cannot serve is refused by the figure, in the block core's words,
    /// before anything is reserved; the largest block size it can is served.
    #[test]
    fn absurd_sizes_are_refused_by_name() {
        let refusal = |result: Result<RunPrefixCache, CacheError>| match result {
            Err(CacheError::InvalidInput(message)) => message,
            Err(other) => panic!("refused as {other:?}"),
            Ok(_) => panic!("served"),
        };
        let message = refusal(build(16, MAX_BLOCK_SIZE + 1));
        assert!(
            message.contains("is above the largest supported"),
            "{message}"
        );
        let message = refusal(build(u32::MAX, 4));
        assert!(message.contains("bytes up front"), "{message}");
        assert_eq!(
            build(4, MAX_BLOCK_SIZE).unwrap().block_size(),
            MAX_BLOCK_SIZE
        );
    }
}
