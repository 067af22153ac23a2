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
//! - `append_tokens`, `commit` and `accept_drafts` are refused only for reasons every group
//!   judges alike (the same tokens, drafts and ids in every group), so the first group refuses
//!   and nothing changed. (One exception: with different block sizes, a `commit` past the slots
//!   of one group but not of another; no engine commits past what it allocated.)
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

use crate::cache::{FullHit, PrefixCache};
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
        Ok(Self {
            groups,
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
        self.agree_on_hit(id)
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
            self.agree_on_hit(id)?;
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
            self.agree_on_hit(id)?;
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
    pub fn commit(&self, id: &RequestId, num_computed_tokens: usize) -> Result<usize> {
        let _serialised = self.scheduled.lock();
        let mut committed = usize::MAX;
        for cache in &self.groups {
            committed = committed.min(cache.commit(id, num_computed_tokens)?);
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

    /// The hit every group can serve (module docs), left set as each group's cap. Called with
    /// the lock held.
    fn agree_on_hit(&self, id: &RequestId) -> Result<usize> {
        agree(self.hit_granularity, self.groups.len(), |group, cap| {
            let cache = &self.groups[group];
            cache.limit_cached_prefix(id, cap)?;
            cache.start_position(id)
        })
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

/// The agreement loop of the module docs over `groups` groups: `start_under(group, cap)` is
/// the longest hit `group` serves under `cap` (`None`: uncapped), at most `cap`.
fn agree(
    granularity: usize,
    groups: usize,
    mut start_under: impl FnMut(usize, Option<usize>) -> Result<usize>,
) -> Result<usize> {
    let mut cap = None;
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
mod tests {
    use super::*;
    use crate::cache::CacheConfig;
    use crate::key::{context_fingerprint, BlockKey};

    const FULL: usize = 0;
    const SLIDING: usize = 1;

    fn cache(
        num_blocks: u32,
        block_size: usize,
        window: Option<usize>,
        group: u8,
    ) -> Arc<PrefixCache> {
        let config = CacheConfig {
            sliding_window: window,
            ..CacheConfig::new(num_blocks, block_size)
        };
        // Each group under its own context, as `group_context` gives them in Python.
        let context: BlockKey = context_fingerprint(&[group]);
        Arc::new(PrefixCache::new(config, context).expect("a valid config"))
    }

    /// A full group and a sliding one (`window` tokens).
    fn pair(blocks: (u32, u32), sizes: (usize, usize), window: usize) -> KvGroups {
        KvGroups::new(vec![
            cache(blocks.0, sizes.0, None, 0),
            cache(blocks.1, sizes.1, Some(window), 1),
        ])
        .expect("two distinct caches")
    }

    fn prompt(len: usize) -> Vec<u32> {
        (0..len as u32).map(|t| t * 7 % 101).collect()
    }

    fn id(name: &str) -> RequestId {
        RequestId::from(name)
    }

    /// Prefill `tokens` as request `name` in one group's cache alone, commit, finish.
    fn cache_prefix(cache: &PrefixCache, name: &str, tokens: &[u32]) {
        let name = id(name);
        cache
            .add_request(
                name.clone(),
                tokens.to_vec(),
                b"",
                RequestExtras::default(),
                0,
            )
            .unwrap();
        cache.allocate_slots(&name, tokens.len(), 0, 0).unwrap();
        cache.commit(&name, tokens.len()).unwrap();
        cache.finish(&name).unwrap();
    }

    fn add(groups: &KvGroups, name: &str, tokens: &[u32]) {
        groups
            .add_request(id(name), tokens.to_vec(), b"", RequestExtras::default(), 0)
            .unwrap();
    }

    fn free_and_used(groups: &KvGroups) -> Vec<(usize, usize)> {
        groups
            .groups()
            .iter()
            .map(|cache| {
                let stats = cache.stats();
                (stats.blocks_free, stats.blocks_in_use)
            })
            .collect()
    }

    #[test]
    fn new_refuses_no_group_a_shared_cache_and_reused_last_blocks() {
        assert!(matches!(
            KvGroups::new(Vec::new()),
            Err(CacheError::InvalidInput(_))
        ));
        let shared = cache(8, 4, None, 0);
        assert!(KvGroups::new(vec![shared.clone(), shared]).is_err());
        let config = CacheConfig {
            full_hit: FullHit::ReuseLastBlock,
            ..CacheConfig::new(8, 4)
        };
        let reuse = Arc::new(PrefixCache::new(config, BlockKey([0; 32])).unwrap());
        assert!(KvGroups::new(vec![reuse]).is_err());
    }

    #[test]
    fn the_agreement_loop_lowers_its_cap_until_every_group_agrees() {
        // Group 0 is monotone (a full group); group 1 is not: it serves 36 and 20, but
        // nothing between (a sliding group whose blocks at 20..32 were evicted).
        let full = |cap: Option<usize>| cap.unwrap_or(usize::MAX).min(28);
        let sliding = |cap: Option<usize>| match cap {
            None => 36,
            Some(cap) if cap >= 36 => 36,
            Some(cap) => cap.min(20),
        };
        let mut asked = Vec::new();
        let agreed = agree(4, 2, |group, cap| {
            asked.push((group, cap));
            Ok(if group == 0 { full(cap) } else { sliding(cap) })
        });
        assert_eq!(agreed, Ok(20));
        // Uncapped (28, 36), then capped at 28 (28, 20), then at 20 (20, 20).
        assert_eq!(
            asked,
            [
                (0, None),
                (1, None),
                (0, Some(28)),
                (1, Some(28)),
                (0, Some(20)),
                (1, Some(20))
            ]
        );
        // Rounded down to the granularity: 28 and 36 under blocks of 12 agree on 24.
        let agreed = agree(12, 2, |group, cap| {
            let most = if group == 0 { 28 } else { 36 };
            Ok(cap.map_or(most, |cap| cap.min(most)))
        });
        assert_eq!(agreed, Ok(24));
    }

    #[test]
    fn groups_that_disagree_agree_on_the_longest_hit_both_serve() {
        let groups = pair((32, 32), (4, 4), 5);
        let tokens = prompt(40);
        // The full group cached 7 blocks, the sliding group all 10.
        cache_prefix(&groups.groups()[FULL], "x", &tokens[..28]);
        cache_prefix(&groups.groups()[SLIDING], "x", &tokens);
        assert_eq!(
            groups.groups()[SLIDING]
                .lookup(&tokens, b"", &RequestExtras::default())
                .unwrap()
                .num_cached_tokens,
            36
        );
        add(&groups, "b", &tokens);
        assert_eq!(groups.start_position(&id("b")), Ok(28));
        let slots = groups.allocate_slots(&id("b"), 12, 0, 0).unwrap();
        assert_eq!(slots.num_computed_tokens, 28);
        assert_eq!(slots.num_cached_tokens, 28);
        assert!(!slots.full_hit);
        let tables = groups.block_tables(&id("b")).unwrap();
        assert_eq!(tables.iter().map(Vec::len).collect::<Vec<_>>(), [10, 10]);
        // The window of position 28 starts at 24: block 6; the sliding group's earlier
        // positions are its null block.
        let null = groups.groups()[SLIDING].null_block().unwrap();
        assert!(tables[SLIDING][..6].iter().all(|&b| b == null));
        assert!(tables[SLIDING][6..].iter().all(|&b| b != null));
        assert_eq!(groups.num_computed_tokens(&id("b")), Ok(28));
        groups.finish(&id("b")).unwrap();
        for cache in groups.groups() {
            cache.check_invariants();
        }
    }

    #[test]
    fn block_sizes_4_and_6_agree_on_multiples_of_12() {
        let groups = pair((32, 32), (4, 6), 5);
        assert_eq!(groups.hit_granularity(), 12);
        let tokens = prompt(40);
        add(&groups, "a", &tokens);
        groups.allocate_slots(&id("a"), 40, 0, 0).unwrap();
        groups.commit(&id("a"), 40).unwrap();
        groups.finish(&id("a")).unwrap();
        for length in [40, 30, 26, 12, 11] {
            add(&groups, "b", &tokens[..length]);
            let position = groups.start_position(&id("b")).unwrap();
            assert_eq!(position, 12 * ((length - 1) / 12), "prompt of {length}");
            let slots = groups
                .allocate_slots(&id("b"), length - position, 0, 0)
                .unwrap();
            assert_eq!(slots.num_computed_tokens, position);
            let tables = groups.block_tables(&id("b")).unwrap();
            assert_eq!(tables[0].len(), length.div_ceil(4));
            assert_eq!(tables[1].len(), length.div_ceil(6));
            groups.finish(&id("b")).unwrap();
        }
        for cache in groups.groups() {
            cache.check_invariants();
        }
    }

    #[test]
    fn an_allocation_one_group_cannot_supply_changes_no_group() {
        // The window covers the whole prompt: the sliding group needs every block, and has 4.
        let groups = pair((32, 4), (4, 4), 64);
        add(&groups, "a", &prompt(40));
        let before = free_and_used(&groups);
        let refused = groups.allocate_slots(&id("a"), 40, 0, 0);
        let Err(CacheError::InKvGroup { group, error }) = refused else {
            panic!("expected a refusal naming the group, got {refused:?}");
        };
        assert_eq!(group, SLIDING);
        assert!(matches!(
            *error,
            CacheError::OutOfBlocks {
                needed: 10,
                available: 4
            }
        ));
        assert!(CacheError::InKvGroup { group, error }
            .to_string()
            .starts_with("KV group 1: out of KV blocks"));
        assert_eq!(free_and_used(&groups), before);
        assert_eq!(groups.block_tables(&id("a")).unwrap(), [vec![], vec![]]);
        assert_eq!(groups.can_allocate_slots(&id("a"), 40, 0, 0), Ok(false));
        // Still waiting: a chunk that fits is served from the start.
        let slots = groups.allocate_slots(&id("a"), 8, 0, 0).unwrap();
        assert_eq!(slots.num_computed_tokens, 0);
        for blocks in &slots.group_block_ids {
            assert_eq!(blocks.len(), 2);
        }
        groups.finish(&id("a")).unwrap();
        for cache in groups.groups() {
            cache.check_invariants();
        }
    }

    #[test]
    fn a_truncation_one_group_refuses_cuts_no_group() {
        let groups = pair((32, 32), (4, 4), 8);
        let tokens = prompt(32);
        add(&groups, "a", &tokens[..12]);
        groups.allocate_slots(&id("a"), 12, 0, 0).unwrap();
        groups.commit(&id("a"), 12).unwrap();
        // After a reset the request publishes nothing more, but its window still moves on:
        // the sliding group releases positions the full group keeps, unpublished.
        for cache in groups.groups() {
            cache.clear();
        }
        groups
            .append_tokens(&id("a"), &tokens[12..], false)
            .unwrap();
        groups.allocate_slots(&id("a"), 20, 0, 0).unwrap();
        groups.commit(&id("a"), 32).unwrap();
        // Cutting to 16 tokens: the full group would (its blocks from 16 on are its own), the
        // sliding group would not (position 16 reads from 9 on, released).
        assert_eq!(groups.groups()[FULL].check_truncate(&id("a"), 16), Ok(()));
        let refused = groups.truncate(&id("a"), 16);
        assert!(
            matches!(&refused, Err(CacheError::InKvGroup { group: SLIDING, error })
                if matches!(**error, CacheError::InvalidInput(_))),
            "{refused:?}"
        );
        for cache in groups.groups() {
            assert_eq!(cache.num_tokens(&id("a")), Ok(32));
        }
        assert_eq!(
            groups.groups()[FULL].block_table(&id("a")).unwrap().len(),
            8
        );
        // A cut both accept (position 31 reads from 24 on) goes through in both.
        groups.truncate(&id("a"), 31).unwrap();
        for cache in groups.groups() {
            assert_eq!(cache.num_tokens(&id("a")), Ok(31));
        }
        groups.finish(&id("a")).unwrap();
    }

    #[test]
    fn decode_steps_take_new_blocks_only_at_block_boundaries() {
        let groups = pair((32, 32), (4, 4), 6);
        add(&groups, "a", &prompt(10));
        groups.allocate_slots(&id("a"), 10, 0, 0).unwrap();
        groups.commit(&id("a"), 10).unwrap();
        for step in 0..6 {
            let position = 10 + step;
            groups.append_tokens(&id("a"), &[1], false).unwrap();
            let slots = groups.allocate_slots(&id("a"), 1, 0, 0).unwrap();
            assert_eq!(slots.num_computed_tokens, position);
            let new_blocks = usize::from(position % 4 == 0);
            for blocks in &slots.group_block_ids {
                assert_eq!(blocks.len(), new_blocks, "step at {position}");
            }
            groups.commit(&id("a"), position + 1).unwrap();
        }
        assert_eq!(groups.num_computed_tokens(&id("a")), Ok(16));
        let tables = groups.block_tables(&id("a")).unwrap();
        let null = groups.groups()[SLIDING].null_block().unwrap();
        // At 16 the window (6) reads from 11 on: positions 0 and 1 are released.
        assert_eq!(tables[SLIDING][..2], [null, null]);
        assert_eq!(tables[FULL].len(), 4);
        groups.finish(&id("a")).unwrap();
        for cache in groups.groups() {
            cache.check_invariants();
            assert_eq!(cache.stats().blocks_in_use, 0);
        }
    }

    #[test]
    fn add_request_is_all_or_nothing_and_finish_reaches_every_group() {
        let groups = pair((8, 8), (4, 4), 8);
        // Live in the sliding group alone: adding it to both is refused, and the full group
        // is rolled back.
        groups.groups()[SLIDING]
            .add_request(id("a"), prompt(4), b"", RequestExtras::default(), 0)
            .unwrap();
        let refused = groups.add_request(id("a"), prompt(4), b"", RequestExtras::default(), 0);
        assert!(matches!(refused, Err(CacheError::DuplicateRequest(_))));
        assert!(groups.groups()[FULL].num_tokens(&id("a")).is_err());
        // Finishing it reports the full group's refusal, and still finishes the sliding group.
        assert!(matches!(
            groups.finish(&id("a")),
            Err(CacheError::UnknownRequest(_))
        ));
        assert!(groups.groups()[SLIDING].num_tokens(&id("a")).is_err());
    }

    #[test]
    fn a_preempted_request_agrees_again() {
        let groups = pair((16, 16), (4, 4), 8);
        let tokens = prompt(20);
        add(&groups, "a", &tokens);
        groups.allocate_slots(&id("a"), 20, 0, 0).unwrap();
        groups.commit(&id("a"), 20).unwrap();
        groups.preempt(&id("a")).unwrap();
        assert_eq!(groups.block_tables(&id("a")).unwrap(), [vec![], vec![]]);
        // Its committed blocks stay cached in both groups: a full hit recomputes the last one.
        assert_eq!(groups.start_position(&id("a")), Ok(16));
        let slots = groups.allocate_slots(&id("a"), 4, 0, 0).unwrap();
        assert!(slots.full_hit);
        assert_eq!(slots.num_cached_tokens, 16);
        groups.finish(&id("a")).unwrap();
        assert!(matches!(
            groups.start_position(&id("a")),
            Err(CacheError::UnknownRequest(_))
        ));
    }
}
