//! `PrefixCache`: the engine-facing block manager.
//!
//! ## A request's life
//! 1. `begin` looks up the longest chain of cached full blocks for the prompt, takes a
//!    reference on each, and allocates private blocks for the rest. If every block of the
//!    prompt is cached, the request is a *full hit*: only the final token is recomputed (to
//!    get logits), reading its KV from the shared block, and nothing is written into it.
//! 2. The engine writes KV into the request's private blocks.
//! 3. `commit` publishes every block that has become full (prompt and generated tokens alike),
//!    so the next turn of a chat hits the previous answer. If another request cached the same
//!    block first, the existing copy stays canonical and this request's copy is freed when it
//!    finishes (deduplication).
//! 4. `append` adds generated tokens, allocating blocks as they are needed.
//! 5. `finish` drops the request's references. Its cached blocks stay, evictable in LRU order.
//!
//! ## Threads
//! `lookup` never takes a lock: it reads the lock-free table and the context through
//! `arc-swap`. Every call that changes state takes one mutex, inside which it validates its
//! whole input before changing anything: an `Err` means nothing changed. A lookup racing with
//! a writer sees the table before or after each single insert or removal; its answer is a
//! probe, made authoritative only by `begin` / `match_and_acquire`, which match and take
//! references atomically under the mutex.
//!
//! ## Reset
//! `clear` and `set_context` drop every cached block nobody references and detach the
//! referenced ones (unreachable to new lookups, freed at their last release). Live requests are
//! marked non-cacheable: their KV was computed under the old weights or context, and must never
//! be published under the new one. The same holds for blocks held through the low-level API:
//! each reset starts a new *epoch*, every allocation records its epoch, and `commit_blocks`
//! refuses a block from an older one.
//!
//! ## Who may drop a reference
//! A request's references belong to the request and are dropped only by `finish`. References
//! taken through `allocate` / `match_and_acquire` are counted apart and are the only ones
//! `release` accepts, so a caller can never release a block out from under a request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::error::{CacheError, Result};
use crate::key::{block_key_with, root_key, BlockKey, RequestExtras, TableHasher, TableKey};
use crate::pool::{BlockId, BlockPool};
use crate::stats::CacheStats;
use crate::table::{new_table, Anchor, Entry, Parent, Table};

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
        }
    }
}

/// The cached prefix of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Cached blocks, in prompt order.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV can be read from the cache: the engine computes from this position.
    pub num_cached_tokens: usize,
    /// Every block of the prompt is cached: compute only the final token, write nothing.
    pub full_hit: bool,
}

/// What `begin` hands the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginResult {
    /// Id for the other request calls.
    pub request_id: u64,
    /// Blocks covering every prompt token: the cached ones, then the request's own.
    pub block_table: Vec<BlockId>,
    /// Tokens whose KV is already in the cached blocks.
    pub num_cached_tokens: usize,
    /// See `PrefixMatch::full_hit`.
    pub full_hit: bool,
}

struct Request {
    tokens: Vec<u32>,
    block_table: Vec<BlockId>,
    root: BlockKey,
    extras: RequestExtras,
    priority: i32,
    /// The canonical cached entry of each committed position, in order. Usually the request's
    /// own block; another request's copy after deduplication.
    anchors: Vec<Anchor>,
    /// False once the request's KV may no longer be published (after `clear` or a collision).
    cacheable: bool,
}

#[derive(Default)]
struct Counters {
    lookups: u64,
    lookup_tokens: u64,
    hit_tokens: u64,
    evictions: u64,
    committed_blocks: u64,
    deduplicated_blocks: u64,
    collisions: u64,
}

struct Inner {
    pool: BlockPool,
    /// The published entry of each cached block.
    entries: Vec<Option<Anchor>>,
    requests: HashMap<u64, Request>,
    pins: HashMap<u64, Vec<BlockId>>,
    next_request: u64,
    next_pin: u64,
    next_entry: u64,
    tick: u64,
    counters: Counters,
    scratch: Vec<u8>,
    /// Bumped by `clear` and `set_context`: KV computed in an older epoch is never published.
    epoch: u64,
    /// Epoch in which each block was last allocated (its KV computed).
    block_epoch: Vec<u64>,
    /// References taken through the low-level API (`allocate`, `match_and_acquire`): the only
    /// ones `release` may drop, so a caller can never release a block a request owns.
    external_refs: Vec<u32>,
}

/// The prefix cache's block manager. `Sync`: share it between threads by reference.
pub struct PrefixCache {
    config: CacheConfig,
    table: Table,
    hasher: TableHasher,
    context: ArcSwap<BlockKey>,
    inner: Mutex<Inner>,
    probes: AtomicU64,
}

impl PrefixCache {
    /// A cache with every block free, under the given context fingerprint.
    pub fn new(config: CacheConfig, context: BlockKey) -> Result<Self> {
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
        if config.key_bits == 0 || config.key_bits > TableHasher::BITS {
            return Err(CacheError::InvalidInput(
                "key_bits must be in 1..=128".into(),
            ));
        }
        let num_blocks = config.num_blocks;
        let pool = BlockPool::new(num_blocks)?;
        let too_big = |_| CacheError::OutOfBlocks {
            needed: num_blocks as usize,
            available: 0,
        };
        let mut entries = Vec::new();
        entries
            .try_reserve_exact(num_blocks as usize)
            .map_err(too_big)?;
        entries.resize(num_blocks as usize, None);
        let mut block_epoch = Vec::new();
        block_epoch
            .try_reserve_exact(num_blocks as usize)
            .map_err(too_big)?;
        block_epoch.resize(num_blocks as usize, 0);
        let mut external_refs = Vec::new();
        external_refs
            .try_reserve_exact(num_blocks as usize)
            .map_err(too_big)?;
        external_refs.resize(num_blocks as usize, 0);
        Ok(Self {
            // Pre-size for speed up to a million entries; the map grows past that on its own.
            table: new_table((num_blocks as usize).min(1 << 20)),
            hasher: TableHasher::new(config.key_bits),
            context: ArcSwap::from_pointee(context),
            inner: Mutex::new(Inner {
                pool,
                entries,
                epoch: 0,
                block_epoch,
                external_refs,
                requests: HashMap::new(),
                pins: HashMap::new(),
                next_request: 1,
                next_pin: 1,
                next_entry: 1,
                tick: 0,
                counters: Counters::default(),
                scratch: Vec::new(),
            }),
            probes: AtomicU64::new(0),
            config,
        })
    }

    /// The settings this cache was built with.
    #[must_use]
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The current context fingerprint.
    #[must_use]
    pub fn context(&self) -> BlockKey {
        **self.context.load()
    }

    // ----- lookups ---------------------------------------------------------------------------

    /// The cached prefix of `tokens`, without taking references. Lock-free; the answer is a
    /// probe (blocks may be evicted right after), for routing and hit-length estimates.
    pub fn lookup(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<PrefixMatch> {
        self.check_tokens(tokens)?;
        self.probes.fetch_add(1, Ordering::Relaxed);
        let blocks = self.matched_blocks(&mut Vec::new(), tokens, salt, extras);
        Ok(self.prefix_match(blocks, tokens.len()))
    }

    /// SHA-256 block keys of every full block of `tokens` under the current context: the keys
    /// that may leave the process (events, external tiers, routers). Lookups never need them.
    pub fn block_keys(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<Vec<BlockKey>> {
        self.check_tokens(tokens)?;
        let root = root_key(&self.context.load(), salt);
        let mut parent = root;
        let mut buffer = Vec::new();
        let bs = self.config.block_size;
        Ok(tokens
            .chunks_exact(bs)
            .enumerate()
            .map(|(i, chunk)| {
                let block_extras = block_extras(extras, i, bs);
                parent = block_key_with(&mut buffer, &parent, chunk, &block_extras);
                parent
            })
            .collect())
    }

    /// Computes the table key of every full block of `tokens` and nothing else; returns how
    /// many. The floor under `lookup` and `begin`, for benchmarks.
    pub fn hash_prompt(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> usize {
        let root = root_key(&self.context.load(), salt);
        let mut parent = self.hasher.root(&root);
        let mut buffer = Vec::new();
        let bs = self.config.block_size;
        let mut count = 0;
        for (index, chunk) in tokens.chunks_exact(bs).enumerate() {
            let block_extras = block_extras(extras, index, bs);
            parent = self.hasher.block(&mut buffer, parent, chunk, &block_extras);
            count += 1;
        }
        std::hint::black_box(parent);
        count
    }

    // ----- the request API -------------------------------------------------------------------

    /// Starts a request: matches its cached prefix, references it, allocates the rest.
    pub fn begin(
        &self,
        tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<BeginResult> {
        self.check_tokens(&tokens)?;
        if tokens.is_empty() {
            return Err(CacheError::InvalidInput(
                "a request needs at least one token".into(),
            ));
        }
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let root = root_key(&self.context.load(), salt);
        let mut anchors = Vec::new();
        self.match_chain(&mut inner.scratch, root, &tokens, &extras, |e, key| {
            anchors.push(e.anchor(key));
        });
        let hits: Vec<BlockId> = anchors.iter().map(|e| e.block).collect();
        let total_blocks = tokens.len().div_ceil(self.config.block_size);
        let fresh = self.acquire_and_allocate(inner, &hits, total_blocks - hits.len())?;

        inner.tick += 1;
        for &block in &hits {
            inner.pool.touch(block, inner.tick, priority);
        }
        let matched = self.prefix_match(hits, tokens.len());
        inner.counters.lookups += 1;
        inner.counters.lookup_tokens += tokens.len() as u64;
        inner.counters.hit_tokens += matched.num_cached_tokens as u64;

        let mut block_table = matched.blocks;
        block_table.extend_from_slice(&fresh);
        let request_id = inner.next_request;
        inner.next_request += 1;
        inner.requests.insert(
            request_id,
            Request {
                tokens,
                block_table: block_table.clone(),
                root,
                extras,
                priority,
                anchors,
                cacheable: true,
            },
        );
        Ok(BeginResult {
            request_id,
            block_table,
            num_cached_tokens: matched.num_cached_tokens,
            full_hit: matched.full_hit,
        })
    }

    /// Adds generated tokens to a request, allocating blocks for them. Returns the new blocks.
    pub fn append(&self, request_id: u64, tokens: &[u32]) -> Result<Vec<BlockId>> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner
            .requests
            .get(&request_id)
            .ok_or(CacheError::UnknownRequest(request_id))?;
        let total = request.tokens.len() + tokens.len();
        let needed = total
            .div_ceil(self.config.block_size)
            .saturating_sub(request.block_table.len());
        let fresh = self.acquire_and_allocate(inner, &[], needed)?;
        let request = inner.requests.get_mut(&request_id).expect("checked above");
        request.tokens.extend_from_slice(tokens);
        request.block_table.extend_from_slice(&fresh);
        Ok(fresh)
    }

    /// Publishes every full block among the first `num_computed_tokens` tokens of a request,
    /// whose KV the engine has written. Returns how many positions are now committed.
    pub fn commit(&self, request_id: u64, num_computed_tokens: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut request = inner
            .requests
            .remove(&request_id)
            .ok_or(CacheError::UnknownRequest(request_id))?;
        if num_computed_tokens > request.tokens.len() {
            let len = request.tokens.len();
            inner.requests.insert(request_id, request);
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {len} tokens"
            )));
        }
        let target = num_computed_tokens / self.config.block_size;
        if request.cacheable {
            inner.tick += 1;
            self.extend_anchors(inner, &mut request, target);
        }
        let committed = request.anchors.len();
        inner.requests.insert(request_id, request);
        Ok(committed)
    }

    /// Ends a request: drops its references. Cached blocks stay, now evictable.
    pub fn finish(&self, request_id: u64) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner
            .requests
            .remove(&request_id)
            .ok_or(CacheError::UnknownRequest(request_id))?;
        inner.tick += 1;
        for &block in &request.block_table {
            if inner.pool.is_cached(block) {
                inner.pool.touch(block, inner.tick, request.priority);
            }
            // A request's references are its own: `release` can only drop external ones, so
            // each block here still holds the reference this request took.
            inner.pool.release(block);
        }
        Ok(())
    }

    /// A live request's block table.
    pub fn block_table(&self, request_id: u64) -> Result<Vec<BlockId>> {
        let inner = self.inner.lock();
        let request = inner
            .requests
            .get(&request_id)
            .ok_or(CacheError::UnknownRequest(request_id))?;
        Ok(request.block_table.clone())
    }

    /// A live request's token count.
    pub fn num_tokens(&self, request_id: u64) -> Result<usize> {
        let inner = self.inner.lock();
        let request = inner
            .requests
            .get(&request_id)
            .ok_or(CacheError::UnknownRequest(request_id))?;
        Ok(request.tokens.len())
    }

    // ----- low-level calls, for engines that keep their own block tables ---------------------

    /// Matches the cached prefix and takes a reference on each matched block, atomically.
    pub fn match_and_acquire(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
        priority: i32,
    ) -> Result<PrefixMatch> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = self.matched_blocks(&mut inner.scratch, tokens, salt, extras);
        inner.tick += 1;
        for &block in &blocks {
            inner.pool.acquire(block);
            inner.external_refs[block as usize] += 1;
            inner.pool.touch(block, inner.tick, priority);
        }
        let matched = self.prefix_match(blocks, tokens.len());
        inner.counters.lookups += 1;
        inner.counters.lookup_tokens += tokens.len() as u64;
        inner.counters.hit_tokens += matched.num_cached_tokens as u64;
        Ok(matched)
    }

    /// Takes `count` free blocks (evicting if needed), each with one reference.
    pub fn allocate(&self, count: usize) -> Result<Vec<BlockId>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = self.acquire_and_allocate(inner, &[], count)?;
        for &block in &blocks {
            inner.external_refs[block as usize] += 1;
        }
        Ok(blocks)
    }

    /// Publishes full blocks of a sequence the caller manages itself. `blocks[i]` holds the KV
    /// of tokens `i*block_size .. (i+1)*block_size`; the caller must hold a reference on each.
    /// Returns the canonical block of each position that is now cached: the caller's own, or an
    /// existing identical one (then the caller's copy is a duplicate, freed at its release).
    /// The result can be shorter than `blocks` if a key collision stops the chain.
    pub fn commit_blocks(
        &self,
        tokens: &[u32],
        blocks: &[BlockId],
        salt: &[u8],
        extras: &RequestExtras,
        priority: i32,
    ) -> Result<Vec<BlockId>> {
        self.check_tokens(tokens)?;
        let bs = self.config.block_size;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        for (position, &block) in blocks.iter().enumerate() {
            inner.pool.check_id(block)?;
            if inner.external_refs[block as usize] == 0 {
                return Err(CacheError::InvalidBlock {
                    block,
                    reason: "not held by the caller (take it with allocate or match_and_acquire)",
                });
            }
            if inner.block_epoch[block as usize] != inner.epoch {
                return Err(CacheError::BlockState {
                    block,
                    reason: "its KV was computed before clear() or set_context(): never published",
                });
            }
            if (position + 1) * bs > tokens.len() {
                return Err(CacheError::BlockState {
                    block,
                    reason: "not full: too few tokens to commit it",
                });
            }
        }
        let mut request = Request {
            tokens: tokens[..blocks.len() * bs].to_vec(),
            block_table: blocks.to_vec(),
            root: root_key(&self.context.load(), salt),
            extras: extras.clone(),
            priority,
            anchors: Vec::new(),
            cacheable: true,
        };
        inner.tick += 1;
        self.extend_anchors(inner, &mut request, blocks.len());
        Ok(request.anchors.iter().map(|e| e.block).collect())
    }

    /// Drops one reference per listed block (a block may be listed as often as it is held).
    pub fn release(&self, blocks: &[BlockId]) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut counts: HashMap<BlockId, u32> = HashMap::new();
        for &block in blocks {
            inner.pool.check_id(block)?;
            let count = counts.entry(block).or_insert(0);
            *count += 1;
            if *count > inner.external_refs[block as usize] {
                return Err(CacheError::BlockState {
                    block,
                    reason: "released more often than it was acquired with allocate or \
                             match_and_acquire (a double release, or a block a request owns)",
                });
            }
        }
        inner.tick += 1;
        for &block in blocks {
            if inner.pool.is_cached(block) {
                inner.pool.touch(block, inner.tick, i32::MIN);
            }
            inner.external_refs[block as usize] -= 1;
            inner.pool.release(block);
        }
        Ok(())
    }

    // ----- retention -------------------------------------------------------------------------

    /// Pins the cached prefix of `tokens` so eviction never takes it. Returns a pin id for
    /// `unpin` and the number of blocks pinned.
    pub fn pin(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> Result<(u64, usize)> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = self.matched_blocks(&mut inner.scratch, tokens, salt, extras);
        for &block in &blocks {
            inner.pool.pin(block);
        }
        let pin_id = inner.next_pin;
        inner.next_pin += 1;
        let count = blocks.len();
        inner.pins.insert(pin_id, blocks);
        Ok((pin_id, count))
    }

    /// Releases a pin taken by `pin`.
    pub fn unpin(&self, pin_id: u64) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = inner
            .pins
            .remove(&pin_id)
            .ok_or_else(|| CacheError::InvalidInput(format!("unknown pin id {pin_id}")))?;
        for block in blocks {
            inner.pool.unpin(block);
        }
        Ok(())
    }

    // ----- reset -----------------------------------------------------------------------------

    /// Drops every unreferenced cached block, detaches referenced ones, drops all pins.
    pub fn clear(&self) {
        let mut guard = self.inner.lock();
        self.clear_locked(&mut guard);
    }

    /// Switches to a new context fingerprint; clears the cache as `clear` does.
    pub fn set_context(&self, context: BlockKey) {
        let mut guard = self.inner.lock();
        // Store first: a lookup that sees the new context finds nothing of the old.
        self.context.store(Arc::new(context));
        self.clear_locked(&mut guard);
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
            blocks_total: inner.pool.num_blocks(),
            blocks_free: inner.pool.num_free(),
            blocks_cached: inner.pool.num_cached(),
            blocks_in_use: inner.pool.num_in_use(),
            blocks_pinned: inner.pool.num_pinned(),
            blocks_evictable: inner.pool.num_evictable_leaves(),
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

    /// Asserts the pool's and the table's invariants (tests).
    pub fn check_invariants(&self) {
        let inner = self.inner.lock();
        inner.pool.check_invariants();
        let guard = self.table.guard();
        assert_eq!(self.table.len(), inner.pool.num_cached(), "table size");
        for (block, entry) in inner.entries.iter().enumerate() {
            assert_eq!(
                entry.is_some(),
                inner.pool.is_cached(block as BlockId),
                "entry of {block}"
            );
            if let Some(entry) = entry {
                let published = self
                    .table
                    .get(&entry.key, &guard)
                    .expect("cached entry in table");
                assert_eq!(published.id, entry.id);
            }
        }
    }

    // ----- internals -------------------------------------------------------------------------

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if let Some(vocab) = self.config.vocab_size {
            if let Some((index, token)) = tokens.iter().enumerate().find(|(_, &t)| t >= vocab) {
                return Err(CacheError::InvalidInput(format!(
                    "token id {token} at position {index} is outside the vocabulary (size {vocab})"
                )));
            }
        }
        Ok(())
    }

    /// The blocks of the cached prefix of `tokens` under the current context and `salt`.
    fn matched_blocks(
        &self,
        buffer: &mut Vec<u8>,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Vec<BlockId> {
        let root = root_key(&self.context.load(), salt);
        let mut blocks = Vec::new();
        self.match_chain(buffer, root, tokens, extras, |entry, _| {
            blocks.push(entry.block)
        });
        blocks
    }

    /// Walks the cached chain of `tokens` from the root, verifying every entry, calling
    /// `on_hit` for each matched block in order.
    fn match_chain(
        &self,
        buffer: &mut Vec<u8>,
        root: BlockKey,
        tokens: &[u32],
        extras: &RequestExtras,
        mut on_hit: impl FnMut(&Entry, TableKey),
    ) {
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let mut parent_key = self.hasher.root(&root);
        let mut parent = Parent::Root(root);
        for (index, chunk) in tokens.chunks_exact(bs).enumerate() {
            let block_extras = block_extras(extras, index, bs);
            let key = self.hasher.block(buffer, parent_key, chunk, &block_extras);
            match self.table.get(&key, &guard) {
                Some(entry) if entry.verifies(&parent, chunk, &block_extras) => {
                    on_hit(entry, key);
                    parent = Parent::Entry(entry.id);
                    parent_key = key;
                }
                _ => break,
            }
        }
    }

    fn prefix_match(&self, blocks: Vec<BlockId>, num_tokens: usize) -> PrefixMatch {
        let bs = self.config.block_size;
        let cached = blocks.len() * bs;
        // Every prompt token is cached: recompute only the last one (the engine needs its
        // logits), reading its KV from the shared block.
        let full_hit = cached == num_tokens && num_tokens > 0;
        let num_cached_tokens = if full_hit { num_tokens - 1 } else { cached };
        PrefixMatch {
            blocks,
            num_cached_tokens,
            full_hit,
        }
    }

    /// References `hits` and allocates `count` fresh blocks, or changes nothing.
    fn acquire_and_allocate(
        &self,
        inner: &mut Inner,
        hits: &[BlockId],
        count: usize,
    ) -> Result<Vec<BlockId>> {
        // Reference the hits first so eviction cannot take them for the fresh blocks.
        for &block in hits {
            inner.pool.acquire(block);
        }
        match inner.pool.allocate(count) {
            Ok((fresh, evicted)) => {
                for &block in &fresh {
                    inner.block_epoch[block as usize] = inner.epoch;
                }
                let guard = self.table.guard();
                for block in evicted {
                    let entry = inner.entries[block as usize]
                        .take()
                        .expect("evicted a cached block");
                    self.table.remove(&entry.key, &guard);
                    inner.counters.evictions += 1;
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

    /// Commits positions `request.anchors.len() .. target` of `request`, whose KV lies in
    /// `request.block_table[position]`.
    fn extend_anchors(&self, inner: &mut Inner, request: &mut Request, target: usize) {
        // A deduplicated anchor is another request's block, which this request does not hold:
        // it may have been evicted since the last commit. Liveness is prefix-closed (a cached
        // child keeps its parent), so drop dead anchors from the tip; their positions are
        // committed again below from this request's own copies.
        while let Some(last) = request.anchors.last() {
            let live = inner.entries[last.block as usize]
                .as_ref()
                .is_some_and(|e| e.id == last.id);
            if live {
                break;
            }
            request.anchors.pop();
        }
        let bs = self.config.block_size;
        let guard = self.table.guard();
        while request.anchors.len() < target {
            let position = request.anchors.len();
            let (parent, parent_key, parent_block) = match request.anchors.last() {
                Some(e) => (Parent::Entry(e.id), e.key, Some(e.block)),
                None => (
                    Parent::Root(request.root),
                    self.hasher.root(&request.root),
                    None,
                ),
            };
            let chunk = &request.tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(&request.extras, position, bs);
            let key = self
                .hasher
                .block(&mut inner.scratch, parent_key, chunk, &block_extras);
            let own_block = request.block_table[position];
            if inner.pool.is_cached(own_block) {
                // Only through the low-level API: the caller passed a block that is already
                // cached. Fine if it is exactly this entry; it cannot stand anywhere else.
                match self.table.get(&key, &guard) {
                    Some(e)
                        if e.block == own_block && e.verifies(&parent, chunk, &block_extras) =>
                    {
                        let anchor = e.anchor(key);
                        inner.pool.touch(anchor.block, inner.tick, request.priority);
                        request.anchors.push(anchor);
                        continue;
                    }
                    _ => {
                        request.cacheable = false;
                        return;
                    }
                }
            }
            // One probe of the table: insert, or find who holds the key already.
            let entry = Entry {
                id: inner.next_entry,
                block: own_block,
                parent,
                tokens: chunk.into(),
                extras: block_extras.into_boxed_slice(),
            };
            let anchor = match self.table.try_insert(key, entry, &guard) {
                Ok(inserted) => {
                    inner.next_entry += 1;
                    inner.pool.mark_cached(own_block, parent_block);
                    let anchor = inserted.anchor(key);
                    inner.entries[own_block as usize] = Some(anchor);
                    inner.counters.committed_blocks += 1;
                    anchor
                }
                Err(occupied) => {
                    let existing = occupied.current;
                    let mine = &occupied.not_inserted;
                    if !existing.verifies(&mine.parent, &mine.tokens, &mine.extras) {
                        // A different block owns this key: a hash collision. Never publish
                        // under it; this request's later blocks stay private.
                        inner.counters.collisions += 1;
                        request.cacheable = false;
                        return;
                    }
                    // Another request computed the same block first: it stays canonical, this
                    // request's copy is freed when the request finishes.
                    inner.counters.deduplicated_blocks += 1;
                    existing.anchor(key)
                }
            };
            inner.pool.touch(anchor.block, inner.tick, request.priority);
            request.anchors.push(anchor);
        }
    }

    fn clear_locked(&self, inner: &mut Inner) {
        inner.epoch += 1;
        for request in inner.requests.values_mut() {
            request.cacheable = false;
            request.anchors.clear();
        }
        inner.pins.clear();
        let guard = self.table.guard();
        for block in inner.pool.cached_blocks() {
            if let Some(entry) = inner.entries[block as usize].take() {
                self.table.remove(&entry.key, &guard);
            }
            inner.pool.uncache(block);
        }
    }
}

fn block_extras(extras: &RequestExtras, index: usize, block_size: usize) -> Vec<u8> {
    if extras.is_empty() {
        return Vec::new();
    }
    let start = (index * block_size) as u64;
    extras.for_block(start, start + block_size as u64)
}
