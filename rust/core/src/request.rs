//! A request's life in the cache, step by step as a scheduler drives it, and how its blocks
//! are published.
//!
//! ## The life
//! A request is a sequence of tokens (its prompt, then what it generates) under an id the
//! engine chooses. It is *waiting* while it holds no blocks, *scheduled* while it does.
//! 1. `add_request` registers it: no blocks, no hashing, nothing referenced.
//! 2. `allocate_slots(n, lookahead)` makes room for the next `n` tokens to compute (a chunk
//!    of the prompt, or decode tokens) plus `lookahead` slots for draft tokens not yet known.
//!    The first call on a waiting request first matches its cached prefix and references it,
//!    so the hit and the room for the first chunk are taken in one step under the mutex: a
//!    chunk that does not fit fails with nothing changed, and the scheduler can wait or
//!    preempt. A prompt never needs all its blocks at once.
//! 3. The engine writes KV into the slots and says so with `commit(num_computed_tokens)`,
//!    which publishes every block that is now full and *verified* (below).
//! 4. `append_tokens` adds sampled tokens, or draft tokens (`draft = true`) for speculative
//!    decoding. After verification `accept_drafts(k)` keeps the first `k` drafts and drops
//!    the rest; `truncate` drops any unpublished tail. Blocks left without tokens go back.
//! 5. `preempt` drops every reference the request holds and forgets its KV: its committed
//!    blocks stay cached (evictable), so the next `allocate_slots` re-matches them, usually as
//!    a hit, from the block keys the request kept (no rehashing).
//! 6. `finish` drops its references and forgets it. Its cached blocks stay, evictable in LRU
//!    order; its private blocks go back to the free list.
//!
//! `begin` (add + slots for the whole prompt) and `append` (tokens + their slots) keep the
//! simple whole-prompt loop for callers that want it.
//!
//! An id is live from `add_request`/`begin` to `finish`; a second `add_request` of a live id
//! is `DuplicateRequest`, every other call on an id that is not live is `UnknownRequest`, and
//! both change nothing. The request owns one reference on each block of its block table and
//! is the only one that may drop it (`cache.rs`), so its blocks, shared or private, cannot be
//! evicted or reused while it holds them.
//!
//! ## Full hits
//! When every block of the prompt is cached, something must still compute the last token (its
//! logits start generation). Two ways, chosen per cache (`FullHit`):
//! - `RecomputeLastBlock` (the default): the match stops one block short, so the last block is
//!   recomputed into a private block, as vLLM's runner does. The runner writes KV as always;
//!   nothing it does can touch a shared block. The private copy deduplicates at commit.
//! - `ReuseLastBlock`: every block is shared and `num_cached_tokens` is `n - 1`; the runner
//!   computes the last token reading its KV from the shared block and must *not* write it
//!   (`last_token_shared`). One token instead of a block, for a runner that honours that.
//!
//! ## Drafts are never published
//! Draft tokens sit at the tail until `accept_drafts` (or a `truncate` that removes them).
//! `commit` may record KV written for them (the verification pass writes it), but publishes
//! only blocks whose every token is verified: no hit can ever come from a rejected draft. A
//! block once published is never written again, so `truncate` refuses to cut into one.
//!
//! ## Keys, computed once
//! A request keeps the table key of each full block it has hashed (`keys`), in order: the
//! first match, each commit, re-matching after `preempt` and exporting SHA-256 keys extend
//! them, never rehash. A reset (`clear`, `set_context`) changes every key; a waiting request
//! notices at its next match and starts over under the new context.
//!
//! ## Publishing, and two inserts of the same key
//! A request remembers, as *anchors*, the canonical entry of each position it has committed, in
//! order; a commit extends them. For the next position it takes the table key (chained on the
//! previous one) and inserts an entry for its own block with one probe of the table:
//! - the key is free: the block is published, child of the previous anchor's block;
//! - the key holds an entry that verifies (same parent entry, tokens and extras): another
//!   sequence published this block first. That copy stays canonical and becomes the anchor, so
//!   later positions chain on it; this request's own copy stays private and is freed when the
//!   request finishes (deduplication);
//! - the key holds an entry that does not verify: a hash collision. Nothing is published under
//!   it, and since every later block would chain on this one, the request publishes nothing more
//!   (it becomes non-cacheable). Correctness never depends on the hash: the cost is a miss.
//!
//! Inserts never race: they happen under the mutex, so "first" is the mutex order.
//!
//! A deduplicated anchor is another sequence's block, which this request does not hold: it can be
//! evicted between two commits. Liveness is prefix-closed (a cached child keeps its parent), so
//! dead anchors are dropped from the tip and their positions committed again from the request's
//! own copies.
//!
//! ## Non-cacheable requests
//! A scheduled request stops publishing for good after a collision, and after a `clear` or
//! `set_context`: its KV was computed under the old weights or context and must never be
//! published under the new one (`cache.rs`, on epochs). It keeps its blocks and its references;
//! `commit` then reports the positions still committed (none after a reset). Once preempted it
//! holds no KV, so it computes afresh under the new context and may publish again.

use std::collections::HashMap;
use std::fmt;

use crate::cache::{block_extras, FullHit, Inner, PrefixCache, LOOKAHEAD};
use crate::error::{CacheError, Result};
use crate::key::{block_key_with, BlockKey, RequestExtras, TableHasher, TableKey};
use crate::pool::BlockId;
use crate::sliding::{null_anchor, positions_out_of_window};
use crate::table::{Anchor, Entry, Parent};

/// An engine's own name for a request: an integer or a string.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum RequestId {
    /// An integer id (`begin` without an id picks the next unused one).
    Int(i64),
    /// A string id, as most engines use.
    Str(Box<str>),
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Int(id) => write!(f, "{id}"),
            Self::Str(id) => write!(f, "{id:?}"),
        }
    }
}

impl From<i64> for RequestId {
    fn from(id: i64) -> Self {
        Self::Int(id)
    }
}

impl From<&str> for RequestId {
    fn from(id: &str) -> Self {
        Self::Str(id.into())
    }
}

/// What `begin` hands the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginResult {
    /// The request's id: the one given, or one `begin` picked.
    pub request_id: RequestId,
    /// Blocks covering every prompt token: the cached ones, then the request's own.
    pub block_table: Vec<BlockId>,
    /// Tokens whose KV is already in the cached blocks.
    pub num_cached_tokens: usize,
    /// See `PrefixMatch::full_hit`.
    pub full_hit: bool,
    /// See `PrefixMatch::last_token_shared`.
    pub last_token_shared: bool,
}

/// What `allocate_slots` hands the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slots {
    /// Blocks this call appended to the request's block table, in order: when it matched the
    /// cached prefix (the first call after `add_request` or `preempt`), those blocks first.
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV the request has: the scheduled tokens start at this position.
    pub num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (0 when it matched nothing or did not
    /// match, being a later call).
    pub num_cached_tokens: usize,
    /// This call matched every block of the prompt (see `PrefixMatch::full_hit`).
    pub full_hit: bool,
    /// See `PrefixMatch::last_token_shared`.
    pub last_token_shared: bool,
}

/// One request: its tokens, the blocks holding their KV, and what it has published.
/// `commit_blocks` publishes through a short-lived one of these.
pub(crate) struct Request {
    /// Prompt, generated and draft tokens, in order.
    tokens: Vec<u32>,
    /// How many of the last `tokens` are unverified drafts.
    num_drafts: usize,
    /// Tokens whose KV is written (`commit`).
    num_computed: usize,
    /// One slot block per `block_size` positions; the request holds a reference on each.
    block_table: Vec<BlockId>,
    /// False while waiting (no blocks held, no prefix matched).
    scheduled: bool,
    salt: Box<[u8]>,
    /// Root key of context and salt, for the epoch below.
    root: BlockKey,
    /// The epoch `root` and `keys` belong to.
    epoch: u64,
    extras: RequestExtras,
    priority: i32,
    /// The canonical cached entry of each committed position, in order (see the module docs).
    pub(crate) anchors: Vec<Anchor>,
    /// Table key of each leading full block hashed so far (prefix-closed, never rehashed).
    keys: Vec<TableKey>,
    /// SHA-256 key of each leading full block exported so far.
    export_keys: Vec<BlockKey>,
    /// False once the request may no longer publish (after a collision, `clear`, `set_context`).
    cacheable: bool,
    /// Sliding-window caches: the leading positions of `block_table` that hold the null block
    /// (out of the window, or not needed by the hit). Always 0 in a full-attention cache.
    released: usize,
    /// The longest hit its matches may use (`limit_cached_prefix`); kept until changed.
    max_cached_tokens: Option<usize>,
}

impl Request {
    fn waiting(
        tokens: Vec<u32>,
        salt: &[u8],
        root: BlockKey,
        epoch: u64,
        extras: RequestExtras,
        priority: i32,
    ) -> Self {
        Self {
            tokens,
            num_drafts: 0,
            num_computed: 0,
            block_table: Vec::new(),
            scheduled: false,
            salt: salt.into(),
            root,
            epoch,
            extras,
            priority,
            anchors: Vec::new(),
            keys: Vec::new(),
            export_keys: Vec::new(),
            cacheable: true,
            released: 0,
            max_cached_tokens: None,
        }
    }

    /// A sequence whose KV is all in `block_table` already (the low-level `commit_blocks`).
    pub(crate) fn computed(
        tokens: Vec<u32>,
        block_table: Vec<BlockId>,
        root: BlockKey,
        epoch: u64,
        extras: RequestExtras,
        priority: i32,
    ) -> Self {
        let mut request = Self::waiting(tokens, b"", root, epoch, extras, priority);
        request.num_computed = request.tokens.len();
        request.block_table = block_table;
        request.scheduled = true;
        request
    }

    fn num_verified(&self) -> usize {
        self.tokens.len() - self.num_drafts
    }
}

/// The table key of block `position` of `tokens`, from `keys` when already computed, else
/// computed from the previous one and appended. Positions are visited in order, so `position`
/// is at most `keys.len()`.
fn table_key(
    hasher: &TableHasher,
    scratch: &mut Vec<u8>,
    keys: &mut Vec<TableKey>,
    root: &BlockKey,
    chunk: &[u32],
    block_extras: &[u8],
    position: usize,
) -> TableKey {
    if let Some(&key) = keys.get(position) {
        return key;
    }
    debug_assert_eq!(position, keys.len());
    let parent = match position {
        0 => hasher.root(root),
        _ => keys[position - 1],
    };
    let key = hasher.block(scratch, parent, chunk, block_extras);
    keys.push(key);
    key
}

/// The live requests, by id.
pub(crate) struct Requests {
    live: HashMap<RequestId, Request>,
    /// Next id `begin` tries when given none.
    next_auto: i64,
}

impl Default for Requests {
    fn default() -> Self {
        Self {
            live: HashMap::new(),
            next_auto: 1,
        }
    }
}

impl Requests {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    fn get(&self, id: &RequestId) -> Result<&Request> {
        self.live
            .get(id)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    fn get_mut(&mut self, id: &RequestId) -> Result<&mut Request> {
        self.live
            .get_mut(id)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    /// Takes a request out of the map (its key with it, so putting it back clones nothing).
    fn take(&mut self, id: &RequestId) -> Result<(RequestId, Request)> {
        self.live
            .remove_entry(id)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    fn put(&mut self, id: RequestId, request: Request) {
        self.live.insert(id, request);
    }

    fn check_new(&self, id: &RequestId) -> Result<()> {
        if self.live.contains_key(id) {
            return Err(CacheError::DuplicateRequest(id.clone()));
        }
        Ok(())
    }

    /// The id `begin` gives a request that came without one: never a live id, and never one
    /// it gave before.
    fn auto_id(&mut self) -> RequestId {
        loop {
            let id = RequestId::Int(self.next_auto);
            self.next_auto += 1;
            if !self.live.contains_key(&id) {
                return id;
            }
        }
    }

    /// Every block reference the live requests hold, one item per reference.
    pub(crate) fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.live
            .values()
            .flat_map(|r| r.block_table[r.released..].iter().copied())
    }

    /// The sliding-window invariants of every live request (`sliding.rs`), for
    /// `check_invariants`.
    pub(crate) fn check_sliding(&self, window: usize, block_size: usize, num_blocks: u32) {
        let null = num_blocks;
        for (id, request) in &self.live {
            let table = &request.block_table;
            assert!(
                request.released <= table.len(),
                "request {id}: {} released positions of {}",
                request.released,
                table.len()
            );
            assert!(
                table[..request.released].iter().all(|&b| b == null),
                "request {id}: a released position holds a real block"
            );
            assert!(
                table[request.released..].iter().all(|&b| b < num_blocks),
                "request {id}: the null block past the released positions"
            );
            let settled = request.num_computed.min(request.num_verified());
            assert!(
                request.released <= positions_out_of_window(window, block_size, settled),
                "request {id}: released a block the window at {settled} still reads"
            );
        }
    }

    /// At a reset: no scheduled request may publish again, and none still anchors on the
    /// table. (Waiting ones hold no KV: they re-key at their next match, `epoch` tells them.)
    pub(crate) fn forget_cached_prefixes(&mut self) {
        for request in self.live.values_mut() {
            if request.scheduled {
                request.cacheable = false;
            }
            request.anchors.clear();
        }
    }
}

/// What a match (or a dry run of one) found, before anything is referenced.
struct Plan {
    /// One per position of the hit; positions below `released` hold the null block.
    anchors: Vec<Anchor>,
    /// Leading positions of the hit that are the null block (sliding-window caches).
    released: usize,
    /// Position the scheduled tokens start at.
    start: usize,
    num_cached: usize,
    full_hit: bool,
    last_token_shared: bool,
    /// Fresh blocks to allocate.
    fresh: usize,
}

impl PrefixCache {
    // ----- starting -------------------------------------------------------------------------

    /// Registers a request under the engine's id: no blocks taken, nothing hashed yet.
    pub fn add_request(
        &self,
        id: RequestId,
        tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<()> {
        self.check_prompt(&tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        inner.requests.check_new(&id)?;
        let request = Request::waiting(
            tokens,
            salt,
            self.root_key(salt),
            inner.epoch,
            extras,
            priority,
        );
        inner.requests.put(id, request);
        Ok(())
    }

    /// Starts a request with slots for its whole prompt: `add_request` and `allocate_slots`
    /// for every prompt token in one step. `id` None picks an unused integer id.
    pub fn begin(
        &self,
        id: Option<RequestId>,
        tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<BeginResult> {
        self.check_prompt(&tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if let Some(id) = &id {
            inner.requests.check_new(id)?;
        }
        let mut request = Request::waiting(
            tokens,
            salt,
            self.root_key(salt),
            inner.epoch,
            extras,
            priority,
        );
        let slots = self.allocate_locked(inner, &mut request, None, 0, 0)?;
        let request_id = id.unwrap_or_else(|| inner.requests.auto_id());
        inner.requests.put(request_id.clone(), request);
        Ok(BeginResult {
            request_id,
            block_table: slots.block_ids,
            num_cached_tokens: slots.num_cached_tokens,
            full_hit: slots.full_hit,
            last_token_shared: slots.last_token_shared,
        })
    }

    // ----- scheduling -----------------------------------------------------------------------

    /// Makes room for the next `num_new_tokens` tokens of a request (they must be known:
    /// prompt, sampled or draft tokens) plus `num_lookahead_tokens` slots past them, keeping at
    /// least `watermark` blocks obtainable afterwards. On a waiting request it first matches
    /// and references the cached prefix. Fails with nothing changed (`OutOfBlocks`) when the
    /// pool cannot supply the blocks.
    pub fn allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<Slots> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.get(id)?;
        if let Some(slots) =
            self.slots_if_covered(request, num_new_tokens, num_lookahead_tokens, watermark)
        {
            return Ok(slots);
        }
        with_request(inner, id, |inner, request| {
            self.allocate_locked(
                inner,
                request,
                Some(num_new_tokens),
                num_lookahead_tokens,
                watermark,
            )
        })?
    }

    /// What `allocate_slots` with these arguments returns, when answering takes neither
    /// planning nor allocating: `Some` when the request is scheduled, no watermark is asked
    /// for, its slots already cover the tokens and its window (if any) has nothing to release.
    /// That is the common decode step; `allocate_slots` would return exactly these `Slots`
    /// and change nothing, so a caller driving several caches (`groups.rs`) may take this
    /// answer in place of the call. `None` means "call `allocate_slots`". Changes nothing.
    pub fn covered_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<Option<Slots>> {
        let inner = self.inner.lock();
        let request = inner.requests.get(id)?;
        Ok(self.slots_if_covered(request, num_new_tokens, num_lookahead_tokens, watermark))
    }

    /// Whether `allocate_slots` with these arguments would succeed now. Changes nothing.
    pub fn can_allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<bool> {
        match self.check_allocate_slots(id, num_new_tokens, num_lookahead_tokens, watermark) {
            Ok(()) => Ok(true),
            Err(CacheError::OutOfBlocks { .. }) => Ok(false),
            Err(other) => Err(other),
        }
    }

    /// `can_allocate_slots` as a `Result`: `Err(OutOfBlocks)` with the blocks the call needs
    /// (watermark included) and how many the pool could supply, when it would be refused.
    /// Changes nothing.
    pub fn check_allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let plan = self.plan_for(inner, id, num_new_tokens, num_lookahead_tokens)?;
        let want = plan.fresh + watermark;
        let available = self.obtainable_with(inner, &plan.anchors[plan.released..], want);
        if available < want {
            return Err(CacheError::OutOfBlocks {
                needed: want,
                available,
            });
        }
        Ok(())
    }

    /// Blocks `allocate_slots(id, num_new_tokens, num_lookahead_tokens)` would take from the
    /// pool now (cached prefix blocks it would reference are not counted). Changes nothing.
    pub fn blocks_needed(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<usize> {
        let mut guard = self.inner.lock();
        Ok(self
            .plan_for(&mut guard, id, num_new_tokens, num_lookahead_tokens)?
            .fresh)
    }

    /// The position the next `allocate_slots` would start computing from, changing nothing:
    /// for a waiting request the length of its cached prefix (matched from the keys it kept,
    /// so a scheduler may ask every step without rehashing the prompt), for a scheduled one
    /// its computed tokens.
    pub fn start_position(&self, id: &RequestId) -> Result<usize> {
        let mut guard = self.inner.lock();
        Ok(self.plan_for(&mut guard, id, 0, 0)?.start)
    }

    /// Caps the cached prefix the request's matches may use at `max_cached_tokens` tokens
    /// (`None` lifts the cap): its next `allocate_slots` while waiting (and `start_position`,
    /// `can_allocate_slots`, `blocks_needed` before it) considers only hits of at most that
    /// many tokens, a full hit only if the cap allows its `num_cached_tokens`. The cap stays
    /// until changed, so it also applies to a re-match after `preempt`. A coordinator running
    /// one cache per KV group uses it to make every group serve the same hit length.
    pub fn limit_cached_prefix(
        &self,
        id: &RequestId,
        max_cached_tokens: Option<usize>,
    ) -> Result<()> {
        let mut guard = self.inner.lock();
        guard.requests.get_mut(id)?.max_cached_tokens = max_cached_tokens;
        Ok(())
    }

    /// Adds tokens to a request without allocating: sampled tokens, or with `draft` unverified
    /// draft tokens for speculative decoding. Verified tokens cannot follow drafts: resolve
    /// them first (`accept_drafts`, `truncate`).
    pub fn append_tokens(&self, id: &RequestId, tokens: &[u32], draft: bool) -> Result<()> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let request = guard.requests.get_mut(id)?;
        if !draft {
            no_pending_drafts(id, request)?;
        }
        request.tokens.extend_from_slice(tokens);
        if draft {
            request.num_drafts += tokens.len();
        }
        Ok(())
    }

    /// Adds verified tokens and allocates slots for them: `append_tokens` and
    /// `allocate_slots` in one step, for the whole-prompt loop. Returns the new blocks.
    pub fn append(&self, id: &RequestId, tokens: &[u32]) -> Result<Vec<BlockId>> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.get(id)?;
        no_pending_drafts(id, request)?;
        let needed = if request.scheduled {
            (request.tokens.len() + tokens.len())
                .div_ceil(self.config.block_size)
                .saturating_sub(request.block_table.len())
        } else {
            0
        };
        let fresh = self.acquire_and_allocate(inner, &[], needed)?;
        let request = inner.requests.get_mut(id)?;
        request.tokens.extend_from_slice(tokens);
        request.block_table.extend_from_slice(&fresh);
        Ok(fresh)
    }

    /// Records that the KV of the first `num_computed_tokens` tokens is written, and publishes
    /// every full block of verified tokens among them. Returns how many leading positions of
    /// the request are now committed.
    pub fn commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.get(id)?;
        let len = request.tokens.len();
        if num_computed_tokens > len {
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {len} tokens"
            )));
        }
        let slots = request.block_table.len() * self.config.block_size;
        if num_computed_tokens > slots {
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {slots} slots: \
                 no KV can have been written past them (allocate_slots first)"
            )));
        }
        // Nothing new to publish (most decode steps): no need to take the request out.
        let target = num_computed_tokens
            .max(request.num_computed)
            .min(request.num_verified())
            / self.config.block_size;
        // Anchors at released positions are never republished (their blocks are gone), so
        // only a dead tip past them sends the commit down the slow path.
        let tip_live = request.anchors.len() <= request.released
            || request
                .anchors
                .last()
                .is_none_or(|last| anchor_live(inner, last));
        if tip_live && (!request.cacheable || target <= request.anchors.len()) {
            let request = inner.requests.get_mut(id)?;
            request.num_computed = request.num_computed.max(num_computed_tokens);
            if !self.window_moved(request) {
                return Ok(request.anchors.len());
            }
        }
        with_request(inner, id, |inner, request| {
            request.num_computed = request.num_computed.max(num_computed_tokens);
            self.publish_verified(inner, request);
            self.release_out_of_window(inner, request);
            request.anchors.len()
        })
    }

    /// Keeps the first `num_accepted` draft tokens as verified and drops the others (their
    /// KV and every block left without tokens, as `truncate`). Publishes what became full and
    /// verified. Returns how many leading positions are now committed.
    pub fn accept_drafts(&self, id: &RequestId, num_accepted: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.get(id)?;
        if num_accepted > request.num_drafts {
            return Err(CacheError::InvalidInput(format!(
                "num_accepted {num_accepted} exceeds the request's {} draft tokens",
                request.num_drafts
            )));
        }
        let keep = request.num_verified() + num_accepted;
        with_request(inner, id, |inner, request| {
            self.truncate_locked(inner, request, keep);
            request.num_drafts = 0;
            self.publish_verified(inner, request);
            self.release_out_of_window(inner, request);
            request.anchors.len()
        })
    }

    /// Drops every token from position `num_tokens` on (drafts or not), their KV, and every
    /// block left without tokens (returned, now freed). Refuses to cut into a published
    /// block: published KV is never rewritten.
    pub fn truncate(&self, id: &RequestId, num_tokens: usize) -> Result<Vec<BlockId>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        self.truncate_refusal(inner, inner.requests.get(id)?, num_tokens)?;
        with_request(inner, id, |inner, request| {
            self.truncate_locked(inner, request, num_tokens)
        })
    }

    /// Whether `truncate(id, num_tokens)` would be accepted now: `Ok` if so, else the error it
    /// would return. Changes nothing; a caller driving several caches (`groups.rs`) asks each
    /// before cutting any.
    pub fn check_truncate(&self, id: &RequestId, num_tokens: usize) -> Result<()> {
        let inner = self.inner.lock();
        self.truncate_refusal(&inner, inner.requests.get(id)?, num_tokens)
    }

    /// Why `request` may not be truncated to `num_tokens` tokens, if it may not.
    fn truncate_refusal(&self, inner: &Inner, request: &Request, num_tokens: usize) -> Result<()> {
        let len = request.tokens.len();
        let published = request.anchors.len() * self.config.block_size;
        if num_tokens > len || num_tokens == 0 {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: the request has {len}, and keeps at \
                 least one"
            )));
        }
        if num_tokens < published {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: the first {published} are in published \
                 blocks, which are never rewritten"
            )));
        }
        if let Some(window) = self.config.sliding_window {
            let first_read = positions_out_of_window(window, self.config.block_size, num_tokens);
            if request.released > 0 && first_read < request.released {
                return Err(CacheError::InvalidInput(format!(
                    "cannot truncate to {num_tokens} tokens: the query there reads the last \
                     {window} tokens (the sliding window), and this request already released \
                     the blocks holding some of them"
                )));
            }
        }
        // Every block the cut touches must be the request's alone. After a reset a block of a
        // prefix hit is no longer published (no anchor) but still shared with other requests:
        // writing into it, or freeing it, would corrupt them.
        let first = num_tokens / self.config.block_size;
        if let Some(&shared) = request.block_table.get(first..).and_then(|tail| {
            tail.iter()
                .find(|&&b| inner.pool.is_cached(b) || inner.pool.ref_count(b) != Some(1))
        }) {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: block {shared} holding them is shared \
                 with another request, and is never rewritten"
            )));
        }
        Ok(())
    }

    /// Drops every reference the request holds and its KV; its drafts are dropped too. The
    /// blocks it committed stay cached (evictable), so its next `allocate_slots` matches them
    /// again. Preempting a waiting request changes nothing.
    pub fn preempt(&self, id: &RequestId) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        with_request(inner, id, |inner, request| {
            if !request.scheduled {
                return;
            }
            inner.tick += 1;
            self.release_table(inner, request);
            let verified = request.num_verified();
            request.tokens.truncate(verified);
            request.num_drafts = 0;
            request.block_table.clear();
            request.released = 0;
            request.anchors.clear();
            request.num_computed = 0;
            request.scheduled = false;
            // Its KV is gone: computed afresh, it may publish again (a collision is found
            // again; a reset is noticed by the epoch at the next match).
            request.cacheable = true;
        })
    }

    /// Ends a request: drops its references. Cached blocks stay, now evictable.
    pub fn finish(&self, id: &RequestId) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let (_, request) = inner.requests.take(id)?;
        inner.tick += 1;
        self.release_table(inner, &request);
        Ok(())
    }

    // ----- observation ----------------------------------------------------------------------

    /// A live request's block table (empty while it waits).
    pub fn block_table(&self, id: &RequestId) -> Result<Vec<BlockId>> {
        let inner = self.inner.lock();
        Ok(inner.requests.get(id)?.block_table.clone())
    }

    /// A live request's token count (drafts included).
    pub fn num_tokens(&self, id: &RequestId) -> Result<usize> {
        let inner = self.inner.lock();
        Ok(inner.requests.get(id)?.tokens.len())
    }

    /// A live request's tokens with KV written.
    pub fn num_computed_tokens(&self, id: &RequestId) -> Result<usize> {
        let inner = self.inner.lock();
        Ok(inner.requests.get(id)?.num_computed)
    }

    /// SHA-256 keys of every full block of a request's verified tokens (see `block_keys`),
    /// each computed once for the life of the request (after a reset, once more for a request
    /// that waits: it is re-keyed under the new context).
    pub fn request_block_keys(&self, id: &RequestId) -> Result<Vec<BlockKey>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        with_request(inner, id, |inner, request| {
            if !request.scheduled {
                self.refresh_epoch(inner, request);
            }
            let bs = self.config.block_size;
            let target = request.num_verified() / bs;
            for position in request.export_keys.len()..target {
                let parent = request.export_keys.last().copied().unwrap_or(request.root);
                let chunk = &request.tokens[position * bs..(position + 1) * bs];
                let extras = block_extras(&request.extras, position, bs);
                let key = block_key_with(&mut inner.scratch, &parent, chunk, &extras);
                request.export_keys.push(key);
            }
            request.export_keys[..target].to_vec()
        })
    }

    // ----- internals ------------------------------------------------------------------------

    fn check_prompt(&self, tokens: &[u32]) -> Result<()> {
        self.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Err(CacheError::InvalidInput(
                "a request needs at least one token".into(),
            ));
        }
        Ok(())
    }

    /// A waiting request keyed under an older epoch starts over under the current one.
    fn refresh_epoch(&self, inner: &Inner, request: &mut Request) {
        if request.epoch != inner.epoch {
            request.root = self.root_key(&request.salt);
            request.epoch = inner.epoch;
            request.keys.clear();
            request.export_keys.clear();
            request.cacheable = true;
        }
    }

    /// Matches a waiting request's cached prefix under the mutex, from its kept keys.
    fn match_request(&self, inner: &mut Inner, request: &mut Request) -> Vec<Anchor> {
        self.refresh_epoch(inner, request);
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let mut anchors = Vec::new();
        let mut parent = Parent::Root(request.root);
        for position in 0..request.num_verified() / bs {
            let chunk = &request.tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(&request.extras, position, bs);
            let key = table_key(
                &self.hasher,
                &mut inner.scratch,
                &mut request.keys,
                &request.root,
                chunk,
                &block_extras,
                position,
            );
            match self.table.get(&key, &guard) {
                Some(entry) if entry.verifies(&parent, chunk, &block_extras) => {
                    anchors.push(entry.anchor(key));
                    parent = Parent::Entry(entry.id);
                }
                _ => break,
            }
        }
        anchors
    }

    /// `plan` for request `id`, which stays in place.
    fn plan_for(
        &self,
        inner: &mut Inner,
        id: &RequestId,
        num_new: usize,
        lookahead: usize,
    ) -> Result<Plan> {
        with_request(inner, id, |inner, request| {
            self.plan(inner, request, Some(num_new), lookahead)
        })?
    }

    /// What allocating `num_new` (None: every known token not yet computed) plus `lookahead`
    /// slots for `request` would take. Touches nothing but the request's key memo.
    fn plan(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        num_new: Option<usize>,
        lookahead: usize,
    ) -> Result<Plan> {
        let bs = self.config.block_size;
        let mut plan = Plan {
            anchors: Vec::new(),
            released: 0,
            start: request.num_computed,
            num_cached: 0,
            full_hit: false,
            last_token_shared: false,
            fresh: 0,
        };
        let held = if request.scheduled {
            request.block_table.len()
        } else if let Some(window) = self.config.sliding_window {
            let (anchors, hit) = self.match_sliding(inner, request, window);
            plan.anchors = anchors;
            plan.released = hit.first_needed;
            plan.num_cached = hit.num_cached;
            plan.full_hit = hit.full_hit;
            plan.last_token_shared = hit.last_token_shared;
            plan.start = hit.num_cached;
            plan.anchors.len()
        } else {
            plan.anchors = self.match_request(inner, request);
            let verified = request.num_verified();
            let cap = request.max_cached_tokens;
            let (num_cached, full_hit, shared) = self.hit_length(&mut plan.anchors, verified, cap);
            plan.num_cached = num_cached;
            plan.full_hit = full_hit;
            plan.last_token_shared = shared;
            plan.start = num_cached;
            plan.anchors.len()
        };
        let known = request.tokens.len() - plan.start;
        let num_new = num_new.unwrap_or(known);
        if num_new > known {
            return Err(CacheError::InvalidInput(format!(
                "num_new_tokens {num_new} is more than the request's {known} tokens not yet \
                 computed (append them first)"
            )));
        }
        plan.fresh = (plan.start + num_new + lookahead)
            .div_ceil(bs)
            .saturating_sub(held);
        Ok(plan)
    }

    /// How many blocks of `anchors` a hit uses, by the cache's `FullHit` mode and the request's
    /// cap; returns (cached tokens, full hit, last token shared) and drops the anchors it does
    /// not use.
    pub(crate) fn hit_length(
        &self,
        anchors: &mut Vec<Anchor>,
        num_tokens: usize,
        cap: Option<usize>,
    ) -> (usize, bool, bool) {
        let mut shape = self.hit_shape(anchors.len(), num_tokens);
        if let Some(cap) = cap.filter(|&cap| shape.0 > cap) {
            // The longest block boundary under the cap: below the prompt's last block, since
            // the cap is below this hit, so never a full hit.
            let blocks = anchors.len().min(cap / self.config.block_size);
            shape = self.hit_shape(blocks, num_tokens);
        }
        anchors.truncate(self.hit_blocks(shape));
        shape
    }

    /// Blocks a hit of this shape uses: every cached token's, and the shared last block.
    pub(crate) fn hit_blocks(&self, (cached, _, shared): (usize, bool, bool)) -> usize {
        let bs = self.config.block_size;
        if shared {
            cached / bs + 1
        } else {
            cached / bs
        }
    }

    /// (cached tokens, full hit, last token shared) for `matched` leading cached blocks of a
    /// `num_tokens` prompt under the cache's `FullHit` mode.
    pub(crate) fn hit_shape(&self, matched: usize, num_tokens: usize) -> (usize, bool, bool) {
        let bs = self.config.block_size;
        let full_hit = num_tokens > 0 && matched * bs == num_tokens;
        match (full_hit, self.config.full_hit) {
            (false, _) => (matched * bs, false, false),
            (true, FullHit::RecomputeLastBlock) => (num_tokens - bs, true, false),
            (true, FullHit::ReuseLastBlock) => (num_tokens - 1, true, true),
        }
    }

    /// Matches a waiting request in a sliding-window cache (`sliding.rs`): the anchors of the
    /// chosen hit, the null stand-in at each position it does not need.
    fn match_sliding(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        window: usize,
    ) -> (Vec<Anchor>, crate::sliding::SlidingHit) {
        self.refresh_epoch(inner, request);
        let verified = request.num_verified();
        let num_full = verified / self.config.block_size;
        self.extend_sliding_keys(
            &mut inner.scratch,
            &request.root,
            &request.tokens,
            &request.extras,
            &mut request.export_keys,
            &mut request.keys,
            num_full,
        );
        let found = self.probe_sliding(
            &request.root,
            &request.tokens,
            &request.extras,
            &request.export_keys,
            &request.keys,
            num_full,
        );
        let present: Vec<bool> = found.iter().map(Option::is_some).collect();
        let hit = self.choose_sliding_hit(window, &present, verified, request.max_cached_tokens);
        let null = null_anchor(self.config.num_blocks);
        let anchors = found[..hit.blocks]
            .iter()
            .enumerate()
            .map(|(position, anchor)| match anchor {
                Some(anchor) if position >= hit.first_needed => *anchor,
                // `choose_sliding_hit` found every needed position cached.
                _ => {
                    debug_assert!(position < hit.first_needed);
                    null
                }
            })
            .collect();
        (anchors, hit)
    }

    /// Whether a sliding-window request has positions to release now (one comparison; always
    /// false in a full-attention cache).
    #[inline]
    fn window_moved(&self, request: &Request) -> bool {
        self.config.sliding_window.is_some_and(|window| {
            let settled = request.num_computed.min(request.num_verified());
            positions_out_of_window(window, self.config.block_size, settled) > request.released
        })
    }

    /// The `Slots` of a decode step that needs nothing (see `covered_slots`), or `None`.
    #[inline]
    fn slots_if_covered(
        &self,
        request: &Request,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Option<Slots> {
        if !request.scheduled || watermark > 0 {
            return None;
        }
        let start = request.num_computed;
        let end = start + num_new_tokens;
        let covered = end <= request.tokens.len()
            && (end + num_lookahead_tokens).div_ceil(self.config.block_size)
                <= request.block_table.len()
            && !self.window_moved(request);
        covered.then(|| Slots {
            block_ids: Vec::new(),
            num_computed_tokens: start,
            num_cached_tokens: 0,
            full_hit: false,
            last_token_shared: false,
        })
    }

    /// Releases every position the request's window has left (`sliding.rs`): its reference is
    /// dropped (touched first if cached, so it joins the LRU order now) and the null block
    /// takes its place.
    fn release_out_of_window(&self, inner: &mut Inner, request: &mut Request) {
        let Some(window) = self.config.sliding_window else {
            return;
        };
        let settled = request.num_computed.min(request.num_verified());
        let end = positions_out_of_window(window, self.config.block_size, settled)
            .min(request.block_table.len());
        if end <= request.released {
            return;
        }
        inner.tick += 1;
        let null = self.config.num_blocks;
        for position in request.released..end {
            let block = std::mem::replace(&mut request.block_table[position], null);
            if inner.pool.is_cached(block) {
                inner.pool.touch(block, inner.tick, request.priority);
            }
            // The request's own reference (see `cache.rs`): only it drops it.
            inner.pool.release(block);
        }
        inner.counters.blocks_released += (end - request.released) as u64;
        request.released = end;
    }

    /// Blocks the pool could hand out after referencing `hits`, capped at `want`.
    fn obtainable_with(&self, inner: &mut Inner, hits: &[Anchor], want: usize) -> usize {
        for anchor in hits {
            inner.pool.acquire(anchor.block);
        }
        let available = inner.pool.available(want);
        // Releasing restores each hit's exact eviction position: nothing was touched.
        for anchor in hits {
            inner.pool.release(anchor.block);
        }
        available
    }

    fn allocate_locked(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        num_new: Option<usize>,
        lookahead: usize,
        watermark: usize,
    ) -> Result<Slots> {
        let was_waiting = !request.scheduled;
        let plan = self.plan(inner, request, num_new, lookahead)?;
        if watermark > 0 {
            let want = plan.fresh + watermark;
            let available = self.obtainable_with(inner, &plan.anchors[plan.released..], want);
            if available < want {
                return Err(CacheError::OutOfBlocks {
                    needed: want,
                    available,
                });
            }
        }
        // Every position of the hit, null ones included: that is the block table.
        let hits: Vec<BlockId> = plan.anchors.iter().map(|a| a.block).collect();
        let referenced = &hits[plan.released..];
        let fresh = self.acquire_and_allocate(inner, referenced, plan.fresh)?;
        if was_waiting {
            inner.tick += 1;
            for &block in referenced {
                inner.pool.touch(block, inner.tick, request.priority);
            }
            inner.counters.lookups += 1;
            inner.counters.lookup_tokens += request.num_verified() as u64;
            inner.counters.hit_tokens += plan.num_cached as u64;
            request.anchors = plan.anchors;
            request.released = plan.released;
            request.num_computed = plan.start;
            request.scheduled = true;
        }
        let mut block_ids = hits;
        block_ids.extend_from_slice(&fresh);
        request.block_table.extend_from_slice(&block_ids);
        self.release_out_of_window(inner, request);
        Ok(Slots {
            block_ids,
            num_computed_tokens: plan.start,
            num_cached_tokens: plan.num_cached,
            full_hit: plan.full_hit,
            last_token_shared: plan.last_token_shared,
        })
    }

    fn truncate_locked(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        num_tokens: usize,
    ) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let removed = request.tokens.len() - num_tokens;
        request.tokens.truncate(num_tokens);
        request.num_drafts = request.num_drafts.saturating_sub(removed);
        request.num_computed = request.num_computed.min(num_tokens);
        request.keys.truncate(num_tokens / bs);
        request.export_keys.truncate(num_tokens / bs);
        let keep = num_tokens.div_ceil(bs);
        if !request.scheduled || request.block_table.len() <= keep {
            return Vec::new();
        }
        let freed = request.block_table.split_off(keep);
        for &block in &freed {
            // Past every published position: private blocks, freed right here.
            inner.pool.release(block);
        }
        freed
    }

    fn release_table(&self, inner: &mut Inner, request: &Request) {
        for &block in &request.block_table[request.released..] {
            if inner.pool.is_cached(block) {
                inner.pool.touch(block, inner.tick, request.priority);
            }
            // The reference the request took: only it drops it (see `cache.rs`).
            inner.pool.release(block);
        }
    }

    /// Publishes the full blocks of verified tokens with KV written, if the request may.
    fn publish_verified(&self, inner: &mut Inner, request: &mut Request) {
        if request.cacheable {
            inner.tick += 1;
            let target = request.num_computed.min(request.num_verified()) / self.config.block_size;
            self.publish(inner, request, target);
        }
    }

    /// Commits positions `request.anchors.len() .. target` of `request`, whose KV lies in
    /// `request.block_table[position]`, by the rules in the module docs.
    pub(crate) fn publish(&self, inner: &mut Inner, request: &mut Request, target: usize) {
        // Dead anchors are recommitted from the request's own copies; a released position has
        // none any more (the null block stands there), so the pops stop above it.
        while request.anchors.len() > request.released {
            let last = request.anchors[request.anchors.len() - 1];
            if anchor_live(inner, &last) {
                break;
            }
            request.anchors.pop();
        }
        if request.anchors.len() < request.released {
            return;
        }
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let sliding = self.config.sliding_window.is_some();
        if sliding {
            // Keys from the SHA-256 block keys: an entry names its parent by key (`sliding.rs`).
            self.extend_sliding_keys(
                &mut inner.scratch,
                &request.root,
                &request.tokens,
                &request.extras,
                &mut request.export_keys,
                &mut request.keys,
                target,
            );
        }
        // Every key to publish, kept by the request (computed once, chained on keys whatever
        // the table holds); then the table reads of the next few positions start together so
        // their cache misses overlap (`match_chain`).
        for p in request.keys.len()..target {
            let chunk = &request.tokens[p * bs..(p + 1) * bs];
            let block_extras = block_extras(&request.extras, p, bs);
            table_key(
                &self.hasher,
                &mut inner.scratch,
                &mut request.keys,
                &request.root,
                chunk,
                &block_extras,
                p,
            );
        }
        let mut prefetched_to = 0;
        while request.anchors.len() < target {
            let position = request.anchors.len();
            let (parent, parent_block) = match request.anchors.last() {
                _ if sliding => (Parent::Root(sliding_parent(request, position)), None),
                Some(e) => (Parent::Entry(e.id), Some(e.block)),
                None => (Parent::Root(request.root), None),
            };
            if position >= prefetched_to {
                prefetched_to = target.min(position + LOOKAHEAD);
                for p in position..prefetched_to {
                    self.table
                        .prefetch(&request.keys[p], Some(request.block_table[p]));
                }
            }
            let chunk = &request.tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(&request.extras, position, bs);
            let key = request.keys[position];
            let own_block = request.block_table[position];
            if inner.pool.is_cached(own_block) {
                // A shared block of the request's own hit (reuse-last-block full hits), or a
                // block `commit_blocks` was passed that is already cached. Fine if it is
                // exactly this entry; it cannot stand anywhere else.
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
                    let origin = (&request.root, &request.extras);
                    if sliding {
                        // The parent block may be released or evicted: name it by key.
                        let block_key = request.export_keys[position];
                        let parent_key = position.checked_sub(1).map(|p| request.export_keys[p]);
                        inner.events.stored_with_keys(
                            own_block,
                            (block_key, parent_key),
                            origin,
                            chunk,
                            &inserted.extras,
                        );
                    } else {
                        inner.events.stored(
                            own_block,
                            parent_block,
                            origin,
                            chunk,
                            &inserted.extras,
                        );
                    }
                    let anchor = inserted.anchor(key);
                    inner.entries[own_block as usize] = Some(anchor);
                    inner.counters.committed_blocks += 1;
                    anchor
                }
                Err(occupied) => {
                    let existing = occupied.current;
                    let mine = &occupied.not_inserted;
                    if !existing.verifies(&mine.parent, &mine.tokens, &mine.extras) {
                        inner.counters.collisions += 1;
                        request.cacheable = false;
                        return;
                    }
                    inner.counters.deduplicated_blocks += 1;
                    existing.anchor(key)
                }
            };
            inner.pool.touch(anchor.block, inner.tick, request.priority);
            request.anchors.push(anchor);
        }
    }
}

/// Whether `anchor` is still the entry published in its block (a null stand-in never is).
fn anchor_live(inner: &Inner, anchor: &Anchor) -> bool {
    inner
        .entries
        .get(anchor.block as usize)
        .and_then(Option::as_ref)
        .is_some_and(|e| e.id == anchor.id)
}

/// The parent an entry at `position` names in a sliding-window cache: the previous block's
/// SHA-256 key, or the request's root for block 0 (`sliding.rs`).
fn sliding_parent(request: &Request, position: usize) -> BlockKey {
    position
        .checked_sub(1)
        .map_or(request.root, |p| request.export_keys[p])
}

/// Runs `f` on request `id` taken out of the map, so that `f` may borrow the rest of `inner`
/// mutably (`publish` does), and puts it back: its key with it, so nothing is cloned.
fn with_request<T>(
    inner: &mut Inner,
    id: &RequestId,
    f: impl FnOnce(&mut Inner, &mut Request) -> T,
) -> Result<T> {
    let (key, mut request) = inner.requests.take(id)?;
    let result = f(inner, &mut request);
    inner.requests.put(key, request);
    Ok(result)
}

fn no_pending_drafts(id: &RequestId, request: &Request) -> Result<()> {
    if request.num_drafts > 0 {
        return Err(CacheError::InvalidInput(format!(
            "request {id} has {} draft tokens: accept_drafts or truncate them before appending \
             verified tokens",
            request.num_drafts
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::RequestId;
    use crate::cache::tests::{cache, no_extras};
    use crate::error::CacheError;
    use crate::key::context_fingerprint;
    use crate::{CacheConfig, FullHit, PrefixCache};

    #[test]
    fn calls_on_an_id_that_is_not_live_are_unknown_request_and_change_nothing() {
        let c = cache(8, 2);
        let r = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        c.finish(&r.request_id).unwrap();
        let before = c.stats();
        for id in [r.request_id, RequestId::Int(99), "x".into()] {
            let unknown = CacheError::UnknownRequest(id.clone());
            let id = &id;
            assert_eq!(c.finish(id), Err(unknown.clone()));
            assert_eq!(c.commit(id, 0), Err(unknown.clone()));
            assert_eq!(c.append(id, &[1]), Err(unknown.clone()));
            assert_eq!(c.append_tokens(id, &[1], true), Err(unknown.clone()));
            assert_eq!(c.allocate_slots(id, 0, 0, 0), Err(unknown.clone()));
            assert_eq!(c.can_allocate_slots(id, 0, 0, 0), Err(unknown.clone()));
            assert_eq!(c.truncate(id, 1), Err(unknown.clone()));
            assert_eq!(c.accept_drafts(id, 0), Err(unknown.clone()));
            assert_eq!(c.preempt(id), Err(unknown.clone()));
            assert_eq!(c.request_block_keys(id), Err(unknown.clone()));
            assert_eq!(c.block_table(id), Err(unknown.clone()));
            assert_eq!(c.num_tokens(id), Err(unknown));
        }
        assert_eq!(c.stats(), before);
        c.check_invariants();
    }

    #[test]
    fn request_ids_are_never_reused() {
        let c = cache(8, 2);
        let a = c.begin(None, vec![1], b"", no_extras(), 0).unwrap();
        c.finish(&a.request_id).unwrap();
        let b = c.begin(None, vec![1], b"", no_extras(), 0).unwrap();
        assert_ne!(a.request_id, b.request_id);
        assert_eq!(
            c.finish(&a.request_id),
            Err(CacheError::UnknownRequest(a.request_id))
        );
        c.finish(&b.request_id).unwrap();
    }

    #[test]
    fn malformed_calls_are_invalid_input_and_change_nothing() {
        let c = PrefixCache::new(
            crate::CacheConfig {
                vocab_size: Some(10),
                ..crate::CacheConfig::new(8, 2)
            },
            context_fingerprint(b"unit"),
        )
        .unwrap();
        assert!(matches!(
            c.begin(None, vec![], b"", no_extras(), 0),
            Err(CacheError::InvalidInput(_))
        ));
        assert!(matches!(
            c.begin(None, vec![1, 10], b"", no_extras(), 0),
            Err(CacheError::InvalidInput(_))
        ));
        let r = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        let before = c.stats();
        assert!(matches!(
            c.commit(&r.request_id, 4),
            Err(CacheError::InvalidInput(_))
        ));
        assert!(matches!(
            c.append(&r.request_id, &[3, 11]),
            Err(CacheError::InvalidInput(_))
        ));
        assert_eq!(c.stats(), before);
        assert_eq!(
            c.num_tokens(&r.request_id),
            Ok(3),
            "the request is still live"
        );
        c.finish(&r.request_id).unwrap();
        c.check_invariants();
    }

    #[test]
    fn out_of_blocks_leaves_the_request_as_it_was() {
        let c = cache(2, 2);
        let r = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        assert_eq!(
            c.append(&r.request_id, &[4, 5]),
            Err(CacheError::OutOfBlocks {
                needed: 1,
                available: 0
            })
        );
        assert_eq!(c.num_tokens(&r.request_id), Ok(3));
        assert_eq!(c.block_table(&r.request_id).unwrap().len(), 2);
        // Room for the last token of the current block needs no new block.
        assert_eq!(c.append(&r.request_id, &[4]), Ok(vec![]));
        c.finish(&r.request_id).unwrap();
        c.check_invariants();
    }

    #[test]
    fn commit_is_idempotent_and_publishes_only_full_blocks() {
        let c = cache(8, 2);
        let r = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        assert_eq!(c.commit(&r.request_id, 1), Ok(0));
        assert_eq!(c.commit(&r.request_id, 3), Ok(1));
        assert_eq!(c.commit(&r.request_id, 3), Ok(1));
        assert_eq!(c.stats().committed_blocks, 1);
        c.append(&r.request_id, &[4, 5]).unwrap();
        assert_eq!(
            c.commit(&r.request_id, 5),
            Ok(2),
            "generated tokens publish too"
        );
        c.finish(&r.request_id).unwrap();
        assert_eq!(
            c.lookup(&[1, 2, 3, 4, 5], b"", &no_extras())
                .unwrap()
                .num_cached_tokens,
            4
        );
        c.check_invariants();
    }

    #[test]
    fn a_request_live_across_a_reset_never_publishes() {
        for reset in [PrefixCache::clear as fn(&PrefixCache), |c: &PrefixCache| {
            c.set_context(context_fingerprint(b"other"))
        }] {
            let c = cache(8, 2);
            let r = c
                .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
                .unwrap();
            assert_eq!(c.commit(&r.request_id, 2), Ok(1));
            reset(&c);
            assert_eq!(
                c.commit(&r.request_id, 4),
                Ok(0),
                "nothing is committed any more"
            );
            c.append(&r.request_id, &[5, 6]).unwrap();
            assert_eq!(
                c.commit(&r.request_id, 6),
                Ok(0),
                "not even blocks allocated after"
            );
            assert_eq!(c.stats().blocks_cached, 0);
            c.finish(&r.request_id).unwrap();
            assert_eq!(c.stats().blocks_free, 8, "its blocks are freed, not cached");
            c.check_invariants();
        }
    }

    #[test]
    fn a_full_hit_in_reuse_mode_shares_every_block_and_recomputes_one_token() {
        let c = PrefixCache::new(
            CacheConfig {
                full_hit: FullHit::ReuseLastBlock,
                ..CacheConfig::new(8, 2)
            },
            context_fingerprint(b"unit"),
        )
        .unwrap();
        let a = c
            .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
            .unwrap();
        c.commit(&a.request_id, 4).unwrap();
        let b = c
            .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
            .unwrap();
        assert!(b.full_hit && b.last_token_shared);
        assert_eq!(b.num_cached_tokens, 3);
        assert_eq!(b.block_table, a.block_table);
        assert_eq!(c.ref_count(a.block_table[1]), Ok(2));
        c.finish(&a.request_id).unwrap();
        c.finish(&b.request_id).unwrap();
        c.check_invariants();
    }

    #[test]
    fn a_collision_stops_publishing_and_only_costs_a_miss() {
        // One-bit table keys: find a seed under which the two prompts' first blocks collide.
        let (a, b) = (vec![1, 2], vec![3, 4]);
        let c = (0..64)
            .map(|seed| {
                let config = crate::CacheConfig {
                    key_bits: 1,
                    ..crate::CacheConfig::new(8, 2)
                };
                PrefixCache::with_table_seed(config, context_fingerprint(b"unit"), seed).unwrap()
            })
            .find(|c| {
                let key = |t: &[u32]| {
                    let root = c.hasher.root(&c.root_key(b""));
                    c.hasher.block(&mut Vec::new(), root, t, b"")
                };
                key(&a) == key(&b)
            })
            .expect("half the seeds collide");
        let first = c.begin(None, a.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(c.commit(&first.request_id, 2), Ok(1));
        let second = c.begin(None, b.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(
            second.num_cached_tokens, 0,
            "the colliding entry does not verify"
        );
        assert_eq!(c.commit(&second.request_id, 2), Ok(0));
        assert_eq!(c.stats().collisions, 1);
        c.finish(&first.request_id).unwrap();
        c.finish(&second.request_id).unwrap();
        let probe = |t: &[u32]| [t, &[0]].concat();
        assert_eq!(
            c.lookup(&probe(&a), b"", &no_extras()).unwrap().blocks,
            first.block_table
        );
        assert!(c
            .lookup(&probe(&b), b"", &no_extras())
            .unwrap()
            .blocks
            .is_empty());
        c.check_invariants();
    }

    #[test]
    fn an_evicted_deduplicated_anchor_is_recommitted_from_the_own_copy() {
        let c = cache(5, 1);
        let a = c.begin(None, vec![1, 2], b"", no_extras(), 0).unwrap();
        let b = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        c.commit(&a.request_id, 2).unwrap();
        c.commit(&b.request_id, 1).unwrap(); // anchors on a's first block
        c.finish(&a.request_id).unwrap();
        // Pressure evicts a's cached chain (b holds only its own, uncached copies).
        let pressure = c.allocate(2).unwrap();
        assert_eq!(c.stats().evictions, 2);
        assert_eq!(
            c.commit(&b.request_id, 3),
            Ok(3),
            "b republishes from its own blocks"
        );
        assert_eq!(
            c.lookup(&[1, 2, 3, 0], b"", &no_extras()).unwrap().blocks,
            b.block_table
        );
        c.release(&pressure).unwrap();
        c.finish(&b.request_id).unwrap();
        c.check_invariants();
    }
}
