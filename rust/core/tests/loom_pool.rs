//! loom models of the cache's concurrency protocol: a lock-free `lookup` racing writers that
//! release, evict, refill, publish and switch context; and the refcount / evict race on the
//! pool.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p prefixkv-core --test
//! loom_pool --release` (`make loom`).
//!
//! ## What runs under loom: the real cache
//! The models drive the real `PrefixCache`: its lookup walk and verification (`cache/lookup.rs`), its
//! publishing, deduplication and collision rules (`request/publish.rs`), its eviction, release and
//! reset paths, all unchanged. Only the three synchronisation primitives underneath are swapped,
//! under `--cfg loom`, for loom types with the same contract (`src/sync.rs`, `src/table/shared.rs`):
//! - the writer mutex (`parking_lot`) becomes `loom::sync::Mutex`;
//! - the context cell (`arc-swap`) becomes a `loom::sync::RwLock<BlockKey>`: one linearizable
//!   load or store;
//! - the lookup table (`table/mod.rs`: a compact index beside per-block seqlocked slots, and
//!   child links for runs) becomes maps behind a `loom::sync::RwLock`, one step per store of
//!   the real table's protocol that readers can observe: a linked child's slot, then its
//!   parent's link; a reader loads a link, then verifies the slot it names, then falls back to
//!   the index (`table/shared.rs`). An index probe with its slot read is one linearizable
//!   step handing out owned snapshots, as the real table does.
//!
//! loom then tries every interleaving of those steps (within a preemption bound, below): a lookup
//! can read each table slot before or after any insert or removal of a writer, and read the
//! context before or after a `set_context`. The checks: a lookup never returns a block that did
//! not hold the looked-up prefix when it was read (no false hit: with one-bit table keys the
//! other prompt's entries sit under the very keys the lookup reads, and only verification keeps
//! them out), never mixes blocks of two contexts, and every refcount stays owned
//! (`check_invariants` after each writer and at the end; nothing referenced once all finish).
//!
//! ## What is not modelled, and why
//! - **The table's and arc-swap's internals.** loom explores only operations on its own
//!   `loom::sync` types; the table is built on `std` atomics (a sequence lock per slot, a
//!   backward-shifting index), arc-swap on `std` atomics and thread-local debts. So the models
//!   *assume* their contracts: every table operation and every load/store is linearizable, and
//!   a reader gets a consistent snapshot. The table's own tests check that contract with real
//!   threads (`table/tests.rs`: readers racing insert/remove/refill never see a torn or wrong entry;
//!   removals keep every other entry reachable); the stand-ins give exactly that contract,
//!   nothing stronger per operation.
//! - **Weak memory orderings inside those crates.** The stand-ins are sequentially consistent;
//!   the cache itself uses no atomics with weaker orderings except the relaxed `probes`
//!   statistics counter, which no decision reads.
//! - **Larger pools and longer histories.** Each model is a few blocks and a few calls, so the
//!   search stays exhaustive within the bound; `tests/stress.rs` (real threads, the real table,
//!   many rounds) and `tests/state_machine.rs` (long sequential histories against a reference
//!   model) cover breadth.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use prefixkv_core::key::TableHasher;
use prefixkv_core::pool::{BlockPool, Evicted};
use prefixkv_core::{
    context_fingerprint, root_key, BlockId, BlockKey, CacheConfig, FullHit, PrefixCache,
    RequestExtras,
};

/// Preemptions loom may insert per execution. Each race the models target needs at most two
/// (a lookup preempted between two of its reads while a writer runs through a whole call);
/// 4 leaves room and runs in seconds (a bound of 3 already catches every planted bug we tried,
/// entry ids reused after a reset among them), while an unbounded search does not end within
/// minutes.
const PREEMPTION_BOUND: usize = 4;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(PREEMPTION_BOUND);
    builder.check(f);
}

const A: [u32; 2] = [1, 2];
const B: [u32; 2] = [3, 4];

/// The table keys of a two-block prompt under `root`, one block per token.
fn keys(hasher: &TableHasher, root: &BlockKey, prompt: [u32; 2]) -> [u128; 2] {
    let mut buffer = Vec::new();
    let first = hasher.block(&mut buffer, hasher.root(root), &prompt[..1], b"");
    let second = hasher.block(&mut buffer, first, &prompt[1..], b"");
    [first.0, second.0]
}

/// A seed under which one-bit table keys make `pick` true (found by search, so the models do not
/// depend on one hash function's outputs).
fn seed_where(pick: impl Fn(&TableHasher) -> bool) -> u64 {
    (0..1024)
        .find(|&seed| pick(&TableHasher::with_seed(1, seed)))
        .expect("a quarter of the seeds qualify")
}

fn cache(num_blocks: u32, context: BlockKey, seed: u64) -> PrefixCache {
    let config = CacheConfig {
        key_bits: 1,
        // Lookups here are probes of what is cached: a full hit reports every block.
        full_hit: FullHit::ReuseLastBlock,
        ..CacheConfig::new(num_blocks, 1)
    };
    PrefixCache::with_table_seed(config, context, seed).unwrap()
}

fn serve(cache: &PrefixCache, prompt: &[u32]) -> Vec<BlockId> {
    let r = cache
        .begin(None, prompt.to_vec(), b"", RequestExtras::default(), 0)
        .unwrap();
    cache.commit(&r.request_id, prompt.len()).unwrap();
    cache.finish(&r.request_id).unwrap();
    r.block_table
}

fn lookup(cache: &PrefixCache, prompt: &[u32]) -> Vec<BlockId> {
    cache
        .lookup(prompt, b"", &RequestExtras::default())
        .unwrap()
        .blocks
}

fn is_prefix(found: &[BlockId], of: &[BlockId]) -> bool {
    of.starts_with(found)
}

/// The race both eviction models run, on `cache` with every block free: `first` is served and
/// held by a releaser thread, the rest of the pool is the writer's padding; then, at once, the
/// releaser drops `first`'s blocks, a writer allocates `pressure` blocks (which evicts some of
/// `first` only if the releaser has gone), frees its padding and serves `second`, and a reader
/// looks up both prompts. Every lookup must return a prefix of blocks that held its prompt, and
/// nothing may stay referenced or leak. Returns the blocks `first` and `second` were served in.
fn race_eviction_and_refill(
    cache: PrefixCache,
    first: &'static [u32],
    second: &'static [u32],
    pressure: usize,
) -> (Vec<BlockId>, Vec<BlockId>) {
    let first_blocks = serve(&cache, first);
    let held = cache
        .match_and_acquire(first, b"", &RequestExtras::default(), 0)
        .unwrap()
        .blocks;
    assert_eq!(held, first_blocks);
    let num_blocks = cache.stats().blocks_total;
    let padding = cache.allocate(num_blocks - first_blocks.len()).unwrap();
    let cache = Arc::new(cache);

    let releaser = {
        let cache = Arc::clone(&cache);
        thread::spawn(move || {
            cache.release(&held).unwrap();
            cache.check_invariants();
        })
    };
    let writer = {
        let cache = Arc::clone(&cache);
        thread::spawn(move || {
            let pressure = cache.allocate(pressure);
            cache.release(&padding).unwrap();
            let blocks = serve(&cache, second);
            if let Ok(pressure) = pressure {
                cache.release(&pressure).unwrap();
            }
            cache.check_invariants();
            blocks
        })
    };
    let reader = {
        let cache = Arc::clone(&cache);
        thread::spawn(move || (lookup(&cache, first), lookup(&cache, second)))
    };

    releaser.join().unwrap();
    let second_blocks = writer.join().unwrap();
    let (found_first, found_second) = reader.join().unwrap();
    assert!(
        is_prefix(&found_first, &first_blocks),
        "lookup of {first:?} returned {found_first:?}: it was only ever in {first_blocks:?}"
    );
    assert!(
        is_prefix(&found_second, &second_blocks),
        "lookup of {second:?} returned {found_second:?}: it was only ever in {second_blocks:?}"
    );
    cache.check_invariants();
    let stats = cache.stats();
    assert_eq!(
        stats.blocks_in_use, 0,
        "every reference was dropped by its owner"
    );
    assert_eq!(
        stats.blocks_free + stats.blocks_cached,
        num_blocks,
        "no block leaked"
    );
    (first_blocks, second_blocks)
}

/// A lookup of prompt A races a writer that evicts A's blocks and publishes prompt B, whose
/// entries take A's table keys, and a releaser that makes A evictable.
#[test]
fn lookup_racing_release_evict_and_refill_never_returns_a_false_hit() {
    let context = context_fingerprint(b"loom");
    let root = root_key(&context, b"");
    // A publishes whole; B's first block takes A's first key (so a lookup of A reads B's
    // entry there once A is evicted), and B publishes whole too.
    let seed = seed_where(|h| {
        let (a, b) = (keys(h, &root, A), keys(h, &root, B));
        a[0] != a[1] && b[0] == a[0] && b[1] != b[0]
    });
    model(move || {
        // Blocks 0 <- 1 hold A, cached; the releaser holds them. Blocks 2, 3 are the writer's
        // padding, so the pool is full: evicting A is the only way to get blocks.
        race_eviction_and_refill(cache(4, context, seed), &A, &B, 2);
    });
}

/// A lookup of prompt A follows the link from A's first block to its second while the writer
/// evicts the second (unlinking it) and publishes A', which shares A's first block, as the
/// first block's new linked child in another block (relinking). Full-width keys, so the second
/// blocks are linked from the first rather than indexed (`table/runs.rs`).
#[test]
fn lookup_following_a_link_racing_unlink_and_relink_never_returns_a_false_hit() {
    const A2: [u32; 2] = [1, 5];
    let context = context_fingerprint(b"loom");
    model(move || {
        let config = CacheConfig {
            key_bits: TableHasher::BITS,
            full_hit: FullHit::ReuseLastBlock,
            ..CacheConfig::new(3, 1)
        };
        // Blocks 0 <- 1 hold A, cached; the releaser holds them. Block 2 is the writer's
        // padding, so A's second block (its first is a parent) is the only one to evict.
        let (a_blocks, a2_blocks) =
            race_eviction_and_refill(PrefixCache::new(config, context).unwrap(), &A, &A2, 1);
        assert_eq!(
            a2_blocks[0], a_blocks[0],
            "set-up: A' shares A's first block"
        );
        assert_ne!(
            a2_blocks[1], a_blocks[1],
            "set-up: A' publishes in another block"
        );
    });
}

/// A lookup of prompt A races `set_context` and the same prompt served under the new context,
/// whose first entry takes the old first entry's table key. Whichever context the lookup
/// reads, it returns blocks of that context only.
#[test]
fn lookup_racing_set_context_never_mixes_contexts() {
    let old = context_fingerprint(b"loom old");
    let new = context_fingerprint(b"loom new");
    let (old_root, new_root) = (root_key(&old, b""), root_key(&new, b""));
    let seed = seed_where(|h| {
        let (o, n) = (keys(h, &old_root, A), keys(h, &new_root, A));
        o[0] != o[1] && n[0] == o[0] && n[1] != n[0]
    });
    model(move || {
        let cache = cache(4, old, seed);
        let old_blocks = serve(&cache, &A);
        // Held across the reset: detached, not freed, so the new context gets other blocks.
        let held = cache
            .match_and_acquire(&A, b"", &RequestExtras::default(), 0)
            .unwrap()
            .blocks;
        let cache = Arc::new(cache);

        let writer = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                cache.set_context(new);
                let blocks = serve(&cache, &A);
                cache.check_invariants();
                blocks
            })
        };
        let reader = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                let before = cache.context();
                let found = lookup(&cache, &A);
                (before, found, cache.context())
            })
        };

        let new_blocks = writer.join().unwrap();
        let (before, found, after) = reader.join().unwrap();
        assert!(new_blocks.iter().all(|b| !old_blocks.contains(b)), "set-up");
        // The context changes once, old to new: if it was old after the lookup, the lookup
        // read old; if it was new before, the lookup read new.
        let under_old = is_prefix(&found, &old_blocks);
        let under_new = is_prefix(&found, &new_blocks);
        if after == old {
            assert!(under_old, "read the old context, returned {found:?}");
        } else if before == new {
            assert!(under_new, "read the new context, returned {found:?}");
        } else {
            assert!(under_old || under_new, "mixed contexts: {found:?}");
        }
        cache.release(&held).unwrap();
        cache.check_invariants();
        assert_eq!(cache.stats().blocks_in_use, 0);
    });
}

/// The take-reference / release / evict race on the real `BlockPool` behind a loom mutex: a
/// referenced block is never evicted, no block is freed twice, the pool's invariants hold after
/// each critical section.
#[test]
fn take_reference_release_and_evict_race() {
    model(|| {
        // Blocks 0 <- 1 form a cached chain nobody holds; block 2 is held by the "releaser".
        let mut pool = BlockPool::new(3).unwrap();
        let (blocks, _) = pool.allocate(3).unwrap();
        pool.mark_cached(blocks[0], None);
        pool.mark_cached(blocks[1], Some(blocks[0]));
        pool.release(blocks[0]);
        pool.release(blocks[1]);
        let held = blocks[2];
        let pool = Arc::new(loom::sync::Mutex::new(pool));

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
                    for &Evicted { block, .. } in &evicted {
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

/// Issue 22: entries move. Twins computed prompt A, the second one's blocks are duplicates and
/// its third block chains on them; once the first twin is done, an allocation evicts A's
/// originals, moving each entry into its duplicate. A lookup racing it finds, at each position,
/// the original or the duplicate (each held A's prefix when read), never anything else, and
/// the whole chain stays reachable after: no held child loses its parent.
#[test]
fn lookup_racing_an_eviction_that_moves_entries_into_duplicates() {
    const PROMPT: [u32; 3] = [1, 2, 5];
    model(|| {
        let config = CacheConfig {
            full_hit: FullHit::ReuseLastBlock,
            ..CacheConfig::new(5, 1)
        };
        let cache = PrefixCache::with_table_seed(config, context_fingerprint(b"loom"), 7).unwrap();
        let begin = |prompt: &[u32]| {
            cache
                .begin(None, prompt.to_vec(), b"", RequestExtras::default(), 0)
                .unwrap()
        };
        let first = begin(&PROMPT[..2]);
        let second = begin(&PROMPT);
        cache.commit(&first.request_id, 2).unwrap();
        cache.commit(&second.request_id, 3).unwrap();
        cache.finish(&first.request_id).unwrap();
        let (originals, copies) = (first.block_table, second.block_table);
        let cache = Arc::new(cache);

        let reader = {
            let cache = Arc::clone(&cache);
            let (originals, copies) = (originals.clone(), copies.clone());
            thread::spawn(move || {
                let found = lookup(&cache, &PROMPT);
                for (position, block) in found.iter().enumerate() {
                    let allowed = [
                        copies[position],
                        *originals.get(position).unwrap_or(&copies[2]),
                    ];
                    assert!(
                        allowed.contains(block),
                        "position {position}: block {block} never held A's prefix"
                    );
                }
            })
        };
        let evictor = {
            let cache = Arc::clone(&cache);
            thread::spawn(move || {
                let taken = cache.allocate(2).unwrap();
                cache.check_invariants();
                cache.release(&taken).unwrap();
            })
        };
        reader.join().unwrap();
        evictor.join().unwrap();
        assert_eq!(
            lookup(&cache, &PROMPT),
            copies,
            "the chain lives on in the duplicates"
        );
        cache.finish(&second.request_id).unwrap();
        cache.check_invariants();
        assert_eq!(
            cache.stats().evictions,
            0,
            "every entry moved, none was lost"
        );
    });
}
