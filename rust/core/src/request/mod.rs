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
//!    a hit, from the block keys the request kept (no rehashing) and its cached chain's links.
//! 6. `finish` drops its references and forgets it. Its cached blocks stay, evictable in LRU
//!    order; its private blocks go back to the free list.
//!
//! `begin` (add + slots for the whole prompt) and `append` (tokens + their slots) keep the
//! simple whole-prompt loop for callers that want it.
//!
//! An id is live from `add_request`/`begin` to `finish`; a second `add_request` of a live id
//! is `DuplicateRequest`, every other call on an id that is not live is `UnknownRequest`, and
//! both change nothing. The request owns one reference on each block of its block table and
//! is the only one that may drop it (`cache/mod.rs`), so its blocks, shared or private, cannot be
//! evicted or reused while it holds them.
//!
//! The parts, each with its own invariants:
//! - `allocate.rs`: matching a waiting request's cached prefix and making room for its tokens;
//! - `drafts.rs`: draft tokens, `accept_drafts` and `truncate`;
//! - `keys.rs`: the block keys a request keeps, each computed at most once, where needed;
//! - `publish.rs`: `commit`, and how blocks are published.

mod allocate;
mod drafts;
mod keys;
mod publish;

use std::collections::HashMap;
use std::fmt;

use crate::cache::{Inner, PrefixCache};
use crate::error::{CacheError, Result};
use crate::key::{BlockKey, RequestExtras, TableKey};
use crate::pool::BlockId;
use crate::sliding::positions_out_of_window;
use crate::table::Anchor;

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
    /// Table key of each leading full block known so far (prefix-closed, never rehashed):
    /// hashed where the index needs one, or read from a linked child's slot (`keys.rs`).
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
    /// Its later blocks chain, in the pool, on its own copy of a deduplicated block
    /// (`publish.rs`); false for `commit_blocks`, whose caller releases blocks one by one.
    pub(crate) own_chain: bool,
    /// Its own sliding window, in place of the cache's (`set_request_window`: one lane of a
    /// hybrid layout per request, docs/vllm.md); `None` keeps the cache's.
    window: Option<usize>,
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
            own_chain: true,
            window: None,
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
        request.own_chain = false;
        request
    }

    fn num_verified(&self) -> usize {
        self.tokens.len() - self.num_drafts
    }
}

/// The live requests, by id. Boxed, so that taking one out and putting it back (`with_request`,
/// several times a request) moves a pointer, not the ~300-byte request; hashed with foldhash
/// (seeded per map), not std's SipHash, which cost ~200 instructions a lookup on an int id.
pub(crate) struct Requests {
    live: HashMap<RequestId, Box<Request>, foldhash::quality::RandomState>,
    /// Next id `begin` tries when given none.
    next_auto: i64,
}

impl Default for Requests {
    fn default() -> Self {
        Self {
            live: HashMap::default(),
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
            .map(|request| &**request)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    fn get_mut(&mut self, id: &RequestId) -> Result<&mut Request> {
        self.live
            .get_mut(id)
            .map(|request| &mut **request)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    /// Takes a request out of the map (its key with it, so putting it back clones nothing).
    fn take(&mut self, id: &RequestId) -> Result<(RequestId, Box<Request>)> {
        self.live
            .remove_entry(id)
            .ok_or_else(|| CacheError::UnknownRequest(id.clone()))
    }

    fn put(&mut self, id: RequestId, request: Box<Request>) {
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
            let window = request.window.unwrap_or(window);
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
            // The engine's processed count may pass the commits (`release_out_of_window`),
            // never the verified tokens.
            let verified = request.num_verified();
            assert!(
                request.released <= positions_out_of_window(window, block_size, verified),
                "request {id}: released a block the window at {verified} still reads"
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
        let request = Box::new(Request::waiting(
            tokens,
            salt,
            self.root_key(salt),
            inner.epoch,
            extras,
            priority,
        ));
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
        let mut request = Box::new(Request::waiting(
            tokens,
            salt,
            self.root_key(salt),
            inner.epoch,
            extras,
            priority,
        ));
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

    /// In a cache built with `WindowRelease::Explicit`: releases the request's leading positions
    /// that lie wholly before `processed_tokens + 1 - sliding_window` (capped at its block
    /// table), last first, the null block taking their place; returns how many it released now.
    /// vLLM's `remove_skipped_blocks`, which its manager calls before each allocation for the
    /// request with the tokens whose KV is written and committed. A waiting request holds no
    /// table (nothing to release); a full-attention cache releases nothing before `finish`.
    /// Refused (nothing changed): a sliding cache that releases on commit, and
    /// `processed_tokens` above the request's verified tokens (no KV can be written past
    /// them). The count may pass its committed tokens: the engine vouches for its KV.
    pub fn release_out_of_window(&self, id: &RequestId, processed_tokens: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let Some(window) = self.window_of(inner.requests.get(id)?) else {
            return Ok(0);
        };
        if !self.config.releases_explicitly() {
            return Err(CacheError::InvalidInput(
                "release_out_of_window: this sliding-window cache releases on commit (build it \
                 with window_release Explicit to release on the engine's schedule)"
                    .into(),
            ));
        }
        let request = inner.requests.get(id)?;
        // Verified, not committed: vLLM counts the drafts it verified last step before its
        // allocation caches them (positions released unpublished stay so: `publish.rs`).
        let verified = request.num_verified();
        if processed_tokens > verified {
            return Err(CacheError::InvalidInput(format!(
                "processed_tokens {processed_tokens} exceeds the {verified} verified tokens of \
                 request {id}"
            )));
        }
        if !request.scheduled {
            return Ok(0);
        }
        let end = positions_out_of_window(window, self.config.block_size, processed_tokens);
        with_request(inner, id, |inner, request| {
            self.release_positions(inner, request, end)
        })
    }

    /// In a cache built with `WindowRelease::Explicit`: gives request `id` its own sliding
    /// window of `window` tokens in place of the cache's, so that one cache (one pool, one
    /// eviction order, one free count) serves the KV groups of a hybrid model, one request per
    /// group, as vLLM's groups share one block pool (docs/vllm.md, "Hybrid and sliding-window
    /// layouts"). A window longer than any request never releases and hits the leading run of
    /// cached blocks: a full-attention group. Its lookups pass the same window
    /// (`lookup_in_window`); give each group's requests their own salt, so groups never share
    /// entries. Refused (`InvalidInput`, nothing changed): another kind of cache, a window of
    /// 0, and a request already scheduled or that has published (its table and entries were
    /// laid out under the old window).
    pub fn set_request_window(&self, id: &RequestId, window: usize) -> Result<()> {
        let mut guard = self.inner.lock();
        let request = guard.requests.get_mut(id)?;
        if !self.config.releases_explicitly() {
            return Err(CacheError::InvalidInput(
                "set_request_window: only a sliding-window cache with window_release Explicit \
                 serves requests with their own windows"
                    .into(),
            ));
        }
        if window == 0 {
            return Err(CacheError::InvalidInput(
                "set_request_window: window must be at least 1 token".into(),
            ));
        }
        if request.scheduled || !request.anchors.is_empty() {
            return Err(CacheError::InvalidInput(format!(
                "set_request_window: request {id} is already scheduled (its window is fixed \
                 before its first allocation)"
            )));
        }
        request.window = Some(window);
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

    /// The sliding window `request` lives under: its own (`set_request_window`) or the
    /// cache's; `None` in a full-attention cache.
    pub(super) fn window_of(&self, request: &Request) -> Option<usize> {
        self.config
            .sliding_window
            .map(|window| request.window.unwrap_or(window))
    }

    fn release_table(&self, inner: &mut Inner, request: &Request) {
        let table = &request.block_table[request.released..];
        if self.config.releases_explicitly() {
            // A sliding cache has no pool parents: every cached block and every duplicate is
            // evictable on its own, so the ticks alone give the order, tail first as vLLM's
            // `SingleTypeKVCacheManager.free` (`WindowRelease::Explicit`).
            release_tail_first(inner, table, request.priority, true);
            return;
        }
        if self.config.sliding_window.is_some() {
            // Positions before `released` went already, so whoever holds a duplicate's successor
            // may not hold a copy of the duplicate's content: the successor goes to the
            // canonical copy instead (`pool.rs`, `reparent`). Full attention: a duplicate keeps
            // it as a spare, so the canonical copy stays evictable in its own place, as vLLM
            // evicts it first (`pool.rs`).
            hand_over_duplicate_children(inner, table);
        }
        // Cached blocks join the LRU order now; duplicates (spares once released: `pool.rs`)
        // one tick later, so they go after the request's other blocks: vLLM frees a request's
        // blocks tail first, and a full hit's duplicate is its prompt's last block. The
        // references the request took: only it drops them (see `cache/mod.rs`). Duplicates
        // last, so a duplicate's successor is no longer held by this request when it becomes a
        // spare (a spare gives a blocked child to its canonical copy: `pool.rs`).
        let spare_tick = inner.tick + 1;
        let spares = inner
            .pool
            .finish_table(table, inner.tick, spare_tick, request.priority);
        if spares {
            inner.tick = spare_tick;
        }
    }
}

/// Drops a request's references to `blocks` (a table, or a run of positions leaving the
/// window) as vLLM's `BlockPool.free_blocks(reversed(blocks))` frees them: the cached ones join
/// the LRU order last position first, one tick each (appended to vLLM's free queue, so the tail
/// is evicted first), duplicates as spares alike, and the uncached ones go back to the free list so that the last position
/// is on top (vLLM prepends them, in that order, to the head of its queue: reused first, tail
/// first). `next_tick` says whether the first cached block needs a tick of its own.
pub(super) fn release_tail_first(
    inner: &mut Inner,
    blocks: &[BlockId],
    priority: i32,
    mut next_tick: bool,
) {
    for &block in blocks.iter().rev() {
        // A duplicate copy too: vLLM keeps every copy under its hash (`pool.rs`, spares).
        if inner.pool.is_cached(block) || inner.pool.duplicate_of(block).is_some() {
            if next_tick {
                inner.tick += 1;
            }
            next_tick = true;
            inner.pool.touch(block, inner.tick, priority);
        }
    }
    // Released first to last position: the free list is a stack, its top handed out first.
    for &block in blocks {
        // The reference the request took: only it drops it (see `cache/mod.rs`).
        inner.pool.release(block);
    }
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

#[cfg(test)]
mod tests;

/// Hands each duplicate's cached successor in `table`, if the duplicate parents it, to the
/// duplicate's canonical copy (sliding-window caches: `release_table`).
pub(super) fn hand_over_duplicate_children(inner: &mut Inner, table: &[BlockId]) {
    for (&block, &next) in table.iter().zip(table.iter().skip(1)) {
        if let Some(canonical) = inner.pool.duplicate_of(block) {
            if inner.pool.is_cached(next) && inner.pool.parent_of(next) == Some(block) {
                inner.pool.reparent(next, canonical);
            }
        }
    }
}
