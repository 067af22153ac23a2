//! The request API end to end, without Python.

use prefixkv_core::{
    context_fingerprint, CacheConfig, CacheError, FullHit, PrefixCache, RequestExtras, RequestId,
};

fn cache(num_blocks: u32, block_size: usize, key_bits: u32) -> PrefixCache {
    let config = CacheConfig {
        key_bits,
        ..CacheConfig::new(num_blocks, block_size)
    };
    PrefixCache::new(config, context_fingerprint(b"test")).unwrap()
}

fn serve(cache: &PrefixCache, tokens: &[u32], salt: &[u8]) -> usize {
    let r = cache
        .begin(None, tokens.to_vec(), salt, RequestExtras::default(), 0)
        .unwrap();
    cache.commit(&r.request_id, tokens.len()).unwrap();
    cache.finish(&r.request_id).unwrap();
    r.num_cached_tokens
}

#[test]
fn a_full_hit_recomputes_the_last_block_into_a_private_one_by_default() {
    let c = cache(8, 4, 128);
    assert_eq!(serve(&c, &[1, 2, 3, 4, 5, 6, 7, 8], b""), 0);
    let cached = c
        .lookup(&[1, 2, 3, 4, 5, 6, 7, 8, 9], b"", &none())
        .unwrap();
    let r = c.begin(None, (1..=8).collect(), b"", none(), 0).unwrap();
    assert!(r.full_hit && !r.last_token_shared);
    assert_eq!(
        r.num_cached_tokens, 4,
        "block-aligned: the last block is recomputed"
    );
    assert_eq!(r.block_table[0], cached.blocks[0]);
    assert_ne!(r.block_table[1], cached.blocks[1], "a private copy");
    assert_eq!(c.commit(&r.request_id, 8), Ok(2));
    assert_eq!(c.stats().deduplicated_blocks, 1);
    c.finish(&r.request_id).unwrap();
    // The two entries and the recomputed copy, a spare now (cached content, as vLLM keeps it).
    let stats = c.stats();
    assert_eq!(stats.blocks_cached, 3);
    assert_eq!(stats.blocks_free + stats.blocks_cached, stats.blocks_total);
    c.check_invariants();
}

#[test]
fn a_full_hit_in_reuse_mode_leaves_one_token_and_shares_the_last_block() {
    let config = CacheConfig {
        full_hit: FullHit::ReuseLastBlock,
        ..CacheConfig::new(8, 4)
    };
    let c = PrefixCache::new(config, context_fingerprint(b"test")).unwrap();
    assert_eq!(serve(&c, &[1, 2, 3, 4, 5, 6, 7, 8], b""), 0);
    let r = c.begin(None, (1..=8).collect(), b"", none(), 0).unwrap();
    assert!(r.full_hit && r.last_token_shared);
    assert_eq!(r.num_cached_tokens, 7);
    assert_eq!(c.stats().blocks_free, 6);
    c.finish(&r.request_id).unwrap();
    c.check_invariants();
}

fn id(name: &str) -> RequestId {
    RequestId::from(name)
}

fn none() -> RequestExtras {
    RequestExtras::default()
}

#[test]
fn chunked_prefill_takes_blocks_chunk_by_chunk_and_a_chunk_that_does_not_fit_changes_nothing() {
    let c = cache(4, 4, 128);
    let prompt: Vec<u32> = (1..=14).collect();
    c.add_request(id("a"), prompt.clone(), b"", none(), 0)
        .unwrap();
    assert_eq!(c.stats().blocks_free, 4, "adding takes nothing");
    let first = c.allocate_slots(&id("a"), 6, 0, 0).unwrap();
    assert_eq!((first.num_computed_tokens, first.block_ids.len()), (0, 2));
    c.commit(&id("a"), 6).unwrap();
    assert_eq!(
        c.stats().committed_blocks,
        1,
        "only the full block is published"
    );
    // Another request holds the last free blocks: the next chunk cannot fit.
    let other = c.allocate(2).unwrap();
    let before = c.stats();
    assert_eq!(c.can_allocate_slots(&id("a"), 8, 0, 0), Ok(false));
    assert!(matches!(
        c.allocate_slots(&id("a"), 8, 0, 0),
        Err(CacheError::OutOfBlocks { .. })
    ));
    assert_eq!(c.stats(), before, "a refused chunk changes nothing");
    assert_eq!(c.block_table(&id("a")).unwrap(), first.block_ids);
    c.release(&other).unwrap();
    let second = c.allocate_slots(&id("a"), 8, 0, 0).unwrap();
    assert_eq!(second.num_computed_tokens, 6);
    assert_eq!(second.block_ids.len(), 2);
    assert_eq!(c.commit(&id("a"), 14), Ok(3));
    assert!(
        matches!(
            c.allocate_slots(&id("a"), 1, 0, 0),
            Err(CacheError::InvalidInput(_))
        ),
        "every known token is computed: nothing more can be scheduled before an append"
    );
    c.finish(&id("a")).unwrap();
    assert_eq!(serve(&c, &(1..=15).collect::<Vec<_>>(), b""), 12);
    c.check_invariants();
}

#[test]
fn engine_ids_are_the_handle_and_duplicates_are_refused() {
    let c = cache(8, 2, 128);
    c.add_request(id("req-1"), vec![1, 2, 3], b"", none(), 0)
        .unwrap();
    let before = c.stats();
    assert_eq!(
        c.add_request(id("req-1"), vec![4], b"", none(), 0),
        Err(CacheError::DuplicateRequest(id("req-1")))
    );
    assert_eq!(
        c.begin(Some(id("req-1")), vec![4], b"", none(), 0)
            .map(|r| r.request_id),
        Err(CacheError::DuplicateRequest(id("req-1")))
    );
    assert_eq!(c.stats(), before);
    assert_eq!(
        c.num_tokens(&id("req-1")),
        Ok(3),
        "the first one is untouched"
    );
    c.add_request(RequestId::Int(7), vec![1], b"", none(), 0)
        .unwrap();
    // An id given by the engine is never handed out by `begin` while live.
    let ids: Vec<RequestId> = (0..8)
        .map(|_| c.begin(None, vec![9], b"", none(), 0).unwrap().request_id)
        .collect();
    assert!(!ids.contains(&RequestId::Int(7)));
    c.finish(&id("req-1")).unwrap();
    c.add_request(id("req-1"), vec![4], b"", none(), 0).unwrap();
    c.check_invariants();
}

#[test]
fn rejected_drafts_are_never_published_and_truncate_returns_whole_blocks() {
    let c = cache(16, 2, 128);
    c.add_request(id("a"), vec![1, 2, 3], b"", none(), 0)
        .unwrap();
    let slots = c.allocate_slots(&id("a"), 3, 4, 0).unwrap();
    assert_eq!(
        slots.block_ids.len(),
        4,
        "3 tokens + 4 lookahead slots = 4 blocks"
    );
    c.commit(&id("a"), 3).unwrap();
    c.append_tokens(&id("a"), &[40, 41, 42, 43], true).unwrap();
    assert!(
        matches!(
            c.append_tokens(&id("a"), &[5], false),
            Err(CacheError::InvalidInput(_))
        ),
        "verified tokens cannot follow unresolved drafts"
    );
    // The verification pass writes KV for every draft; none of it may be published.
    assert_eq!(c.commit(&id("a"), 7), Ok(1));
    assert_eq!(c.stats().committed_blocks, 1);
    // One draft accepted: tokens 1 2 3 40, blocks [1 2] [3 40] published; the block that held
    // only rejected drafts goes back.
    let free = c.stats().blocks_free;
    assert_eq!(c.accept_drafts(&id("a"), 1), Ok(2));
    assert_eq!(c.stats().blocks_free, free + 2);
    assert_eq!(c.block_table(&id("a")).unwrap().len(), 2);
    assert_eq!(
        c.lookup(&[1, 2, 3, 40, 41, 42, 43], b"", &none())
            .unwrap()
            .num_cached_tokens,
        4,
        "the rejected drafts are not cached"
    );
    // Truncating into a published block is refused: its KV is never rewritten.
    assert!(matches!(
        c.truncate(&id("a"), 3),
        Err(CacheError::InvalidInput(_))
    ));
    c.append_tokens(&id("a"), &[5, 6], true).unwrap();
    assert_eq!(
        c.truncate(&id("a"), 5),
        Ok(vec![]),
        "token 5 keeps its block"
    );
    assert_eq!(c.num_tokens(&id("a")), Ok(5));
    c.finish(&id("a")).unwrap();
    c.check_invariants();
}

#[test]
fn preempt_keeps_committed_blocks_cached_and_resume_hits_them() {
    let c = cache(8, 2, 128);
    c.add_request(id("a"), (1..=7).collect(), b"", none(), 0)
        .unwrap();
    c.allocate_slots(&id("a"), 7, 0, 0).unwrap();
    c.commit(&id("a"), 7).unwrap();
    c.append_tokens(&id("a"), &[8], false).unwrap();
    let keys = c.request_block_keys(&id("a")).unwrap();
    assert_eq!(
        keys,
        c.block_keys(&(1..=8).collect::<Vec<_>>(), b"", &none())
            .unwrap()
    );
    c.preempt(&id("a")).unwrap();
    assert_eq!(c.stats().blocks_in_use, 0, "preempted: no references held");
    assert_eq!(c.stats().blocks_cached, 3);
    assert!(c.block_table(&id("a")).unwrap().is_empty());
    let stats = c.stats();
    assert_eq!(
        c.start_position(&id("a")),
        Ok(6),
        "the probe matches from the kept keys"
    );
    assert_eq!(c.stats(), stats, "and changes nothing");
    let resumed = c.allocate_slots(&id("a"), 2, 0, 0).unwrap();
    assert_eq!(
        resumed.num_cached_tokens, 6,
        "the committed blocks are hit again"
    );
    assert_eq!(resumed.num_computed_tokens, 6);
    assert_eq!(
        c.start_position(&id("a")),
        Ok(6),
        "scheduled: its computed tokens"
    );
    assert_eq!(c.request_block_keys(&id("a")).unwrap(), keys);
    c.finish(&id("a")).unwrap();
    c.check_invariants();
}

#[test]
fn a_watermark_keeps_blocks_back_for_running_requests() {
    let c = cache(4, 2, 128);
    c.add_request(id("a"), vec![1, 2, 3], b"", none(), 0)
        .unwrap();
    assert_eq!(c.blocks_needed(&id("a"), 3, 0), Ok(2));
    assert_eq!(c.can_allocate_slots(&id("a"), 3, 0, 2), Ok(true));
    assert_eq!(c.can_allocate_slots(&id("a"), 3, 0, 3), Ok(false));
    assert!(matches!(
        c.allocate_slots(&id("a"), 3, 0, 3),
        Err(CacheError::OutOfBlocks {
            needed: 5,
            available: 4
        })
    ));
    c.allocate_slots(&id("a"), 3, 0, 2).unwrap();
    c.finish(&id("a")).unwrap();
    c.check_invariants();
}

#[test]
fn forced_collisions_only_cause_misses() {
    // 2-bit keys: almost every distinct block collides with another.
    let c = cache(64, 2, 2);
    let prompts: Vec<Vec<u32>> = (0..40u32)
        .map(|i| vec![i % 5, i % 3, i % 7, i % 2, i, 1])
        .collect();
    let mut truth = std::collections::HashMap::new();
    for round in 0..3 {
        for p in &prompts {
            let r = c
                .begin(None, p.clone(), b"", RequestExtras::default(), 0)
                .unwrap();
            let hit_blocks = r.num_cached_tokens.div_ceil(2);
            for (i, &block) in r.block_table.iter().enumerate().take(hit_blocks) {
                assert_eq!(
                    truth.get(&block),
                    Some(&p[..(i + 1) * 2].to_vec()),
                    "wrong KV in round {round}"
                );
            }
            for (i, &block) in r.block_table.iter().enumerate().skip(hit_blocks) {
                if !c.is_cached(block).unwrap() {
                    truth.insert(block, p[..((i + 1) * 2).min(p.len())].to_vec());
                }
            }
            c.commit(&r.request_id, p.len()).unwrap();
            c.finish(&r.request_id).unwrap();
            c.check_invariants();
        }
    }
    assert!(c.stats().collisions > 0);
}

#[test]
fn errors_leave_the_cache_unchanged() {
    let c = cache(2, 4, 128);
    serve(&c, &[1, 2, 3, 4, 5], b"");
    let before = c.stats();
    let err = c
        .begin(None, vec![9; 20], b"", RequestExtras::default(), 0)
        .unwrap_err();
    assert!(matches!(err, CacheError::OutOfBlocks { needed: 5, .. }));
    assert_eq!(
        c.finish(&77.into()),
        Err(CacheError::UnknownRequest(77.into()))
    );
    assert!(matches!(
        c.release(&[0]),
        Err(CacheError::BlockState { .. })
    ));
    assert_eq!(c.stats(), before);
    c.check_invariants();
}

#[test]
fn salts_isolate_tenants() {
    let c = cache(16, 4, 128);
    serve(&c, &[1, 2, 3, 4, 5], b"a");
    assert_eq!(
        c.lookup(&[1, 2, 3, 4, 5], b"a", &RequestExtras::default())
            .unwrap()
            .num_cached_tokens,
        4
    );
    assert_eq!(
        c.lookup(&[1, 2, 3, 4, 5], b"b", &RequestExtras::default())
            .unwrap()
            .num_cached_tokens,
        0
    );
}
