//! The request API end to end, without Python.

use prefixkv_core::{context_fingerprint, CacheConfig, CacheError, PrefixCache, RequestExtras};

fn cache(num_blocks: u32, block_size: usize, key_bits: u32) -> PrefixCache {
    let config = CacheConfig {
        key_bits,
        ..CacheConfig::new(num_blocks, block_size)
    };
    PrefixCache::new(config, context_fingerprint(b"test")).unwrap()
}

fn serve(cache: &PrefixCache, tokens: &[u32], salt: &[u8]) -> usize {
    let r = cache
        .begin(tokens.to_vec(), salt, RequestExtras::default(), 0)
        .unwrap();
    cache.commit(r.request_id, tokens.len()).unwrap();
    cache.finish(r.request_id).unwrap();
    r.num_cached_tokens
}

#[test]
fn full_hit_leaves_one_token_and_shares_the_last_block() {
    let c = cache(8, 4, 128);
    assert_eq!(serve(&c, &[1, 2, 3, 4, 5, 6, 7, 8], b""), 0);
    let r = c
        .begin(
            vec![1, 2, 3, 4, 5, 6, 7, 8],
            b"",
            RequestExtras::default(),
            0,
        )
        .unwrap();
    assert!(r.full_hit);
    assert_eq!(r.num_cached_tokens, 7);
    assert_eq!(c.stats().blocks_free, 6);
    c.finish(r.request_id).unwrap();
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
                .begin(p.clone(), b"", RequestExtras::default(), 0)
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
            c.commit(r.request_id, p.len()).unwrap();
            c.finish(r.request_id).unwrap();
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
        .begin(vec![9; 20], b"", RequestExtras::default(), 0)
        .unwrap_err();
    assert!(matches!(err, CacheError::OutOfBlocks { needed: 5, .. }));
    assert_eq!(c.finish(77), Err(CacheError::UnknownRequest(77)));
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
