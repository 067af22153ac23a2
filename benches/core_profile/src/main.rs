//! Per-request and per-block costs of the core alone (no Python), printed as JSON lines:
//! the same shapes as section 1's 4,000-token issue cases, the core's two hashes (the XXH3-128
//! table key every lookup computes, the SHA-256 block key computed on demand) next to BLAKE3
//! layouts (the core used BLAKE3 before commit c021a06), and what a miss's commit is made of:
//! its table keys, bare inserts into the same presized lock-free table, and the rest.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The system allocator, counting the allocations made while `COUNTING` is set (the timed
/// calls of `replay-runs`), by size class: what a request allocates.
struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];
static REALLOCS: AtomicU64 = AtomicU64::new(0);
// Safety: forwards to `System` unchanged; only counts.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            let class = match layout.size() {
                0..=256 => 0,
                257..=4096 => 1,
                4097..=65536 => 2,
                _ => 3,
            };
            ALLOCS[class].fetch_add(1, Ordering::Relaxed);
        }
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            REALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}
#[global_allocator]
static GLOBAL: Counting = Counting;

mod run_queue;
mod run_segments;
mod stand_in;

use stand_in::StandIn;

use prefixkv_core::cache::FullHit;
use prefixkv_core::key::TableKey;
use prefixkv_core::run_cache::RunPrefixCache;
use prefixkv_core::table::{NewEntry, Parent, Table};
use prefixkv_core::{
    block_key, context_fingerprint, root_key, BeginResult, CacheConfig, PrefixCache, RequestExtras,
};

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

/// Per-request nanoseconds of `f` run on `prompts` in order, one cache per call site.
fn percentile(sorted: &[u128], p: f64) -> f64 {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index] as f64
}

/// The eviction-pressure workload: long prompts (a shared 2,048-token system prompt, then a
/// unique rest; totals log-uniform in 1k..=128k tokens) through a cache far smaller than the
/// working set, and the same requests through one that never evicts. Every request misses
/// after the shared prefix in both, so the two do the same hashing and publishing: what differs
/// is eviction. The two caches and the hash floor take each request in turn (rotating order),
/// so load from other processes hits them alike.
fn pressure_prompts(requests: usize) -> Vec<Vec<u32>> {
    let system = tokens(9, 2048);
    let mut state = 0x2545_F491_4F6C_DD1D_u64;
    (0..requests)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64;
            let len = (1024.0 * 128f64.powf(unit)) as usize;
            let mut prompt = system.clone();
            prompt.extend(tokens(
                1000 + i as u64,
                len.saturating_sub(system.len()).max(16),
            ));
            prompt
        })
        .collect()
}

fn run_request(cache: &PrefixCache, prompt: &[u32]) -> u128 {
    let start = Instant::now();
    one_request(cache, prompt);
    start.elapsed().as_nanos()
}

fn pressure(requests: usize, small_blocks: u32) {
    let context = context_fingerprint(b"bench");
    let prompts = pressure_prompts(requests);
    let blocks: usize = prompts.iter().map(|p| p.len().div_ceil(BLOCK_SIZE)).sum();
    let roomy = PrefixCache::new(
        CacheConfig::new((blocks + 1024) as u32, BLOCK_SIZE),
        context,
    )
    .expect("cache");
    let small =
        PrefixCache::new(CacheConfig::new(small_blocks, BLOCK_SIZE), context).expect("cache");
    let extras = RequestExtras::default();
    let mut times = [Vec::new(), Vec::new(), Vec::new()];
    for (i, prompt) in prompts.iter().enumerate() {
        for k in 0..3 {
            let which = (i + k) % 3;
            let t = match which {
                0 => run_request(&roomy, prompt),
                1 => run_request(&small, prompt),
                _ => {
                    let start = Instant::now();
                    std::hint::black_box(roomy.hash_prompt(
                        std::hint::black_box(prompt),
                        b"",
                        &extras,
                    ));
                    start.elapsed().as_nanos()
                }
            };
            if i >= 8 {
                times[which].push(t);
            }
        }
    }
    let summary = |v: &mut Vec<u128>| {
        let mean = v.iter().sum::<u128>() as f64 / v.len() as f64;
        v.sort_unstable();
        (mean, percentile(v, 0.5), percentile(v, 0.99))
    };
    let (roomy_mean, roomy_p50, roomy_p99) = summary(&mut times[0]);
    let (small_mean, small_p50, small_p99) = summary(&mut times[1]);
    let (floor_mean, _, floor_p99) = summary(&mut times[2]);
    let (rs, ss) = (roomy.stats(), small.stats());
    let timed = (requests - 8) as f64;
    println!(
        "{{\"what\": \"pressure: {requests} prompts 1k-128k tokens (2k shared), cache of {small_blocks} blocks vs one of {} that never evicts\", \"pressure\": true, \
\"no_pressure_mean_ns\": {roomy_mean:.0}, \"no_pressure_p50_ns\": {roomy_p50:.0}, \"no_pressure_p99_ns\": {roomy_p99:.0}, \
\"pressure_mean_ns\": {small_mean:.0}, \"pressure_p50_ns\": {small_p50:.0}, \"pressure_p99_ns\": {small_p99:.0}, \
\"floor_mean_ns\": {floor_mean:.0}, \"floor_p99_ns\": {floor_p99:.0}, \
\"evictions_per_request\": {:.0}, \"no_pressure_evictions\": {}, \"hit_rate_pressure\": {:.3}, \"hit_rate_no_pressure\": {:.3}, \"blocks_per_request\": {:.0}}}",
        roomy.config().num_blocks,
        ss.evictions as f64 / requests as f64,
        rs.evictions,
        ss.hit_tokens as f64 / ss.lookup_tokens as f64,
        rs.hit_tokens as f64 / rs.lookup_tokens as f64,
        blocks as f64 / requests as f64,
    );
    let _ = timed;
}

/// Per-step decode cost: append one token, then commit it (a block is published every 16th).
fn decode(steps: usize) {
    let context = context_fingerprint(b"bench");
    let cache = PrefixCache::new(CacheConfig::new(200_000, BLOCK_SIZE), context).expect("cache");
    let prompt = tokens(77, 4000);
    let r = cache
        .begin(None, prompt, b"", RequestExtras::default(), 0)
        .expect("begin");
    cache.commit(&r.request_id, 4000).expect("commit");
    let mut len = 4000;
    let generated = tokens(78, steps);
    let start = Instant::now();
    for &token in &generated {
        cache.append(&r.request_id, &[token]).expect("append");
        len += 1;
        cache.commit(&r.request_id, len).expect("commit");
    }
    let per_step = start.elapsed().as_nanos() as f64 / steps as f64;
    cache.finish(&r.request_id).expect("finish");
    println!("{{\"what\": \"decode step: append 1 token + commit (mean over {steps} steps from a 4000-token prompt)\", \"ns\": {per_step:.0}}}");
}

/// `requests COUNT LEN SHARED`: COUNT requests of LEN tokens sharing their first SHARED, each a
/// begin + commit + finish through `one_request`, on a 200k-block cache; for
/// `valgrind --tool=callgrind --toggle-collect='*one_request*'`, which counts the requests'
/// instructions alone (a short request's fixed costs: `PROFILE.md`, issue 24, round 10).
fn fixed_requests(count: usize, len: usize, shared: usize) {
    let cache = PrefixCache::new(
        CacheConfig::new(200_000, BLOCK_SIZE),
        context_fingerprint(b"x"),
    )
    .expect("cache");
    let prefix = tokens(1, shared);
    let prompts: Vec<Vec<u32>> = (0..count)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(i as u64 + 7, len - shared));
            prompt
        })
        .collect();
    let start = Instant::now();
    for prompt in &prompts {
        one_request(&cache, prompt);
    }
    eprintln!(
        "{:.0} ns/request",
        start.elapsed().as_nanos() as f64 / count as f64
    );
}

/// `requests`' shapes (prompts of `len` tokens sharing their first `shared`) through the core
/// and the run-table stand-in (`run_segments.rs`), alternating request by request: mean CPU µs
/// a request each; every request's block table checked equal.
fn run_table_requests(count: usize, len: usize, shared: usize) {
    let num_blocks = 200_000;
    let cache = PrefixCache::new(
        CacheConfig::new(num_blocks, BLOCK_SIZE),
        context_fingerprint(b"x"),
    )
    .expect("cache");
    let mut table = run_segments::new(num_blocks, BLOCK_SIZE);
    let prefix = tokens(1, shared);
    let prompts: Vec<Vec<u32>> = (0..count)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(i as u64 + 7, len - shared));
            prompt
        })
        .collect();
    let mut ns = [0u128; 2];
    for (i, prompt) in prompts.iter().enumerate() {
        let mut got: [(usize, Vec<u32>); 2] = Default::default();
        for k in 0..2 {
            let side = (i + k) % 2;
            let (cost, hit) = if side == 0 {
                core_request(&cache, prompt, &mut got[0].1)
            } else {
                stand_in_request(&mut table, prompt, &mut got[1].1)
            };
            ns[side] += cost.iter().sum::<u128>();
            got[side].0 = hit;
        }
        assert_eq!(got[0], got[1], "request {i}: the two caches differ");
    }
    println!(
        "{{\"len\": {len}, \"shared\": {shared}, \"core_us\": {:.2}, \"run_segments_us\": {:.2}, \"ratio\": {:.2}}}",
        ns[0] as f64 / count as f64 / 1e3,
        ns[1] as f64 / count as f64 / 1e3,
        ns[0] as f64 / ns[1] as f64,
    );
}

/// Lock-free reads of cached prompts: the core's `lookup` (its first block's key, then the walk
/// down the links verifying each block) against the run table's reader (`run_table`: the
/// first run found through its index, then verified block by block from the run's chunks)
/// on the same prompts, each cached as one run. `count` prompts of `len` tokens, read in
/// rotation so that with many of them the tables' lines are cold, as on production traffic;
/// the two sides alternate prompt by prompt, CPU time of the thread.
fn run_table_reader(count: usize, len: usize, rounds: usize) {
    use prefixkv_core::run_table::{RunAllocator, RunParent, RunTable};
    let blocks_per = len / BLOCK_SIZE;
    let num_blocks = (count * blocks_per + 16) as u32;
    let context = context_fingerprint(b"reader");
    // Every block of a cached prompt reported, as the run table's reader reports them.
    let config = CacheConfig {
        full_hit: prefixkv_core::FullHit::ReuseLastBlock,
        ..CacheConfig::new(num_blocks, BLOCK_SIZE)
    };
    let cache = PrefixCache::new(config, context).expect("cache");
    let table = RunTable::new(num_blocks as usize, BLOCK_SIZE, 11).expect("run table");
    let mut alloc = RunAllocator::new(&table);
    let root = root_key(&context, b"");
    let prompts: Vec<Vec<u32>> = (0..count).map(|i| tokens(i as u64 + 100, len)).collect();
    for (i, prompt) in prompts.iter().enumerate() {
        run_request(&cache, prompt);
        let ids: Vec<u32> = (0..blocks_per)
            .map(|b| (i * blocks_per + b) as u32)
            .collect();
        table.create(
            &mut alloc,
            RunParent::Root(root),
            &ids,
            &prompt[..blocks_per * BLOCK_SIZE],
        );
    }
    let extras = RequestExtras::default();
    let parent = RunParent::Root(root);
    let mut ns = [0u128; 2];
    let mut found = Vec::with_capacity(blocks_per);
    for round in 0..rounds {
        for (i, prompt) in prompts.iter().enumerate() {
            for k in 0..2 {
                let side = (i + round + k) % 2;
                let start = thread_ns();
                let hit = if side == 0 {
                    cache
                        .lookup(prompt, b"", &extras)
                        .expect("lookup")
                        .blocks
                        .len()
                } else {
                    found.clear();
                    let hash = table.head_hash(&root, &prompt[..BLOCK_SIZE]);
                    table
                        .find(hash, &parent, prompt, &mut found)
                        .map_or(0, |(_, matched)| matched.matched as usize)
                };
                ns[side] += thread_ns() - start;
                assert_eq!(hit, blocks_per, "prompt {i}: side {side} missed");
            }
        }
    }
    let reads = (count * rounds) as f64;
    println!(
        "{{\"prompts\": {count}, \"len\": {len}, \"core_lookup_us\": {:.2}, \"run_table_us\": {:.2}, \"core_ns_a_block\": {:.1}, \"run_table_ns_a_block\": {:.1}, \"ratio\": {:.2}}}",
        ns[0] as f64 / reads / 1e3,
        ns[1] as f64 / reads / 1e3,
        ns[0] as f64 / reads / blocks_per as f64,
        ns[1] as f64 / reads / blocks_per as f64,
        ns[0] as f64 / ns[1] as f64,
    );
}

/// One request's begin + commit + finish (not inlined: `requests` mode's callgrind toggle).
#[inline(never)]
fn one_request(cache: &PrefixCache, prompt: &[u32]) {
    let r = cache
        .begin(None, prompt.to_vec(), b"", RequestExtras::default(), 0)
        .expect("begin");
    cache.commit(&r.request_id, prompt.len()).expect("commit");
    cache.finish(&r.request_id).expect("finish");
}

/// `loop-MODE SECONDS [REQUESTS]`: one shape, repeated, for `perf record`; with REQUESTS, stops
/// after that many requests too (a fixed amount of work, for `valgrind --tool=callgrind`).
fn profile_loop(mode: &str, seconds: f64, max_requests: usize) {
    let context = context_fingerprint(b"bench");
    let start = Instant::now();
    let mut seed = 5000;
    match mode {
        "loop-miss" => {
            let cache =
                PrefixCache::new(CacheConfig::new(200_000, BLOCK_SIZE), context).expect("cache");
            let mut count = 0;
            while start.elapsed().as_secs_f64() < seconds && count < max_requests {
                seed += 1;
                run_request(&cache, &tokens(seed, 4000));
                count += 1;
            }
            eprintln!("requests: {count}");
        }
        "loop-hit" => {
            let cache =
                PrefixCache::new(CacheConfig::new(200_000, BLOCK_SIZE), context).expect("cache");
            let shared = tokens(1, 3808);
            let mut count = 0;
            while start.elapsed().as_secs_f64() < seconds && count < max_requests {
                seed += 1;
                let mut prompt = shared.clone();
                prompt.extend(tokens(seed, 192));
                run_request(&cache, &prompt);
                count += 1;
            }
            eprintln!("requests: {count}");
        }
        "loop-pressure" => {
            let cache =
                PrefixCache::new(CacheConfig::new(16_384, BLOCK_SIZE), context).expect("cache");
            let prompts = pressure_prompts(64);
            let mut count = 0;
            'outer: loop {
                for prompt in &prompts {
                    if start.elapsed().as_secs_f64() > seconds || count >= max_requests {
                        break 'outer;
                    }
                    run_request(&cache, prompt);
                    count += 1;
                }
            }
            eprintln!("requests: {count}");
        }
        "loop-decode" => {
            while start.elapsed().as_secs_f64() < seconds {
                decode(100_000);
            }
        }
        _ => panic!("unknown mode {mode}"),
    }
}

/// A trace written by `benches/production_workload.py PATH [--quick]`: (cache blocks, warm-up
/// requests, prompts).
fn read_trace(path: &str) -> (u32, usize, Vec<Vec<u32>>) {
    let bytes = std::fs::read(path).expect("trace file");
    let mut words = bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    let mut next = || words.next().expect("truncated trace");
    let (num_blocks, warmup, count) = (next(), next() as usize, next() as usize);
    let prompts = (0..count)
        .map(|_| {
            let len = next() as usize;
            (0..len).map(|_| next()).collect()
        })
        .collect();
    (num_blocks, warmup, prompts)
}

/// CPU time of the calling thread, in ns (the clock of `benches/common.py`).
fn thread_ns() -> u128 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Safety: `now` is a valid, writable timespec for the duration of the call.
    #[allow(unsafe_code)]
    unsafe {
        libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now);
    }
    now.tv_sec as u128 * 1_000_000_000 + now.tv_nsec as u128
}

/// Prompt-length buckets of the replay's per-length rows (`bench_production.py`'s).
const BUCKETS: [(usize, &str); 4] = [
    (4096, "0k-4k"),
    (16_384, "4k-16k"),
    (65_536, "16k-64k"),
    (usize::MAX, "64k-256k"),
];

/// One request's begin + commit + finish; returns the CPU ns of each and the cached tokens.
/// Prompts of 64k tokens or more go through `replay_long_request` instead, the same code under
/// another name, so `valgrind --tool=callgrind --toggle-collect='*replay_long_request*'` counts
/// the long requests' instructions alone.
#[inline(never)]
fn replay_request(cache: &PrefixCache, prompt: &[u32]) -> ([u128; 3], usize) {
    let (phases, r) = timed_request(cache, prompt);
    (phases, r.num_cached_tokens)
}

/// Begin, commit and finish of one request, timed: the CPU ns of each and what begin gave.
#[inline(always)]
fn timed_request(cache: &PrefixCache, prompt: &[u32]) -> ([u128; 3], BeginResult) {
    let t0 = thread_ns();
    let r = cache
        .begin(None, prompt.to_vec(), b"", RequestExtras::default(), 0)
        .expect("begin");
    let t1 = thread_ns();
    cache.commit(&r.request_id, prompt.len()).expect("commit");
    let t2 = thread_ns();
    cache.finish(&r.request_id).expect("finish");
    let t3 = thread_ns();
    ([t1 - t0, t2 - t1, t3 - t2], r)
}

/// `replay_request` for the long prompts (see there).
#[inline(never)]
fn replay_long_request(cache: &PrefixCache, prompt: &[u32]) -> ([u128; 3], usize) {
    // `black_box`: not a tail call, so the frame stays on `perf`'s call stacks.
    std::hint::black_box(replay_request(cache, prompt))
}

/// `replay TRACE [ROUNDS]`: the production-shaped trace of `bench_production.py` through the
/// core alone, begin + commit + finish per request beside the hash floor (`hash_prompt`), in
/// rotating order; per round the mean µs of both over the timed requests, their ratio and the
/// hit rate (which must not change between builds), then per prompt-length bucket the mean µs
/// of each phase and the ratios of the means and of the p99s. Also the loop to `perf record`.
fn replay(path: &str, rounds: usize) {
    let (num_blocks, warmup, prompts) = read_trace(path);
    let context = context_fingerprint(b"bench");
    let extras = RequestExtras::default();
    for _ in 0..rounds {
        let cache =
            PrefixCache::new(CacheConfig::new(num_blocks, BLOCK_SIZE), context).expect("cache");
        let (mut ours, mut floor, mut timed) = (0u128, 0u128, 0usize);
        let (mut prompt_tokens, mut hit_tokens) = (0usize, 0usize);
        // Per bucket: (begin, commit, finish, floor) of each timed request.
        let mut by_length: Vec<Vec<[u128; 4]>> = vec![Vec::new(); BUCKETS.len()];
        let mut all: Vec<[u128; 2]> = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let mut phases = [0u128; 3];
            let mut hash_ns = 0u128;
            for k in 0..2 {
                if (i + k) % 2 == 0 {
                    let (cost, cached) = if prompt.len() >= 65_536 {
                        replay_long_request(&cache, prompt)
                    } else {
                        replay_request(&cache, prompt)
                    };
                    phases = cost;
                    hit_tokens += cached;
                } else {
                    let start = thread_ns();
                    std::hint::black_box(cache.hash_prompt(
                        std::hint::black_box(prompt),
                        b"",
                        &extras,
                    ));
                    hash_ns = thread_ns() - start;
                }
            }
            prompt_tokens += prompt.len();
            if i >= warmup {
                let total: u128 = phases.iter().sum();
                ours += total;
                floor += hash_ns;
                timed += 1;
                let bucket = BUCKETS
                    .iter()
                    .position(|&(limit, _)| prompt.len() < limit)
                    .unwrap_or(0);
                by_length[bucket].push([phases[0], phases[1], phases[2], hash_ns]);
                all.push([total, hash_ns]);
            }
        }
        let stats = cache.stats();
        let p99_ratio = |rows: &mut Vec<[u128; 2]>| {
            let mut a: Vec<u128> = rows.iter().map(|r| r[0]).collect();
            let mut b: Vec<u128> = rows.iter().map(|r| r[1]).collect();
            a.sort_unstable();
            b.sort_unstable();
            percentile(&a, 0.99) / percentile(&b, 0.99)
        };
        println!(
            "{{\"replay_us\": {:.1}, \"floor_us\": {:.1}, \"ratio\": {:.2}, \"p99_ratio\": {:.2}, \"hit_rate\": {:.5}, \"evictions\": {}}}",
            ours as f64 / timed as f64 / 1e3,
            floor as f64 / timed as f64 / 1e3,
            ours as f64 / floor as f64,
            p99_ratio(&mut all),
            hit_tokens as f64 / prompt_tokens as f64,
            stats.evictions,
        );
        for ((_, name), rows) in BUCKETS.iter().zip(&by_length) {
            if rows.is_empty() {
                continue;
            }
            let n = rows.len() as f64;
            let mean = |k: usize| rows.iter().map(|r| r[k]).sum::<u128>() as f64 / n / 1e3;
            let ours = mean(0) + mean(1) + mean(2);
            let mut pairs: Vec<[u128; 2]> =
                rows.iter().map(|r| [r[0] + r[1] + r[2], r[3]]).collect();
            println!(
                "{{\"bucket\": \"{name}\", \"requests\": {}, \"begin_us\": {:.1}, \"commit_us\": {:.1}, \"finish_us\": {:.1}, \"floor_us\": {:.1}, \"ratio\": {:.2}, \"p99_ratio\": {:.2}}}",
                rows.len(),
                mean(0),
                mean(1),
                mean(2),
                mean(3),
                ours / mean(3),
                p99_ratio(&mut pairs),
            );
        }
    }
}

/// The core `replay-runs` (the run core) or `replay-blocks` (the default core) drives.
enum Core {
    Runs(RunPrefixCache),
    Blocks(PrefixCache),
}

impl Core {
    /// Begin + commit + finish of one request whose prompt is already copied: the CPU ns of
    /// each phase, and the cached tokens.
    fn request(&self, prompt: Vec<u32>) -> ([u128; 3], usize) {
        let len = prompt.len();
        let t0 = thread_ns();
        let (cached, t1, t2) = match self {
            Core::Runs(cache) => {
                let (id, slots) = cache
                    .begin(None, prompt, b"", RequestExtras::default(), 0)
                    .expect("begin");
                let t1 = thread_ns();
                cache.commit(&id, len).expect("commit");
                let t2 = thread_ns();
                cache.finish(&id).expect("finish");
                (slots.num_cached_tokens, t1, t2)
            }
            Core::Blocks(cache) => {
                let r = cache
                    .begin(None, prompt, b"", RequestExtras::default(), 0)
                    .expect("begin");
                let t1 = thread_ns();
                cache.commit(&r.request_id, len).expect("commit");
                let t2 = thread_ns();
                cache.finish(&r.request_id).expect("finish");
                (r.num_cached_tokens, t1, t2)
            }
        };
        let t3 = thread_ns();
        ([t1 - t0, t2 - t1, t3 - t2], cached)
    }

    fn evictions(&self) -> u64 {
        match self {
            Core::Runs(cache) => cache.stats().expect("stats").evictions,
            Core::Blocks(cache) => cache.stats().evictions,
        }
    }
}

/// Per-request figures of a replay, in µs: the mean, p50 and p99 of the totals, and each
/// phase's mean.
struct Summary {
    mean: f64,
    p50: f64,
    p99: f64,
    phases: [f64; 3],
}

impl Summary {
    fn of(rows: &[[u128; 3]]) -> Self {
        let n = rows.len() as f64;
        let mut totals: Vec<u128> = rows.iter().map(|r| r.iter().sum()).collect();
        totals.sort_unstable();
        let phase = |k: usize| rows.iter().map(|r| r[k]).sum::<u128>() as f64 / n / 1e3;
        Self {
            mean: totals.iter().sum::<u128>() as f64 / n / 1e3,
            p50: percentile(&totals, 0.5) / 1e3,
            p99: percentile(&totals, 0.99) / 1e3,
            phases: [phase(0), phase(1), phase(2)],
        }
    }
}

/// `replay-runs TRACE [ROUNDS] [POLLUTE_MIB]`: the production trace through the run core
/// (`PrefixCache(core="runs")`'s `RunPrefixCache`) alone, begin + commit + finish per request:
/// per round the mean, p50 and p99 µs a request (CPU time), the mean of each phase, the hit rate
/// and the evictions. Also the loop to `perf record` the run core by.
fn replay_runs(path: &str, rounds: usize, pollute_mib: usize, on_runs: bool) {
    let (num_blocks, warmup, prompts) = read_trace(path);
    let mut polluter = vec![0u8; pollute_mib << 20];
    let context = context_fingerprint(b"bench");
    for _ in 0..rounds {
        let core = if on_runs {
            Core::Runs(
                RunPrefixCache::new(
                    num_blocks,
                    BLOCK_SIZE,
                    context,
                    None,
                    FullHit::RecomputeLastBlock,
                )
                .expect("cache"),
            )
        } else {
            Core::Blocks(
                PrefixCache::new(CacheConfig::new(num_blocks, BLOCK_SIZE), context).expect("cache"),
            )
        };
        let mut rows: Vec<[u128; 3]> = Vec::new();
        let (mut prompt_tokens, mut hit_tokens) = (0usize, 0usize);
        for (i, prompt) in prompts.iter().enumerate() {
            // What an engine does between two requests (its model's weights and activations,
            // the interpreter) evicts the cache's lines from the core's caches: `pollute` MiB
            // written between requests stands in for it.
            for line in polluter.chunks_mut(64) {
                line[0] = line[0].wrapping_add(1);
            }
            // Copied before the clock starts, as the Python benches hand each side a fresh
            // (warm) copy of the prompt.
            let owned = prompt.to_vec();
            COUNTING.store(i >= warmup, Ordering::Relaxed);
            let (phases, cached) = core.request(owned);
            COUNTING.store(false, Ordering::Relaxed);
            if i >= warmup {
                rows.push(phases);
                prompt_tokens += prompt.len();
                hit_tokens += cached;
            }
        }
        let n = rows.len() as f64;
        let s = Summary::of(&rows);
        println!(
            "{{\"mean_us\": {:.2}, \"p50_us\": {:.2}, \"p99_us\": {:.1}, \"phases_us\": [{:.2}, {:.2}, {:.2}], \"hit_rate\": {:.5}, \"evictions\": {}}}",
            s.mean,
            s.p50,
            s.p99,
            s.phases[0],
            s.phases[1],
            s.phases[2],
            hit_tokens as f64 / prompt_tokens as f64,
            core.evictions(),
        );
        let per = |a: &AtomicU64| a.swap(0, Ordering::Relaxed) as f64 / n;
        println!(
            "{{\"allocs_per_request_by_size\": [{:.2}, {:.2}, {:.2}, {:.2}], \"reallocs\": {:.2}}}",
            per(&ALLOCS[0]),
            per(&ALLOCS[1]),
            per(&ALLOCS[2]),
            per(&ALLOCS[3]),
            per(&REALLOCS)
        );
    }
}

/// One block's line in `memory_bound`'s stand-in arrays: 64 bytes, aligned, as the cache's
/// pool metadata, table slot and token row each are.
#[derive(Clone, Copy, Default)]
#[repr(align(64))]
struct Line([u64; 8]);

/// `replay_request` that also hands back the block table.
fn core_request(
    cache: &PrefixCache,
    prompt: &[u32],
    block_table: &mut Vec<u32>,
) -> ([u128; 3], usize) {
    let (phases, r) = timed_request(cache, prompt);
    *block_table = r.block_table;
    (phases, r.num_cached_tokens)
}

/// One request through a run-table stand-in, timed as `replay_request` times the core's (the
/// block table copied out untimed); the cached tokens.
fn stand_in_request<T: StandIn>(
    table: &mut T,
    prompt: &[u32],
    block_table: &mut Vec<u32>,
) -> ([u128; 3], usize) {
    let t0 = thread_ns();
    let mut r = table
        .begin(prompt.to_vec())
        .expect("the trace fits the cache");
    let t1 = thread_ns();
    let cached = T::cached_blocks(&r) * BLOCK_SIZE;
    table.commit(&mut r);
    let t2 = thread_ns();
    block_table.clear();
    block_table.extend_from_slice(T::blocks(&r));
    let t2b = thread_ns();
    table.finish(std::hint::black_box(r));
    let t3 = thread_ns();
    ([t1 - t0, t2 - t1, t3 - t2b], cached)
}

/// `run-table TRACE [ROUNDS]`: the production trace through the real core and through the two
/// run-table stand-ins (`run_segments.rs`: the core's eviction order queued by run;
/// `run_queue.rs`: vLLM's per-block free queue under the same runs), request by request in
/// rotating order so load from other processes hits each alike. Per side: mean, p50 and p99 µs
/// a request (CPU time), its phases, the 64k+ requests' phases, the hit rate, and how many
/// requests got other hits or another block table than the core's (0 for `run_segments`: the
/// same blocks in the same order).
fn run_table_replay(path: &str, rounds: usize) {
    const SIDES: usize = 3;
    let names = ["core", "run_segments", "run_queue"];
    let (num_blocks, warmup, prompts) = read_trace(path);
    let context = context_fingerprint(b"bench");
    for _ in 0..rounds {
        let cache =
            PrefixCache::new(CacheConfig::new(num_blocks, BLOCK_SIZE), context).expect("cache");
        let mut segments = run_segments::new(num_blocks, BLOCK_SIZE);
        let mut queue = run_queue::RunQueue::new(num_blocks, BLOCK_SIZE);
        // Per side: (phases, prompt length) of each timed request.
        let mut rows: [Vec<([u128; 3], usize)>; SIDES] = Default::default();
        let mut hits = [0usize; SIDES];
        // Requests (warm-up included) whose hit, and whose block table, differ from the core's.
        let mut hits_differ = [0usize; SIDES];
        let mut tables_differ = [0usize; SIDES];
        let mut prompt_tokens = 0usize;
        for (i, prompt) in prompts.iter().enumerate() {
            let mut costs = [([0u128; 3], 0usize); SIDES];
            let mut tables: [Vec<u32>; SIDES] = Default::default();
            for k in 0..SIDES {
                let side = (i + k) % SIDES;
                let into = &mut tables[side];
                costs[side] = match side {
                    0 => core_request(&cache, prompt, into),
                    1 => stand_in_request(&mut segments, prompt, into),
                    _ => stand_in_request(&mut queue, prompt, into),
                };
            }
            for side in 1..SIDES {
                tables_differ[side] += usize::from(tables[side] != tables[0]);
                hits_differ[side] += usize::from(costs[side].1 != costs[0].1);
            }
            if i >= warmup {
                prompt_tokens += prompt.len();
                for side in 0..SIDES {
                    hits[side] += costs[side].1;
                    rows[side].push((costs[side].0, prompt.len()));
                }
            }
        }
        let evictions = [
            cache.stats().evictions,
            segments.counters().evictions,
            queue.evictions,
        ];
        for side in 0..SIDES {
            let phases: Vec<[u128; 3]> = rows[side].iter().map(|r| r.0).collect();
            let s = Summary::of(&phases);
            let long: Vec<[u128; 3]> = rows[side]
                .iter()
                .filter(|r| r.1 >= 65_536)
                .map(|r| r.0)
                .collect();
            let long_phase = |k: usize| {
                long.iter().map(|r| r[k]).sum::<u128>() as f64 / long.len().max(1) as f64 / 1e3
            };
            println!(
                "{{\"side\": \"{}\", \"mean_us\": {:.1}, \"p50_us\": {:.1}, \"p99_us\": {:.1}, \"phases_us\": [{:.1}, {:.1}, {:.1}], \"64k+_phases_us\": [{:.1}, {:.1}, {:.1}], \"hit_rate\": {:.5}, \"evictions\": {}, \"hits_differ\": {}, \"block_tables_differ\": {}}}",
                names[side],
                s.mean,
                s.p50,
                s.p99,
                s.phases[0],
                s.phases[1],
                s.phases[2],
                long_phase(0),
                long_phase(1),
                long_phase(2),
                hits[side] as f64 / prompt_tokens as f64,
                evictions[side],
                hits_differ[side],
                tables_differ[side],
            );
        }
    }
}

/// `memory-bound TRACE`: what the production replay would cost a per-block design that did
/// nothing but touch the cache lines it must (a lower bound for any table with a metadata line,
/// a slot and a token row per block, like prefixkv's). The trace goes through the real cache
/// first, untimed, to record each request's block table and hit; then, timed, each request
/// touches its blocks' lines as the real cache must at the least: a hit block's slot and token
/// row read and its metadata updated (a reference); a new block's metadata and slot written at
/// eviction, its slot, token row and metadata written at publish; every block's metadata
/// updated at finish. With the same read-ahead distance as the cache (16 blocks), and the
/// stand-in arrays on huge pages where the system allows, as the cache's are (`hugepages.rs`).
/// Prints the mean µs of the touches, of the touches after the prompt's hash (the bound for a
/// table that hashes every block, as prefixkv did before round 15: it now hashes a key only
/// where its index needs one), and of the floor (the hash alone), and their ratios to it.
fn memory_bound(path: &str) {
    let (num_blocks, warmup, prompts) = read_trace(path);
    let context = context_fingerprint(b"bench");
    let extras = RequestExtras::default();
    let cache = PrefixCache::new(CacheConfig::new(num_blocks, BLOCK_SIZE), context).expect("cache");
    // Block ids as indices, converted here so the timed passes allocate nothing.
    let mut recorded: Vec<(Vec<usize>, usize)> = Vec::with_capacity(prompts.len());
    for prompt in &prompts {
        let r = cache
            .begin(None, prompt.clone(), b"", extras.clone(), 0)
            .expect("begin");
        cache.commit(&r.request_id, prompt.len()).expect("commit");
        cache.finish(&r.request_id).expect("finish");
        let table = r.block_table.iter().map(|&b| b as usize).collect();
        recorded.push((table, r.num_cached_tokens / BLOCK_SIZE));
    }
    let n = num_blocks as usize;
    let mut meta = huge_lines(n);
    let mut slots = huge_lines(n);
    let mut rows = huge_lines(n);
    let ahead = 16;
    let prefetch_line = |line: &Line| {
        #[cfg(target_arch = "x86_64")]
        // Safety: a prefetch hint reads nothing and cannot fault.
        #[allow(unsafe_code)]
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                (line as *const Line).cast::<i8>(),
                std::arch::x86_64::_MM_HINT_T0,
            );
        }
    };
    let (mut bound, mut with_hash, mut floor, mut timed) = (0u128, 0u128, 0u128, 0usize);
    for (i, (prompt, (table, hits))) in prompts.iter().zip(&recorded).enumerate() {
        let (mut touch_ns, mut hash_then_touch_ns, mut hash_ns) = (0u128, 0u128, 0u128);
        for k in 0..2 {
            let start = thread_ns();
            std::hint::black_box(cache.hash_prompt(std::hint::black_box(prompt), b"", &extras));
            let hashed = thread_ns();
            if (i + k) % 2 == 1 {
                hash_ns = hashed - start;
                continue;
            }
            let blocks = table.as_slice();
            let (hit, new) = blocks.split_at((*hits).min(blocks.len()));
            let mut sum = 0u64;
            // begin: the hit walk, then the evictions (each victim is a new block's id).
            for (j, &b) in hit.iter().enumerate() {
                if let Some(&a) = hit.get(j + ahead) {
                    prefetch_line(&slots[a]);
                    prefetch_line(&rows[a]);
                    prefetch_line(&meta[a]);
                }
                sum = sum.wrapping_add(slots[b].0[1] ^ rows[b].0[0] ^ rows[b].0[7]);
                meta[b].0[0] += 1;
            }
            for (j, &b) in new.iter().enumerate() {
                if let Some(&a) = new.get(j + ahead) {
                    prefetch_line(&meta[a]);
                    prefetch_line(&slots[a]);
                }
                meta[b].0[1] = meta[b].0[1].wrapping_add(1);
                slots[b].0[1] = 0;
            }
            // commit: publish the new blocks.
            for (j, (&b, chunk)) in new
                .iter()
                .zip(prompt[hit.len() * BLOCK_SIZE..].chunks_exact(BLOCK_SIZE))
                .enumerate()
            {
                if let Some(&a) = new.get(j + ahead) {
                    prefetch_line(&meta[a]);
                    prefetch_line(&slots[a]);
                    prefetch_line(&rows[a]);
                }
                for (word, pair) in rows[b].0.iter_mut().zip(chunk.chunks_exact(2)) {
                    *word = u64::from(pair[0]) | u64::from(pair[1]) << 32;
                }
                slots[b].0[..4].copy_from_slice(&[i as u64, b as u64, 1, 2]);
                meta[b].0[2] = i as u64;
            }
            // finish: every block's reference dropped.
            for (j, &b) in blocks.iter().enumerate().rev() {
                if let Some(a) = j.checked_sub(ahead).map(|a| blocks[a]) {
                    prefetch_line(&meta[a]);
                }
                meta[b].0[0] = meta[b].0[0].wrapping_sub(1);
            }
            std::hint::black_box(sum);
            let end = thread_ns();
            touch_ns = end - hashed;
            hash_then_touch_ns = end - start;
        }
        if i >= warmup {
            bound += touch_ns;
            with_hash += hash_then_touch_ns;
            floor += hash_ns;
            timed += 1;
        }
    }
    let us = |ns: u128| ns as f64 / timed as f64 / 1e3;
    println!(
        "{{\"memory_bound_us\": {:.1}, \"with_hash_us\": {:.1}, \"floor_us\": {:.1}, \"ratio\": {:.2}, \"with_hash_ratio\": {:.2}}}",
        us(bound),
        us(with_hash),
        us(floor),
        bound as f64 / floor as f64,
        with_hash as f64 / floor as f64,
    );
}

/// `n` zeroed lines, on huge pages where the system allows, as the cache's arrays are
/// (`prefixkv_core::hugepages::reserve`, `PREFIXKV_HUGE_PAGES` included).
fn huge_lines(n: usize) -> Vec<Line> {
    let mut lines: Vec<Line> = prefixkv_core::hugepages::reserve(n).expect("stand-in arrays");
    lines.resize(n, Line::default());
    lines
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(mode) = args.get(1) {
        if mode == "memory-bound" {
            memory_bound(args.get(2).expect("memory-bound TRACE"));
            return;
        }
        if mode == "replay" {
            let path = args.get(2).expect("replay TRACE [ROUNDS]");
            replay(path, args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1));
            return;
        }
        if mode == "replay-runs" || mode == "replay-blocks" {
            let path = args
                .get(2)
                .expect("replay-runs|replay-blocks TRACE [ROUNDS] [POLLUTE_MIB]");
            replay_runs(
                path,
                args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1),
                args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0),
                mode == "replay-runs",
            );
            return;
        }
        if mode == "run-table" {
            let path = args.get(2).expect("run-table TRACE [ROUNDS]");
            run_table_replay(path, args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1));
            return;
        }
        if mode == "run-table-alone" {
            let path = args.get(2).expect("run-table-alone TRACE");
            let (num_blocks, _, prompts) = read_trace(path);
            let mut table = run_segments::new(num_blocks, BLOCK_SIZE);
            let mut into = Vec::new();
            let mut total = 0u128;
            for prompt in &prompts {
                total += stand_in_request(&mut table, prompt, &mut into)
                    .0
                    .iter()
                    .sum::<u128>();
            }
            println!(
                "{:.1} us a request",
                total as f64 / prompts.len() as f64 / 1e3
            );
            return;
        }
        if mode == "run-table-reader" {
            let arg = |i: usize, default: usize| {
                args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default)
            };
            run_table_reader(arg(2, 1), arg(3, 16384), arg(4, 200));
            return;
        }
        if mode == "run-table-requests" {
            let arg = |i: usize, default: usize| {
                args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default)
            };
            run_table_requests(arg(2, 2000), arg(3, 1024), arg(4, 0));
            return;
        }
        if mode == "requests" {
            let arg = |i: usize, default: usize| {
                args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default)
            };
            fixed_requests(arg(2, 2000), arg(3, 1024), arg(4, 0));
            return;
        }
        if mode.starts_with("loop-") {
            let seconds = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3.0);
            let max_requests = args
                .get(3)
                .and_then(|s| s.parse().ok())
                .unwrap_or(usize::MAX);
            profile_loop(mode, seconds, max_requests);
            return;
        }
    }
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
        (
            "core block_key (SHA-256 of tag + parent + tokens, 97 bytes: 2 compressions)",
            Box::new(|| {
                let mut parent = root;
                for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                    parent = block_key(&parent, chunk, b"");
                }
                std::hint::black_box(parent);
            }),
        ),
        (
            "blake3 of parent + 64 token bytes (96 bytes: 2 compressions)",
            Box::new(|| {
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
            }),
        ),
        (
            "sha2 SHA-256 of tag + parent + 64 token bytes (97 bytes), fixed buffer",
            Box::new(|| {
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
            }),
        ),
        // What a key layout change could buy: the parent key as BLAKE3's key, the 64 token
        // bytes as the whole message.
        (
            "blake3 keyed_hash(parent, 64 token bytes): 1 compression",
            Box::new(|| {
                let mut parent = [0u8; 32];
                let mut buffer = [0u8; 64];
                for chunk in prompt.chunks_exact(BLOCK_SIZE) {
                    for (i, t) in chunk.iter().enumerate() {
                        buffer[4 * i..4 * i + 4].copy_from_slice(&t.to_le_bytes());
                    }
                    parent = *blake3::keyed_hash(&parent, &buffer).as_bytes();
                }
                std::hint::black_box(parent);
            }),
        ),
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
    // with the core's own entry type into a table sized like the cache's (200,000 blocks), fresh
    // keys each round, each block's old entry removed first as eviction would: what the table
    // itself costs, with no pool or request bookkeeping.
    let table = Table::new(200_000, BLOCK_SIZE).expect("table");
    let mut keys_of_block = vec![None; 200_000];
    let mut next_key = 0x9E37_79B9_7F4A_7C15_u64;
    let mut next_id = 0u64;
    let insert_ns = median_ns(101, || {
        for chunk in prompt.chunks_exact(BLOCK_SIZE) {
            next_key ^= next_key << 13;
            next_key ^= next_key >> 7;
            next_key ^= next_key << 17;
            next_id += 1;
            let entry = NewEntry {
                id: next_id,
                block: (next_id % 200_000) as u32,
                parent: Parent::Entry(next_id - 1),
                tokens: chunk,
                extras: &[],
            };
            let key = TableKey(u128::from(next_key) << 64 | u128::from(next_id));
            if keys_of_block[entry.block as usize].replace(key).is_some() {
                table.remove(entry.block);
            }
            // No parent block: every entry indexed, as the micro-benchmark always measured.
            let _ = std::hint::black_box(table.insert(key, &entry, None));
        }
    });
    println!("{{\"what\": \"table insert of 250 entries (borrowed NewEntry; each block's old entry removed first), 200,000-block table\", \"ns\": {insert_ns:.0}}}");

    let mut seed = 100;
    let request = |tokens: Vec<u32>| -> [u128; 3] {
        let t0 = Instant::now();
        let r = cache
            .begin(None, tokens, b"", RequestExtras::default(), 0)
            .expect("begin");
        let t1 = Instant::now();
        cache.commit(&r.request_id, n).expect("commit");
        let t2 = Instant::now();
        cache.finish(&r.request_id).expect("finish");
        [
            t1.duration_since(t0).as_nanos(),
            t2.duration_since(t1).as_nanos(),
            t2.elapsed().as_nanos(),
        ]
    };
    for (name, shared_blocks) in [
        ("shares 95% of its blocks", 238usize),
        ("shares nothing", 0),
    ] {
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
    decode(20_000);
    pressure(600, 16_384);
}
