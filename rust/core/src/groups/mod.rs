//! `KvGroups`: the block managers of a hybrid model's KV groups, driven as one.
//!
//! A hybrid model's layers form KV groups (full attention, sliding window `W`). Each group has
//! its own pages, so each has its own [`PrefixCache`]: its own pool, block keys, verification,
//! eviction and stats; a sliding group's is built with `sliding_window = Some(W)` (`sliding.rs`).
//! `KvGroups` gives an engine the step API of one cache over all of them. It shares the caches
//! (`Arc`) with its caller, who keeps using each directly for lookups, events and stats, but
//! drives a request's life only through `KvGroups`: the invariants below hold only if every
//! call that changes a request (add, allocate, commit, append, accept, truncate, preempt,
//! finish) goes through it.
//!
//! ## One hit length
//! A waiting request's cached prefix is the longest one *every* group can serve: all its blocks
//! for a full group, the window's blocks for a sliding one. The groups' answers are not
//! monotone in each other (a sliding group may serve 48 tokens but not 32), so each group is
//! asked for its longest hit under a cap (`limit_cached_prefix`, then `start_position`), the
//! cap is lowered to the smallest answer rounded down to the *hit granularity* (the least
//! common multiple of the groups' block sizes, where every group's blocks end), and this
//! repeats until all agree. Each answer is at most the cap, so when they do not all agree the
//! next cap is strictly lower than the last: it ends, at 0 at worst. The cap stays set in
//! every group, so the `allocate_slots` that follows matches exactly that length.
//!
//! ## All or nothing
//! Every call here holds `KvGroups`' own mutex from start to end, and takes the groups' mutexes
//! inside it (never the other way round, so no deadlock). Within that:
//! - `allocate_slots` asks every group whether it can supply its blocks
//!   (`check_allocate_slots`) before any allocates. Only this object allocates in the groups'
//!   pools, and it holds its lock, so the answers still hold when it allocates: a refusal
//!   ([`CacheError::InKvGroup`], naming the group) changes no group.
//! - `truncate` asks every group whether it would accept the cut (`check_truncate`) before
//!   cutting any: a sliding group refuses a cut into positions it already released, which a full
//!   group would accept.
//! - `add_request` finishes the groups it added to when a later one refuses.
//! - `commit` asks every group whether it would accept the count (`check_commit`) before
//!   committing in any: a commit publishes at once, and with different block sizes one group
//!   may hold slots for tokens another does not (a refused commit must not have published a
//!   block, half written, in an earlier group). With one block size every group holds as many
//!   slots (allocations and truncations are all or nothing, a released position keeps its
//!   place), so every group judges a commit alike and the check pass is skipped.
//! - `append_tokens` and `accept_drafts` are refused only for reasons every group judges alike
//!   (the same tokens, drafts and ids in every group), so the first group refuses and nothing
//!   changed.
//! - `preempt` and `finish` go to every group even if one fails, then report the first error.
//!
//! ## The decode step
//! A scheduled request whose slots already cover its next tokens in every group needs no
//! check pass: `PrefixCache::covered_slots` answers what `allocate_slots` would, without
//! planning and without changing anything, so a "yes" from every group is the whole step.
//! A "no" from any group falls back to the check pass and the allocations.
//!
//! Only `FullHit::RecomputeLastBlock` caches are accepted: with `ReuseLastBlock` the groups
//! could disagree on whether the last token's KV is to be written.

use std::collections::HashSet;
use std::sync::Arc;

use crate::cache::{FullHit, PrefixCache, WindowRelease};
use crate::error::{CacheError, Result};
use crate::key::RequestExtras;
use crate::pool::BlockId;
use crate::request::{RequestId, Slots};
use crate::sync::Mutex;

/// What `KvGroups::allocate_slots` hands the engine: `Slots`, per group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSlots {
    /// Blocks this call appended to each group's block table, in group order.
    pub group_block_ids: Vec<Vec<BlockId>>,
    /// Tokens whose KV the request has, in every group: the scheduled tokens start here.
    pub num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (the same in every group).
    pub num_cached_tokens: usize,
    /// This call matched every block of the prompt in every group.
    pub full_hit: bool,
}

/// The block managers of a model's KV groups, driven as one (see the module docs).
pub struct KvGroups {
    groups: Vec<Arc<PrefixCache>>,
    /// Hit lengths are multiples of this: the least common multiple of the block sizes.
    hit_granularity: usize,
    /// Every group has the same block size: then every group holds as many slots for a request
    /// as the others, so a commit one refuses every one refuses, and `commit` needs no check
    /// pass (module docs, "All or nothing").
    uniform_blocks: bool,
    /// Requests that matched their prefix and hold blocks in every group; the others wait.
    /// The mutex also serialises every call (module docs, "All or nothing").
    scheduled: Mutex<HashSet<RequestId>>,
}

impl KvGroups {
    /// Drives `groups` as one. Refuses an empty list, a cache listed twice and a cache that
    /// serves full hits with `ReuseLastBlock`.
    pub fn new(groups: Vec<Arc<PrefixCache>>) -> Result<Self> {
        if groups.is_empty() {
            return Err(CacheError::InvalidInput(
                "KV groups need at least one group".into(),
            ));
        }
        for (index, cache) in groups.iter().enumerate() {
            if groups[..index]
                .iter()
                .any(|other| Arc::ptr_eq(other, cache))
            {
                return Err(CacheError::InvalidInput(format!(
                    "KV group {index} is the cache of an earlier group: each group needs its own"
                )));
            }
            if cache.config().full_hit != FullHit::RecomputeLastBlock {
                return Err(CacheError::InvalidInput(format!(
                    "KV group {index} reuses the last block of a full hit: KV groups serve full \
                     hits only by recomputing the last block"
                )));
            }
        }
        let hit_granularity = groups
            .iter()
            .map(|cache| cache.config().block_size)
            .try_fold(1, checked_lcm)
            .ok_or_else(|| {
                CacheError::InvalidInput(
                    "the least common multiple of the groups' block sizes overflows".into(),
                )
            })?;
        let first_size = groups[0].config().block_size;
        let uniform_blocks = groups
            .iter()
            .all(|cache| cache.config().block_size == first_size);
        Ok(Self {
            groups,
            uniform_blocks,
            hit_granularity,
            scheduled: Mutex::new(HashSet::new()),
        })
    }

    /// The groups' caches, in group order.
    #[must_use]
    pub fn groups(&self) -> &[Arc<PrefixCache>] {
        &self.groups
    }

    /// Every hit length is a multiple of this (the least common multiple of the block sizes).
    #[must_use]
    pub fn hit_granularity(&self) -> usize {
        self.hit_granularity
    }

    // ----- a request's life -------------------------------------------------------------------

    /// Registers a waiting request in every group, or in none.
    pub fn add_request(
        &self,
        id: RequestId,
        mut tokens: Vec<u32>,
        salt: &[u8],
        extras: RequestExtras,
        priority: i32,
    ) -> Result<()> {
        let _serialised = self.scheduled.lock();
        let last = self.groups.len() - 1;
        for (index, cache) in self.groups.iter().enumerate() {
            // Each group keeps its own copy; the last one takes the caller's.
            let group_tokens = if index == last {
                std::mem::take(&mut tokens)
            } else {
                tokens.clone()
            };
            let added = cache.add_request(id.clone(), group_tokens, salt, extras.clone(), priority);
            if let Err(error) = added {
                for earlier in &self.groups[..index] {
                    // Just added there, so live: this cannot fail.
                    let _ = earlier.finish(&id);
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Where the next `allocate_slots` starts computing, changing no group's blocks: for a
    /// waiting request the hit every group agrees on (which stays set as each group's cap),
    /// for a scheduled one its computed tokens.
    pub fn start_position(&self, id: &RequestId) -> Result<usize> {
        let scheduled = self.scheduled.lock();
        if scheduled.contains(id) {
            return self.groups[0].start_position(id);
        }
        self.agree_on_hit(id, None)
    }

    /// `PrefixCache::allocate_slots` in every group, or in none: a refusal is
    /// `CacheError::InKvGroup` naming the first group that cannot supply its blocks, with
    /// nothing changed in any group. A waiting request first agrees on its hit length.
    pub fn allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<GroupSlots> {
        let mut scheduled = self.scheduled.lock();
        let waiting = !scheduled.contains(id);
        if waiting {
            self.agree_on_hit(id, Some(num_new_tokens))?;
        } else if let Some(slots) =
            self.covered_in_every_group(id, num_new_tokens, num_lookahead_tokens, watermark)?
        {
            return Ok(slots);
        }
        for (index, cache) in self.groups.iter().enumerate() {
            cache
                .check_allocate_slots(id, num_new_tokens, num_lookahead_tokens, watermark)
                .map_err(|error| in_group(index, error))?;
        }
        let mut per_group: Vec<Slots> = Vec::with_capacity(self.groups.len());
        for (index, cache) in self.groups.iter().enumerate() {
            match cache.allocate_slots(id, num_new_tokens, num_lookahead_tokens, watermark) {
                Ok(slots) => per_group.push(slots),
                Err(error) => {
                    // Only if someone allocated from a group's pool directly since the check.
                    // A waiting request is put back as it was; a scheduled one cannot be.
                    if waiting {
                        for earlier in &self.groups[..index] {
                            let _ = earlier.preempt(id);
                        }
                    }
                    return Err(in_group(index, error));
                }
            }
        }
        // The caps make every group match the agreed hit; groups computing from different
        // positions would write KV at different places for the same tokens.
        debug_assert!(
            per_group
                .iter()
                .all(|s| s.num_computed_tokens == per_group[0].num_computed_tokens),
            "KV groups disagree on where to compute: {per_group:?}"
        );
        if waiting {
            scheduled.insert(id.clone());
        }
        Ok(GroupSlots {
            num_computed_tokens: per_group[0].num_computed_tokens,
            num_cached_tokens: per_group
                .iter()
                .map(|s| s.num_cached_tokens)
                .min()
                .unwrap_or(0),
            full_hit: waiting && per_group.iter().all(|s| s.full_hit),
            group_block_ids: per_group.into_iter().map(|s| s.block_ids).collect(),
        })
    }

    /// Whether `allocate_slots` with these arguments would succeed now in every group.
    /// Changes no group's blocks (a waiting request agrees on its hit first).
    pub fn can_allocate_slots(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<bool> {
        let scheduled = self.scheduled.lock();
        if !scheduled.contains(id) {
            self.agree_on_hit(id, Some(num_new_tokens))?;
        }
        for cache in &self.groups {
            if !cache.can_allocate_slots(id, num_new_tokens, num_lookahead_tokens, watermark)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Adds sampled (or, with `draft`, draft) tokens in every group.
    pub fn append_tokens(&self, id: &RequestId, tokens: &[u32], draft: bool) -> Result<()> {
        let _serialised = self.scheduled.lock();
        for cache in &self.groups {
            cache.append_tokens(id, tokens, draft)?;
        }
        Ok(())
    }

    /// Records written KV in every group (a sliding group then releases what its window
    /// passed); returns the committed positions of the group with fewest.
    /// All or nothing: a refusal is `CacheError::InKvGroup` naming the first group that
    /// refuses, with nothing committed or published in any group.
    pub fn commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<usize> {
        let _serialised = self.scheduled.lock();
        if !self.uniform_blocks {
            for (index, cache) in self.groups.iter().enumerate() {
                cache
                    .check_commit(id, num_computed_tokens)
                    .map_err(|error| in_group(index, error))?;
            }
        }
        let mut committed = usize::MAX;
        for (index, cache) in self.groups.iter().enumerate() {
            // Accepted by the check above under the same lock; or, with one block size, refused
            // by the first group if by any, before anything changed.
            let positions = cache
                .commit(id, num_computed_tokens)
                .map_err(|error| in_group(index, error))?;
            committed = committed.min(positions);
        }
        Ok(committed)
    }

    /// `PrefixCache::accept_drafts` in every group; returns the committed positions of the
    /// group with fewest.
    pub fn accept_drafts(&self, id: &RequestId, num_accepted: usize) -> Result<usize> {
        let _serialised = self.scheduled.lock();
        let mut committed = usize::MAX;
        for cache in &self.groups {
            committed = committed.min(cache.accept_drafts(id, num_accepted)?);
        }
        Ok(committed)
    }

    /// `PrefixCache::release_out_of_window` in every group (a full group releases nothing);
    /// returns the positions released, all groups together. Refused before any group changes:
    /// a sliding group that releases on commit, and `processed_tokens` above the request's
    /// settled tokens (the same in every group, so the first sliding group judges for all).
    pub fn release_out_of_window(&self, id: &RequestId, processed_tokens: usize) -> Result<usize> {
        let _serialised = self.scheduled.lock();
        for (index, cache) in self.groups.iter().enumerate() {
            let config = cache.config();
            if config.sliding_window.is_some() && config.window_release != WindowRelease::Explicit {
                return Err(CacheError::InKvGroup {
                    group: index,
                    error: Box::new(CacheError::InvalidInput(
                        "release_out_of_window: this sliding-window group releases on commit"
                            .into(),
                    )),
                });
            }
        }
        let mut released = 0;
        for (index, cache) in self.groups.iter().enumerate() {
            released += cache
                .release_out_of_window(id, processed_tokens)
                .map_err(|error| in_group(index, error))?;
        }
        Ok(released)
    }

    /// `PrefixCache::truncate` in every group, or in none: a refusal is
    /// `CacheError::InKvGroup` naming the first group that refuses.
    pub fn truncate(&self, id: &RequestId, num_tokens: usize) -> Result<()> {
        let _serialised = self.scheduled.lock();
        for (index, cache) in self.groups.iter().enumerate() {
            cache
                .check_truncate(id, num_tokens)
                .map_err(|error| in_group(index, error))?;
        }
        for (index, cache) in self.groups.iter().enumerate() {
            // Accepted by the check above under the same lock.
            cache
                .truncate(id, num_tokens)
                .map_err(|error| in_group(index, error))?;
        }
        Ok(())
    }

    /// Drops the request's blocks and KV in every group; it waits again.
    pub fn preempt(&self, id: &RequestId) -> Result<()> {
        let mut scheduled = self.scheduled.lock();
        scheduled.remove(id);
        let mut first_error = None;
        for cache in &self.groups {
            if let Err(error) = cache.preempt(id) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Ends the request in every group, even where another group fails; then reports the
    /// first failure.
    pub fn finish(&self, id: &RequestId) -> Result<()> {
        let mut scheduled = self.scheduled.lock();
        scheduled.remove(id);
        let mut first_error = None;
        for cache in &self.groups {
            if let Err(error) = cache.finish(id) {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    // ----- observation ------------------------------------------------------------------------

    /// The request's block table in each group (a sliding group's starts with its null block
    /// at every released position).
    pub fn block_tables(&self, id: &RequestId) -> Result<Vec<Vec<BlockId>>> {
        let _serialised = self.scheduled.lock();
        self.groups
            .iter()
            .map(|cache| cache.block_table(id))
            .collect()
    }

    /// The request's tokens with KV written (the same in every group).
    pub fn num_computed_tokens(&self, id: &RequestId) -> Result<usize> {
        let _serialised = self.scheduled.lock();
        let computed = self.groups[0].num_computed_tokens(id)?;
        debug_assert!(
            self.groups
                .iter()
                .all(|cache| cache.num_computed_tokens(id) == Ok(computed)),
            "KV groups disagree on the computed tokens of request {id}"
        );
        Ok(computed)
    }

    // ----- internals --------------------------------------------------------------------------

    /// The hit every group can serve (module docs), left set as each group's cap; with
    /// `num_new` tokens to allocate, one that leaves room for them before the request's end
    /// (as `PrefixCache::allocate_slots` does for one cache: a hit that grew since
    /// `start_position` is cut back rather than refused). Called with the lock held.
    fn agree_on_hit(&self, id: &RequestId, num_new: Option<usize>) -> Result<usize> {
        let room = match num_new {
            None => None,
            Some(num_new) => {
                let len = self.groups[0].num_tokens(id)?;
                let room = len.checked_sub(num_new).ok_or_else(|| {
                    CacheError::InvalidInput(format!(
                        "num_new_tokens {num_new} is more than the request's {len} tokens \
                         (append them first)"
                    ))
                })?;
                Some(room - room % self.hit_granularity)
            }
        };
        agree(
            self.hit_granularity,
            self.groups.len(),
            room,
            |group, cap| {
                let cache = &self.groups[group];
                cache.limit_cached_prefix(id, cap)?;
                cache.start_position(id)
            },
        )
    }

    /// The decode step's answer when every group's slots already cover it (module docs).
    fn covered_in_every_group(
        &self,
        id: &RequestId,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<Option<GroupSlots>> {
        let mut start = None;
        for cache in &self.groups {
            let Some(slots) =
                cache.covered_slots(id, num_new_tokens, num_lookahead_tokens, watermark)?
            else {
                return Ok(None);
            };
            debug_assert!(
                start.is_none_or(|s| s == slots.num_computed_tokens),
                "KV groups disagree on the computed tokens of request {id}"
            );
            start = Some(slots.num_computed_tokens);
        }
        Ok(start.map(|num_computed_tokens| GroupSlots {
            group_block_ids: vec![Vec::new(); self.groups.len()],
            num_computed_tokens,
            num_cached_tokens: 0,
            full_hit: false,
        }))
    }
}

/// The agreement loop of the module docs over `groups` groups, from cap `first_cap` (`None`:
/// uncapped): `start_under(group, cap)` is the longest hit `group` serves under `cap`, at most
/// `cap`.
fn agree(
    granularity: usize,
    groups: usize,
    first_cap: Option<usize>,
    mut start_under: impl FnMut(usize, Option<usize>) -> Result<usize>,
) -> Result<usize> {
    let mut cap = first_cap;
    loop {
        let mut lowest = usize::MAX;
        let mut highest = 0;
        for group in 0..groups {
            let start = start_under(group, cap)?;
            debug_assert!(cap.is_none_or(|cap| start <= cap), "a hit above its cap");
            lowest = lowest.min(start);
            highest = highest.max(start);
        }
        let agreed = lowest - lowest % granularity;
        if highest == agreed {
            return Ok(agreed);
        }
        cap = Some(agreed);
    }
}

/// `error` from group `group`, named so; an id that is not live is no group's own refusal.
fn in_group(group: usize, error: CacheError) -> CacheError {
    match error {
        CacheError::UnknownRequest(_) => error,
        error => CacheError::InKvGroup {
            group,
            error: Box::new(error),
        },
    }
}

fn checked_lcm(a: usize, b: usize) -> Option<usize> {
    fn gcd(mut a: usize, mut b: usize) -> usize {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }
    (a / gcd(a, b)).checked_mul(b)
}

#[cfg(test)]
mod tests;
