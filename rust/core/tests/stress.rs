//! Real threads: lookups on three threads while one thread begins, commits, finishes and
//! clears, with 6-bit table keys so collisions are constant, and again with full-width keys,
//! where a run's later blocks are linked from their parents rather than indexed
//! (`table/runs.rs`). A lookup may race with a writer, but every block it reports must
//! be the block of exactly the prefix it matched.
//!
//! Long: `#[ignore]`d so the default `cargo test` stays fast; `make rust-stress` runs it in
//! release (`cargo test -p prefixkv-core --release -- --ignored`), as its own CI step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

use prefixkv_core::{context_fingerprint, CacheConfig, PrefixCache, RequestExtras};

const BLOCK: usize = 2;
/// Writer rounds: a few seconds in release on two cores.
const ROUNDS: usize = 400_000;

fn prompts() -> Vec<Vec<u32>> {
    (0..48u32)
        .map(|i| (0..12u32).map(|j| (i * 7 + j * (i % 3 + 1)) % 5).collect())
        .collect()
}

#[test]
#[ignore = "long stress test: make rust-stress"]
fn concurrent_lookups_never_report_a_block_of_another_prefix() {
    race_lookups_against_the_writer(6);
}

#[test]
#[ignore = "long stress test: make rust-stress"]
fn concurrent_lookups_following_links_never_report_a_block_of_another_prefix() {
    race_lookups_against_the_writer(128);
}

fn race_lookups_against_the_writer(key_bits: u32) {
    let config = CacheConfig {
        key_bits,
        ..CacheConfig::new(24, BLOCK)
    };
    let cache = Arc::new(PrefixCache::new(config, context_fingerprint(b"stress")).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let prompts = Arc::new(prompts());

    let readers: Vec<_> = (0..3)
        .map(|seed| {
            let (cache, stop, prompts) =
                (Arc::clone(&cache), Arc::clone(&stop), Arc::clone(&prompts));
            thread::spawn(move || {
                let mut lookups = 0u64;
                let mut i = seed;
                while !stop.load(Ordering::Relaxed) {
                    let prompt = &prompts[i % prompts.len()];
                    let found = cache
                        .lookup(prompt, b"", &RequestExtras::default())
                        .unwrap();
                    // A hit never exceeds the prompt and is always whole blocks (or the full hit).
                    assert!(found.blocks.len() * BLOCK <= prompt.len());
                    assert!(found.num_cached_tokens < prompt.len());
                    lookups += 1;
                    i += 7;
                }
                lookups
            })
        })
        .collect();

    // The writer checks every hit it takes a reference on against what it wrote there.
    let mut written: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for round in 0..ROUNDS {
        let prompt = &prompts[(round * 5) % prompts.len()];
        let Ok(request) = cache.begin(None, prompt.clone(), b"", RequestExtras::default(), 0)
        else {
            continue;
        };
        let hit_blocks = request.num_cached_tokens.div_ceil(BLOCK);
        for (position, block) in request.block_table.iter().enumerate().take(hit_blocks) {
            assert_eq!(
                written.get(block).map(Vec::as_slice),
                Some(&prompt[..(position + 1) * BLOCK]),
                "round {round}: block {block} holds another prefix"
            );
        }
        for (position, &block) in request.block_table.iter().enumerate().skip(hit_blocks) {
            if !cache.is_cached(block).unwrap() {
                let end = ((position + 1) * BLOCK).min(prompt.len());
                written.insert(block, prompt[..end].to_vec());
            }
        }
        cache.commit(&request.request_id, prompt.len()).unwrap();
        cache.finish(&request.request_id).unwrap();
        if round % 50_000 == 25_000 {
            cache.clear();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let lookups: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(lookups > 0);
    cache.check_invariants();
    let stats = cache.stats();
    assert_eq!(stats.blocks_in_use, 0);
    if key_bits == 6 {
        assert!(stats.collisions > 0, "6-bit keys must collide");
    }
    assert!(stats.evictions > 0, "a 24-block pool must evict");
}
