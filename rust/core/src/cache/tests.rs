use super::*;
use crate::key::context_fingerprint;

/// A cache with full-width keys and a fixed seed.
pub(crate) fn cache(num_blocks: u32, block_size: usize) -> PrefixCache {
    PrefixCache::with_table_seed(
        CacheConfig::new(num_blocks, block_size),
        context_fingerprint(b"unit"),
        7,
    )
    .unwrap()
}

pub(crate) fn no_extras() -> RequestExtras {
    RequestExtras::default()
}

#[test]
fn the_first_copy_stays_canonical_and_the_duplicate_is_a_spare() {
    let c = cache(8, 2);
    let prompt = vec![1, 2, 3, 4, 5];
    // Two requests compute the same prefix side by side: both miss, both get own blocks.
    let a = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
    let b = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
    assert_eq!((a.num_cached_tokens, b.num_cached_tokens), (0, 0));
    assert_eq!(c.commit(&a.request_id, 5).unwrap(), 2);
    // The second commit finds both keys taken by identical content: it deduplicates.
    assert_eq!(c.commit(&b.request_id, 5).unwrap(), 2);
    let stats = c.stats();
    assert_eq!((stats.committed_blocks, stats.deduplicated_blocks), (2, 2));
    for position in 0..2 {
        assert!(c.is_cached(a.block_table[position]).unwrap());
        assert!(!c.is_cached(b.block_table[position]).unwrap());
    }
    // A third request hits a's blocks, never b's.
    let hit = c.lookup(&prompt, b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, a.block_table[..2]);
    // At finish, b's partial block goes back to the free list, its duplicates become spares:
    // obtainable, in the eviction order as vLLM keeps its copies (`pool.rs`); a's stay cached.
    let (free, evictable) = (c.stats().blocks_free, c.stats().blocks_evictable);
    c.finish(&b.request_id).unwrap();
    assert_eq!(c.stats().blocks_free, free + 1);
    assert_eq!(c.stats().blocks_evictable, evictable + 2);
    c.finish(&a.request_id).unwrap();
    // Cached content: a's two entries and b's two spares; every other block is free.
    let stats = c.stats();
    assert_eq!(stats.blocks_cached, 4);
    assert_eq!(stats.blocks_free + stats.blocks_cached, stats.blocks_total);
    assert_eq!(c.stats().blocks_obtainable, c.stats().blocks_total);
    c.check_invariants();
    // Taking every block takes the spares too (nothing of what they held is lost before).
    let all = c.allocate(c.stats().blocks_total).unwrap();
    assert_eq!(c.stats().evictions, 2);
    c.release(&all).unwrap();
    c.check_invariants();
}

#[test]
fn a_duplicate_commit_leaves_the_canonical_copy_in_its_eviction_place() {
    // vLLM caches a request's copy of a block without touching the first copy, which keeps its
    // place in the free queue. x's blocks are released before y's; z, a full hit on x's first
    // two blocks, recomputes x's second block into its own copy. The next eviction takes x's
    // second block (released first), whose entry moves into z's copy.
    let c = cache(6, 2);
    let serve = |tokens: Vec<u32>| {
        let r = c.begin(None, tokens.clone(), b"", no_extras(), 0).unwrap();
        c.commit(&r.request_id, tokens.len()).unwrap();
        r
    };
    let x = serve(vec![1; 5]);
    c.finish(&x.request_id).unwrap();
    let y = serve(vec![2; 5]);
    c.finish(&y.request_id).unwrap();
    let z = serve(vec![1; 4]);
    assert_eq!(z.num_cached_tokens, 2);
    assert_ne!(z.block_table[1], x.block_table[1]);
    let w = serve(vec![3; 4]);
    assert!(w.block_table.contains(&x.block_table[1]), "{w:?} {x:?}");
    assert!(!w.block_table.contains(&y.block_table[1]));
    let hit = c.lookup(&[1; 5], b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, [x.block_table[0], z.block_table[1]]);
    c.check_invariants();
}

#[test]
fn an_evicted_canonical_copy_hands_its_entry_to_the_earliest_copy() {
    // vLLM's lookup returns the first block cached under a hash that is still there: after
    // the original goes, the copy cached first.
    let c = cache(5, 2);
    let serve = |tokens: Vec<u32>| {
        let r = c.begin(None, tokens.clone(), b"", no_extras(), 0).unwrap();
        c.commit(&r.request_id, tokens.len()).unwrap();
        c.finish(&r.request_id).unwrap();
        r
    };
    let x = serve(vec![1; 4]);
    let first = serve(vec![1; 4]);
    let second = serve(vec![1; 4]);
    let copies = [
        x.block_table[1],
        first.block_table[1],
        second.block_table[1],
    ];
    assert!(copies[0] != copies[1] && copies[1] != copies[2] && copies[0] != copies[2]);
    // One free block, then the oldest evictable one: x's second block.
    let taken = c.allocate(2).unwrap();
    assert!(taken.contains(&x.block_table[1]));
    let hit = c.lookup(&[1; 5], b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, [x.block_table[0], first.block_table[1]]);
    c.check_invariants();
}

#[test]
fn commit_blocks_returns_the_canonical_copy() {
    let c = cache(8, 2);
    let prompt = [1, 2, 3, 4];
    let first = c.allocate(2).unwrap();
    assert_eq!(
        c.commit_blocks(&prompt, &first, b"", &no_extras(), 0)
            .unwrap(),
        first
    );
    let second = c.allocate(2).unwrap();
    assert_eq!(
        c.commit_blocks(&prompt, &second, b"", &no_extras(), 0)
            .unwrap(),
        first,
        "the duplicate commit is told to read the first copy"
    );
    assert_eq!(c.stats().deduplicated_blocks, 2);
    c.release(&second).unwrap();
    assert_eq!(
        c.stats().blocks_free,
        6,
        "the duplicates are freed at release"
    );
    c.check_invariants();
}

#[test]
fn low_level_blocks_computed_before_a_reset_are_never_published() {
    for reset in [PrefixCache::clear as fn(&PrefixCache), |c: &PrefixCache| {
        c.set_context(context_fingerprint(b"other"))
    }] {
        let c = cache(8, 2);
        let old = c.allocate(2).unwrap();
        reset(&c);
        let err = c
            .commit_blocks(&[1, 2, 3, 4], &old, b"", &no_extras(), 0)
            .unwrap_err();
        assert!(
            matches!(err, CacheError::BlockState { block, .. } if block == old[0]),
            "{err:?}"
        );
        assert_eq!(c.stats().blocks_cached, 0);
        // Blocks allocated after the reset publish normally, and the old ones release.
        let fresh = c.allocate(2).unwrap();
        assert_eq!(
            c.commit_blocks(&[1, 2, 3, 4], &fresh, b"", &no_extras(), 0)
                .unwrap(),
            fresh
        );
        c.release(&old).unwrap();
        c.release(&fresh).unwrap();
        c.check_invariants();
    }
}

#[test]
fn cached_blocks_acquired_before_a_reset_are_not_republished() {
    let c = cache(8, 2);
    let blocks = c.allocate(2).unwrap();
    c.commit_blocks(&[1, 2, 3, 4], &blocks, b"", &no_extras(), 0)
        .unwrap();
    let held = c
        .match_and_acquire(&[1, 2, 3, 4, 5], b"", &no_extras(), 0)
        .unwrap();
    assert_eq!(held.blocks, blocks);
    c.release(&blocks).unwrap();
    c.clear();
    // Detached, still held: neither cached nor publishable again.
    assert!(!c.is_cached(held.blocks[0]).unwrap());
    assert!(matches!(
        c.commit_blocks(&[1, 2, 3, 4], &held.blocks, b"", &no_extras(), 0),
        Err(CacheError::BlockState { .. })
    ));
    c.release(&held.blocks).unwrap();
    assert_eq!(c.stats().blocks_free, 8);
    c.check_invariants();
}

#[test]
fn release_cannot_drop_a_reference_a_request_owns() {
    let c = cache(8, 2);
    let request = c.begin(None, vec![1, 2, 3], b"", no_extras(), 0).unwrap();
    let own = request.block_table[0];
    let before = c.stats();
    let err = c.release(&[own]).unwrap_err();
    assert!(
        matches!(err, CacheError::BlockState { block, .. } if block == own),
        "{err:?}"
    );
    assert_eq!(c.stats(), before);
    // A block both the request and the caller hold: the caller may drop only its own.
    c.commit(&request.request_id, 3).unwrap();
    let held = c
        .match_and_acquire(&[1, 2, 3], b"", &no_extras(), 0)
        .unwrap();
    assert_eq!(held.blocks, vec![own]);
    assert_eq!(c.ref_count(own).unwrap(), 2);
    assert!(
        c.release(&[own, own]).is_err(),
        "the second is the request's"
    );
    assert_eq!(
        c.ref_count(own).unwrap(),
        2,
        "a refused release changes nothing"
    );
    c.release(&[own]).unwrap();
    assert_eq!(c.ref_count(own).unwrap(), 1);
    assert!(c.release(&[own]).is_err(), "a double release");
    c.finish(&request.request_id).unwrap();
    assert_eq!(c.ref_count(own).unwrap(), 0);
    assert!(c.is_cached(own).unwrap());
    c.check_invariants();
}

#[test]
fn release_checks_every_id_before_dropping_any() {
    let c = cache(4, 2);
    let blocks = c.allocate(2).unwrap();
    assert!(matches!(
        c.release(&[blocks[0], 99]),
        Err(CacheError::InvalidBlock { block: 99, .. })
    ));
    assert_eq!(c.ref_count(blocks[0]).unwrap(), 1);
    c.release(&blocks).unwrap();
    c.check_invariants();
}

/// A commit's run of fresh blocks (`publish_fresh_run`) hands over to the general loop at the
/// first block already cached: here one cached as other content, which cannot stand there.
#[test]
fn a_fresh_run_stops_at_a_cached_block() {
    let c = cache(8, 2);
    let held = c.allocate(2).unwrap();
    c.commit_blocks(&[1, 2, 3, 4], &held, b"", &no_extras(), 0)
        .unwrap();
    let fresh = c.allocate(1).unwrap();
    // [3, 4] after [5, 6] is not the entry `held[1]` holds ([3, 4] after [1, 2]).
    let published = c
        .commit_blocks(&[5, 6, 3, 4], &[fresh[0], held[1]], b"", &no_extras(), 0)
        .unwrap();
    assert_eq!(published, fresh, "only the fresh block is published");
    let hit = c.lookup(&[5, 6, 3, 4, 9], b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, fresh);
    let hit = c.lookup(&[1, 2, 3, 4, 9], b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, held, "the cached block keeps its own entry");
    c.check_invariants();
}

#[test]
fn commit_blocks_refuses_blocks_it_does_not_hold_or_that_are_not_full() {
    let c = cache(4, 2);
    let blocks = c.allocate(2).unwrap();
    let other = 3;
    assert!(matches!(
        c.commit_blocks(&[1, 2, 3, 4], &[blocks[0], other], b"", &no_extras(), 0),
        Err(CacheError::InvalidBlock { block: 3, .. })
    ));
    assert!(matches!(
        c.commit_blocks(&[1, 2, 3], &blocks, b"", &no_extras(), 0),
        Err(CacheError::BlockState { .. })
    ));
    assert_eq!(
        c.stats().blocks_cached,
        0,
        "a refused commit publishes nothing"
    );
    c.release(&blocks).unwrap();
    c.check_invariants();
}

#[test]
fn eviction_removes_the_table_entry_before_reuse() {
    let c = cache(2, 1);
    let first = c.begin(None, vec![1, 2], b"", no_extras(), 0).unwrap();
    c.commit(&first.request_id, 2).unwrap();
    c.finish(&first.request_id).unwrap();
    // The same two blocks, now holding other KV: the old prefix must miss.
    let second = c.begin(None, vec![3, 4], b"", no_extras(), 0).unwrap();
    assert_eq!(c.stats().evictions, 2);
    assert!(c
        .lookup(&[1, 2], b"", &no_extras())
        .unwrap()
        .blocks
        .is_empty());
    c.finish(&second.request_id).unwrap();
    c.check_invariants();
}

#[test]
fn eviction_log_lists_evicted_blocks_once_and_only_when_on() {
    let c = cache(2, 1);
    let first = c.begin(None, vec![1, 2], b"", no_extras(), 0).unwrap();
    let first_blocks = c.block_table(&first.request_id).unwrap();
    c.commit(&first.request_id, 2).unwrap();
    c.finish(&first.request_id).unwrap();
    assert!(c.drain_evicted().is_empty(), "off by default");
    c.set_eviction_log(true);
    let second = c.begin(None, vec![3], b"", no_extras(), 0).unwrap();
    let evicted = c.drain_evicted();
    assert_eq!(evicted.len(), 1);
    assert!(first_blocks.contains(&evicted[0]));
    assert_eq!(c.block_table(&second.request_id).unwrap(), evicted);
    assert!(c.drain_evicted().is_empty(), "drained");
    c.finish(&second.request_id).unwrap();
    c.set_eviction_log(false);
    let third = c.begin(None, vec![5, 6], b"", no_extras(), 0).unwrap();
    assert!(c.drain_evicted().is_empty(), "off again");
    c.finish(&third.request_id).unwrap();
    c.check_invariants();
}

/// Issue 20, item 14: an absurd size is refused by its figure before anything is allocated,
/// never reported as `OutOfBlocks` (no block was asked for).
#[test]
fn absurd_sizes_are_refused_by_figure_before_allocating() {
    let refused = |num_blocks, block_size| match PrefixCache::new(
        CacheConfig::new(num_blocks, block_size),
        context_fingerprint(b"x"),
    ) {
        Err(CacheError::InvalidInput(message)) => message,
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("{num_blocks} blocks of {block_size} tokens accepted"),
    };
    let message = refused(16, 1 << 24);
    assert!(message.contains("block_size 16777216"), "{message}");
    let message = refused(u32::MAX, 16);
    assert!(
        message.contains("num_blocks 4294967295") && message.contains("bytes"),
        "{message}"
    );
    let message = refused(1 << 20, MAX_BLOCK_SIZE);
    assert!(message.contains("bytes up front"), "{message}");
    // Real sizes are accepted.
    PrefixCache::new(CacheConfig::new(1 << 16, 16), context_fingerprint(b"x")).unwrap();
    PrefixCache::new(
        CacheConfig::new(4, MAX_BLOCK_SIZE),
        context_fingerprint(b"x"),
    )
    .unwrap();
}

#[test]
fn a_canonical_copy_goes_before_a_finished_duplicates_successor() {
    // r1 is a full hit on r0's prompt: it recomputes the last block into its own copy and
    // decodes a further block on it. vLLM frees r0's original first and evicts it first (its
    // hash stays cached in r1's copy), so the successor stays reachable; the copy keeps it as
    // a spare rather than handing it to the original, which would then outlive it.
    let c = cache(8, 2);
    let r0 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    c.commit(&r0.request_id, 4).unwrap();
    c.finish(&r0.request_id).unwrap();
    let r1 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    let copy = r1.block_table[1];
    assert_ne!(
        copy, r0.block_table[1],
        "the full hit's last block is a copy"
    );
    c.commit(&r1.request_id, 4).unwrap();
    let successor = c.append(&r1.request_id, &[5, 6]).unwrap();
    c.commit(&r1.request_id, 6).unwrap();
    c.append(&r1.request_id, &[7]).unwrap();
    c.finish(&r1.request_id).unwrap();
    c.check_invariants();
    // Four free blocks (r1's partial one among them), then the oldest evictable block: the
    // original, whose entry moves into r1's copy.
    let taken = c.allocate(5).unwrap();
    assert!(taken.contains(&r0.block_table[1]));
    assert!(!taken.contains(&successor[0]) && !taken.contains(&copy));
    let hit = c.lookup(&[1, 2, 3, 4, 5, 6, 7], b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, [r0.block_table[0], copy, successor[0]]);
    c.check_invariants();
}

#[test]
fn a_finished_duplicates_spare_goes_in_its_release_place_while_its_successor_is_held() {
    // As above, r1's copy of P's last block is a spare above r1's decoded block C. Then r2 hits
    // P and C (through r0's original) and holds them. vLLM counts r1's copy free (nobody
    // references it; its hash stays cached in the original) and takes it first; the copy must
    // not wait for C, whose holder holds the original.
    let c = cache(8, 2);
    let r0 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    c.commit(&r0.request_id, 4).unwrap();
    c.finish(&r0.request_id).unwrap();
    let r1 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    let copy = r1.block_table[1];
    c.commit(&r1.request_id, 4).unwrap();
    let successor = c.append(&r1.request_id, &[5, 6]).unwrap()[0];
    c.commit(&r1.request_id, 6).unwrap();
    c.finish(&r1.request_id).unwrap();
    let r2 = c
        .begin(None, vec![1, 2, 3, 4, 5, 6, 8], b"", no_extras(), 0)
        .unwrap();
    assert_eq!(r2.num_cached_tokens, 6);
    assert_eq!(
        r2.block_table[..3],
        [r0.block_table[0], r0.block_table[1], successor]
    );
    c.check_invariants();
    // Held: r2's four blocks. Free: three; the copy is the one other block obtainable.
    let stats = c.stats();
    assert_eq!((stats.blocks_free, stats.blocks_obtainable), (3, 4));
    let taken = c.allocate(4).unwrap();
    assert!(taken.contains(&copy));
    c.check_invariants();
    c.release(&taken).unwrap();
    c.finish(&r2.request_id).unwrap();
    let hit = c.lookup(&[1, 2, 3, 4, 5, 6, 7], b"", &no_extras()).unwrap();
    assert_eq!(
        hit.blocks,
        [r0.block_table[0], r0.block_table[1], successor]
    );
    c.check_invariants();
}

#[test]
fn a_refused_request_leaves_a_spares_successor_where_it_was() {
    // As in `a_canonical_copy_goes_before_a_finished_duplicates_successor`, r1's copy is a
    // spare above its decoded block C. r2 hits P and C but cannot get its other blocks: the
    // refused call must change nothing, so C, lent to the original while r2's check held it
    // (`pool.rs`), is back under the copy, and the original still goes first.
    let c = cache(8, 2);
    let r0 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    c.commit(&r0.request_id, 4).unwrap();
    c.finish(&r0.request_id).unwrap();
    let r1 = c
        .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
        .unwrap();
    let copy = r1.block_table[1];
    c.commit(&r1.request_id, 4).unwrap();
    let successor = c.append(&r1.request_id, &[5, 6]).unwrap()[0];
    c.commit(&r1.request_id, 6).unwrap();
    c.finish(&r1.request_id).unwrap();
    let mut long = vec![1, 2, 3, 4, 5, 6];
    long.extend(10..22);
    let refused = c.begin(None, long, b"", no_extras(), 0);
    assert!(
        matches!(refused, Err(CacheError::OutOfBlocks { .. })),
        "{refused:?}"
    );
    c.check_invariants();
    let taken = c.allocate(5).unwrap();
    assert!(taken.contains(&r0.block_table[1]));
    assert!(!taken.contains(&successor) && !taken.contains(&copy));
    c.check_invariants();
}

/// Round 11: the removals run as a pipeline that reads ahead by `LOOKAHEAD` and
/// `2 * LOOKAHEAD` victims. Whatever the batch's size against those distances, every victim's
/// entry goes and every other entry stays (planted: a removal skipped at the pipeline's edges
/// fails it).
#[test]
fn every_victim_of_any_batch_size_loses_its_entry_and_no_other_does() {
    const CACHED: usize = 100;
    let lookahead = crate::cache::LOOKAHEAD;
    let sizes = [
        1,
        lookahead - 1,
        lookahead,
        lookahead + 1,
        2 * lookahead - 1,
        2 * lookahead,
        2 * lookahead + 1,
        3 * lookahead + 1,
        CACHED,
    ];
    for chained in [false, true] {
        for &victims in &sizes {
            let c = cache(CACHED as u32, 1);
            // Either one chain of CACHED blocks (evicted tail first, walking up the chain) or
            // CACHED one-block prefixes (each a leaf of its own, evicted oldest first).
            let prompts: Vec<Vec<u32>> = if chained {
                vec![(1..=CACHED as u32).collect()]
            } else {
                (1..=CACHED as u32).map(|t| vec![t]).collect()
            };
            for prompt in &prompts {
                let r = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
                c.commit(&r.request_id, prompt.len()).unwrap();
                c.finish(&r.request_id).unwrap();
            }
            c.set_eviction_log(true);
            let fresh: Vec<u32> = (0..victims as u32).map(|t| 1_000 + t).collect();
            let r = c.begin(None, fresh, b"", no_extras(), 0).unwrap();
            assert_eq!(
                c.drain_evicted().len(),
                victims,
                "chained {chained}, {victims}"
            );
            assert_eq!(c.stats().evictions, victims as u64);
            // What stays cached: the chain's first CACHED - victims blocks, or the newest
            // CACHED - victims prefixes; everything else misses. (Each probe has one token
            // more: a prompt cached whole matches all but its last block.)
            let probe = |prompt: &Vec<u32>| [prompt.as_slice(), &[999_999]].concat();
            if chained {
                let hit = c.lookup(&probe(&prompts[0]), b"", &no_extras()).unwrap();
                assert_eq!(hit.blocks.len(), CACHED - victims, "chained, {victims}");
            } else {
                for (i, prompt) in prompts.iter().enumerate() {
                    let hit = c.lookup(&probe(prompt), b"", &no_extras()).unwrap();
                    assert_eq!(hit.blocks.len(), usize::from(i >= victims), "prefix {i}");
                }
            }
            c.finish(&r.request_id).unwrap();
            c.check_invariants();
        }
    }
}

/// Round 11: each published block names the block `CHAIN_HINT_DISTANCE` positions up its
/// chain, so that evicting it asks for that block's metadata ahead of the walk. A hint only
/// (nothing reads it for an answer), so this is the one test that would notice it pointing
/// nowhere; a chain's first `CHAIN_HINT_DISTANCE` blocks have none.
#[test]
fn published_blocks_hint_the_block_a_fixed_distance_up_their_chain() {
    use crate::pool::CHAIN_HINT_DISTANCE as D;
    // More than twice the distance, so that most blocks have a hint whatever `D` is (with 20
    // blocks and `D` 32 none had one, and the test checked nothing: found by a review).
    let blocks = 2 * D + 8;
    let c = cache(u32::try_from(blocks + 8).unwrap(), 2);
    let tokens: Vec<u32> = (0..u32::try_from(2 * blocks).unwrap()).collect();
    let r = c.begin(None, tokens, b"", no_extras(), 0).unwrap();
    // Two commits: a commit's first block goes through the general publish loop, the rest
    // through `publish_fresh_run`; each sets hints its own way, both checked past `D`.
    c.commit(&r.request_id, 2 * (D + 4)).unwrap();
    c.commit(&r.request_id, 2 * blocks).unwrap();
    let table = c.block_table(&r.request_id).unwrap();
    assert_eq!(table.len(), blocks);
    let inner = c.inner.lock();
    for (position, &block) in table.iter().enumerate() {
        let expected = position.checked_sub(D).map_or(BlockId::MAX, |p| table[p]);
        assert_eq!(
            inner.pool.chain_hint_of(block),
            expected,
            "position {position}"
        );
    }
    drop(inner);
    c.finish(&r.request_id).unwrap();
}

/// Round 11: a prompt repeated whole leaves one more duplicate of its last block each time
/// (its recomputed copy), so a full pool holds many duplicates of one canonical block, which
/// is evicted, handing its entry to its earliest duplicate, again and again. Duplicates name
/// their group, which moves to the heir; every invariant holds and every repeat still hits all
/// but its last block, through groups emptied and reused.
#[test]
fn a_prompt_repeated_whole_hands_its_last_block_down_its_duplicates() {
    let c = cache(10, 2);
    let prompt: Vec<u32> = (0..6).collect();
    for round in 0..60 {
        let r = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
        let expected = if round == 0 { 0 } else { 4 };
        assert_eq!(r.num_cached_tokens, expected, "round {round}");
        c.commit(&r.request_id, prompt.len()).unwrap();
        c.finish(&r.request_id).unwrap();
        c.check_invariants();
        if round == 30 || round == 45 {
            // Another prompt takes most of the pool: the canonical copy and its duplicates go,
            // and the next group reuses the emptied one.
            let other: Vec<u32> = (100 + round..116 + round).collect();
            let r = c.begin(None, other, b"", no_extras(), 0).unwrap();
            c.commit(&r.request_id, 16).unwrap();
            c.finish(&r.request_id).unwrap();
            c.check_invariants();
        }
    }
}

#[test]
fn a_recommit_past_cached_blocks_under_truncated_keys_fills_no_key() {
    // One-bit keys (no links, so every entry is indexed, and half the keys are 0, the value
    // that stands for "no key" in a linked slot). Committing a longer chain over blocks already
    // cached hashes the positions it passes; none of their indexed slots may take that as a
    // key to fill in (`Table::fill_key` debug-asserted a linked slot here).
    for seed in 0..16 {
        let c = PrefixCache::with_table_seed(
            CacheConfig {
                key_bits: 1,
                ..CacheConfig::new(8, 1)
            },
            context_fingerprint(b"unit"),
            seed,
        )
        .unwrap();
        let blocks = c.allocate(3).unwrap();
        let tokens = [4, 5, 6];
        let first = c
            .commit_blocks(&tokens[..2], &blocks[..2], b"", &no_extras(), 0)
            .unwrap();
        let all = c
            .commit_blocks(&tokens, &blocks, b"", &no_extras(), 0)
            .unwrap();
        assert_eq!(all[..first.len()], first[..]);
        c.check_invariants();
    }
}

#[test]
fn a_short_hit_of_a_long_prompt_keeps_no_room_it_never_used() {
    // The block list is reserved for the whole prompt at the first hit, then handed to a
    // `PrefixMatch` or a pin that may live long: a one-block hit of a 4,096-block prompt must
    // not hold room for 4,096 ids.
    let c = cache(64, 2);
    let held = c.allocate(1).unwrap();
    c.commit_blocks(&[1, 2], &held, b"", &no_extras(), 0)
        .unwrap();
    let mut long = vec![1, 2];
    long.extend((0..8190).map(|t| 3 + t % 1000));
    let hit = c.lookup(&long, b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, held);
    assert!(
        hit.blocks.capacity() <= 2,
        "{} ids of room kept",
        hit.blocks.capacity()
    );
    let miss = c.lookup(&[9; 8192], b"", &no_extras()).unwrap();
    assert!(miss.blocks.is_empty());
    assert_eq!(miss.blocks.capacity(), 0, "a miss allocates nothing");
    // A hit as long as the pool allows is reserved once and kept whole.
    let all = c.allocate(32).unwrap();
    let tokens: Vec<u32> = (0..64).map(|t| 2000 + t).collect();
    c.commit_blocks(&tokens, &all, b"", &no_extras(), 0)
        .unwrap();
    let mut longer = tokens.clone();
    longer.extend([5; 9000]);
    let hit = c.lookup(&longer, b"", &no_extras()).unwrap();
    assert_eq!(hit.blocks, all);
    assert!(
        hit.blocks.capacity() <= 64,
        "capped at the pool: {}",
        hit.blocks.capacity()
    );
    c.check_invariants();
}
