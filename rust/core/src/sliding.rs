//! Sliding-window KV groups (`CacheConfig::sliding_window`): what a hybrid model's
//! sliding-window layers need from the block manager.
//!
//! An engine builds one `PrefixCache` per KV group (layers of one attention kind). A
//! full-attention group is the ordinary cache; a sliding group with window `W` tokens differs in
//! three ways, all following from one fact: the query at position `i` reads keys
//! `i - W < j <= i` only.
//!
//! size: one concept (what a window changes: release, keys by SHA-256 parent, explicit release
//! on vLLM's schedule and per-request windows for lanes), with its tests below the code.
//!
//! ## Blocks that left the window are released
//! A scheduled request whose *settled* count is `s = min(num_computed, num_verified)` (drafts
//! never count) computes its next token at `s`, and no later query reads further back, so every
//! block position `p` with `(p + 1) * block_size <= s + 1 - W` is never read again. `commit`,
//! `allocate_slots` and `accept_drafts` release those positions: the request drops its
//! reference (a published block stays cached, evictable in LRU order; a private one is freed)
//! and the *null block* takes its place in the block table. The released positions are always
//! the table's leading run (`Request::released` counts them exactly), and no position the window
//! of `s` intersects is ever null: that is the property the model tests check, "a released
//! block is never read" (`check_invariants` asserts it on the verified count, the bound of an
//! explicit release, below).
//!
//! ## Explicit release
//! An engine that publishes a step's blocks before the step writes them (vLLM caches them at
//! allocation) cannot let a commit release: the positions a step is still writing would go
//! back to the LRU order, where another request could evict and reuse them in the same step.
//! With `WindowRelease::Explicit` the release points above do nothing, and the engine calls
//! `release_out_of_window(request, processed_tokens)` where vLLM calls `remove_skipped_blocks`
//! (before each allocation for the request). `processed_tokens` may not exceed the verified
//! tokens; it may pass the commits (vLLM counts drafts it verified last step before it caches
//! them), and a position released before it was published is never published (`publish.rs`),
//! as vLLM's `cache_full_blocks` skips null blocks. Released positions, and a finished or
//! preempted request's table, are released as vLLM's `free_blocks(reversed(blocks))` frees
//! them (`release_tail_first`): cached blocks join the LRU order tail first, uncached ones go
//! on the free list so that the tail is reused first.
//!
//! The null block is the id one past the pool (`PrefixCache::null_block`). The pool never sees
//! it, so it is never allocated, freed, cached, counted or referenced; the engine keeps one spare
//! KV page for it so a block table can always be indexed, and no attention reads it.
//!
//! ## Entries verify without their parent
//! Early blocks get evicted while later ones stay cached, so an entry cannot name its parent by
//! entry id (the parent may be gone) and the pool keeps no parent link (`mark_cached(_, None)`):
//! every unreferenced, unpinned cached block is evictable on its own, LRU. Instead an entry's
//! parent is `Parent::Root(<SHA-256 block key of the previous block>)` (the request's root key
//! for block 0), and its table key is `hasher.root(<its own SHA-256 block key>)`. The SHA-256
//! key chains on every earlier token, so verifying the parent key (256 bits), tokens and extras
//! still proves the whole prefix matches: a table-key collision can only cost a miss.
//! The keys are the request's `export_keys`, computed once each, which events and tiers use too.
//!
//! ## The longest servable hit
//! A hit of `L` tokens needs only the blocks intersecting `[max(0, L + 1 - W), L)`; the blocks
//! before are not read and appear as the null block (not referenced). So a match probes every
//! full block of the prompt once and picks the longest `L` whose window is a run of cached,
//! verified blocks, not the first gap: `L` is a block boundary below the prompt's end, or a full
//! hit shaped by `FullHit` as in full mode (`RecomputeLastBlock`: `n - block_size`;
//! `ReuseLastBlock`: `n - 1`, last block shared, needing `[max(0, n - W), n)`).
//!
//! ## The hit cap (both modes)
//! `limit_cached_prefix` caps the hit length of a request's next matches, so a coordinator
//! running several groups side by side can make them agree on one length (the shortest any
//! group can serve): a group then serves the longest hit not above the cap.

use crate::cache::{block_extras, PrefixCache, PrefixMatch};
use crate::key::{block_key_with, BlockKey, RequestExtras, TableKey};
use crate::pool::BlockId;
use crate::table::{Anchor, Parent};

/// Leading block positions a request settled at `settled` tokens no longer reads: every
/// position whose tokens all lie before `settled + 1 - window`.
#[inline]
pub(crate) fn positions_out_of_window(window: usize, block_size: usize, settled: usize) -> usize {
    (settled + 1).saturating_sub(window) / block_size
}

/// The hit a sliding-window match chose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlidingHit {
    pub(crate) num_cached: usize,
    pub(crate) full_hit: bool,
    pub(crate) last_token_shared: bool,
    /// Block positions the hit covers (null ones included).
    pub(crate) blocks: usize,
    /// Leading positions the hit does not need: they are the null block.
    pub(crate) first_needed: usize,
}

impl PrefixCache {
    /// Extends `export_keys` (SHA-256) and `keys` (table keys derived from them) to the first
    /// `upto` full blocks of `tokens`, computing each key once.
    #[allow(clippy::too_many_arguments)] // the request's key memo, split so callers can lend it
    pub(crate) fn extend_sliding_keys(
        &self,
        scratch: &mut Vec<u8>,
        root: &BlockKey,
        tokens: &[u32],
        extras: &RequestExtras,
        export_keys: &mut Vec<BlockKey>,
        keys: &mut Vec<TableKey>,
        upto: usize,
    ) {
        let bs = self.config.block_size;
        let mut extras_buffer = Vec::new();
        for position in export_keys.len()..upto {
            let parent = export_keys.last().copied().unwrap_or(*root);
            let chunk = &tokens[position * bs..(position + 1) * bs];
            let block_extras = block_extras(extras, position, bs, &mut extras_buffer);
            export_keys.push(block_key_with(scratch, &parent, chunk, block_extras));
        }
        let known = keys.len().min(upto);
        keys.extend(
            export_keys[known..upto]
                .iter()
                .map(|key| self.hasher.root(key)),
        );
    }

    /// The cached, verified entry of each of the first `upto` full blocks (keys extended
    /// first). Every block is probed: a gap does not end the walk.
    pub(crate) fn probe_sliding(
        &self,
        root: &BlockKey,
        tokens: &[u32],
        extras: &RequestExtras,
        export_keys: &[BlockKey],
        keys: &[TableKey],
        upto: usize,
    ) -> Vec<Option<Anchor>> {
        let bs = self.config.block_size;
        let guard = self.table.guard();
        let mut extras_buffer = Vec::new();
        for key in keys.iter().take(upto.min(crate::cache::LOOKAHEAD)) {
            self.table.prefetch_entry(key);
        }
        (0..upto)
            .map(|position| {
                if let Some(key) = keys.get(position + crate::cache::LOOKAHEAD) {
                    self.table.prefetch_entry(key);
                }
                let parent = match position {
                    0 => *root,
                    _ => export_keys[position - 1],
                };
                let chunk = &tokens[position * bs..(position + 1) * bs];
                let block_extras = block_extras(extras, position, bs, &mut extras_buffer);
                self.table.get_verified(
                    &keys[position],
                    &Parent::Root(parent),
                    chunk,
                    block_extras,
                    &guard,
                )
            })
            .collect()
    }

    /// The longest hit servable from `present` (one flag per full block of a `num_tokens`
    /// prompt) under window `window`, not above `cap`.
    pub(crate) fn choose_sliding_hit(
        &self,
        window: usize,
        present: &[bool],
        num_tokens: usize,
        cap: Option<usize>,
    ) -> SlidingHit {
        let bs = self.config.block_size;
        // run_start[p]: first position of the run of cached blocks ending at p (p + 1 if p is
        // missing), so "positions lo..hi all cached" is `run_start[hi - 1] <= lo`.
        let mut run_start = Vec::with_capacity(present.len());
        for (position, &cached) in present.iter().enumerate() {
            let start = match (cached, position) {
                (false, _) => position + 1,
                (true, 0) => 0,
                (true, _) => run_start[position - 1],
            };
            run_start.push(start);
        }
        let allowed = |num_cached: usize| cap.is_none_or(|cap| num_cached <= cap);
        // The hit whose KV covers `blocks` positions and whose query starts at `num_cached`.
        let servable = |num_cached: usize, blocks: usize| {
            let first_needed = positions_out_of_window(window, bs, num_cached).min(blocks);
            let ok = blocks == first_needed || run_start[blocks - 1] <= first_needed;
            ok.then_some(first_needed)
        };
        let num_full = present.len();
        if num_full > 0 && num_full * bs == num_tokens {
            let shape = self.config.full_hit.shape(num_full, num_tokens, bs);
            let (num_cached, blocks, shared) =
                (shape.num_cached, shape.keep, shape.last_token_shared);
            // A full hit, as in full mode, has every needed block and the last one cached.
            if present[num_full - 1] && allowed(num_cached) {
                if let Some(first_needed) = servable(num_cached, blocks) {
                    return SlidingHit {
                        num_cached,
                        full_hit: true,
                        last_token_shared: shared,
                        blocks,
                        first_needed,
                    };
                }
            }
        }
        // Ordinary hits end on a block boundary strictly inside the prompt.
        let longest = if num_full * bs == num_tokens {
            num_full.saturating_sub(1)
        } else {
            num_full
        };
        for blocks in (1..=longest).rev() {
            let num_cached = blocks * bs;
            if !allowed(num_cached) {
                continue;
            }
            if let Some(first_needed) = servable(num_cached, blocks) {
                return SlidingHit {
                    num_cached,
                    full_hit: false,
                    last_token_shared: false,
                    blocks,
                    first_needed,
                };
            }
        }
        SlidingHit {
            num_cached: 0,
            full_hit: false,
            last_token_shared: false,
            blocks: 0,
            first_needed: 0,
        }
    }

    /// `lookup` and `match_and_acquire` in a sliding-window cache: the chosen hit's blocks,
    /// with the null block at every position the hit does not need.
    pub(crate) fn sliding_lookup(
        &self,
        scratch: &mut Vec<u8>,
        window: usize,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> PrefixMatch {
        let root = self.root_key(salt);
        let num_full = tokens.len() / self.config.block_size;
        let (mut export_keys, mut keys) = (Vec::new(), Vec::new());
        self.extend_sliding_keys(
            scratch,
            &root,
            tokens,
            extras,
            &mut export_keys,
            &mut keys,
            num_full,
        );
        let found = self.probe_sliding(&root, tokens, extras, &export_keys, &keys, num_full);
        let present: Vec<bool> = found.iter().map(Option::is_some).collect();
        let hit = self.choose_sliding_hit(window, &present, tokens.len(), None);
        let null = self.config.num_blocks;
        let blocks = found[..hit.blocks]
            .iter()
            .enumerate()
            .map(|(position, anchor)| match anchor {
                Some(anchor) if position >= hit.first_needed => anchor.block,
                _ => null,
            })
            .collect();
        PrefixMatch {
            blocks,
            num_cached_tokens: hit.num_cached,
            full_hit: hit.full_hit,
            last_token_shared: hit.last_token_shared,
        }
    }
}

/// Stands in the anchor list of a request for a position a hit did not need (it holds the null
/// block): no entry has id 0, so it is never taken for a live entry.
pub(crate) fn null_anchor(null: BlockId) -> Anchor {
    Anchor {
        id: 0,
        block: null,
        key: TableKey(0),
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::tests::no_extras;
    use crate::error::CacheError;
    use crate::key::context_fingerprint;
    use crate::{CacheConfig, FullHit, PrefixCache, RequestId, WindowRelease};

    fn sliding(
        num_blocks: u32,
        block_size: usize,
        window: usize,
        full_hit: FullHit,
    ) -> PrefixCache {
        let config = CacheConfig {
            sliding_window: Some(window),
            full_hit,
            ..CacheConfig::new(num_blocks, block_size)
        };
        PrefixCache::with_table_seed(config, context_fingerprint(b"unit"), 7).unwrap()
    }

    fn prompt(n: u32) -> Vec<u32> {
        (1..=n).collect()
    }

    /// Request `name` added, given slots for all of `tokens` and committed: their KV computed.
    fn computed(c: &PrefixCache, name: &str, tokens: Vec<u32>) -> RequestId {
        let id = RequestId::from(name);
        let n = tokens.len();
        c.add_request(id.clone(), tokens, b"", no_extras(), 0)
            .unwrap();
        c.allocate_slots(&id, n, 0, 0).unwrap();
        c.commit(&id, n).unwrap();
        id
    }

    fn explicit(num_blocks: u32, block_size: usize, window: usize) -> PrefixCache {
        let config = CacheConfig {
            sliding_window: Some(window),
            window_release: WindowRelease::Explicit,
            ..CacheConfig::new(num_blocks, block_size)
        };
        PrefixCache::with_table_seed(config, context_fingerprint(b"unit"), 7).unwrap()
    }

    #[test]
    fn explicit_release_needs_a_window_and_is_refused_when_releasing_on_commit() {
        let config = CacheConfig {
            window_release: WindowRelease::Explicit,
            ..CacheConfig::new(8, 2)
        };
        let Err(err) = PrefixCache::new(config, context_fingerprint(b"unit")) else {
            panic!("Explicit without a window was accepted");
        };
        assert!(err.to_string().contains("window_release"), "{err}");
        let c = sliding(16, 2, 3, FullHit::default());
        let a = &computed(&c, "a", prompt(10));
        let err = c.release_out_of_window(a, 10).unwrap_err();
        assert!(err.to_string().contains("releases on commit"), "{err}");
        // Full attention: nothing leaves a window before the request ends.
        let full = crate::cache::tests::cache(8, 2);
        let f = &computed(&full, "f", prompt(10));
        assert_eq!(full.release_out_of_window(f, 10), Ok(0));
        assert_eq!(
            full.release_out_of_window(&"nobody".into(), 0),
            Err(CacheError::UnknownRequest("nobody".into()))
        );
    }

    #[test]
    fn explicit_release_publishes_at_commit_and_releases_only_when_called() {
        // vLLM's schedule (`test_vllm_sliding_window_frees_at_the_next_allocation`): blocks of
        // 4, window 8, a 20-token prompt in 5 blocks; nothing is freed at the step that
        // schedules it, three blocks (those wholly before 20 + 1 - 8 = 13) at the next.
        let c = explicit(16, 4, 8);
        let null = c.null_block().unwrap();
        let a = &computed(&c, "a", prompt(20));
        let table = c.block_table(a).unwrap();
        assert!(!table.contains(&null), "a commit releases nothing");
        assert!(table.iter().all(|&b| c.is_cached(b) == Ok(true)));
        assert!(table.iter().all(|&b| c.ref_count(b) == Ok(1)));
        let err = c.release_out_of_window(a, 21).unwrap_err();
        assert!(err.to_string().contains("processed_tokens 21"), "{err}");
        assert_eq!(
            c.block_table(a).unwrap(),
            table,
            "a refusal changes nothing"
        );
        assert_eq!(c.release_out_of_window(a, 12), Ok(1));
        assert_eq!(c.release_out_of_window(a, 20), Ok(2));
        assert_eq!(c.release_out_of_window(a, 20), Ok(0));
        let now = c.block_table(a).unwrap();
        assert_eq!(&now[..3], &[null; 3]);
        assert_eq!(&now[3..], &table[3..]);
        assert_eq!(c.stats().blocks_released, 3);
        assert!(table[..3].iter().all(|&b| c.ref_count(b) == Ok(0)));
        c.check_invariants();
        // Decoding covers itself without releasing (a decode step's fast path included).
        for token in 21..=24 {
            c.append_tokens(a, &[token], false).unwrap();
            c.allocate_slots(a, 1, 0, 0).unwrap();
            c.commit(a, token as usize).unwrap();
        }
        assert_eq!(c.block_table(a).unwrap()[3], table[3]);
        assert_eq!(c.release_out_of_window(a, 24), Ok(1));
        c.check_invariants();
        // A waiting request holds nothing to release.
        let b = &RequestId::from("b");
        c.add_request(b.clone(), prompt(30), b"", no_extras(), 0)
            .unwrap();
        assert_eq!(c.release_out_of_window(b, 0), Ok(0));
        c.finish(a).unwrap();
        c.finish(b).unwrap();
        c.check_invariants();
    }

    #[test]
    fn positions_released_before_their_commit_are_skipped_and_later_ones_published() {
        // vLLM's processed count may run ahead of what it cached (drafts verified last step):
        // `remove_skipped_blocks` then frees blocks it never cached, and `cache_full_blocks`
        // skips the null blocks and caches the positions after them.
        let c = explicit(16, 4, 5);
        let null = c.null_block().unwrap();
        let a = &RequestId::from("a");
        c.add_request(a.clone(), prompt(12), b"", no_extras(), 0)
            .unwrap();
        let table = c.allocate_slots(a, 12, 0, 0).unwrap().block_ids;
        let err = c.release_out_of_window(a, 13).unwrap_err();
        assert!(err.to_string().contains("processed_tokens 13"), "{err}");
        // Positions wholly before 12 + 1 - 5 = 8: the first two, uncached, go back free.
        assert_eq!(c.release_out_of_window(a, 12), Ok(2));
        assert!(table[..2].iter().all(|&b| c.ref_count(b) == Ok(0)));
        assert_eq!(c.stats().blocks_free, 16 - 1);
        c.check_invariants();
        assert_eq!(c.commit(a, 12), Ok(3), "the third position is published");
        assert_eq!(c.block_table(a).unwrap(), vec![null, null, table[2]]);
        assert_eq!(c.is_cached(table[2]), Ok(true));
        assert!(table[..2].iter().all(|&b| c.is_cached(b) == Ok(false)));
        c.check_invariants();
        // A later prompt through the same tokens hits the third block (its window needs one).
        let mut probe = prompt(12);
        probe.push(99);
        let hit = c.lookup(&probe, b"", &no_extras()).unwrap();
        assert_eq!(hit.num_cached_tokens, 12);
        c.finish(a).unwrap();
        c.check_invariants();
    }

    #[test]
    fn a_second_copy_stays_cached_as_a_duplicate_as_in_vllm() {
        // Two requests compute the same two blocks in one step: vLLM caches both copies under
        // the hash and frees both into the tail of its queue; evicting the first copy leaves
        // the content cached in the second.
        let c = explicit(8, 4, 8);
        let (a, b) = (&RequestId::from("a"), &RequestId::from("b"));
        for id in [a, b] {
            c.add_request(id.clone(), prompt(8), b"", no_extras(), 0)
                .unwrap();
            c.allocate_slots(id, 8, 0, 0).unwrap();
        }
        let (table_a, table_b) = (c.block_table(a).unwrap(), c.block_table(b).unwrap());
        assert_eq!(c.commit(a, 8), Ok(2));
        assert_eq!(c.commit(b, 8), Ok(2));
        c.finish(a).unwrap();
        c.finish(b).unwrap();
        c.check_invariants();
        assert_eq!(c.stats().blocks_free, 4, "b's copies are cached, not free");
        // The four never-used blocks, then a's tail (released first): its entry moves into
        // b's copy, so the content stays cached.
        let taken = c.allocate(5).unwrap();
        assert_eq!(taken[4], table_a[1]);
        let probe = [prompt(8), vec![99]].concat();
        let hit = c.lookup(&probe, b"", &no_extras()).unwrap();
        assert_eq!(hit.num_cached_tokens, 8);
        assert_eq!(hit.blocks, vec![table_a[0], table_b[1]]);
        c.release(&taken).unwrap();
        c.check_invariants();
    }

    #[test]
    fn requests_with_their_own_windows_are_lanes_of_one_pool() {
        // A hybrid model's groups as lanes of one cache: the full-attention lane's window
        // exceeds every request, the sliding lane keeps the cache's 8 tokens.
        let c = explicit(16, 4, 8);
        let null = c.null_block().unwrap();
        let (full, window) = (&RequestId::from("full"), &RequestId::from("window"));
        c.add_request(full.clone(), prompt(20), b"g0", no_extras(), 0)
            .unwrap();
        c.add_request(window.clone(), prompt(20), b"g1", no_extras(), 0)
            .unwrap();
        let err = c.set_request_window(full, 0).unwrap_err();
        assert!(err.to_string().contains("at least 1 token"), "{err}");
        c.set_request_window(full, 1000).unwrap();
        for id in [full, window] {
            c.allocate_slots(id, 20, 0, 0).unwrap();
            assert_eq!(c.commit(id, 20), Ok(5));
        }
        assert_eq!(c.stats().blocks_in_use, 10, "one pool for both lanes");
        let err = c.set_request_window(window, 1000).unwrap_err();
        assert!(err.to_string().contains("already scheduled"), "{err}");
        assert!(matches!(
            c.set_request_window(&RequestId::from("nobody"), 8),
            Err(CacheError::UnknownRequest(_))
        ));
        assert_eq!(c.release_out_of_window(full, 20), Ok(0));
        assert_eq!(c.release_out_of_window(window, 20), Ok(3));
        assert!(!c.block_table(full).unwrap().contains(&null));
        assert_eq!(&c.block_table(window).unwrap()[..3], &[null; 3]);
        c.check_invariants();
        c.finish(full).unwrap();
        c.finish(window).unwrap();
        c.check_invariants();
        // Each lane's lookup under its window and salt: the full lane's leading run, the
        // sliding lane's window after released (still cached) blocks; salts keep them apart.
        let probe = [prompt(20), vec![99]].concat();
        let hit = |salt: &[u8], w| c.lookup_in_window(&probe, salt, &no_extras(), w).unwrap();
        assert_eq!(hit(b"g0", 1000).num_cached_tokens, 20);
        assert_eq!(hit(b"g1", 8).num_cached_tokens, 20);
        assert_eq!(hit(b"g2", 8).num_cached_tokens, 0);
        assert!(c.lookup_in_window(&probe, b"g0", &no_extras(), 0).is_err());
        // Only an explicit-release sliding cache serves lanes.
        let on_commit = sliding(8, 4, 8, FullHit::default());
        let id = &RequestId::from("r");
        on_commit
            .add_request(id.clone(), prompt(4), b"", no_extras(), 0)
            .unwrap();
        assert!(on_commit.set_request_window(id, 1000).is_err());
    }

    #[test]
    fn explicit_release_and_finish_free_the_tail_first_as_vllms_free_queue() {
        let c = explicit(6, 4, 8);
        c.set_eviction_log(true);
        let a = &computed(&c, "a", prompt(20));
        let table = c.block_table(a).unwrap();
        c.release_out_of_window(a, 20).unwrap();
        // One block is free; the next three come from the released ones, last position first.
        let mut pressure = c.allocate(2).unwrap();
        pressure.extend(c.allocate(2).unwrap());
        assert_eq!(c.drain_evicted(), vec![table[2], table[1], table[0]]);
        c.finish(a).unwrap();
        pressure.extend(c.allocate(1).unwrap());
        assert_eq!(
            c.drain_evicted(),
            vec![table[4]],
            "a finished table leaves tail first"
        );
        c.release(&pressure).unwrap();
        c.check_invariants();
    }

    #[test]
    fn explicit_release_frees_in_the_order_of_vllms_free_queue() {
        // vLLM 0.32's `BlockPool.free_blocks`: a released block without a hash is prepended to
        // the free queue (reused first, the request's tail first), a cached one appended
        // (evicted last, in release order); `popleft_n` takes the head first.
        let c = explicit(8, 4, 8);
        c.set_eviction_log(true);
        let a = &computed(&c, "a", prompt(20));
        let table = c.block_table(a).unwrap();
        // Positions 0..3 leave the window: cached, they wait behind the never-used blocks.
        c.release_out_of_window(a, 20).unwrap();
        let b = &RequestId::from("b");
        c.add_request(b.clone(), vec![90, 91, 92], b"", no_extras(), 0)
            .unwrap();
        // Two blocks, neither full: both go back uncached, to the head of the queue.
        let private = c.allocate_slots(b, 3, 4, 0).unwrap().block_ids;
        assert_eq!(private.len(), 2);
        c.finish(b).unwrap();
        let stats = c.stats();
        assert_eq!((stats.blocks_free, stats.blocks_in_use), (3, 2));
        assert!(!c.is_cached(private[0]).unwrap() && !c.is_cached(private[1]).unwrap());
        c.check_invariants();
        // b's tail, then b's first block, then the never-used one, then a's released blocks
        // from the last position: one allocation takes them in exactly that order.
        let taken = c.allocate(4).unwrap();
        assert_eq!(taken[..2], [private[1], private[0]]);
        assert!(!table.contains(&taken[2]), "a never-used block");
        assert_eq!(taken[3], table[2]);
        assert_eq!(c.drain_evicted(), vec![table[2]]);
        let rest = c.allocate(2).unwrap();
        assert_eq!(rest, vec![table[1], table[0]]);
        assert_eq!(c.drain_evicted(), vec![table[1], table[0]]);
        c.release(&taken).unwrap();
        c.release(&rest).unwrap();
        c.check_invariants();
        c.finish(a).unwrap();
        c.check_invariants();
    }

    #[test]
    fn a_zero_window_is_refused_and_full_attention_has_no_null_block() {
        let config = CacheConfig {
            sliding_window: Some(0),
            ..CacheConfig::new(8, 2)
        };
        assert!(matches!(
            PrefixCache::new(config, context_fingerprint(b"unit")),
            Err(CacheError::InvalidInput(_))
        ));
        assert_eq!(crate::cache::tests::cache(8, 2).null_block(), None);
        assert_eq!(sliding(8, 2, 4, FullHit::default()).null_block(), Some(8));
    }

    #[test]
    fn commit_releases_the_blocks_that_left_the_window() {
        let c = sliding(16, 2, 3, FullHit::default());
        let null = c.null_block().unwrap();
        let id = "a".into();
        c.add_request(id, prompt(10), b"", no_extras(), 0).unwrap();
        let id = &RequestId::from("a");
        let slots = c.allocate_slots(id, 10, 0, 0).unwrap();
        assert_eq!(slots.block_ids.len(), 5);
        // Settled at 10: the next query (position 10) reads 8..=10, so positions 0..4 go.
        assert_eq!(c.commit(id, 10), Ok(5));
        let table = c.block_table(id).unwrap();
        assert_eq!(&table[..4], &[null; 4]);
        assert_ne!(table[4], null);
        assert_eq!(c.stats().blocks_released, 4);
        // Published blocks stay cached, unreferenced.
        for &block in &slots.block_ids[..4] {
            assert!(c.is_cached(block).unwrap());
            assert_eq!(c.ref_count(block), Ok(0));
        }
        c.check_invariants();
        // Decode: settled at 11 the query reads 9..=11, so position 4 (8, 9) stays; at 12 it goes.
        for (token, position_4_released) in [(11, false), (12, true)] {
            c.append_tokens(id, &[token], false).unwrap();
            c.allocate_slots(id, 1, 0, 0).unwrap();
            c.commit(id, token as usize).unwrap();
            let table = c.block_table(id).unwrap();
            assert_eq!(table[4] == null, position_4_released, "settled at {token}");
            c.check_invariants();
        }
        assert!(
            c.release(&[null]).is_err(),
            "the null block is never released"
        );
        assert!(c.ref_count(null).is_err());
        c.finish(id).unwrap();
        assert_eq!(c.stats().blocks_in_use, 0);
        c.check_invariants();
    }

    #[test]
    fn a_hit_needs_only_the_window_after_early_blocks_were_evicted() {
        let c = sliding(6, 2, 3, FullHit::default());
        let null = c.null_block().unwrap();
        let a = &computed(&c, "a", prompt(10));
        c.finish(a).unwrap();
        // Pressure evicts the LRU blocks: the early ones, released first.
        let pressure = c.allocate(3).unwrap();
        assert_eq!(c.stats().evictions, 2);
        let probe = [prompt(10), vec![99]].concat();
        let hit = c.lookup(&probe, b"", &no_extras()).unwrap();
        assert_eq!(
            hit.num_cached_tokens, 10,
            "not stopped at the evicted first blocks"
        );
        assert_eq!(&hit.blocks[..4], &[null; 4]);
        assert!(hit.blocks[4] < 6);
        let b = &RequestId::from("b");
        c.add_request(b.clone(), probe, b"", no_extras(), 0)
            .unwrap();
        assert_eq!(c.start_position(b), Ok(10));
        let slots = c.allocate_slots(b, 1, 0, 0).unwrap();
        assert_eq!(slots.num_cached_tokens, 10);
        assert_eq!(&slots.block_ids[..4], &[null; 4]);
        assert_eq!(c.ref_count(hit.blocks[4]), Ok(1));
        c.check_invariants();
        c.finish(b).unwrap();
        c.release(&pressure).unwrap();
        c.check_invariants();
    }

    #[test]
    fn a_window_larger_than_the_prompt_needs_every_block() {
        let c = sliding(16, 2, 64, FullHit::default());
        let a = &computed(&c, "a", prompt(8));
        assert_eq!(c.stats().blocks_released, 0);
        c.finish(a).unwrap();
        let first = c.lookup(&prompt(3), b"", &no_extras()).unwrap().blocks;
        // Evict exactly the first block: then no hit is servable.
        let mut pressure = c.allocate(12).unwrap();
        pressure.extend(c.allocate(1).unwrap());
        assert!(!c.is_cached(first[0]).unwrap());
        let hit = c
            .lookup(&[prompt(8), vec![0]].concat(), b"", &no_extras())
            .unwrap();
        assert_eq!(hit.num_cached_tokens, 0);
        assert!(hit.blocks.is_empty());
        c.release(&pressure).unwrap();
        c.check_invariants();
    }

    #[test]
    fn full_hits_check_their_own_window_in_both_modes() {
        for (mode, cached, shared) in [
            (FullHit::RecomputeLastBlock, 6, false),
            (FullHit::ReuseLastBlock, 7, true),
        ] {
            let c = sliding(16, 2, 2, mode);
            let null = c.null_block().unwrap();
            let a = &computed(&c, "a", prompt(8));
            let b = &RequestId::from("b");
            c.add_request(b.clone(), prompt(8), b"", no_extras(), 0)
                .unwrap();
            let slots = c.allocate_slots(b, 8 - cached, 0, 0).unwrap();
            assert!(slots.full_hit);
            assert_eq!(slots.last_token_shared, shared);
            assert_eq!(slots.num_cached_tokens, cached);
            // Window 2: the query at `cached` reads `cached - 1 ..= cached`.
            let first_needed = (cached + 1 - 2) / 2;
            let table = c.block_table(b).unwrap();
            assert!(table[..first_needed].iter().all(|&x| x == null));
            assert!(table[first_needed..].iter().all(|&x| x != null));
            c.check_invariants();
            c.commit(b, 8).unwrap();
            c.finish(b).unwrap();
            c.finish(a).unwrap();
            c.check_invariants();
        }
    }

    #[test]
    fn truncate_refuses_to_need_a_released_block() {
        // Blocks of 4, window 2: settled at 7 the query reads 6..=7, so block 0 (0..4) goes.
        let c = sliding(16, 4, 2, FullHit::default());
        let a = &RequestId::from("a");
        c.add_request(a.clone(), prompt(7), b"", no_extras(), 0)
            .unwrap();
        c.allocate_slots(a, 7, 0, 0).unwrap();
        assert_eq!(c.commit(a, 7), Ok(1));
        assert_eq!(c.block_table(a).unwrap()[0], c.null_block().unwrap());
        // A query at 4 would read token 3, in the released block.
        let err = c.truncate(a, 4).unwrap_err();
        assert!(err.to_string().contains("sliding window"), "{err}");
        assert_eq!(c.num_tokens(a), Ok(7), "a refused truncate changes nothing");
        assert_eq!(c.truncate(a, 5), Ok(vec![]));
        c.check_invariants();
        c.finish(a).unwrap();
        c.check_invariants();
    }

    #[test]
    fn the_cap_limits_the_next_match_in_both_modes() {
        for window in [None, Some(4)] {
            let config = CacheConfig {
                sliding_window: window,
                ..CacheConfig::new(32, 2)
            };
            let c = PrefixCache::with_table_seed(config, context_fingerprint(b"unit"), 7).unwrap();
            let a = &computed(&c, "a", prompt(12));
            let b = &RequestId::from("b");
            assert_eq!(
                c.limit_cached_prefix(b, Some(3)),
                Err(CacheError::UnknownRequest(b.clone()))
            );
            c.add_request(b.clone(), prompt(12), b"", no_extras(), 0)
                .unwrap();
            assert_eq!(c.start_position(b), Ok(10), "a full hit");
            c.limit_cached_prefix(b, Some(7)).unwrap();
            assert_eq!(c.start_position(b), Ok(6));
            let slots = c.allocate_slots(b, 6, 0, 0).unwrap();
            assert_eq!((slots.num_cached_tokens, slots.full_hit), (6, false));
            c.limit_cached_prefix(b, Some(0)).unwrap();
            c.preempt(b).unwrap();
            assert_eq!(c.start_position(b), Ok(0), "the cap stays until changed");
            c.limit_cached_prefix(b, None).unwrap();
            assert_eq!(c.start_position(b), Ok(10));
            c.finish(b).unwrap();
            c.finish(a).unwrap();
            c.check_invariants();
        }
    }

    #[test]
    fn low_level_publishing_and_pins_are_refused_and_match_and_acquire_skips_nulls() {
        let c = sliding(16, 2, 3, FullHit::default());
        let null = c.null_block().unwrap();
        let blocks = c.allocate(2).unwrap();
        let err = c
            .commit_blocks(&prompt(4), &blocks, b"", &no_extras(), 0)
            .unwrap_err();
        assert!(err.to_string().contains("sliding-window"), "{err}");
        assert!(matches!(
            c.pin(&prompt(4), b"", &no_extras()),
            Err(CacheError::InvalidInput(_))
        ));
        c.release(&blocks).unwrap();
        let a = &computed(&c, "a", prompt(10));
        c.finish(a).unwrap();
        let held = c
            .match_and_acquire(&prompt(11), b"", &no_extras(), 0)
            .unwrap();
        assert_eq!(held.num_cached_tokens, 10);
        assert_eq!(&held.blocks[..4], &[null; 4]);
        assert_eq!(c.ref_count(held.blocks[4]), Ok(1));
        c.release(&held.blocks[4..]).unwrap();
        c.check_invariants();
    }

    #[test]
    fn stored_events_carry_the_export_keys_and_their_parents() {
        use crate::events::{EventConfig, KvEvent, TokenIds};
        let c = sliding(16, 2, 3, FullHit::default());
        c.enable_events(EventConfig {
            capacity: 100,
            token_ids: TokenIds::All,
        });
        let a = &RequestId::from("a");
        c.add_request(a.clone(), prompt(8), b"", no_extras(), 0)
            .unwrap();
        c.allocate_slots(a, 8, 0, 0).unwrap();
        c.commit(a, 4).unwrap();
        c.commit(a, 8).unwrap();
        let keys = c.block_keys(&prompt(8), b"", &no_extras()).unwrap();
        let mut stored = Vec::new();
        for event in c.drain_events().events {
            if let KvEvent::Stored {
                keys: event_keys,
                parent,
                ..
            } = event
            {
                stored.push((event_keys, parent));
            }
        }
        // Two commits of one chain coalesce into one event, as in full mode.
        assert_eq!(stored, vec![(keys.clone(), None)]);
        // A later block whose parent was released names the parent by its key.
        c.append_tokens(a, &[9, 10], false).unwrap();
        c.allocate_slots(a, 2, 0, 0).unwrap();
        c.commit(a, 10).unwrap();
        let keys = c.block_keys(&prompt(10), b"", &no_extras()).unwrap();
        let drained = c.drain_events().events;
        assert!(
            matches!(&drained[..], [KvEvent::Stored { keys: k, parent: Some(p), .. }]
                if k == &keys[4..] && *p == keys[3]),
            "{drained:?}"
        );
        assert_eq!(c.request_block_keys(a).unwrap(), keys);
        c.finish(a).unwrap();
    }
}
