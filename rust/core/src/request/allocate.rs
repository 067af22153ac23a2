//! Allocation and matching: how `allocate_slots` makes room for a request's next tokens, matching
//! a waiting request's cached prefix first (the life is in `mod.rs`).
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

use super::drafts::no_pending_drafts;
use super::{release_tail_first, with_request, Request};
use crate::cache::{block_extras, Inner, PrefixCache};
use crate::error::{CacheError, Result};
use crate::pool::BlockId;
use crate::request::{RequestId, Slots};
use crate::sliding::{null_anchor, positions_out_of_window};
use crate::table::{Anchor, Parent};

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
    /// and change nothing, so a caller driving several caches (`groups/mod.rs`) may take this
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
        let want = with_watermark(plan.fresh, watermark)?;
        let hits: Vec<BlockId> = plan.anchors[plan.released..]
            .iter()
            .map(|a| a.block)
            .collect();
        let available = self.obtainable_with(inner, &hits, want);
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

    /// Matches a waiting request's cached prefix under the mutex, from its kept keys.
    ///
    /// As in `match_chain`: the first block is found through the index, each later one through
    /// its parent's link (or the index, at a branch), verified in place (`table/runs.rs`). Keys
    /// are taken from the request's memo or a linked child's slot, or hashed where the index
    /// needs one and kept there; keys hashed at a branch are left in the matched slots that
    /// held none (`fill_keys`).
    fn match_request(&self, inner: &mut Inner, request: &mut Request) -> Vec<Anchor> {
        self.refresh_epoch(inner, request);
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let num_full = request.num_verified() / bs;
        // Every key is hashed by the commit if not here: sized once, not regrown.
        request
            .keys
            .reserve(num_full.saturating_sub(request.keys.len()));
        // Sized once for a full hit: grown by doubling, a 64-block hit reallocated 7 times
        // (~4% of its begin+commit+finish). Sizing it lazily, at the first hit, measured no
        // better on misses (callgrind).
        let mut anchors: Vec<Anchor> = Vec::with_capacity(num_full);
        // The first matched position whose slot holds no key, while the walk has not hashed it.
        let mut first_unknown = None;
        let mut extras_buffer = Vec::new();
        for p in 0..num_full {
            let chunk = &request.tokens[p * bs..(p + 1) * bs];
            let block_extras = block_extras(&request.extras, p, bs, &mut extras_buffer);
            let parent = match anchors.last() {
                Some(last) => {
                    // Down a run: the linked child verifies without a key, and its slot holds
                    // its key or none (`Table::get_linked_child`), so matched blocks are not
                    // hashed; the request keeps a key it learns this way.
                    if let Some(anchor) =
                        self.table
                            .get_linked_child(last, chunk, block_extras, &guard)
                    {
                        if !anchor.key.is_known() {
                            first_unknown.get_or_insert(p);
                        }
                        if p == request.keys.len() && anchor.key.is_known() {
                            debug_assert_eq!(
                                anchor.key,
                                self.hasher.block(
                                    &mut inner.scratch,
                                    request.keys[p - 1],
                                    chunk,
                                    block_extras
                                ),
                                "a linked child's stored key is the one its chain computes"
                            );
                            request.keys.push(anchor.key);
                        }
                        anchors.push(anchor);
                        continue;
                    }
                    if !self.table.may_have_indexed_children(last, &guard) {
                        // No other child: the hit ends here, and nothing was hashed for it.
                        return anchors;
                    }
                    Parent::Entry(last.id)
                }
                None => {
                    if let Some(key) = request.keys.first() {
                        // The first block's entry is read while the rest of the call runs up
                        // to the probe. A prefetch hint, no effect on any answer.
                        self.table.prefetch_entry(key);
                    }
                    Parent::Root(request.root)
                }
            };
            // A first block, or a branch: through the index, with the key. The keys hashed on
            // the way are left in the hit's slots that hold none.
            let key = self.extend_keys(
                &mut inner.scratch,
                &mut request.keys,
                (&request.root, &request.tokens, &request.extras),
                p,
            );
            if let Some(from) = first_unknown.take() {
                self.fill_keys(&mut anchors[from..], &request.keys[from..p]);
            }
            match self
                .table
                .get_verified(&key, &parent, chunk, block_extras, &guard)
            {
                Some(anchor) => anchors.push(anchor),
                None => return anchors,
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
    /// slots for `request` would take. Touches nothing but the request's key memo and the keys
    /// of matched slots that held none (`match_request`).
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
        } else if let Some(window) = self.window_of(request) {
            let cap = match_cap(request, num_new)?;
            let (anchors, hit) = self.match_sliding(inner, request, window, cap);
            plan.anchors = anchors;
            plan.released = hit.first_needed;
            plan.num_cached = hit.num_cached;
            plan.full_hit = hit.full_hit;
            plan.last_token_shared = hit.last_token_shared;
            plan.start = hit.num_cached;
            plan.anchors.len()
        } else {
            let cap = match_cap(request, num_new)?;
            plan.anchors = self.match_request(inner, request);
            let verified = request.num_verified();
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
        let end = (plan.start + num_new)
            .checked_add(lookahead)
            .ok_or_else(|| {
                CacheError::InvalidInput(format!(
                    "num_lookahead_tokens {lookahead} past position {} overflows a 64-bit count",
                    plan.start + num_new
                ))
            })?;
        plan.fresh = end.div_ceil(bs).saturating_sub(held);
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
        let shape = self
            .config
            .full_hit
            .shape(matched, num_tokens, self.config.block_size);
        (shape.num_cached, shape.full_hit, shape.last_token_shared)
    }

    /// Matches a waiting request in a sliding-window cache (`sliding.rs`): the anchors of the
    /// chosen hit, the null stand-in at each position it does not need.
    fn match_sliding(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        window: usize,
        cap: Option<usize>,
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
        let hit = self.choose_sliding_hit(window, &present, verified, cap);
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
    pub(super) fn window_moved(&self, request: &Request) -> bool {
        if self.config.releases_explicitly() {
            return false;
        }
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
        // Counts that overflow are not covered: `allocate_slots` refuses them by name.
        let end = start.checked_add(num_new_tokens)?;
        let covered = end <= request.tokens.len()
            && end
                .checked_add(num_lookahead_tokens)?
                .div_ceil(self.config.block_size)
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

    /// Releases every position the request's window has left (`sliding.rs`), in a cache
    /// that releases on commit (a no-op with `WindowRelease::Explicit`).
    pub(super) fn release_passed_positions(&self, inner: &mut Inner, request: &mut Request) {
        let Some(window) = self.config.sliding_window else {
            return;
        };
        if self.config.releases_explicitly() {
            return;
        }
        let settled = request.num_computed.min(request.num_verified());
        let end = positions_out_of_window(window, self.config.block_size, settled);
        self.release_positions(inner, request, end);
    }

    /// Releases the request's positions from its first unreleased one up to `end` (capped at
    /// its table): its reference is dropped (touched first if cached, so it joins the LRU
    /// order now) and the null block takes its place. With `WindowRelease::Explicit` they are
    /// released as vLLM frees them (`release_tail_first`); otherwise on one tick. Returns how
    /// many it released.
    pub(super) fn release_positions(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        end: usize,
    ) -> usize {
        let end = end.min(request.block_table.len());
        if end <= request.released {
            return 0;
        }
        let null = self.config.num_blocks;
        let released: Vec<BlockId> = request.block_table[request.released..end]
            .iter_mut()
            .map(|slot| std::mem::replace(slot, null))
            .collect();
        if self.config.releases_explicitly() {
            // As vLLM's `_remove_blocks_in_range` frees them into its free queue.
            release_tail_first(inner, &released, request.priority, true);
        } else {
            inner.tick += 1;
            for &block in &released {
                // A duplicate (a spare once released) joins the order with them.
                if inner.pool.is_cached(block) || inner.pool.duplicate_of(block).is_some() {
                    inner.pool.touch(block, inner.tick, request.priority);
                }
                // The request's own reference (see `cache/mod.rs`): only it drops it.
                inner.pool.release(block);
            }
        }
        let count = end - request.released;
        inner.counters.blocks_released += count as u64;
        request.released = end;
        count
    }

    /// Blocks the pool could hand out after referencing `hits`, capped at `want`.
    fn obtainable_with(&self, inner: &mut Inner, hits: &[BlockId], want: usize) -> usize {
        inner.pool.acquire_run(hits);
        let available = inner.pool.available(want);
        // Releasing restores each hit's exact eviction position: nothing was touched.
        for &block in hits {
            inner.pool.release(block);
        }
        available
    }

    pub(super) fn allocate_locked(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        num_new: Option<usize>,
        lookahead: usize,
        watermark: usize,
    ) -> Result<Slots> {
        let was_waiting = !request.scheduled;
        let plan = self.plan(inner, request, num_new, lookahead)?;
        // Every position of the hit, null ones included: that is the block table.
        let hits: Vec<BlockId> = plan.anchors.iter().map(|a| a.block).collect();
        let referenced = &hits[plan.released..];
        if watermark > 0 {
            let want = with_watermark(plan.fresh, watermark)?;
            let available = self.obtainable_with(inner, referenced, want);
            if available < want {
                return Err(CacheError::OutOfBlocks {
                    needed: want,
                    available,
                });
            }
        }
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
        self.release_passed_positions(inner, request);
        Ok(Slots {
            block_ids,
            num_computed_tokens: plan.start,
            num_cached_tokens: plan.num_cached,
            full_hit: plan.full_hit,
            last_token_shared: plan.last_token_shared,
        })
    }
}

/// The longest hit a waiting request's match may use: its own cap (`limit_cached_prefix`),
/// and, when the call names `num_new` tokens, room for them before the request's end. So a hit
/// that grew since the scheduler last asked `start_position` (another request committed the
/// same prefix meanwhile) is cut back to leave room for the tokens it asked for, rather than
/// the call being refused: `Slots::num_computed_tokens` says where they start.
fn match_cap(request: &Request, num_new: Option<usize>) -> Result<Option<usize>> {
    let Some(num_new) = num_new else {
        return Ok(request.max_cached_tokens);
    };
    let len = request.tokens.len();
    let room = len.checked_sub(num_new).ok_or_else(|| {
        CacheError::InvalidInput(format!(
            "num_new_tokens {num_new} is more than the request's {len} tokens (append them \
             first)"
        ))
    })?;
    Ok(Some(
        request.max_cached_tokens.map_or(room, |cap| cap.min(room)),
    ))
}

/// `fresh` blocks plus the `watermark` that must stay obtainable, refused by name when the sum
/// overflows.
fn with_watermark(fresh: usize, watermark: usize) -> Result<usize> {
    fresh.checked_add(watermark).ok_or_else(|| {
        CacheError::InvalidInput(format!(
            "watermark_blocks {watermark} plus the {fresh} blocks the call takes overflows a \
             64-bit count"
        ))
    })
}
