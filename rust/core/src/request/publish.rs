//! `commit`, and how a request's blocks are published.
//!
//! ## Publishing, and two inserts of the same key
//! A request remembers, as *anchors*, the canonical entry of each position it has committed, in
//! order; a commit extends them. For the next position it inserts an entry for its own block.
//! When the previous anchor's entry has no child yet, the block is published as its first,
//! linked child, with no key needed (`table/runs.rs`, on keys). Otherwise it takes the table
//! key (chained on the previous one, hashed from the last key the request knows) and probes
//! the table once:
//! - the key is free: the block is published, child of the previous anchor's block;
//! - the previous anchor's linked child, or the key's entry, verifies (same parent entry, tokens and extras): another
//!   sequence published this block first. That copy stays canonical and becomes the anchor, so
//!   later positions chain on it; this request's own copy stays private and is freed when the
//!   request finishes (deduplication);
//! - the key holds an entry that does not verify: a hash collision. Nothing is published under
//!   it, and since every later block would chain on this one, the request publishes nothing more
//!   (it becomes non-cacheable). Correctness never depends on the hash: the cost is a miss.
//!
//! Inserts never race: they happen under the mutex, so "first" is the mutex order.
//!
//! ## Fresh runs
//! Once a commit has published a block itself, the entry it just wrote has no child, so the
//! request's next block, if not cached already, can only be published, as that entry's first
//! (linked) child: no probe, no outcome to tell apart. `publish_fresh_run` takes such positions
//! in a loop of its own until the first cached block, where the general loop takes over; a miss
//! publishes nearly all its blocks there (PROFILE.md, issue 24, round 14).
//!
//! ## Later blocks chain on the request's own copy
//! A deduplicated position's anchor is another sequence's block, which this request does not hold.
//! Its own copy becomes a *duplicate* of it in the pool (`pool.rs`), and the pool parent of the
//! request's next published block is that copy, not the canonical block: in the pool, a request's
//! chain is always the blocks it holds. So the canonical block is evictable once nobody
//! references it, as vLLM counts it (a full hit's recomputed last block is the common case:
//! `request/allocate.rs`), and evicting it moves its entry into a duplicate rather than dropping
//! it, so the request's later entries, which name it as their parent, stay reachable. A duplicate
//! the request lets go of (`finish`, `preempt`) keeps its next block, if it parents it, as a
//! spare (`pool.rs`), so the canonical copy still goes first, as in vLLM; taking the spare hands
//! the block to the canonical copy. A sliding-window cache keeps duplicates the same way (vLLM
//! keeps every copy under its hash), with no pool parents to hand over (`sliding.rs`). The
//! low-level `commit_blocks`, whose caller
//! releases blocks one by one in any order, keeps chaining on canonical blocks instead.
//!
//! An anchor names a block, and an entry can move, or go when nobody holds it: a dead anchor (its
//! block no longer holds its entry) is dropped from the tip and its position committed again
//! from the request's own copy (deduplicating again against the moved entry). Liveness is
//! prefix-closed at the entry level (a cached entry's parent entry is cached), so only the tip
//! needs the check.
//!
//! ## Non-cacheable requests
//! A scheduled request stops publishing for good after a collision, and after a `clear` or
//! `set_context`: its KV was computed under the old weights or context and must never be
//! published under the new one (`cache/mod.rs`, on epochs). It keeps its blocks and its references;
//! `commit` then reports the positions still committed (none after a reset). Once preempted it
//! holds no KV, so it computes afresh under the new context and may publish again.

use super::{with_request, Request};
use crate::cache::{block_extras, Inner, PrefixCache, LOOKAHEAD};
use crate::error::{CacheError, Result};
use crate::key::{BlockKey, RequestExtras, TableKey};
use crate::pool::{BlockId, CHAIN_HINT_DISTANCE};
use crate::request::RequestId;
use crate::sliding::null_anchor;
use crate::table::{Anchor, Insertion, NewEntry, Parent};

impl PrefixCache {
    /// Records that the KV of the first `num_computed_tokens` tokens is written, and publishes
    /// every full block of verified tokens among them. Returns how many leading positions of
    /// the request are now committed.
    pub fn commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        self.commit_locked(&mut guard, id, num_computed_tokens)
    }

    /// `commit`, unless it would publish more than `max_blocks` new blocks: then nothing
    /// changes and the answer is `Ok(None)`. For a caller that runs large commits elsewhere
    /// (the Python binding releases the GIL for them) and small ones where it is: it decides
    /// and, for the small ones (most decode steps), commits under one lock, where asking first
    /// would take two. A refused commit is refused here as by `commit`.
    pub fn commit_at_most(
        &self,
        id: &RequestId,
        num_computed_tokens: usize,
        max_blocks: usize,
    ) -> Result<Option<usize>> {
        let mut guard = self.inner.lock();
        let request = guard.requests.get(id)?;
        self.commit_refusal(request, num_computed_tokens)?;
        let target = num_computed_tokens
            .max(request.num_computed)
            .min(request.num_verified())
            / self.config.block_size;
        if request.cacheable && target.saturating_sub(request.anchors.len()) > max_blocks {
            return Ok(None);
        }
        self.commit_locked(&mut guard, id, num_computed_tokens)
            .map(Some)
    }

    /// `commit` under the lock already taken.
    fn commit_locked(
        &self,
        inner: &mut Inner,
        id: &RequestId,
        num_computed_tokens: usize,
    ) -> Result<usize> {
        let request = inner.requests.get(id)?;
        self.commit_refusal(request, num_computed_tokens)?;
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
                .is_none_or(|last| self.anchor_live(last));
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
            self.release_passed_positions(inner, request);
            request.anchors.len()
        })
    }

    /// Whether `commit(id, num_computed_tokens)` would be accepted now: `Ok` if so, else the
    /// error it would return. Changes nothing; a caller driving several caches (`groups/`)
    /// asks each before committing in any, since a commit publishes at once.
    pub fn check_commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<()> {
        let inner = self.inner.lock();
        self.commit_refusal(inner.requests.get(id)?, num_computed_tokens)
    }

    /// Why `request` may not record `num_computed_tokens` tokens of KV, if it may not.
    fn commit_refusal(&self, request: &Request, num_computed_tokens: usize) -> Result<()> {
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
        Ok(())
    }

    /// Publishes the full blocks of verified tokens with KV written, if the request may.
    pub(super) fn publish_verified(&self, inner: &mut Inner, request: &mut Request) {
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
            if self.anchor_live(&last) {
                break;
            }
            request.anchors.pop();
        }
        // Positions released before they were published (an engine whose processed count ran
        // ahead of its commits: vLLM releases verified drafts' blocks at its next allocation,
        // before it caches them) are never published: the null block stands there, as vLLM's
        // `cache_full_blocks` skips null blocks and caches the positions after them.
        let null = self.config.num_blocks;
        while request.anchors.len() < request.released.min(target) {
            request.anchors.push(null_anchor(null));
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
        // Keys are hashed only where the index needs them (`table/runs.rs`, on keys): a first
        // block, a branch, a table without links. A child published as its parent's first,
        // linked child takes the key the request knows already, or none: a commit that only
        // extends a chain hashes nothing. The request keeps what it hashed (`keys`, a prefix
        // of its blocks' keys), and the table reads of the next few positions (their slots and
        // token rows; an index word only where the entry may be indexed) start together so
        // their cache misses overlap.
        // Sized once: a long miss would otherwise regrow (and copy) the list several times.
        request
            .anchors
            .reserve(target.saturating_sub(request.anchors.len()));
        let mut extras_buffer = Vec::new();
        let links = self.table.links();
        if request.anchors.is_empty() && target > 0 {
            // A first block is always indexed: its key is prefetched with the rest.
            self.extend_keys(
                &mut inner.scratch,
                &mut request.keys,
                (&request.root, &request.tokens, &request.extras),
                0,
            );
        }
        // Sliced once to the positions this commit covers, so each block's reads below index
        // within a length the loop's condition bounds (`position < target`).
        let block_table = &request.block_table[..target];
        let tokens = &request.tokens[..target * bs];
        let mut prefetched_to = 0;
        let fresh_runs = !sliding && self.table.links();
        while request.anchors.len() < target {
            let position = request.anchors.len();
            // `parent_block`: the parent entry's block (events name the chain by it);
            // `chain_parent`: the pool parent (the request's own copy, see the module docs).
            let parent_block = match request.anchors.last() {
                Some(e) if !sliding => Some(e.block),
                _ => None,
            };
            let chain_parent = match position.checked_sub(1) {
                Some(previous) if request.own_chain && !sliding => Some(block_table[previous]),
                _ => parent_block,
            };
            if position >= prefetched_to {
                prefetched_to = target.min(position + LOOKAHEAD);
                for (p, &block) in (position..).zip(&block_table[position..prefetched_to]) {
                    // A run's later blocks are linked, not indexed: no index word to read (a
                    // first block's key is known, and a sliding cache knows every key).
                    let key = request.keys.get(p).unwrap_or(&TableKey::UNKNOWN);
                    self.table.prefetch(key, Some(block), p == 0 || sliding);
                }
            }
            let chunk = &tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(&request.extras, position, bs, &mut extras_buffer);
            let own_block = block_table[position];
            // The parent entry built in place in the new entry: a `Parent` is 40 bytes, and
            // built apart it was copied in for every block (PROFILE.md, round 7).
            let entry = NewEntry {
                id: inner.next_entry,
                block: own_block,
                parent: match request.anchors.last() {
                    _ if sliding => Parent::Root(sliding_parent(request, position)),
                    Some(e) => Parent::Entry(e.id),
                    None => Parent::Root(request.root),
                },
                tokens: chunk,
                extras: block_extras,
            };
            if inner.pool.is_cached(own_block) {
                // A shared block of the request's own hit (reuse-last-block full hits), or a
                // block `commit_blocks` was passed that is already cached. Fine if it is
                // exactly this entry (its parent, tokens and extras: then its key is this
                // position's too); it cannot stand anywhere else.
                let published = self.table.published(own_block, &guard);
                match published.zip(self.table.entry(own_block, &guard)) {
                    Some((anchor, e)) if e.verifies(&entry.parent, chunk, block_extras) => {
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
            let key = if sliding
                || !links
                || !self
                    .table
                    .takes_first_child(&entry.parent, parent_block, &guard)
            {
                let known = request.keys.len();
                let key = self.extend_keys(
                    &mut inner.scratch,
                    &mut request.keys,
                    (&request.root, &request.tokens, &request.extras),
                    position,
                );
                if known < position && links && !sliding {
                    // Left in the slots of the request's matched blocks that hold none.
                    self.fill_keys(
                        &mut request.anchors[known..],
                        &request.keys[known..position],
                    );
                }
                key
            } else {
                request
                    .keys
                    .get(position)
                    .copied()
                    .unwrap_or(TableKey::UNKNOWN)
            };
            let anchor = match self.table.insert(key, &entry, parent_block, &guard) {
                Insertion::Inserted(anchor) => {
                    inner.next_entry += 1;
                    // Cached and touched in one call: one metadata pass, one `refresh`.
                    inner.pool.mark_cached_at(
                        own_block,
                        chain_parent,
                        inner.tick,
                        request.priority,
                    );
                    if request.own_chain && !sliding {
                        // The pool chain is the request's own block table (module docs).
                        if let Some(previous) = position.checked_sub(CHAIN_HINT_DISTANCE) {
                            inner.pool.set_chain_hint(own_block, block_table[previous]);
                        }
                    }
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
                            block_extras,
                        );
                    } else {
                        inner
                            .events
                            .stored(own_block, parent_block, origin, chunk, block_extras);
                    }
                    inner.counters.committed_blocks += 1;
                    request.anchors.push(anchor);
                    if fresh_runs {
                        let run = FreshRun {
                            keys: &request.keys,
                            block_table,
                            tokens,
                            root: &request.root,
                            extras: &request.extras,
                            own_chain: request.own_chain,
                            priority: request.priority,
                        };
                        self.publish_fresh_run(
                            inner,
                            &run,
                            &mut request.anchors,
                            &mut prefetched_to,
                            &mut extras_buffer,
                        );
                    }
                    continue;
                }
                Insertion::Collision => {
                    inner.counters.collisions += 1;
                    request.cacheable = false;
                    return;
                }
                Insertion::Present(mut existing) => {
                    if links && !sliding && key.is_known() && !existing.key.is_known() {
                        // A linked child found by its content: the key hashed for it is its own.
                        self.table.fill_key(&existing, key, &guard);
                        existing.key = key;
                    }
                    let duplicate = request.own_chain;
                    let new_duplicate = !duplicate
                        || inner
                            .pool
                            .mark_duplicate(own_block, existing.block, chain_parent);
                    if new_duplicate {
                        // Not again when a moved entry is met again (a dead anchor's recommit).
                        inner.counters.deduplicated_blocks += 1;
                    }
                    let anchor = existing;
                    if duplicate {
                        // The request computed this block itself and reads its own copy: the
                        // canonical copy is not used, so it keeps its place in the eviction
                        // order (vLLM caches its copy without touching the first one).
                        request.anchors.push(anchor);
                        continue;
                    }
                    anchor
                }
            };
            inner.pool.touch(anchor.block, inner.tick, request.priority);
            request.anchors.push(anchor);
        }
    }
}

/// What `publish_fresh_run` reads of the request: the keys it has hashed (a prefix of its
/// blocks'), its block table and tokens sliced to the positions the commit covers, and what
/// every entry and event of it names.
struct FreshRun<'a> {
    keys: &'a [TableKey],
    block_table: &'a [BlockId],
    tokens: &'a [u32],
    root: &'a BlockKey,
    extras: &'a RequestExtras,
    own_chain: bool,
    priority: i32,
}

impl PrefixCache {
    /// Publishes the positions after the one just inserted for as long as each is a *fresh*
    /// block: the request's own block, not cached. The entry published last then has no child
    /// (`insert` just wrote its slot), so the next is its first child: linked, with no probe of
    /// the index or of a child link and no outcome to tell apart (`Table::insert_first_child`),
    /// and its pool parent is the block published before it, whether or not the request chains
    /// on its own copies (they are the same block). The general loop takes over at the first
    /// cached block (PROFILE.md, issue 24, round 14). Not for sliding-window caches, nor for a
    /// table without links.
    #[inline(always)] // once per commit that publishes
    fn publish_fresh_run(
        &self,
        inner: &mut Inner,
        run: &FreshRun<'_>,
        anchors: &mut Vec<Anchor>,
        prefetched_to: &mut usize,
        extras_buffer: &mut Vec<u8>,
    ) {
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let target = run.block_table.len();
        let Some(&last) = anchors.last() else {
            return;
        };
        let mut parent = last;
        let start = anchors.len();
        let first_id = inner.next_entry;
        // Zipped, so no position is bounds-checked in the loop; the entry ids and the counter
        // are settled once at the end.
        let blocks = run.block_table.get(start..).unwrap_or_default();
        let chunks = run
            .tokens
            .get(start * bs..)
            .unwrap_or_default()
            .chunks_exact(bs);
        let mut published = 0;
        for (&own_block, chunk) in blocks.iter().zip(chunks) {
            let position = start + published;
            // Before the `is_cached` read below, so the window's first line is asked for too.
            if position >= *prefetched_to {
                *prefetched_to = target.min(position + LOOKAHEAD);
                for &block in &run.block_table[position..*prefetched_to] {
                    // Linked: the key is not read. The block's metadata line too: the loop
                    // reads it first (`is_cached`), and it is cold after the forward pass.
                    self.table.prefetch(&TableKey::UNKNOWN, Some(block), false);
                    inner.pool.prefetch_meta(block);
                }
            }
            if inner.pool.is_cached(own_block) {
                break;
            }
            // A linked child needs no key: the one the request hashed already, if it did.
            let key = run.keys.get(position).copied().unwrap_or(TableKey::UNKNOWN);
            let block_extras = block_extras(run.extras, position, bs, extras_buffer);
            let entry = NewEntry {
                id: first_id + published as u64,
                block: own_block,
                parent: Parent::Entry(parent.id),
                tokens: chunk,
                extras: block_extras,
            };
            let anchor = self
                .table
                .insert_first_child(key, &entry, parent.block, &guard);
            let chain_hint = position
                .checked_sub(CHAIN_HINT_DISTANCE)
                .filter(|_| run.own_chain)
                .map(|previous| run.block_table[previous]);
            inner.pool.mark_cached_under_held(
                own_block,
                parent.block,
                inner.tick,
                run.priority,
                chain_hint,
            );
            inner.events.stored(
                own_block,
                Some(parent.block),
                (run.root, run.extras),
                chunk,
                block_extras,
            );
            anchors.push(anchor);
            parent = anchor;
            published += 1;
        }
        inner.next_entry = first_id + published as u64;
        inner.counters.committed_blocks += published as u64;
    }

    /// Whether `anchor` is still the entry published in its block (a null stand-in never is).
    /// Under the mutex (the table's writer side).
    pub(super) fn anchor_live(&self, anchor: &Anchor) -> bool {
        self.table
            .published(anchor.block, &self.table.guard())
            .is_some_and(|e| e.id == anchor.id)
    }
}

/// The parent an entry at `position` names in a sliding-window cache: the previous block's
/// SHA-256 key, or the request's root for block 0 (`sliding.rs`).
pub(super) fn sliding_parent(request: &Request, position: usize) -> BlockKey {
    position
        .checked_sub(1)
        .map_or(request.root, |p| request.export_keys[p])
}
