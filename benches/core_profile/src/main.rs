//! Per-request and per-block costs of the core alone (no Python), printed as JSON lines:
//! the same shapes as section 1's 4,000-token issue cases, the core's two hashes (the XXH3-128
//! table key every lookup computes, the SHA-256 block key computed on demand) next to BLAKE3
//! layouts (the core used BLAKE3 before commit c021a06), and what a miss's commit is made of:
//! its table keys, bare inserts into the same presized lock-free table, and the rest.

use std::time::Instant;

use prefixkv_core::key::TableKey;
use prefixkv_core::table::{new_table, Entry, Parent};
use prefixkv_core::{block_key, context_fingerprint, root_key, CacheConfig, PrefixCache, RequestExtras};

const BLOCK_SIZE: usize = 16;

/// A deterministic xorshift stream of token ids below 128,000.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 128_000) as u32
        })
        .collect()
}

/// Median ns of `f` over `repeats` timed calls after a warmup.
fn median_ns(repeats: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..repeats / 4 + 1 {
        f();
    }
    let mut samples: Vec<u128> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_nanos()
        })
        .collect();
    samples.sort_unstable();
    samples[samples.len() / 2] as f64
}

fn main() {
    let context = context_fingerprint(b"bench");
    let extras = RequestExtras::default();
    let n = 4000;
    let blocks = n / BLOCK_SIZE;
    let cache = PrefixCache::new(CacheConfig::new(200_000, BLOCK_SIZE), context).expect("cache");
    let shared = tokens(1, 238 * BLOCK_SIZE);

    let root = root_key(&context, b"");
    let prompt = tokens(2, n);
    // The hash variants run interleaved, round by round, so load from other processes on a
    // shared machine hits each alike; medians over rounds.
    let mut variants: Vec<(&str, Box<dyn FnMut()>)> = vec![
        ("core block_key (SHA-256 of tag + parent + tokens, 97 bytes: 2 compressions)", Box::new(|| {
            let mut parent = root;
            for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                parent = block_key(&parent, chunk, b"");
            }
            std::hint::black_box(parent);
        })),
        ("blake3 of parent + 64 token bytes (96 bytes: 2 compressions)", Box::new(|| {
            let mut parent = [0u8; 32];
            let mut buffer = [0u8; 96];
            for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                buffer[..32].copy_from_slice(&parent);
                for (i, t) in chunk.iter().enumerate() {
                    buffer[32 + 4 * i..36 + 4 * i].copy_from_slice(&t.to_le_bytes());
                }
                parent = *blake3::hash(&buffer).as_bytes();
            }
            std::hint::black_box(parent);
        })),
        ("sha2 SHA-256 of tag + parent + 64 token bytes (97 bytes), fixed buffer", Box::new(|| {
            use sha2::Digest;
            let mut parent = [0u8; 32];
            let mut buffer = [0u8; 97];
            for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                buffer[1..33].copy_from_slice(&parent);
                for (i, t) in chunk.iter().enumerate() {
                    buffer[33 + 4 * i..37 + 4 * i].copy_from_slice(&t.to_le_bytes());
                }
                parent = sha2::Sha256::digest(buffer).into();
            }
            std::hint::black_box(parent);
        })),
        // What a key layout change could buy: the parent key as BLAKE3's key, the 64 token
        // bytes as the whole message.
        ("blake3 keyed_hash(parent, 64 token bytes): 1 compression", Box::new(|| {
            let mut parent = [0u8; 32];
            let mut buffer = [0u8; 64];
            for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                for (i, t) in chunk.iter().enumerate() {
                    buffer[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
                }
                parent = *blake3::keyed_hash(&parent, &buffer).as_bytes();
            }
            std::hint::black_box(parent);
        })),
    ];
    let mut samples = vec![Vec::new(); variants.len()];
    for round in 0..61 {
        for (index, (_, f)) in variants.iter_mut().enumerate() {
            let start = Instant::now();
            f();
            if round > 0 {
                samples[index].push(start.elapsed().as_nanos());
            }
        }
    }
    for ((what, _), mut s) in variants.iter().zip(samples) {
        s.sort_unstable();
        let per_block = s[s.len() / 2] as f64 / blocks as f64;
        println!("{{\"what\": \"{what}\", \"ns_per_block\": {per_block:.1}}}");
    }
    let keys = median_ns(201, || {
        std::hint::black_box(cache.block_keys(&prompt, b"", &extras).expect("keys"));
    });
    println!("{{\"what\": \"PrefixCache::block_keys, 4000 tokens (SHA-256 block keys)\", \"ns\": {keys:.0}}}");
    let table_keys = median_ns(201, || {
        std::hint::black_box(cache.hash_prompt(&prompt, b"", &extras));
    });
    println!("{{\"what\": \"PrefixCache::hash_prompt, 4000 tokens (XXH3-128 table keys)\", \"ns\": {table_keys:.0}}}");

    // A miss's commit inserts one entry per block into the lock-free table. The bare insert,
    // with the core's own entry type into a table presized like the cache's (200,000), fresh
    // keys each round: what the map itself costs, with no pool or request bookkeeping.
    let table = new_table(200_000);
    let mut next_key = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next_id = 0u64;
    let insert_ns = median_ns(101, || {
        let guard = table.guard();
        for chunk in prompt.chunks_exact(BLOCK_SIZE) {
            next_key ^= next_key << 13;
            next_key ^= next_key >> 7;
            next_key ^= next_key << 17;
            next_id += 1;
            let entry = Entry {
                id: next_id,
                block: (next_id % 200_000) as u32,
                parent: Parent::Entry(next_id - 1),
                tokens: chunk.into(),
                extras: Vec::new().into_boxed_slice(),
            };
            let key = TableKey(u128::from(next_key) << 64 | u128::from(next_id));
            let _ = std::hint::black_box(table.try_insert(key, entry, &guard));
        }
    });
    println!("{{\"what\": \"papaya try_insert of 250 entries (the core's Entry), presized table\", \"ns\": {insert_ns:.0}}}");

    let mut seed = 100;
    let request = |tokens: Vec<u32>| -> [u128; 3] {
        let t0 = Instant::now();
        let r = cache.begin(None, tokens, b"", RequestExtras::default(), 0).expect("begin");
        let t1 = Instant::now();
        cache.commit(&r.request_id, n).expect("commit");
        let t2 = Instant::now();
        cache.finish(&r.request_id).expect("finish");
        [t1.duration_since(t0).as_nanos(), t2.duration_since(t1).as_nanos(), t2.elapsed().as_nanos()]
    };
    for (name, shared_blocks) in [("shares 95% of its blocks", 238usize), ("shares nothing", 0)] {
        let mut samples = Vec::new();
        for i in 0..120 {
            seed += 1;
            let mut prompt = shared[..shared_blocks * BLOCK_SIZE].to_vec();
            prompt.extend(tokens(seed, n - prompt.len()));
            let t = request(prompt);
            if i >= 20 {
                samples.push(t);
            }
        }
        let median = |k: usize| {
            let mut v: Vec<u128> = samples.iter().map(|s| s[k]).collect();
            v.sort_unstable();
            v[v.len() / 2] as f64
        };
        let mut totals: Vec<u128> = samples.iter().map(|s| s.iter().sum()).collect();
        totals.sort_unstable();
        println!(
            "{{\"what\": \"begin+commit+finish, 4000 tokens, {name}\", \"ns\": {}, \"begin_ns\": {:.0}, \"commit_ns\": {:.0}, \"finish_ns\": {:.0}}}",
            totals[totals.len() / 2], median(0), median(1), median(2)
        );
    }
}
