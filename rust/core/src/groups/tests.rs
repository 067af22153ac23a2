use super::*;
use crate::cache::{CacheConfig, WindowRelease};
use crate::key::{context_fingerprint, BlockKey};

const FULL: usize = 0;
const SLIDING: usize = 1;

fn cache(num_blocks: u32, block_size: usize, window: Option<usize>, group: u8) -> Arc<PrefixCache> {
    let config = CacheConfig {
        sliding_window: window,
        ..CacheConfig::new(num_blocks, block_size)
    };
    // Each group under its own context, as `group_context` gives them in Python.
    let context: BlockKey = context_fingerprint(&[group]);
    Arc::new(PrefixCache::new(config, context).expect("a valid config"))
}

/// A full group and a sliding one (`window` tokens).
fn pair(blocks: (u32, u32), sizes: (usize, usize), window: usize) -> KvGroups {
    KvGroups::new(vec![
        cache(blocks.0, sizes.0, None, 0),
        cache(blocks.1, sizes.1, Some(window), 1),
    ])
    .expect("two distinct caches")
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t * 7 % 101).collect()
}

fn id(name: &str) -> RequestId {
    RequestId::from(name)
}

/// Prefill `tokens` as request `name` in one group's cache alone, commit, finish.
fn cache_prefix(cache: &PrefixCache, name: &str, tokens: &[u32]) {
    let name = id(name);
    cache
        .add_request(
            name.clone(),
            tokens.to_vec(),
            b"",
            RequestExtras::default(),
            0,
        )
        .unwrap();
    cache.allocate_slots(&name, tokens.len(), 0, 0).unwrap();
    cache.commit(&name, tokens.len()).unwrap();
    cache.finish(&name).unwrap();
}

fn add(groups: &KvGroups, name: &str, tokens: &[u32]) {
    groups
        .add_request(id(name), tokens.to_vec(), b"", RequestExtras::default(), 0)
        .unwrap();
}

fn free_and_used(groups: &KvGroups) -> Vec<(usize, usize)> {
    groups
        .groups()
        .iter()
        .map(|cache| {
            let stats = cache.stats();
            (stats.blocks_free, stats.blocks_in_use)
        })
        .collect()
}

#[test]
fn new_refuses_no_group_a_shared_cache_and_reused_last_blocks() {
    assert!(matches!(
        KvGroups::new(Vec::new()),
        Err(CacheError::InvalidInput(_))
    ));
    let shared = cache(8, 4, None, 0);
    assert!(KvGroups::new(vec![shared.clone(), shared]).is_err());
    let config = CacheConfig {
        full_hit: FullHit::ReuseLastBlock,
        ..CacheConfig::new(8, 4)
    };
    let reuse = Arc::new(PrefixCache::new(config, BlockKey([0; 32])).unwrap());
    assert!(KvGroups::new(vec![reuse]).is_err());
}

#[test]
fn the_agreement_loop_lowers_its_cap_until_every_group_agrees() {
    // Group 0 is monotone (a full group); group 1 is not: it serves 36 and 20, but
    // nothing between (a sliding group whose blocks at 20..32 were evicted).
    let full = |cap: Option<usize>| cap.unwrap_or(usize::MAX).min(28);
    let sliding = |cap: Option<usize>| match cap {
        None => 36,
        Some(cap) if cap >= 36 => 36,
        Some(cap) => cap.min(20),
    };
    let mut asked = Vec::new();
    let agreed = agree(4, 2, None, |group, cap| {
        asked.push((group, cap));
        Ok(if group == 0 { full(cap) } else { sliding(cap) })
    });
    assert_eq!(agreed, Ok(20));
    // Uncapped (28, 36), then capped at 28 (28, 20), then at 20 (20, 20).
    assert_eq!(
        asked,
        [
            (0, None),
            (1, None),
            (0, Some(28)),
            (1, Some(28)),
            (0, Some(20)),
            (1, Some(20))
        ]
    );
    // Rounded down to the granularity: 28 and 36 under blocks of 12 agree on 24.
    let agreed = agree(12, 2, None, |group, cap| {
        let most = if group == 0 { 28 } else { 36 };
        Ok(cap.map_or(most, |cap| cap.min(most)))
    });
    assert_eq!(agreed, Ok(24));
}

#[test]
fn groups_that_disagree_agree_on_the_longest_hit_both_serve() {
    let groups = pair((32, 32), (4, 4), 5);
    let tokens = prompt(40);
    // The full group cached 7 blocks, the sliding group all 10.
    cache_prefix(&groups.groups()[FULL], "x", &tokens[..28]);
    cache_prefix(&groups.groups()[SLIDING], "x", &tokens);
    assert_eq!(
        groups.groups()[SLIDING]
            .lookup(&tokens, b"", &RequestExtras::default())
            .unwrap()
            .num_cached_tokens,
        36
    );
    add(&groups, "b", &tokens);
    assert_eq!(groups.start_position(&id("b")), Ok(28));
    let slots = groups.allocate_slots(&id("b"), 12, 0, 0).unwrap();
    assert_eq!(slots.num_computed_tokens, 28);
    assert_eq!(slots.num_cached_tokens, 28);
    assert!(!slots.full_hit);
    let tables = groups.block_tables(&id("b")).unwrap();
    assert_eq!(tables.iter().map(Vec::len).collect::<Vec<_>>(), [10, 10]);
    // The window of position 28 starts at 24: block 6; the sliding group's earlier
    // positions are its null block.
    let null = groups.groups()[SLIDING].null_block().unwrap();
    assert!(tables[SLIDING][..6].iter().all(|&b| b == null));
    assert!(tables[SLIDING][6..].iter().all(|&b| b != null));
    assert_eq!(groups.num_computed_tokens(&id("b")), Ok(28));
    groups.finish(&id("b")).unwrap();
    for cache in groups.groups() {
        cache.check_invariants();
    }
}

#[test]
fn block_sizes_4_and_6_agree_on_multiples_of_12() {
    let groups = pair((32, 32), (4, 6), 5);
    assert_eq!(groups.hit_granularity(), 12);
    let tokens = prompt(40);
    add(&groups, "a", &tokens);
    groups.allocate_slots(&id("a"), 40, 0, 0).unwrap();
    groups.commit(&id("a"), 40).unwrap();
    groups.finish(&id("a")).unwrap();
    for length in [40, 30, 26, 12, 11] {
        add(&groups, "b", &tokens[..length]);
        let position = groups.start_position(&id("b")).unwrap();
        assert_eq!(position, 12 * ((length - 1) / 12), "prompt of {length}");
        let slots = groups
            .allocate_slots(&id("b"), length - position, 0, 0)
            .unwrap();
        assert_eq!(slots.num_computed_tokens, position);
        let tables = groups.block_tables(&id("b")).unwrap();
        assert_eq!(tables[0].len(), length.div_ceil(4));
        assert_eq!(tables[1].len(), length.div_ceil(6));
        groups.finish(&id("b")).unwrap();
    }
    for cache in groups.groups() {
        cache.check_invariants();
    }
}

#[test]
fn an_allocation_one_group_cannot_supply_changes_no_group() {
    // The window covers the whole prompt: the sliding group needs every block, and has 4.
    let groups = pair((32, 4), (4, 4), 64);
    add(&groups, "a", &prompt(40));
    let before = free_and_used(&groups);
    let refused = groups.allocate_slots(&id("a"), 40, 0, 0);
    let Err(CacheError::InKvGroup { group, error }) = refused else {
        panic!("expected a refusal naming the group, got {refused:?}");
    };
    assert_eq!(group, SLIDING);
    assert!(matches!(
        *error,
        CacheError::OutOfBlocks {
            needed: 10,
            available: 4
        }
    ));
    assert!(CacheError::InKvGroup { group, error }
        .to_string()
        .starts_with("KV group 1: out of KV blocks"));
    assert_eq!(free_and_used(&groups), before);
    assert_eq!(groups.block_tables(&id("a")).unwrap(), [vec![], vec![]]);
    assert_eq!(groups.can_allocate_slots(&id("a"), 40, 0, 0), Ok(false));
    // Still waiting: a chunk that fits is served from the start.
    let slots = groups.allocate_slots(&id("a"), 8, 0, 0).unwrap();
    assert_eq!(slots.num_computed_tokens, 0);
    for blocks in &slots.group_block_ids {
        assert_eq!(blocks.len(), 2);
    }
    groups.finish(&id("a")).unwrap();
    for cache in groups.groups() {
        cache.check_invariants();
    }
}

#[test]
fn a_truncation_one_group_refuses_cuts_no_group() {
    let groups = pair((32, 32), (4, 4), 8);
    let tokens = prompt(32);
    add(&groups, "a", &tokens[..12]);
    groups.allocate_slots(&id("a"), 12, 0, 0).unwrap();
    groups.commit(&id("a"), 12).unwrap();
    // After a reset the request publishes nothing more, but its window still moves on:
    // the sliding group releases positions the full group keeps, unpublished.
    for cache in groups.groups() {
        cache.clear();
    }
    groups
        .append_tokens(&id("a"), &tokens[12..], false)
        .unwrap();
    groups.allocate_slots(&id("a"), 20, 0, 0).unwrap();
    groups.commit(&id("a"), 32).unwrap();
    // Cutting to 16 tokens: the full group would (its blocks from 16 on are its own), the
    // sliding group would not (position 16 reads from 9 on, released).
    assert_eq!(groups.groups()[FULL].check_truncate(&id("a"), 16), Ok(()));
    let refused = groups.truncate(&id("a"), 16);
    assert!(
        matches!(&refused, Err(CacheError::InKvGroup { group: SLIDING, error })
            if matches!(**error, CacheError::InvalidInput(_))),
        "{refused:?}"
    );
    for cache in groups.groups() {
        assert_eq!(cache.num_tokens(&id("a")), Ok(32));
    }
    assert_eq!(
        groups.groups()[FULL].block_table(&id("a")).unwrap().len(),
        8
    );
    // A cut both accept (position 31 reads from 24 on) goes through in both.
    groups.truncate(&id("a"), 31).unwrap();
    for cache in groups.groups() {
        assert_eq!(cache.num_tokens(&id("a")), Ok(31));
    }
    groups.finish(&id("a")).unwrap();
}

#[test]
fn decode_steps_take_new_blocks_only_at_block_boundaries() {
    let groups = pair((32, 32), (4, 4), 6);
    add(&groups, "a", &prompt(10));
    groups.allocate_slots(&id("a"), 10, 0, 0).unwrap();
    groups.commit(&id("a"), 10).unwrap();
    for step in 0..6 {
        let position = 10 + step;
        groups.append_tokens(&id("a"), &[1], false).unwrap();
        let slots = groups.allocate_slots(&id("a"), 1, 0, 0).unwrap();
        assert_eq!(slots.num_computed_tokens, position);
        let new_blocks = usize::from(position % 4 == 0);
        for blocks in &slots.group_block_ids {
            assert_eq!(blocks.len(), new_blocks, "step at {position}");
        }
        groups.commit(&id("a"), position + 1).unwrap();
    }
    assert_eq!(groups.num_computed_tokens(&id("a")), Ok(16));
    let tables = groups.block_tables(&id("a")).unwrap();
    let null = groups.groups()[SLIDING].null_block().unwrap();
    // At 16 the window (6) reads from 11 on: positions 0 and 1 are released.
    assert_eq!(tables[SLIDING][..2], [null, null]);
    assert_eq!(tables[FULL].len(), 4);
    groups.finish(&id("a")).unwrap();
    for cache in groups.groups() {
        cache.check_invariants();
        assert_eq!(cache.stats().blocks_in_use, 0);
    }
}

#[test]
fn add_request_is_all_or_nothing_and_finish_reaches_every_group() {
    let groups = pair((8, 8), (4, 4), 8);
    // Live in the sliding group alone: adding it to both is refused, and the full group
    // is rolled back.
    groups.groups()[SLIDING]
        .add_request(id("a"), prompt(4), b"", RequestExtras::default(), 0)
        .unwrap();
    let refused = groups.add_request(id("a"), prompt(4), b"", RequestExtras::default(), 0);
    assert!(matches!(refused, Err(CacheError::DuplicateRequest(_))));
    assert!(groups.groups()[FULL].num_tokens(&id("a")).is_err());
    // Finishing it reports the full group's refusal, and still finishes the sliding group.
    assert!(matches!(
        groups.finish(&id("a")),
        Err(CacheError::UnknownRequest(_))
    ));
    assert!(groups.groups()[SLIDING].num_tokens(&id("a")).is_err());
}

#[test]
fn a_preempted_request_agrees_again() {
    let groups = pair((16, 16), (4, 4), 8);
    let tokens = prompt(20);
    add(&groups, "a", &tokens);
    groups.allocate_slots(&id("a"), 20, 0, 0).unwrap();
    groups.commit(&id("a"), 20).unwrap();
    groups.preempt(&id("a")).unwrap();
    assert_eq!(groups.block_tables(&id("a")).unwrap(), [vec![], vec![]]);
    // Its committed blocks stay cached in both groups: a full hit recomputes the last one.
    assert_eq!(groups.start_position(&id("a")), Ok(16));
    let slots = groups.allocate_slots(&id("a"), 4, 0, 0).unwrap();
    assert!(slots.full_hit);
    assert_eq!(slots.num_cached_tokens, 16);
    groups.finish(&id("a")).unwrap();
    assert!(matches!(
        groups.start_position(&id("a")),
        Err(CacheError::UnknownRequest(_))
    ));
}

/// Issue 20, item 1: a commit one group refuses publishes in no group. Block sizes 8 and 4, 4
/// tokens allocated: group 0 holds 8 slots, group 1 four. `commit(8)` used to publish group
/// 0's block 0 with positions 4-7 never written before group 1 refused it.
#[test]
fn a_commit_one_group_refuses_publishes_in_no_group() {
    let groups = KvGroups::new(vec![cache(8, 8, None, 0), cache(8, 4, None, 1)]).unwrap();
    let tokens = prompt(16);
    add(&groups, "a", &tokens);
    groups.allocate_slots(&id("a"), 4, 0, 0).unwrap();
    let before: Vec<_> = groups.groups().iter().map(|c| c.stats()).collect();
    let refused = groups.commit(&id("a"), 8).unwrap_err();
    assert!(
        matches!(&refused, CacheError::InKvGroup { group: 1, error } if matches!(**error, CacheError::InvalidInput(_))),
        "{refused:?}"
    );
    let after: Vec<_> = groups.groups().iter().map(|c| c.stats()).collect();
    assert_eq!(after, before);
    assert_eq!(groups.num_computed_tokens(&id("a")).unwrap(), 0);
    // A later request with the same 8 tokens finds nothing cached in either group.
    add(&groups, "b", &tokens[..9]);
    assert_eq!(groups.start_position(&id("b")).unwrap(), 0);
    // The commit the slots allow is accepted everywhere.
    assert_eq!(groups.commit(&id("a"), 4).unwrap(), 0);
    for cache in groups.groups() {
        cache.check_invariants();
    }
}

/// Issue 20, item 13, for groups: a hit that grew after `start_position` is cut back, in every
/// group alike, so the tokens asked for fit.
#[test]
fn a_hit_that_grew_is_cut_back_alike_in_every_group() {
    let groups = pair((16, 16), (4, 4), 8);
    let tokens = prompt(14);
    add(&groups, "late", &tokens);
    assert_eq!(groups.start_position(&id("late")).unwrap(), 0);
    add(&groups, "first", &tokens);
    groups.allocate_slots(&id("first"), 14, 0, 0).unwrap();
    groups.commit(&id("first"), 14).unwrap();
    assert_eq!(groups.start_position(&id("late")).unwrap(), 12);
    // The scheduler asked for 13 tokens from 0: they fit from position 0 only.
    let slots = groups.allocate_slots(&id("late"), 13, 0, 0).unwrap();
    assert_eq!(slots.num_computed_tokens, 0);
    assert_eq!(slots.num_cached_tokens, 0);
    for cache in groups.groups() {
        cache.check_invariants();
    }
    // More tokens than the request has is still refused, by name.
    add(&groups, "short", &tokens[..4]);
    let refused = groups.allocate_slots(&id("short"), 5, 0, 0).unwrap_err();
    assert!(
        refused.to_string().contains("num_new_tokens 5"),
        "{refused}"
    );
}

/// With one block size the check pass is skipped: the first group refuses what every group
/// would, before anything changed.
#[test]
fn with_one_block_size_a_refused_commit_changes_no_group() {
    let groups = pair((16, 16), (4, 4), 8);
    add(&groups, "a", &prompt(16));
    groups.allocate_slots(&id("a"), 4, 0, 0).unwrap();
    let before: Vec<_> = groups.groups().iter().map(|c| c.stats()).collect();
    let refused = groups.commit(&id("a"), 8).unwrap_err();
    assert!(
        matches!(&refused, CacheError::InKvGroup { group: 0, error } if matches!(**error, CacheError::InvalidInput(_))),
        "{refused:?}"
    );
    let after: Vec<_> = groups.groups().iter().map(|c| c.stats()).collect();
    assert_eq!(after, before);
    assert_eq!(groups.commit(&id("a"), 4).unwrap(), 1);
}

#[test]
fn release_out_of_window_reaches_the_explicit_sliding_groups_or_none() {
    let explicit = |num_blocks, window| {
        let config = CacheConfig {
            sliding_window: window,
            window_release: if window.is_some() {
                WindowRelease::Explicit
            } else {
                WindowRelease::OnCommit
            },
            ..CacheConfig::new(num_blocks, 4)
        };
        Arc::new(PrefixCache::new(config, context_fingerprint(&[0])).expect("a valid config"))
    };
    let groups = KvGroups::new(vec![explicit(16, None), explicit(16, Some(8))]).unwrap();
    let r = id("r");
    groups
        .add_request(r.clone(), prompt(20), b"", RequestExtras::default(), 0)
        .unwrap();
    groups.allocate_slots(&r, 20, 0, 0).unwrap();
    groups.commit(&r, 20).unwrap();
    let null = groups.groups()[SLIDING].null_block().unwrap();
    assert!(!groups.block_tables(&r).unwrap()[SLIDING].contains(&null));
    assert_eq!(groups.release_out_of_window(&r, 20), Ok(3));
    let tables = groups.block_tables(&r).unwrap();
    assert!(!tables[FULL].is_empty() && tables[FULL].len() == 5);
    assert_eq!(&tables[SLIDING][..3], &[null; 3]);
    groups.finish(&r).unwrap();
    for cache in groups.groups() {
        cache.check_invariants();
    }
    // A sliding group that releases on commit: refused before any group changes.
    let mixed = pair((16, 16), (4, 4), 8);
    mixed
        .add_request(r.clone(), prompt(20), b"", RequestExtras::default(), 0)
        .unwrap();
    let err = mixed.release_out_of_window(&r, 0).unwrap_err();
    assert!(
        matches!(err, CacheError::InKvGroup { group: SLIDING, .. }),
        "{err}"
    );
}
