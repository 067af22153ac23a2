//! `PrefixCache`: the block manager's shared state, its lookups, its low-level API and reset.
//!
//! The request life (`begin` to `finish`, and how a commit publishes blocks) is in `request/`;
//! pins are in `pins.rs`: both are further `impl PrefixCache` blocks over the state defined here.
//! What a key covers is in `key.rs`, why a hash collision can only cost a miss in `table/`, and
//! the refcount, pin and eviction mechanics in `pool.rs`.
//!
//! ## Threads
//! Every call that changes state takes the one mutex around [`Inner`] and checks its whole input
//! before changing anything, so an `Err` always means nothing changed. `lookup` takes no lock: it
//! reads the context cell and the lock-free table, and may race with a writer. It then returns a
//! chain that was cached as a whole at some instant during the call (entries are immutable, a
//! cached child keeps its parent cached, and a parent is checked by entry id, never reused), and
//! whose blocks may be evicted right after: its answer is a probe. `begin`, `match_and_acquire`
//! and `pin` match under the mutex, so what they match is what they hold.
//!
//! ## Who may change a refcount
//! Only a call holding the mutex, through the pool. Every reference has one owner, and only its
//! owner drops it:
//! - a request owns one reference on each block of its block table, taken by `begin` and
//!   `append`, dropped by `finish` and by nothing else;
//! - the caller of the low-level API owns the references `allocate` and `match_and_acquire` hand
//!   out. They are counted per block (`Inner::external_refs`) and `release` accepts a block at
//!   most that many times, so it can never drop a reference a request owns.
//!
//! So a block's refcount is always its requests' references plus its external ones
//! (`check_invariants` asserts it). Pins are not references: they only keep a cached block from
//! eviction (`pins.rs`).
//!
//! ## When a block may be evicted
//! Only when the pool counts it evictable (cached, unreferenced, unpinned, no cached child; or a
//! spare, a released duplicate whose content is cached elsewhere: `pool.rs`), and
//! only inside an allocation, under the mutex. Its table entry is removed, or moved into a held
//! duplicate of its content (`pool.rs`), in the same critical section, before the block is handed
//! out: no lookup that starts afterwards can reach it while new KV is written into it.
//!
//! ## Two inserts of the same key
//! Writers never race each other: the mutex orders them. The later insert finds the key taken
//! and either deduplicates (same content: the first copy stays canonical) or is refused (a hash
//! collision: never published). The rules are in `request/publish.rs`, where blocks are published.
//!
//! ## Reset and epochs
//! `clear` and `set_context` drop every cached block nobody references, detach the referenced
//! ones (out of the table, freed at their last release) and drop every pin. Each starts a new
//! *epoch*, and KV of an older epoch is never published: requests live at the reset become
//! non-cacheable (`request/publish.rs`, by the epoch each request records), and every block is
//! marked *stale* (`BlockPool::mark_all_stale`) until `allocate` hands it out again, that is
//! until its KV is computed afresh: `commit_blocks` refuses a stale block. So every cached block
//! belongs to the current epoch (`check_invariants` asserts that no cached block is stale).

mod invariants;
mod lookup;
mod low_level;

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam_utils::CachePadded;

use crate::error::{CacheError, Result};
use crate::events::Events;
use crate::key::{BlockKey, RequestExtras, TableHasher};
use crate::pins::Pins;
use crate::pool::{BlockId, BlockPool, Evicted};
use crate::request::Requests;
use crate::stats::CacheStats;
use crate::sync::{ContextCell, Mutex};
use crate::table::SharedTable;

pub use crate::request::{BeginResult, RequestId, Slots};

/// Fixed settings of a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: usize,
    /// Token ids must be below this (when set).
    pub vocab_size: Option<u32>,
    /// Bits of each table key kept: 128 in production; tests lower it to force collisions.
    pub key_bits: u32,
    /// How a prompt whose every block is cached is served (`request/allocate.rs`, "Full hits").
    pub full_hit: FullHit,
    /// `None`: full attention, every token reads every earlier one. `Some(w)`: a sliding-window
    /// KV group, where the query at position `i` reads keys `i - w < j <= i` only; blocks that
    /// fell out of every live request's window are released (`sliding.rs`).
    pub sliding_window: Option<usize>,
    /// When a sliding-window cache releases the blocks a request's window passed
    /// (`sliding.rs`, "Blocks that left the window are released"). Only `OnCommit` without a
    /// window.
    pub window_release: WindowRelease,
}

/// When a sliding-window cache releases the positions a request's window passed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WindowRelease {
    /// Whenever the request's settled count grows: at `commit`, `allocate_slots` and
    /// `accept_drafts`. Blocks leave as early as they can.
    #[default]
    OnCommit,
    /// Only at `release_out_of_window(request, processed_tokens)`, for an engine that publishes
    /// a step's blocks before the step writes them and releases on its own schedule (vLLM
    /// calls `remove_skipped_blocks` at the request's next allocation). Released positions
    /// then leave the table last first, one LRU tick each, and so do a finished or preempted
    /// request's blocks: the order of vLLM's free queue (`sliding.rs`, "Explicit release").
    Explicit,
}

/// How a full hit (every block of the prompt cached) is handed to the engine. Some token must
/// still be computed for its logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FullHit {
    /// Share every block but the last; the last block is recomputed into a private block. A
    /// standard paged-attention runner, which writes the KV of every token it computes, is
    /// always right with this (vLLM does the same).
    #[default]
    RecomputeLastBlock,
    /// Share every block; only the last token is computed, reading its KV from the shared
    /// block and writing nothing (`last_token_shared`). Saves a block of compute; the runner
    /// must honour "do not write".
    ReuseLastBlock,
}

/// How a hit of whole blocks is served: the blocks it holds, the tokens cached, and whether it
/// is a full hit and shares the last token's block. Both cores (and sliding-window matches)
/// shape their hits here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HitShape {
    pub(crate) keep: usize,
    pub(crate) num_cached: usize,
    pub(crate) full_hit: bool,
    pub(crate) last_token_shared: bool,
}

impl FullHit {
    /// A hit of `matched` leading whole blocks of a `len`-token prompt: a full hit (every
    /// block cached) recomputes the last block or shares it, by this mode.
    pub(crate) fn shape(self, matched: usize, len: usize, block_size: usize) -> HitShape {
        let full_hit = matched > 0 && matched * block_size == len;
        match (full_hit, self) {
            (false, _) => HitShape {
                keep: matched,
                num_cached: matched * block_size,
                full_hit: false,
                last_token_shared: false,
            },
            (true, Self::RecomputeLastBlock) => HitShape {
                keep: matched - 1,
                num_cached: len - block_size,
                full_hit: true,
                last_token_shared: false,
            },
            (true, Self::ReuseLastBlock) => HitShape {
                keep: matched,
                num_cached: len - 1,
                full_hit: true,
                last_token_shared: true,
            },
        }
    }
}

impl CacheConfig {
    /// A production configuration.
    #[must_use]
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            vocab_size: None,
            key_bits: TableHasher::BITS,
            full_hit: FullHit::default(),
            sliding_window: None,
            window_release: WindowRelease::OnCommit,
        }
    }

    /// A sliding-window cache releasing only at `release_out_of_window` (`WindowRelease`).
    pub(crate) fn releases_explicitly(&self) -> bool {
        self.sliding_window.is_some() && self.window_release == WindowRelease::Explicit
    }
}

/// The cached prefix of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Cached blocks, in prompt order.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV can be read from the cache: the engine computes from this position.
    pub num_cached_tokens: usize,
    /// Every block of the prompt is cached. How it is served depends on `FullHit`: with
    /// `RecomputeLastBlock`, `blocks` stops one block short and `num_cached_tokens` is
    /// `n - block_size`; with `ReuseLastBlock`, `blocks` has every block and
    /// `num_cached_tokens` is `n - 1`.
    pub full_hit: bool,
    /// The last prompt token's KV is already in a shared block (`ReuseLastBlock` full hits):
    /// compute its logits reading that KV, and do not write it.
    pub last_token_shared: bool,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) lookups: u64,
    pub(crate) lookup_tokens: u64,
    pub(crate) hit_tokens: u64,
    pub(crate) evictions: u64,
    pub(crate) committed_blocks: u64,
    pub(crate) deduplicated_blocks: u64,
    pub(crate) collisions: u64,
    pub(crate) blocks_released: u64,
}

/// Which call started an epoch (pins remember it, to say why they are gone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reset {
    Clear,
    SetContext,
}

/// Everything behind the mutex.
pub(crate) struct Inner {
    pub(crate) pool: BlockPool,
    pub(crate) requests: Requests,
    pub(crate) pins: Pins,
    /// Id of the next published entry: unique for the life of the cache.
    pub(crate) next_entry: u64,
    /// Logical clock of the LRU order: bumped once per call that uses blocks.
    pub(crate) tick: u64,
    pub(crate) counters: Counters,
    /// Reused hashing buffer.
    pub(crate) scratch: Vec<u8>,
    /// Bumped by `clear` and `set_context`: KV computed in an older epoch is never published.
    pub(crate) epoch: u64,
    /// References taken through the low-level API (`allocate`, `match_and_acquire`): the only
    /// ones `release` may drop.
    pub(crate) external_refs: Vec<u32>,
    /// KV event recording (`events/`): a no-op unless enabled.
    pub(crate) events: Events,
    /// Cached blocks eviction took since the last `drain_evicted`, oldest first; `None` until
    /// `set_eviction_log(true)`. Drained before the pages are written again, it tells a host
    /// tier which blocks' KV to save (their pages still hold it: eviction hands the block to
    /// the allocation that took it, which writes it later).
    pub(crate) eviction_log: Option<Vec<BlockId>>,
}

/// The prefix cache's block manager. `Sync`: share it between threads by reference.
pub struct PrefixCache {
    pub(crate) config: CacheConfig,
    pub(crate) table: SharedTable,
    pub(crate) hasher: TableHasher,
    context: ContextCell,
    /// On cache lines of its own: the writer takes the lock (a store to its state word) on
    /// every call, and lock-free readers read the fields above on every lookup.
    pub(crate) inner: CachePadded<Mutex<Inner>>,
    /// Counted by lock-free readers: away from the lock and the fields above for the same reason.
    probes: CachePadded<AtomicU64>,
}

impl PrefixCache {
    /// A cache with every block free, under the given context fingerprint.
    pub fn new(config: CacheConfig, context: BlockKey) -> Result<Self> {
        let hasher = TableHasher::new(config.key_bits);
        Self::build(config, context, hasher)
    }

    /// `new` with a fixed table-key seed instead of a random one, so that which keys collide is
    /// reproducible: for tests, model checking and replaying a failure. A production cache uses
    /// `new`, whose random seed leaves an attacker no collision to aim at (see `key.rs`).
    pub fn with_table_seed(config: CacheConfig, context: BlockKey, seed: u64) -> Result<Self> {
        let hasher = TableHasher::with_seed(config.key_bits, seed);
        Self::build(config, context, hasher)
    }

    fn build(config: CacheConfig, context: BlockKey, hasher: TableHasher) -> Result<Self> {
        if config.block_size == 0 {
            return Err(CacheError::InvalidInput(
                "block_size must be at least 1".into(),
            ));
        }
        if config.num_blocks == 0 {
            return Err(CacheError::InvalidInput(
                "num_blocks must be at least 1".into(),
            ));
        }
        if config.sliding_window == Some(0) {
            return Err(CacheError::InvalidInput(
                "sliding_window must be at least 1 token (None for full attention)".into(),
            ));
        }
        if config.sliding_window.is_none() && config.window_release != WindowRelease::OnCommit {
            return Err(CacheError::InvalidInput(
                "window_release Explicit needs a sliding_window: full attention releases \
                 nothing before a request ends"
                    .into(),
            ));
        }
        if config.sliding_window.is_some() && config.num_blocks == u32::MAX {
            // The null block is the id one past the pool: it must fit a block id.
            return Err(CacheError::InvalidInput(
                "a sliding-window cache holds at most 4294967294 blocks (one id is the null \
                 block)"
                    .into(),
            ));
        }
        if config.key_bits == 0 || config.key_bits > TableHasher::BITS {
            return Err(CacheError::InvalidInput(
                "key_bits must be in 1..=128".into(),
            ));
        }
        // A bad value is refused here, before anything is reserved (`hugepages.rs`).
        crate::hugepages::from_env().map_err(CacheError::InvalidInput)?;
        let num_blocks = config.num_blocks as usize;
        let bytes = check_up_front_bytes(&config)?;
        // Refused by the figure, never as `OutOfBlocks`: no block was asked for.
        let unallocated = || {
            CacheError::InvalidInput(format!(
                "num_blocks {num_blocks} of block_size {} tokens: the cache's metadata needs \
                 {bytes} bytes up front, which could not be allocated",
                config.block_size
            ))
        };
        let pool = BlockPool::new(config.num_blocks).map_err(|_| unallocated())?;
        Ok(Self {
            // One entry slot per block, allocated now: the table never grows (`table/mod.rs`).
            table: SharedTable::new(
                num_blocks,
                config.block_size,
                config.key_bits == TableHasher::BITS,
            )
            .ok_or_else(unallocated)?,
            hasher,
            context: ContextCell::new(context),
            inner: CachePadded::new(Mutex::new(Inner {
                pool,
                requests: Requests::default(),
                pins: Pins::default(),
                next_entry: 1,
                tick: 0,
                counters: Counters::default(),
                scratch: Vec::new(),
                epoch: 0,
                external_refs: per_block(num_blocks, 0).ok_or_else(unallocated)?,
                events: Events::default(),
                eviction_log: None,
            })),
            probes: CachePadded::new(AtomicU64::new(0)),
            config,
        })
    }

    /// The settings this cache was built with.
    #[must_use]
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The block id that stands in a sliding-window request's table for every position that
    /// fell out of its window: one id past the pool, so never allocated, freed, cached,
    /// counted or referenced (the engine's KV storage keeps one spare page for it, which no
    /// attention ever reads). `None` for a full-attention cache.
    #[must_use]
    pub fn null_block(&self) -> Option<BlockId> {
        self.config.sliding_window.map(|_| self.config.num_blocks)
    }

    /// The current context fingerprint.
    #[must_use]
    pub fn context(&self) -> BlockKey {
        self.context.load()
    }

    // ----- reset -----------------------------------------------------------------------------

    /// Drops every unreferenced cached block, detaches referenced ones, drops all pins.
    pub fn clear(&self) {
        let mut guard = self.inner.lock();
        self.clear_locked(&mut guard, Reset::Clear);
    }

    /// Switches to a new context fingerprint; clears the cache as `clear` does.
    pub fn set_context(&self, context: BlockKey) {
        let mut guard = self.inner.lock();
        // Store first: a lookup that already sees the new context must not meet old entries.
        // (It would not match them anyway: a first block's entry stores its full root key.)
        self.context.store(context);
        self.clear_locked(&mut guard, Reset::SetContext);
    }

    /// Turns the eviction log on or off (off drops what it holds). While on, every cached
    /// block an allocation evicts is logged until `drain_evicted`; the caller must drain it
    /// (after each allocation) or it grows with every eviction.
    pub fn set_eviction_log(&self, enabled: bool) {
        self.inner.lock().eviction_log = enabled.then(Vec::new);
    }

    /// The blocks evicted since the last drain, oldest first (empty when the log is off). A
    /// block is listed by the allocation that took it, so its pages hold the evicted KV until
    /// the caller writes the blocks that allocation returned.
    pub fn drain_evicted(&self) -> Vec<BlockId> {
        let mut inner = self.inner.lock();
        inner
            .eviction_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    // ----- observation -----------------------------------------------------------------------

    /// Counters and block states.
    #[must_use]
    pub fn stats(&self) -> CacheStats {
        let inner = self.inner.lock();
        let c = &inner.counters;
        CacheStats {
            lookups: c.lookups,
            lookup_tokens: c.lookup_tokens,
            hit_tokens: c.hit_tokens,
            probes: self.probes.load(Ordering::Relaxed),
            evictions: c.evictions,
            committed_blocks: c.committed_blocks,
            deduplicated_blocks: c.deduplicated_blocks,
            collisions: c.collisions,
            blocks_released: c.blocks_released,
            blocks_total: inner.pool.num_blocks(),
            blocks_free: inner.pool.num_free(),
            blocks_cached: inner.pool.num_cached() + inner.pool.num_spares(),
            blocks_in_use: inner.pool.num_in_use(),
            blocks_pinned: inner.pool.num_pinned(),
            blocks_evictable: inner.pool.num_evictable_leaves(),
            blocks_obtainable: inner.pool.available(inner.pool.num_blocks()),
            requests_live: inner.requests.len(),
        }
    }

    /// Refcount of a block (tests and debugging).
    pub fn ref_count(&self, block: BlockId) -> Result<u32> {
        let inner = self.inner.lock();
        inner.pool.check_id(block)?;
        Ok(inner.pool.ref_count(block).unwrap_or(0))
    }

    /// Whether a block is cached (reachable by lookups).
    pub fn is_cached(&self, block: BlockId) -> Result<bool> {
        let inner = self.inner.lock();
        inner.pool.check_id(block)?;
        Ok(inner.pool.is_cached(block))
    }

    // ----- internals shared by the request, pin and low-level calls --------------------------

    /// Refuses token ids outside the vocabulary (`CacheConfig::vocab_size`), by position.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(vocab) = self.config.vocab_size {
            if let Some((index, token)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab) {
                return Err(CacheError::InvalidInput(format!(
                    "token id {token} at position {index} is outside the vocabulary (size {vocab})"
                )));
            }
        }
        Ok(())
    }

    /// The low-level calls that publish or pin whole chains have no request whose window says
    /// which blocks may go: a sliding-window cache serves only the request API.
    pub(crate) fn refuse_in_sliding_mode(&self, call: &str) -> Result<()> {
        match self.config.sliding_window {
            Some(window) => Err(CacheError::InvalidInput(format!(
                "{call} is not available in a sliding-window cache (window {window} tokens): \
                 use the request API (add_request, allocate_slots, commit)"
            ))),
            None => Ok(()),
        }
    }

    pub(crate) fn root_key(&self, salt: &[u8]) -> BlockKey {
        self.context.root(salt)
    }

    /// References `hits` and allocates `count` fresh blocks in the current epoch, removing the
    /// table entry of every block evicted for them; or changes nothing.
    pub(crate) fn acquire_and_allocate(
        &self,
        inner: &mut Inner,
        hits: &[BlockId],
        count: usize,
    ) -> Result<Vec<BlockId>> {
        // Reference the hits first so eviction cannot take them for the fresh blocks.
        inner.pool.acquire_run(hits);
        match inner.pool.allocate(count) {
            Ok((fresh, evicted)) => {
                let guard = self.table.guard();
                // A rolling pipeline over the victims (PROFILE.md, round 11): the slot line of
                // the victim `2 * LOOKAHEAD` ahead is asked for (a hint), the
                // index or parent line of the one `LOOKAHEAD` ahead (found from its slot, in
                // cache by then), and this one is removed or moved with its misses started.
                for ahead in &evicted[..evicted.len().min(LOOKAHEAD)] {
                    // Reads the slot itself (the next line's address is in it).
                    self.table.prefetch_removal(ahead.block);
                }
                for ahead in evicted.iter().skip(LOOKAHEAD).take(LOOKAHEAD) {
                    self.table.prefetch_slot(ahead.block);
                }
                for (i, &Evicted { block, moved_to }) in evicted.iter().enumerate() {
                    if let Some(ahead) = evicted.get(i + 2 * LOOKAHEAD) {
                        self.table.prefetch_slot(ahead.block);
                    }
                    if let Some(ahead) = evicted.get(i + LOOKAHEAD) {
                        self.table.prefetch_removal(ahead.block);
                    }
                    if let Some(heir) = moved_to {
                        // Its content stays cached in a duplicate (`pool.rs`): nothing is
                        // lost, nothing for a router or a host tier to learn.
                        let moved = self.table.move_entry(block, heir, &guard);
                        debug_assert!(moved, "evicted a cached block");
                        inner.events.moved(block, heir);
                        continue;
                    }
                    debug_assert!(self.table.published(block, &guard).is_some());
                    self.table.remove(block, &guard);
                    inner.events.removed(block);
                    inner.counters.evictions += 1;
                    if let Some(log) = inner.eviction_log.as_mut() {
                        log.push(block);
                    }
                }
                Ok(fresh)
            }
            Err(err) => {
                // Releasing restores each hit's exact eviction position: nothing was touched.
                for &block in hits {
                    inner.pool.release(block);
                }
                Err(err)
            }
        }
    }

    fn clear_locked(&self, inner: &mut Inner, reset: Reset) {
        inner.events.cleared(&self.context());
        inner.epoch += 1;
        // Blocks evicted under the old context: their KV must not reach a tier now.
        if let Some(log) = inner.eviction_log.as_mut() {
            log.clear();
        }
        inner.requests.forget_cached_prefixes();
        inner.pins.drop_all(reset);
        let guard = self.table.guard();
        for block in inner.pool.cached_blocks() {
            self.table.remove(block, &guard);
            inner.pool.uncache(block);
        }
        inner.pool.forget_duplicates();
        // Every block's KV, held or not, now predates the reset (`commit_blocks` refuses it).
        inner.pool.mark_all_stale();
    }
}

/// Blocks whose table keys a walk over a prompt hashes ahead of its table reads.
pub(crate) const LOOKAHEAD: usize = 16;

/// The encoded extra keys of block `index` (see `key.rs`), written into `buffer`, which a loop
/// over a prompt's blocks keeps: a request without extra keys (almost every one) never
/// allocates it, so no `Vec` is built and dropped per block (PROFILE.md, issue 24, round 13).
/// Emptied for a request without extras: a loop over several requests' blocks (a snapshot of
/// the run cache) must not key a plain block with the extras of the one before.
#[inline(always)]
pub(crate) fn block_extras<'a>(
    extras: &RequestExtras,
    index: usize,
    block_size: usize,
    buffer: &'a mut Vec<u8>,
) -> &'a [u8] {
    if extras.is_empty() {
        buffer.clear();
    } else {
        *buffer = encoded_extras(extras, index, block_size);
    }
    buffer
}

/// `block_extras`' rare case, out of line so the per-block loops that inline the common one
/// stay small.
#[cold]
#[inline(never)]
fn encoded_extras(extras: &RequestExtras, index: usize, block_size: usize) -> Vec<u8> {
    let start = (index * block_size) as u64;
    extras.for_block(start, start + block_size as u64)
}

/// One value per block, or `None` if they do not fit in memory.
fn per_block<T: Clone>(num_blocks: usize, value: T) -> Option<Vec<T>> {
    let mut values = Vec::new();
    values.try_reserve_exact(num_blocks).ok()?;
    values.resize(num_blocks, value);
    Some(values)
}

/// Tokens per block no engine's blocks reach (a few thousand at most, for hybrid models whose
/// attention blocks match a state's page): the table mirrors every block's tokens up front.
pub const MAX_BLOCK_SIZE: usize = 1 << 16;

/// Metadata a cache may allocate up front (table, pool and per-block state): 16 GiB, some
/// 2**28 blocks of 16 tokens, describing far more KV than any device holds.
pub const MAX_UP_FRONT_BYTES: usize = 1 << 34;

/// Refuses a block size above [`MAX_BLOCK_SIZE`], naming it (the run cache's too).
pub(crate) fn check_block_size(block_size: usize) -> Result<()> {
    if block_size > MAX_BLOCK_SIZE {
        return Err(CacheError::InvalidInput(format!(
            "block_size {block_size} is above the largest supported, {MAX_BLOCK_SIZE} tokens \
             per block"
        )));
    }
    Ok(())
}

/// The bytes a cache of `config` allocates at construction, or the refusal naming the size
/// that makes them absurd: everything is allocated (and written) up front, so an absurd size
/// would take the memory, or report its absence as something else.
fn check_up_front_bytes(config: &CacheConfig) -> Result<usize> {
    let (num_blocks, block_size) = (config.num_blocks as usize, config.block_size);
    check_block_size(block_size)?;
    // `Inner::external_refs`, and the pool's own.
    let per_block = std::mem::size_of::<u32>() + BlockPool::BYTES_PER_BLOCK;
    let bytes = crate::table::Table::bytes_up_front(num_blocks, block_size)
        .and_then(|table| num_blocks.checked_mul(per_block)?.checked_add(table));
    match bytes {
        Some(bytes) if bytes <= MAX_UP_FRONT_BYTES => Ok(bytes),
        _ => Err(CacheError::InvalidInput(format!(
            "num_blocks {num_blocks} of block_size {block_size} tokens: the cache's metadata \
             would take {} bytes up front, more than the {MAX_UP_FRONT_BYTES} allowed",
            bytes.map_or_else(|| "over 2**64".to_owned(), |b| b.to_string())
        ))),
    }
}

#[cfg(test)]
pub(crate) mod tests;
