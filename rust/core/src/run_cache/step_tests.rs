//! The step API on runs against the per-block cache's: requests added waiting, their prompts
//! scheduled in chunks (with lookahead slots and watermarks), decode tokens appended and
//! committed block by block, preemptions that re-match, caps on the cached prefix, finishes
//! in any order. After every call both caches must have answered alike: the same slots or
//! the same refusal (out of blocks, or invalid input), the same block table, the same start
//! position, the same KV events (drained after every call, snapshots and overflows included);
//! and at the end the same evictions and every block obtainable again.

use super::tests::{full_hit_of, Draw, Pair, SALTS};
use crate::key::BlockKey;
use std::sync::Arc;

use super::{Origin, RunRequest};
use crate::error::CacheError;
use crate::events::{EventConfig, KvEvent, TokenIds};
use crate::{MultimodalItem, RequestExtras, RequestId};

/// One request in both caches.
struct Live {
    id: RequestId,
    mine: RunRequest,
    salt: usize,
    /// Its multimodal items (`items`).
    items: usize,
    /// Tokens the last `allocate_slots` scheduled up to (what the engine may commit).
    scheduled_to: usize,
    /// Decode tokens it still generates once its prompt is computed.
    decode_left: usize,
}

/// What the seeds reached, summed (each checked to be reached).
#[derive(Debug, Default)]
struct Reached {
    hit_tokens: u64,
    /// Full hits that hold the prompt's last block shared (`FullHit::ReuseLastBlock`).
    shared_last_blocks: u64,
    rematched_tokens: u64,
    out_of_blocks: u64,
    invalid: u64,
    capped: u64,
    decode_tokens: u64,
    drafts: u64,
    accepted: u64,
    truncated: u64,
    preemptions: u64,
    evictions: u64,
    copies: u64,
    splits: u64,
    pinned: u64,
    unpinned: u64,
    logged: u64,
    stored_events: u64,
    removed_events: u64,
    resynchronisations: u64,
    /// Requests with multimodal items, and the tokens their matches hit past an item's start.
    with_items: u64,
    hits_through_items: u64,
}

/// Multimodal items, by index (0: none): an image across blocks 0-1 in two contents, one over
/// blocks 2-4, two images in one prompt, and one from block 1 to the last token id there can be
/// (a review found its end overflowing at block size 1: no tag, a wrong hit). Requests share
/// them, or differ only by them (equal placeholder tokens, another image).
fn items(index: usize, block_size: usize) -> RequestExtras {
    let bs = block_size as u64;
    let item = |start: u64, length: u64, hash: &[u8]| MultimodalItem {
        start,
        length,
        hash: hash.to_vec(),
    };
    let multimodal = match index {
        0 => Vec::new(),
        1 => vec![item(bs / 2, bs, b"a")],
        2 => vec![item(bs / 2, bs, b"b")],
        3 => vec![item(2 * bs, 3 * bs, b"a")],
        4 => vec![item(bs / 2, bs, b"a"), item(3 * bs + 1, 2, b"b")],
        _ => vec![item(bs, u64::MAX - bs, b"c")],
    };
    RequestExtras {
        adapter: None,
        multimodal,
    }
}

/// A request of the run cache for `tokens` under `root` with the items of index `items`.
fn run_request(
    pair: &Pair,
    (root, items_index): (BlockKey, usize),
    tokens: Vec<u32>,
    priority: i32,
    block_size: usize,
) -> RunRequest {
    let origin = Origin {
        root,
        extras: items(items_index, block_size),
    };
    pair.runs.add_from(Arc::new(origin), tokens, priority)
}

/// Seed `seed`'s events: on for two seeds in three, a small queue for one in four (overflows,
/// resynchronised by snapshots), each token policy in turn.
fn event_config(seed: u64) -> Option<EventConfig> {
    (seed % 3 != 2).then(|| EventConfig {
        capacity: if seed.is_multiple_of(4) { 6 } else { 1 << 20 },
        token_ids: [TokenIds::All, TokenIds::Unsalted, TokenIds::None][(seed / 3 % 3) as usize],
    })
}

/// Both caches' events since the last drain must be the same, event for event.
fn same_events(pair: &mut Pair, what: &str, reached: &mut Reached) {
    let core = pair.core.drain_events();
    let mine = pair.runs.drain_events(&pair.context);
    assert_eq!(core, mine, "{what}: KV events");
    reached.resynchronisations += u64::from(core.resynchronised);
    for event in &core.events {
        match event {
            KvEvent::Stored { keys, .. } => reached.stored_events += keys.len() as u64,
            KvEvent::Removed { keys } => reached.removed_events += keys.len() as u64,
            KvEvent::Cleared => {}
        }
    }
}

/// The same kind of refusal, or the same answer.
fn same_outcome<T: PartialEq + std::fmt::Debug, U: std::fmt::Debug>(
    core: &Result<T, CacheError>,
    mine: &Result<U, CacheError>,
    equal: impl Fn(&T, &U) -> bool,
    what: &str,
) {
    match (core, mine) {
        (Ok(c), Ok(m)) => assert!(equal(c, m), "{what}: core {c:?}, run cache {m:?}"),
        (
            Err(CacheError::OutOfBlocks { needed: a, .. }),
            Err(CacheError::OutOfBlocks { needed: b, .. }),
        ) => {
            assert_eq!(a, b, "{what}: blocks needed");
        }
        (Err(CacheError::InvalidInput(_)), Err(CacheError::InvalidInput(_))) => {}
        _ => panic!("{what}: core {core:?}, run cache {mine:?}"),
    }
}

fn steps(seed: u64, block_size: usize, reached: &mut Reached) {
    let num_blocks = [12u32, 40, 160][seed as usize % 3];
    // Every other pair of seeds shares a full hit's last block instead of recomputing it (by
    // pairs: the seed's parity already decides the eviction log).
    let mut pair = Pair::with_full_hit(num_blocks, block_size, full_hit_of(seed / 2));
    let mut draw = Draw::new(seed ^ 0x5157);
    let mut next_id = 0i64;
    let mut next_fresh = 1_000u32;
    // Token sequences seen (prompts and what was generated after them), with their salt.
    let mut seen: Vec<(Vec<u32>, usize, usize)> = Vec::new();
    let mut live: Vec<Live> = Vec::new();
    // Live pins: the core's id, the run cache's ranges.
    let mut pins: Vec<(u64, Vec<super::Held>)> = Vec::new();
    // Half the seeds log evictions (what a host tier drains), the other half do not.
    let logging = seed.is_multiple_of(2);
    if logging {
        pair.core.set_eviction_log(true);
        pair.runs.eviction_log = Some(Vec::new());
    }
    let events = event_config(seed);
    if let Some(config) = events {
        pair.core.enable_events(config);
        pair.runs.enable_events(config, &pair.context);
    }
    let max_prompt = num_blocks as usize * block_size * 3 / 4;
    for step in 0..500 {
        if let Some(config) = events.filter(|_| step % 97 == 50) {
            // Enabled again over a warm cache: the next drain is a snapshot of it.
            pair.core.enable_events(config);
            pair.runs.enable_events(config, &pair.context);
        }
        let winding_down = step >= 440;
        let what = format!("seed {seed}, block size {block_size}, step {step}");
        let action = if winding_down { 5 } else { draw.below(15) };
        match action {
            // Add a request: a cut of something seen (a finished request's decode tokens
            // included), then fresh tokens from a few patterns or unique ones.
            0 | 1 if live.len() < 6 => {
                let mut tokens = Vec::new();
                let mut salt = usize::from(draw.below(8) == 0);
                // One request in five has images; one in four of those built on another's
                // prompt has other ones.
                let mut with_items = if draw.below(5) == 0 {
                    1 + draw.below(5)
                } else {
                    0
                };
                let bases = seen.len() + live.len();
                if bases > 0 && draw.below(4) != 0 {
                    let pick = draw.below(bases);
                    let (base, base_salt, base_items) = if pick < seen.len() {
                        seen[pick].clone()
                    } else {
                        let other = &live[pick - seen.len()];
                        (other.mine.tokens.clone(), other.salt, other.items)
                    };
                    salt = base_salt;
                    if draw.below(4) != 0 {
                        with_items = base_items;
                    }
                    let cut = if draw.below(3) == 0 {
                        base.len() / block_size * block_size
                    } else {
                        draw.below(base.len() + 1)
                    };
                    tokens.extend_from_slice(&base[..cut.min(max_prompt)]);
                }
                if tokens.is_empty() || draw.below(3) != 0 {
                    let count = 1 + draw.below(3 * block_size + 40);
                    for _ in 0..count {
                        if draw.below(2) == 0 {
                            tokens.push(7 + (tokens.len() % block_size) as u32);
                        } else {
                            tokens.push(next_fresh);
                            next_fresh += 1;
                        }
                    }
                }
                tokens.truncate(max_prompt.max(1));
                let priority = draw.below(3) as i32 - 1;
                let id = RequestId::Int(next_id);
                next_id += 1;
                pair.core
                    .add_request(
                        id.clone(),
                        tokens.clone(),
                        SALTS[salt],
                        items(with_items, block_size),
                        priority,
                    )
                    .expect("add");
                reached.with_items += u64::from(with_items != 0);
                let root = (pair.roots[salt], with_items);
                let mut mine = run_request(&pair, root, tokens, priority, block_size);
                if draw.below(6) == 0 {
                    let cap = Some(draw.below(mine.num_tokens() + 1));
                    pair.core.limit_cached_prefix(&id, cap).expect("cap");
                    mine.limit_cached_prefix(cap);
                }
                live.push(Live {
                    id,
                    mine,
                    salt,
                    items: with_items,
                    scheduled_to: 0,
                    decode_left: draw.below(2 * block_size + 2),
                });
            }
            // Allocate slots: the next chunk of the prompt (or all of it), a decode token, now
            // and then more than the request has (refused by both), a lookahead, a watermark.
            2..=4 if !live.is_empty() => {
                let i = draw.below(live.len());
                let l = &mut live[i];
                let waiting = !l.mine.is_scheduled();
                if waiting {
                    let start = pair.core.start_position(&l.id).expect("start");
                    assert_eq!(pair.runs.start_position(&l.mine), start, "{what}: start");
                }
                let start = if waiting {
                    pair.runs.start_position(&l.mine)
                } else {
                    l.mine.num_computed_tokens()
                };
                let known = l.mine.num_tokens() - start;
                let num_new = match draw.below(10) {
                    0 => known + 1 + draw.below(3),
                    1..=3 => known,
                    _ => draw.below(known + 1),
                };
                let lookahead = if draw.below(4) == 0 {
                    draw.below(2 * block_size)
                } else {
                    0
                };
                let watermark = if draw.below(5) == 0 { draw.below(4) } else { 0 };
                let core = pair
                    .core
                    .allocate_slots(&l.id, num_new, lookahead, watermark);
                let mine = pair
                    .runs
                    .allocate_slots(&mut l.mine, num_new, lookahead, watermark);
                same_outcome(
                    &core,
                    &mine,
                    |c, m| {
                        (
                            &c.block_ids,
                            c.num_computed_tokens,
                            c.num_cached_tokens,
                            c.full_hit,
                            c.last_token_shared,
                        ) == (
                            &m.block_ids,
                            m.num_computed_tokens,
                            m.num_cached_tokens,
                            m.full_hit,
                            m.last_token_shared,
                        )
                    },
                    &format!("{what}: allocate_slots({num_new}, {lookahead}, {watermark})"),
                );
                match &mine {
                    Ok(slots) => {
                        if waiting {
                            reached.hit_tokens += slots.num_cached_tokens as u64;
                            // Every item starts by block 4 (`items`).
                            if l.items != 0 && slots.num_cached_tokens > 4 * block_size {
                                reached.hits_through_items += slots.num_cached_tokens as u64;
                            }
                            reached.shared_last_blocks += u64::from(slots.last_token_shared);
                            if slots.num_computed_tokens < start {
                                reached.capped += 1;
                            }
                        }
                        l.scheduled_to = slots.num_computed_tokens + num_new;
                    }
                    Err(CacheError::OutOfBlocks { .. }) => reached.out_of_blocks += 1,
                    Err(_) => reached.invalid += 1,
                }
            }
            // Commit what was scheduled, part of it (a chunk), or past the slots now and then.
            5..=7 if !live.is_empty() => {
                let i = draw.below(live.len());
                let l = &mut live[i];
                let from = l.mine.num_computed_tokens();
                let n = if winding_down || draw.below(3) != 0 {
                    l.scheduled_to.max(from)
                } else if draw.below(8) == 0 {
                    l.mine.num_tokens() + 1
                } else {
                    from + draw.below(l.scheduled_to.max(from) - from + 1)
                };
                let core = pair.core.commit(&l.id, n).map(|_| ());
                let mine = pair.runs.commit(&mut l.mine, n);
                same_outcome(&core, &mine, |(), ()| true, &format!("{what}: commit({n})"));
                if mine.is_err() {
                    reached.invalid += 1;
                }
                // A computed request decodes: a token sampled, appended to both.
                if l.mine.is_scheduled()
                    && l.mine.num_computed_tokens() == l.mine.num_tokens()
                    && l.decode_left > 0
                    && !winding_down
                {
                    l.decode_left -= 1;
                    let token = if draw.below(2) == 0 { 3 } else { next_fresh };
                    next_fresh += 1;
                    let core = pair.core.append_tokens(&l.id, &[token], false);
                    let mine = l.mine.append_tokens(&[token], false);
                    same_outcome(&core, &mine, |(), ()| true, &format!("{what}: append"));
                    reached.decode_tokens += u64::from(mine.is_ok());
                }
            }
            8 if !live.is_empty() => {
                let i = draw.below(live.len());
                let l = &mut live[i];
                if l.mine.is_scheduled() {
                    reached.preemptions += 1;
                }
                pair.core.preempt(&l.id).expect("preempt");
                pair.runs.preempt(&mut l.mine);
                l.scheduled_to = 0;
                let start = pair.core.start_position(&l.id).expect("start");
                assert_eq!(
                    pair.runs.start_position(&l.mine),
                    start,
                    "{what}: start after preempt"
                );
                reached.rematched_tokens += start as u64;
            }
            9 | 10 if !live.is_empty() => {
                // Finished once computed, or any time (an abort).
                let i = draw.below(live.len());
                let l = live.swap_remove(i);
                pair.core.finish(&l.id).expect("finish");
                seen.push((l.mine.tokens.clone(), l.salt, l.items));
                pair.runs.finish(l.mine);
            }
            // Speculative decoding: drafts appended (their slots come from a later
            // allocate_slots, their KV from a commit), then some accepted, or cut by truncate,
            // now and then past what the request has (refused by both).
            11 | 12 if !live.is_empty() => {
                let i = draw.below(live.len());
                let l = &mut live[i];
                if l.mine.num_drafts == 0 {
                    let count = 1 + draw.below(4);
                    let drafts: Vec<u32> = (0..count)
                        .map(|k| {
                            if draw.below(2) == 0 {
                                3
                            } else {
                                next_fresh + k as u32
                            }
                        })
                        .collect();
                    next_fresh += count as u32;
                    pair.core
                        .append_tokens(&l.id, &drafts, true)
                        .expect("drafts");
                    l.mine.append_tokens(&drafts, true).expect("drafts");
                    reached.drafts += count as u64;
                } else if draw.below(2) == 0 {
                    let n = draw.below(l.mine.num_drafts + 2);
                    let core = pair.core.accept_drafts(&l.id, n);
                    let mine = pair.runs.accept_drafts(&mut l.mine, n);
                    same_outcome(
                        &core,
                        &mine,
                        |c, m| c == m,
                        &format!("{what}: accept_drafts({n})"),
                    );
                    reached.accepted += u64::from(mine.is_ok());
                } else {
                    let n = draw.below(l.mine.num_tokens() + 2);
                    let core = pair.core.truncate(&l.id, n);
                    let mine = pair.runs.truncate(&mut l.mine, n);
                    same_outcome(
                        &core,
                        &mine,
                        |c, m| c == m,
                        &format!("{what}: truncate({n})"),
                    );
                    reached.truncated +=
                        u64::from(mine.as_ref().is_ok_and(|freed| !freed.is_empty()));
                }
                l.scheduled_to = l.scheduled_to.min(l.mine.num_tokens());
            }
            // Pin the cached prefix of something seen or live (a system prompt kept), as the
            // core pins it: the same blocks counted, and from then on the same victims.
            13 if !seen.is_empty() || !live.is_empty() => {
                let pick = draw.below(seen.len() + live.len());
                let (tokens, salt, with_items) = if pick < seen.len() {
                    seen[pick].clone()
                } else {
                    let l = &live[pick - seen.len()];
                    (l.mine.tokens.clone(), l.salt, l.items)
                };
                let cut = draw.below(tokens.len() + 1);
                let extras = items(with_items, block_size);
                let (id, count) = pair
                    .core
                    .pin(&tokens[..cut], SALTS[salt], &extras)
                    .expect("pin");
                let tags = extras.run_tags(0..cut / block_size, block_size);
                let (held, mine) = pair.runs.pin(&pair.roots[salt], &tokens[..cut], &tags);
                assert_eq!(mine, count, "{what}: blocks pinned");
                reached.pinned += count as u64;
                pins.push((id, held));
            }
            14 if !pins.is_empty() => {
                let (id, held) = pins.swap_remove(draw.below(pins.len()));
                pair.core.unpin(id).expect("unpin");
                pair.runs.unpin(&held);
                reached.unpinned += 1;
            }
            _ if winding_down && !live.is_empty() => {
                let l = live.swap_remove(0);
                pair.core.finish(&l.id).expect("finish");
                pair.runs.finish(l.mine);
            }
            _ => {}
        }
        let logged = pair.core.drain_evicted();
        let mine = pair
            .runs
            .eviction_log
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        assert_eq!(mine, logged, "{what}: the blocks evicted, in order");
        reached.logged += mine.len() as u64;
        for l in &live {
            assert_eq!(
                pair.core.block_table(&l.id).expect("table"),
                l.mine.blocks(),
                "{what}: block table of {}",
                l.id
            );
            assert_eq!(
                pair.core.num_computed_tokens(&l.id).expect("computed"),
                l.mine.num_computed_tokens(),
                "{what}: computed tokens of {}",
                l.id
            );
        }
        same_events(&mut pair, &what, reached);
        if step % 8 == 0 {
            pair.runs.check_invariants();
            let (mut core_keys, mut mine) = (pair.core.cached_keys(), pair.runs.cached_keys());
            core_keys.sort();
            mine.sort();
            assert_eq!(core_keys, mine, "{what}: the cached set's block keys");
            pair.runs
                .check_block_states(live.iter().map(|l| l.mine.blocks()));
            let counts = pair.runs.block_counts();
            let stats = pair.core.stats();
            assert_eq!(
                (counts.free, counts.cached, counts.obtainable),
                (
                    stats.blocks_free,
                    stats.blocks_cached,
                    stats.blocks_obtainable
                ),
                "{what}: free, cached and obtainable blocks"
            );
            assert_eq!(
                pair.runs.num_pinned(),
                stats.blocks_pinned,
                "{what}: pinned blocks"
            );
            for block in 0..num_blocks {
                assert_eq!(
                    pair.runs.is_cached(block),
                    pair.core.is_cached(block).expect("block"),
                    "{what}: is block {block} cached"
                );
                let held = live
                    .iter()
                    .map(|l| l.mine.blocks().iter().filter(|&&b| b == block).count())
                    .sum::<usize>();
                assert_eq!(
                    held as u32,
                    pair.core.ref_count(block).expect("block"),
                    "{what}: references to block {block}"
                );
            }
        }
    }
    for l in live.drain(..) {
        pair.core.finish(&l.id).expect("finish");
        pair.runs.finish(l.mine);
    }
    for (id, held) in pins.drain(..) {
        pair.core.unpin(id).expect("unpin");
        pair.runs.unpin(&held);
    }
    assert_eq!(pair.runs.num_pinned(), 0, "seed {seed}: every pin dropped");
    pair.runs.check_invariants();
    assert_eq!(
        pair.runs.obtainable(),
        num_blocks as usize,
        "seed {seed}: no block lost"
    );
    let counters = pair.runs.counters();
    assert_eq!(
        counters.evictions,
        pair.core.stats().evictions,
        "seed {seed}: evictions"
    );
    reached.evictions += counters.evictions;
    reached.copies += counters.copies;
    reached.splits += counters.splits;
}

fn steps_over(seeds: std::ops::Range<u64>, block_size: usize) -> Reached {
    let mut reached = Reached::default();
    for seed in seeds {
        steps(seed, block_size, &mut reached);
    }
    eprintln!("block size {block_size}: {reached:?}");
    let Reached {
        hit_tokens,
        shared_last_blocks,
        rematched_tokens,
        out_of_blocks,
        invalid,
        capped,
        decode_tokens,
        drafts,
        accepted,
        truncated,
        preemptions,
        evictions,
        copies,
        splits,
        pinned,
        unpinned,
        logged,
        stored_events,
        removed_events,
        resynchronisations,
        with_items,
        hits_through_items,
    } = reached;
    for (name, n) in [
        ("hit tokens", hit_tokens),
        ("shared last blocks", shared_last_blocks),
        ("rematched tokens", rematched_tokens),
        ("out of blocks", out_of_blocks),
        ("invalid", invalid),
        ("capped", capped),
        ("decode tokens", decode_tokens),
        ("drafts", drafts),
        ("accepted", accepted),
        ("truncated", truncated),
        ("preemptions", preemptions),
        ("evictions", evictions),
        ("copies", copies),
        ("splits", splits),
        ("pinned blocks", pinned),
        ("unpins", unpinned),
        ("evictions logged", logged),
        ("blocks stored (events)", stored_events),
        ("blocks removed (events)", removed_events),
        ("resynchronisations", resynchronisations),
        ("requests with images", with_items),
        ("tokens hit through images", hits_through_items),
    ] {
        assert!(n > 10, "block size {block_size}: only {n} {name}");
    }
    reached
}

/// Chunked prefills, decode, lookahead, watermarks, preemption and caps: the core's slots and
/// refusals, call for call.
#[test]
fn the_step_api_hands_out_the_cores_slots() {
    steps_over(0..300, 16);
    steps_over(0..300, 3);
}

/// The same on many more seeds, in release (`make rust-stress`).
#[test]
#[ignore = "stress: run in release by `make rust-stress`"]
fn the_step_api_hands_out_the_cores_slots_on_many_more_seeds() {
    for block_size in [1, 3, 16, 17] {
        steps_over(1_000..5_000, block_size);
    }
}
