use crate::cache::tests::{cache, no_extras};
use crate::error::CacheError;
use crate::key::context_fingerprint;
use crate::request::RequestId;
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
    // Pressure takes a's cached chain (b holds only its own copies): a's second block is
    // evicted, its first block's entry moves into b's duplicate, which stays cached.
    let pressure = c.allocate(2).unwrap();
    assert_eq!(c.stats().evictions, 1);
    assert_eq!(c.is_cached(b.block_table[0]), Ok(true));
    assert_eq!(
        c.lookup(&[1, 2, 3], b"", &no_extras()).unwrap().blocks,
        b.block_table[..1]
    );
    c.check_invariants();
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

/// Issue 20, item 2: counts whose sum with the request's position overflows are refused by
/// name, with nothing changed; they were wrapped (`Slots` for 2**64-1 new tokens, 0 blocks
/// needed for 2**64-1 lookahead slots).
#[test]
fn counts_that_overflow_are_invalid_input_and_change_nothing() {
    let c = cache(16, 4);
    let done = c
        .begin(None, (0..10).collect(), b"", no_extras(), 0)
        .unwrap();
    let done = &done.request_id;
    c.commit(done, 10).unwrap();
    let waiting = RequestId::from("waiting");
    c.add_request(waiting.clone(), (100..110).collect(), b"", no_extras(), 0)
        .unwrap();
    let before = (c.stats(), c.block_table(done).unwrap());
    let invalid = |result: Result<_, CacheError>, name: &str| match result {
        Err(CacheError::InvalidInput(message)) => assert!(message.contains(name), "{message}"),
        other => panic!("expected InvalidInput naming {name}, got {other:?}"),
    };
    invalid(
        c.allocate_slots(done, usize::MAX, 0, 0).map(|_| ()),
        "num_new_tokens",
    );
    invalid(
        c.allocate_slots(done, 0, usize::MAX, 0).map(|_| ()),
        "num_lookahead_tokens",
    );
    invalid(
        c.allocate_slots(&waiting, 1, usize::MAX, 0).map(|_| ()),
        "num_lookahead_tokens",
    );
    invalid(
        c.can_allocate_slots(done, 0, usize::MAX - 1, 0).map(|_| ()),
        "num_lookahead_tokens",
    );
    invalid(
        c.blocks_needed(done, 0, usize::MAX).map(|_| ()),
        "num_lookahead_tokens",
    );
    invalid(
        c.allocate_slots(done, 0, 4, usize::MAX).map(|_| ()),
        "watermark_blocks",
    );
    invalid(
        c.covered_slots(done, 0, 0, 0)
            .and(c.allocate_slots(&waiting, 11, 0, 0))
            .map(|_| ()),
        "num_new_tokens",
    );
    assert_eq!(c.covered_slots(done, usize::MAX, 0, 0), Ok(None));
    assert_eq!(c.covered_slots(done, 0, usize::MAX, 0), Ok(None));
    assert_eq!((c.stats(), c.block_table(done).unwrap()), before);
    assert!(c.block_table(&waiting).unwrap().is_empty());
    // Counts that do not overflow get their answer: a lookahead beyond the pool is a block
    // count, and refused as such.
    assert_eq!(
        c.blocks_needed(&waiting, 0, usize::MAX - 3),
        Ok(usize::MAX / 4)
    );
    assert_eq!(
        c.can_allocate_slots(&waiting, 0, usize::MAX - 3, 0),
        Ok(false)
    );
    c.check_invariants();
}

/// Issue 20, item 13: a waiting request's hit grew after `start_position` (another request
/// committed the same prefix): `allocate_slots` for the tokens the scheduler counted from the
/// old start cuts the hit back so they fit, instead of refusing with "append them first".
#[test]
fn a_hit_that_grew_since_start_position_is_cut_back_to_fit() {
    let c = cache(16, 4);
    let tokens: Vec<u32> = (0..14).collect();
    let late = RequestId::from("late");
    c.add_request(late.clone(), tokens.clone(), b"", no_extras(), 0)
        .unwrap();
    assert_eq!(c.start_position(&late), Ok(0));
    let first = c.begin(None, tokens.clone(), b"", no_extras(), 0).unwrap();
    c.commit(&first.request_id, 14).unwrap();
    assert_eq!(c.start_position(&late), Ok(12));
    assert_eq!(c.blocks_needed(&late, 13, 0), Ok(4));
    // 13 tokens end at 14 from position 0 or 1: the longest hit leaving room is 0 blocks.
    let slots = c.allocate_slots(&late, 13, 0, 0).unwrap();
    assert_eq!((slots.num_computed_tokens, slots.num_cached_tokens), (0, 0));
    assert_eq!(slots.block_ids.len(), 4);
    c.check_invariants();
    // 6 tokens fit after a hit of 8: the hit is cut to 2 blocks, not dropped.
    let again = RequestId::from("again");
    c.add_request(again.clone(), tokens.clone(), b"", no_extras(), 0)
        .unwrap();
    let slots = c.allocate_slots(&again, 6, 0, 0).unwrap();
    assert_eq!((slots.num_computed_tokens, slots.num_cached_tokens), (8, 8));
    // More tokens than the request has: refused by name, nothing changed.
    let short = RequestId::from("short");
    c.add_request(short.clone(), vec![1, 2], b"", no_extras(), 0)
        .unwrap();
    match c.allocate_slots(&short, 3, 0, 0) {
        Err(CacheError::InvalidInput(message)) => {
            assert!(message.contains("num_new_tokens 3"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(c.block_table(&short).unwrap().is_empty());
    c.check_invariants();
}

/// A prompt of `blocks` blocks of 2 tokens, distinct from every other `tag`'s.
fn chain(tag: u32, blocks: usize) -> Vec<u32> {
    (0..2 * blocks as u32).map(|i| tag * 10_000 + i).collect()
}

#[test]
fn a_match_finds_every_hit_length_across_the_hash_ahead_batches() {
    // `match_request` hashes and reads LOOKAHEAD (16) blocks at a time: hits ending just
    // before, at and after each batch boundary, and the whole prompt, must all be found.
    let c = cache(400, 2);
    let base = chain(1, 50);
    let first = c.begin(None, base.clone(), b"", no_extras(), 0).unwrap();
    assert_eq!(c.commit(&first.request_id, base.len()), Ok(50));
    c.finish(&first.request_id).unwrap();
    for hit in [0, 1, 15, 16, 17, 31, 32, 33, 47, 48, 49] {
        let mut prompt = base[..2 * hit].to_vec();
        prompt.extend(chain(100 + hit as u32, 3));
        let probe = c.lookup(&prompt, b"", &no_extras()).unwrap();
        let r = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(r.num_cached_tokens, 2 * hit, "hit of {hit} blocks");
        assert_eq!(r.block_table[..hit], first.block_table[..hit]);
        assert_eq!(probe.blocks, r.block_table[..hit]);
        // The keys hashed ahead of the miss are the ones the commit publishes under.
        assert_eq!(c.commit(&r.request_id, prompt.len()), Ok(hit + 3));
        c.finish(&r.request_id).unwrap();
        assert_eq!(
            c.lookup(&[&prompt[..], &[0]].concat(), b"", &no_extras())
                .unwrap()
                .blocks
                .len(),
            hit + 3
        );
        c.check_invariants();
    }
    // The whole prompt cached: a full hit, the last block recomputed (the default).
    let r = c.begin(None, base.clone(), b"", no_extras(), 0).unwrap();
    assert!(r.full_hit);
    assert_eq!(r.num_cached_tokens, base.len() - 2);
    assert_eq!(r.block_table[..49], first.block_table[..49]);
    c.finish(&r.request_id).unwrap();
    c.check_invariants();
}

#[test]
fn a_batched_match_still_verifies_every_block_under_colliding_keys() {
    // Three-bit table keys: most blocks of a long chain share keys with others, so the table
    // holds many entries whose key matches a later probe but whose content does not. The hit
    // must be exactly the blocks that were published and equal, whatever the batch.
    for seed in 0..24 {
        let config = crate::CacheConfig {
            key_bits: 3,
            ..crate::CacheConfig::new(200, 2)
        };
        let c = PrefixCache::with_table_seed(config, context_fingerprint(b"unit"), seed).unwrap();
        let a = chain(1, 40);
        let first = c.begin(None, a.clone(), b"", no_extras(), 0).unwrap();
        let published = c.commit(&first.request_id, a.len()).unwrap();
        c.finish(&first.request_id).unwrap();
        for shared in [0, 5, 16, 17, 33, 39] {
            let mut b = a[..2 * shared].to_vec();
            b.extend(chain(2 + shared as u32, 4));
            let r = c.begin(None, b.clone(), b"", no_extras(), 0).unwrap();
            let expected = shared.min(published);
            assert_eq!(
                r.num_cached_tokens,
                2 * expected,
                "seed {seed}, {shared} shared"
            );
            assert_eq!(r.block_table[..expected], first.block_table[..expected]);
            c.finish(&r.request_id).unwrap();
            c.check_invariants();
        }
    }
}

#[test]
fn evicting_more_blocks_than_a_lookahead_removes_exactly_the_evicted_entries() {
    // Removals read 16 entries ahead: an allocation that evicts 45 blocks across three chains
    // must leave the table holding exactly the blocks still cached.
    let c = cache(60, 2);
    c.set_eviction_log(true);
    let prompts: Vec<Vec<u32>> = (1..=3).map(|tag| chain(tag, 20)).collect();
    let mut tables = Vec::new();
    for prompt in &prompts {
        let r = c.begin(None, prompt.clone(), b"", no_extras(), 0).unwrap();
        assert_eq!(c.commit(&r.request_id, prompt.len()), Ok(20));
        c.finish(&r.request_id).unwrap();
        tables.push(r.block_table);
    }
    let big = c.begin(None, chain(9, 45), b"", no_extras(), 0).unwrap();
    assert_eq!(c.stats().evictions, 45);
    let mut evicted = c.drain_evicted();
    evicted.sort_unstable();
    // Least recently used first: the first two chains whole, the third's last five blocks.
    let mut expected: Vec<u32> = tables[0].iter().chain(&tables[1]).copied().collect();
    expected.extend_from_slice(&tables[2][15..]);
    expected.sort_unstable();
    assert_eq!(evicted, expected);
    c.check_invariants();
    let hit = |prompt: &[u32]| {
        c.lookup(&[prompt, &[0]].concat(), b"", &no_extras())
            .unwrap()
            .blocks
    };
    assert!(hit(&prompts[0]).is_empty());
    assert!(hit(&prompts[1]).is_empty());
    assert_eq!(hit(&prompts[2]), tables[2][..15]);
    c.finish(&big.request_id).unwrap();
    c.check_invariants();
}

#[test]
fn commit_at_most_commits_small_commits_and_leaves_larger_ones_undone() {
    // Block size 2: a 10-token prompt is 5 blocks.
    let c = cache(16, 2);
    let r = c
        .begin(None, (0..10).collect(), b"", no_extras(), 0)
        .unwrap();
    let id = &r.request_id;
    let before = c.stats();
    // 4 new blocks, at most 3 allowed: nothing changes.
    assert_eq!(c.commit_at_most(id, 8, 3), Ok(None));
    assert_eq!(c.num_computed_tokens(id), Ok(0));
    assert_eq!(c.stats(), before);
    // At most 4: committed, as `commit` would.
    assert_eq!(c.commit_at_most(id, 8, 4), Ok(Some(4)));
    assert_eq!(c.num_computed_tokens(id), Ok(8));
    // Publishing nothing new (a decode step) always fits; refusals are refused.
    assert_eq!(c.commit_at_most(id, 9, 0), Ok(Some(4)));
    assert!(matches!(
        c.commit_at_most(id, 11, usize::MAX),
        Err(CacheError::InvalidInput(_))
    ));
    assert_eq!(
        c.commit_at_most(&RequestId::Int(99), 1, 0),
        Err(CacheError::UnknownRequest(RequestId::Int(99)))
    );
    c.finish(id).unwrap();
    c.check_invariants();
}
