//! A request's life in the cache, and how its blocks are published.
//!
//! ## The life
//! 1. `begin` matches the longest chain of cached full blocks of the prompt, takes a reference
//!    on each, and allocates private blocks for the rest, as one step under the mutex. If every
//!    block of the prompt is cached, the request is a *full hit*: only the final token is
//!    recomputed (to get its logits), reading its KV from the shared block, and nothing is
//!    written into that block.
//! 2. The engine writes KV into the request's private blocks.
//! 3. `commit` publishes every block that has become full (prompt and generated tokens alike),
//!    so the next turn of a chat hits the previous answer.
//! 4. `append` adds generated tokens, allocating blocks as they are needed.
//! 5. `finish` drops the request's references and forgets the request. Its cached blocks stay,
//!    evictable in LRU order; its private blocks go back to the free list.
//!
//! A request id is live from `begin` to `finish`; every other call on an id that is not live is
//! `UnknownRequest` and changes nothing. Ids are never reused. The request owns one reference on
//! each block of its block table and is the only one that may drop it (`cache.rs`), so its
//! blocks, shared or private, cannot be evicted or reused while it is live.
//!
//! ## Publishing, and two inserts of the same key
//! A request remembers, as *anchors*, the canonical entry of each position it has committed, in
//! order; a commit extends them. For the next position it computes the table key chained on the
//! last anchor's and inserts an entry for its own block with one probe of the table:
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
//! A request stops publishing for good after a collision, and after a `clear` or `set_context`
//! while it is live: its KV was computed under the old weights or context and must never be
//! published under the new one (`cache.rs`, on epochs). It keeps its blocks and its references;
//! `commit` then reports the positions still committed (none after a reset).

use std::collections::HashMap;

use crate::cache::{block_extras, Inner, PrefixCache, LOOKAHEAD};
use crate::error::{CacheError, Result};
use crate::key::{BlockKey, RequestExtras, TableKey};
use crate::pool::BlockId;
use crate::table::{Anchor, Entry, Parent};

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

/// One live request: a sequence of tokens, the blocks holding its KV, and what it has
/// published. `commit_blocks` publishes through a short-lived one of these.
pub(crate) struct Request {
    tokens: Vec<u32>,
    /// One block per started block of `tokens`; the request holds a reference on each.
    block_table: Vec<BlockId>,
    root: BlockKey,
    extras: RequestExtras,
    priority: i32,
    /// The canonical cached entry of each committed position, in order (see the module docs).
    pub(crate) anchors: Vec<Anchor>,
    /// False once the request may no longer publish (after a collision, `clear`, `set_context`).
    cacheable: bool,
}

impl Request {
    pub(crate) fn new(
        tokens: Vec<u32>,
        block_table: Vec<BlockId>,
        root: BlockKey,
        extras: RequestExtras,
        priority: i32,
        anchors: Vec<Anchor>,
    ) -> Self {
        Self {
            tokens,
            block_table,
            root,
            extras,
            priority,
            anchors,
            cacheable: true,
        }
    }
}

/// The live requests, by id.
pub(crate) struct Requests {
    live: HashMap<u64, Request>,
    next_id: u64,
}

impl Default for Requests {
    fn default() -> Self {
        Self {
            live: HashMap::new(),
            next_id: 1,
        }
    }
}

impl Requests {
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    fn get(&self, id: u64) -> Result<&Request> {
        self.live.get(&id).ok_or(CacheError::UnknownRequest(id))
    }

    fn get_mut(&mut self, id: u64) -> Result<&mut Request> {
        self.live.get_mut(&id).ok_or(CacheError::UnknownRequest(id))
    }

    fn remove(&mut self, id: u64) -> Result<Request> {
        self.live.remove(&id).ok_or(CacheError::UnknownRequest(id))
    }

    /// Every block reference the live requests hold, one item per reference.
    pub(crate) fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.live
            .values()
            .flat_map(|r| r.block_table.iter().copied())
    }

    /// At a reset: no live request may publish again, and none still anchors on the table.
    pub(crate) fn forget_cached_prefixes(&mut self) {
        for request in self.live.values_mut() {
            request.cacheable = false;
            request.anchors.clear();
        }
    }
}

impl PrefixCache {
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
        let root = self.root_key(salt);
        let mut anchors = Vec::new();
        self.match_chain(&mut inner.scratch, root, &tokens, &extras, |anchor| {
            anchors.push(anchor);
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
        let requests = &mut inner.requests;
        let request_id = requests.next_id;
        requests.next_id += 1;
        let request = Request::new(tokens, block_table.clone(), root, extras, priority, anchors);
        requests.live.insert(request_id, request);
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
        let request = inner.requests.get(request_id)?;
        let total = request.tokens.len() + tokens.len();
        let needed = total
            .div_ceil(self.config.block_size)
            .saturating_sub(request.block_table.len());
        let fresh = self.acquire_and_allocate(inner, &[], needed)?;
        let request = inner.requests.get_mut(request_id)?;
        request.tokens.extend_from_slice(tokens);
        request.block_table.extend_from_slice(&fresh);
        Ok(fresh)
    }

    /// Publishes every full block among the first `num_computed_tokens` tokens of a request,
    /// whose KV the engine has written. Returns how many positions are now committed.
    pub fn commit(&self, request_id: u64, num_computed_tokens: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let len = inner.requests.get(request_id)?.tokens.len();
        if num_computed_tokens > len {
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {len} tokens"
            )));
        }
        // Out of the map while publishing: `publish` borrows the rest of `inner` mutably.
        let mut request = inner.requests.remove(request_id)?;
        if request.cacheable {
            inner.tick += 1;
            self.publish(
                inner,
                &mut request,
                num_computed_tokens / self.config.block_size,
            );
        }
        let committed = request.anchors.len();
        inner.requests.live.insert(request_id, request);
        Ok(committed)
    }

    /// Ends a request: drops its references. Cached blocks stay, now evictable.
    pub fn finish(&self, request_id: u64) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.remove(request_id)?;
        inner.tick += 1;
        for &block in &request.block_table {
            if inner.pool.is_cached(block) {
                inner.pool.touch(block, inner.tick, request.priority);
            }
            // The reference the request took: only `finish` drops it (see `cache.rs`).
            inner.pool.release(block);
        }
        Ok(())
    }

    /// A live request's block table.
    pub fn block_table(&self, request_id: u64) -> Result<Vec<BlockId>> {
        let inner = self.inner.lock();
        Ok(inner.requests.get(request_id)?.block_table.clone())
    }

    /// A live request's token count.
    pub fn num_tokens(&self, request_id: u64) -> Result<usize> {
        let inner = self.inner.lock();
        Ok(inner.requests.get(request_id)?.tokens.len())
    }

    /// Commits positions `request.anchors.len() .. target` of `request`, whose KV lies in
    /// `request.block_table[position]`, by the rules in the module docs.
    pub(crate) fn publish(&self, inner: &mut Inner, request: &mut Request, target: usize) {
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
        // Keys of the next few positions, hashed ahead (they chain on keys, whatever the table
        // holds) so their index, slot and token-row reads start together (`match_chain`).
        let mut keys = [TableKey(0); LOOKAHEAD];
        let mut keys_from = usize::MAX;
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
            if !(keys_from..keys_from.saturating_add(LOOKAHEAD)).contains(&position) {
                let ahead = position..target.min(position + LOOKAHEAD);
                let mut key = parent_key;
                for (slot, p) in keys.iter_mut().zip(ahead.clone()) {
                    let chunk = &request.tokens[p * bs..(p + 1) * bs];
                    let block_extras = block_extras(&request.extras, p, bs);
                    key = self
                        .hasher
                        .block(&mut inner.scratch, key, chunk, &block_extras);
                    *slot = key;
                }
                for (key, p) in keys.iter().zip(ahead) {
                    self.table.prefetch(key, Some(request.block_table[p]));
                }
                keys_from = position;
            }
            let chunk = &request.tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(&request.extras, position, bs);
            let key = keys[position - keys_from];
            let own_block = request.block_table[position];
            if inner.pool.is_cached(own_block) {
                // Only through `commit_blocks`: the caller passed a block that is already
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

#[cfg(test)]
mod tests {
    use crate::cache::tests::{cache, no_extras};
    use crate::error::CacheError;
    use crate::key::context_fingerprint;
    use crate::PrefixCache;

    #[test]
    fn calls_on_an_id_that_is_not_live_are_unknown_request_and_change_nothing() {
        let c = cache(8, 2);
        let r = c.begin(vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        c.finish(r.request_id).unwrap();
        let before = c.stats();
        for id in [r.request_id, r.request_id + 1, 0] {
            let unknown = CacheError::UnknownRequest(id);
            assert_eq!(c.finish(id), Err(unknown.clone()));
            assert_eq!(c.commit(id, 0), Err(unknown.clone()));
            assert_eq!(c.append(id, &[1]), Err(unknown.clone()));
            assert_eq!(c.block_table(id), Err(unknown.clone()));
            assert_eq!(c.num_tokens(id), Err(unknown));
        }
        assert_eq!(c.stats(), before);
        c.check_invariants();
    }

    #[test]
    fn request_ids_are_never_reused() {
        let c = cache(8, 2);
        let a = c.begin(vec![1], b"", no_extras(), 0).unwrap();
        c.finish(a.request_id).unwrap();
        let b = c.begin(vec![1], b"", no_extras(), 0).unwrap();
        assert_ne!(a.request_id, b.request_id);
        assert_eq!(
            c.finish(a.request_id),
            Err(CacheError::UnknownRequest(a.request_id))
        );
        c.finish(b.request_id).unwrap();
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
            c.begin(vec![], b"", no_extras(), 0),
            Err(CacheError::InvalidInput(_))
        ));
        assert!(matches!(
            c.begin(vec![1, 10], b"", no_extras(), 0),
            Err(CacheError::InvalidInput(_))
        ));
        let r = c.begin(vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        let before = c.stats();
        assert!(matches!(
            c.commit(r.request_id, 4),
            Err(CacheError::InvalidInput(_))
        ));
        assert!(matches!(
            c.append(r.request_id, &[3, 11]),
            Err(CacheError::InvalidInput(_))
        ));
        assert_eq!(c.stats(), before);
        assert_eq!(
            c.num_tokens(r.request_id),
            Ok(3),
            "the request is still live"
        );
        c.finish(r.request_id).unwrap();
        c.check_invariants();
    }

    #[test]
    fn out_of_blocks_leaves_the_request_as_it_was() {
        let c = cache(2, 2);
        let r = c.begin(vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        assert_eq!(
            c.append(r.request_id, &[4, 5]),
            Err(CacheError::OutOfBlocks {
                needed: 1,
                available: 0
            })
        );
        assert_eq!(c.num_tokens(r.request_id), Ok(3));
        assert_eq!(c.block_table(r.request_id).unwrap().len(), 2);
        // Room for the last token of the current block needs no new block.
        assert_eq!(c.append(r.request_id, &[4]), Ok(vec![]));
        c.finish(r.request_id).unwrap();
        c.check_invariants();
    }

    #[test]
    fn commit_is_idempotent_and_publishes_only_full_blocks() {
        let c = cache(8, 2);
        let r = c.begin(vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        assert_eq!(c.commit(r.request_id, 1), Ok(0));
        assert_eq!(c.commit(r.request_id, 3), Ok(1));
        assert_eq!(c.commit(r.request_id, 3), Ok(1));
        assert_eq!(c.stats().committed_blocks, 1);
        c.append(r.request_id, &[4, 5]).unwrap();
        assert_eq!(
            c.commit(r.request_id, 5),
            Ok(2),
            "generated tokens publish too"
        );
        c.finish(r.request_id).unwrap();
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
            let r = c.begin(vec![1, 2, 3, 4], b"", no_extras(), 0).unwrap();
            assert_eq!(c.commit(r.request_id, 2), Ok(1));
            reset(&c);
            assert_eq!(
                c.commit(r.request_id, 4),
                Ok(0),
                "nothing is committed any more"
            );
            c.append(r.request_id, &[5, 6]).unwrap();
            assert_eq!(
                c.commit(r.request_id, 6),
                Ok(0),
                "not even blocks allocated after"
            );
            assert_eq!(c.stats().blocks_cached, 0);
            c.finish(r.request_id).unwrap();
            assert_eq!(c.stats().blocks_free, 8, "its blocks are freed, not cached");
            c.check_invariants();
        }
    }

    #[test]
    fn a_full_hit_shares_every_block_and_recomputes_one_token() {
        let c = cache(8, 2);
        let a = c.begin(vec![1, 2, 3, 4], b"", no_extras(), 0).unwrap();
        c.commit(a.request_id, 4).unwrap();
        let b = c.begin(vec![1, 2, 3, 4], b"", no_extras(), 0).unwrap();
        assert!(b.full_hit);
        assert_eq!(b.num_cached_tokens, 3);
        assert_eq!(b.block_table, a.block_table);
        assert_eq!(c.ref_count(a.block_table[1]), Ok(2));
        c.finish(a.request_id).unwrap();
        c.finish(b.request_id).unwrap();
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
        let first = c.begin(a.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(c.commit(first.request_id, 2), Ok(1));
        let second = c.begin(b.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(
            second.num_cached_tokens, 0,
            "the colliding entry does not verify"
        );
        assert_eq!(c.commit(second.request_id, 2), Ok(0));
        assert_eq!(c.stats().collisions, 1);
        c.finish(first.request_id).unwrap();
        c.finish(second.request_id).unwrap();
        assert_eq!(
            c.lookup(&a, b"", &no_extras()).unwrap().blocks,
            first.block_table
        );
        assert!(c.lookup(&b, b"", &no_extras()).unwrap().blocks.is_empty());
        c.check_invariants();
    }

    #[test]
    fn an_evicted_deduplicated_anchor_is_recommitted_from_the_own_copy() {
        let c = cache(5, 1);
        let a = c.begin(vec![1, 2], b"", no_extras(), 0).unwrap();
        let b = c.begin(vec![1, 2, 3], b"", no_extras(), 0).unwrap();
        c.commit(a.request_id, 2).unwrap();
        c.commit(b.request_id, 1).unwrap(); // anchors on a's first block
        c.finish(a.request_id).unwrap();
        // Pressure evicts a's cached chain (b holds only its own, uncached copies).
        let pressure = c.allocate(2).unwrap();
        assert_eq!(c.stats().evictions, 2);
        assert_eq!(
            c.commit(b.request_id, 3),
            Ok(3),
            "b republishes from its own blocks"
        );
        assert_eq!(
            c.lookup(&[1, 2, 3], b"", &no_extras()).unwrap().blocks,
            b.block_table
        );
        c.release(&pressure).unwrap();
        c.finish(b.request_id).unwrap();
        c.check_invariants();
    }
}
