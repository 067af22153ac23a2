//! loom model of the take-reference / release / evict race on the real `BlockPool`.
//!
//! The cache serialises every refcount change through one mutex around the pool; this model
//! runs the pool behind loom's mutex and lets loom try every interleaving of three threads:
//! one takes a reference on a cached block (as `begin` does on a hit) and later releases it,
//! one allocates under pressure (evicting whatever is evictable), one releases a block it held.
//! In every interleaving: a referenced block is never evicted, no block is freed twice, and
//! the invariants of the pool hold after each critical section.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p prefixkv-core --test loom_pool --release`
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use prefixkv_core::pool::BlockPool;

#[test]
fn take_reference_release_and_evict_race() {
    loom::model(|| {
        // Blocks 0 <- 1 form a cached chain nobody holds; block 2 is held by the "releaser".
        let mut pool = BlockPool::new(3).unwrap();
        let (blocks, _) = pool.allocate(3).unwrap();
        pool.mark_cached(blocks[0], None);
        pool.mark_cached(blocks[1], Some(blocks[0]));
        pool.release(blocks[0]);
        pool.release(blocks[1]);
        let held = blocks[2];
        let pool = Arc::new(Mutex::new(pool));

        let reader = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                // A hit takes references on the whole cached chain, if it is still there.
                let took = {
                    let mut p = pool.lock().unwrap();
                    let cached = p.is_cached(0) && p.is_cached(1);
                    if cached {
                        p.acquire(0);
                        p.acquire(1);
                    }
                    p.check_invariants();
                    cached
                };
                if took {
                    let mut p = pool.lock().unwrap();
                    // While referenced, neither block may have been evicted or reused.
                    assert!(p.is_cached(0) && p.is_cached(1), "referenced block evicted");
                    assert!(p.ref_count(0).unwrap() >= 1 && p.ref_count(1).unwrap() >= 1);
                    p.release(1);
                    p.release(0);
                    p.check_invariants();
                }
            })
        };
        let evictor = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut p = pool.lock().unwrap();
                if let Ok((fresh, evicted)) = p.allocate(2) {
                    for &block in &evicted {
                        assert_eq!(
                            p.ref_count(block),
                            Some(1),
                            "evicted block must be unreferenced, now ours"
                        );
                    }
                    assert_eq!(fresh.len(), 2);
                    p.check_invariants();
                    for block in fresh {
                        p.release(block);
                    }
                }
                p.check_invariants();
            })
        };
        let releaser = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut p = pool.lock().unwrap();
                assert!(
                    p.release(held),
                    "an uncached block goes back to the free list"
                );
                p.check_invariants();
            })
        };
        reader.join().unwrap();
        evictor.join().unwrap();
        releaser.join().unwrap();
        let p = pool.lock().unwrap();
        p.check_invariants();
        assert_eq!(p.num_in_use(), 0);
        assert_eq!(
            p.num_free() + p.num_cached(),
            3,
            "no block leaked or freed twice"
        );
    });
}
