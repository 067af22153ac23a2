//! The table's tests: unit tests, property tests against plain models and threads racing the
//! writer.
//!
//! size: one protocol (the slots' sequence locks, the index, the links and their keys) whose
//! tests share its helpers and models; split by kind they would repeat them.

use std::hash::BuildHasher;

use super::*;
use crate::key::BlockKey;

fn entry(id: u64, block: BlockId, token: u32) -> Entry {
    Entry {
        id,
        block,
        parent: Parent::Entry(id + 1000),
        tokens: SmallVec::from_slice(&[token, token + 1]),
        extras: if token.is_multiple_of(3) {
            vec![token as u8; 3].into_boxed_slice()
        } else {
            Box::default()
        },
    }
}

#[test]
fn removals_shift_back_and_keep_every_other_entry_reachable() {
    // Four-bit keys on a 64-block table: long probe runs of colliding index hashes, then
    // random removals and refills, checked against a plain map after every step.
    let table = Table::new(64, 2).unwrap();
    let mut model: std::collections::HashMap<u128, Entry> = Default::default();
    let mut next_id = 1;
    let mut state = 12345u64;
    for step in 0..4000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let block = (state % 64) as BlockId;
        let published = model
            .iter()
            .find(|(_, e)| e.block == block)
            .map(|(k, _)| *k);
        if let Some(key) = published {
            table.remove(block);
            model.remove(&key);
        } else {
            let key = u128::from(state >> 60) << 124 | u128::from(step as u64);
            let e = entry(next_id, block, step);
            next_id += 1;
            if model.contains_key(&key) {
                continue;
            }
            let anchor = e.anchor(TableKey(key));
            assert_eq!(
                table.insert(TableKey(key), &e.as_new(), None),
                Insertion::Inserted(anchor)
            );
            // The key taken: the same content (from another block) verifies in place and
            // writes nothing; other tokens, another parent or other extras are a collision.
            let mut again = e.as_new();
            again.block = (block + 1) % 64;
            assert_eq!(
                table.insert(TableKey(key), &again, None),
                Insertion::Present(anchor)
            );
            let other_tokens = [e.tokens[0], e.tokens[1] + 1];
            for other in [
                NewEntry {
                    tokens: &other_tokens,
                    ..again
                },
                NewEntry {
                    parent: Parent::Entry(e.id + 2000),
                    ..again
                },
                NewEntry {
                    extras: b"x",
                    ..again
                },
            ] {
                assert_eq!(
                    table.insert(TableKey(key), &other, None),
                    Insertion::Collision
                );
            }
            model.insert(key, e);
        }
        assert_eq!(table.len(), model.len());
        // The writer's per-block view (the cache keeps no other copy of it).
        for block in 0..64 {
            let expected = model
                .iter()
                .find(|(_, e)| e.block == block)
                .map(|(&key, e)| e.anchor(TableKey(key)));
            assert_eq!(table.published(block), expected, "block {block}");
        }
        for (&key, e) in &model {
            let got = table
                .get(&TableKey(key))
                .expect("published entry reachable");
            assert_eq!((got.id, got.block, got.parent), (e.id, e.block, e.parent));
            assert_eq!((&got.tokens, &got.extras), (&e.tokens, &e.extras));
            assert!(table
                .get_verified(&TableKey(key), &e.parent, &e.tokens, &e.extras)
                .is_some());
            assert!(table
                .get_verified(&TableKey(key), &e.parent, &[7, 7], &e.extras)
                .is_none());
        }
    }
}

#[test]
fn readers_racing_the_writer_never_see_a_torn_or_wrong_entry() {
    // Every entry's tokens are derived from its id, so a torn snapshot would not match.
    let table = std::sync::Arc::new(Table::new(32, 4).unwrap());
    let key_of = |id: u64| TableKey(u128::from(id % 48) << 122);
    let tokens_of = |id: u64| [id as u32, (id >> 1) as u32, 3 * id as u32, !(id as u32)];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Readers that have found an entry: the writer goes on until both have (a release build
    // can finish its steps before a reader thread first runs).
    let found = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (table, stop, found) = (table.clone(), stop.clone(), found.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for slot in 0..48u64 {
                        // A lookup walk's prefetch reads a word and a slot the writer may be
                        // moving or rewriting: it must never fault or change an answer.
                        table.prefetch_entry(&key_of(slot));
                        if let Some(e) = table.get(&key_of(slot)) {
                            assert_eq!(key_of(e.id), key_of(slot));
                            assert_eq!(&e.tokens[..], &tokens_of(e.id)[..]);
                            assert_eq!(e.parent, Parent::Entry(e.id ^ 1));
                            if seen == 0 {
                                found.fetch_add(1, Ordering::Relaxed);
                            }
                            seen += 1;
                        }
                    }
                }
                seen
            })
        })
        .collect();
    let mut owner: Vec<Option<u64>> = vec![None; 32];
    let mut live = std::collections::HashSet::new();
    // From 2: `id ^ 1` must name a real entry, and entry id 0 is no entry (a slot stores
    // a parent of 0 as "a root"), so id 1 would read back with a root parent.
    for id in 2u64.. {
        if id >= 200_000 && found.load(Ordering::Relaxed) == 2 {
            break;
        }
        // Bounded: readers that never find an entry fail the test instead of hanging it.
        assert!(
            id < 20_000_000,
            "a reader found no entry in 20,000,000 steps"
        );
        let block = (id % 32) as BlockId;
        if let Some(old) = owner[block as usize].take() {
            table.prefetch_removal(block);
            assert_eq!(
                table.published(block),
                Some(Anchor {
                    id: old,
                    block,
                    key: key_of(old)
                })
            );
            table.remove(block);
            assert_eq!(table.published(block), None);
            live.remove(&(old % 48));
        }
        if live.insert(id % 48) {
            let e = Entry {
                id,
                block,
                parent: Parent::Entry(id ^ 1),
                tokens: SmallVec::from_slice(&tokens_of(id)),
                extras: Box::default(),
            };
            assert!(matches!(
                table.insert(key_of(id), &e.as_new(), None),
                Insertion::Inserted(_)
            ));
            owner[block as usize] = Some(id);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }
}

#[test]
fn truncated_keys_still_spread_over_slots() {
    // 6-bit keys, as the stress test uses: every key's low 64 bits are zero.
    let low_bits: std::collections::HashSet<u64> = (0..64u128)
        .map(|k| BuildKeyHasher.hash_one(TableKey(k << 122)) & 63)
        .collect();
    assert_eq!(low_bits.len(), 64, "each 6-bit key gets its own slot of 64");
}

#[test]
fn a_moved_entry_keeps_its_id_and_frees_its_old_slot() {
    let table = Table::new(8, 2).unwrap();
    let key = TableKey(42 << 100);
    assert!(matches!(
        table.insert(key, &entry(5, 1, 7).as_new(), None),
        Insertion::Inserted(_)
    ));
    assert!(table.move_entry(1, 6));
    let got = table.get(&key).unwrap();
    assert_eq!((got.id, got.block, got.parent), (5, 6, Parent::Entry(1005)));
    assert_eq!(&got.tokens[..], &[7, 8]);
    // The old block holds nothing: a new entry may take it; an empty block does not move.
    assert!(matches!(
        table.insert(TableKey(43 << 100), &entry(9, 1, 1).as_new(), None),
        Insertion::Inserted(_)
    ));
    assert!(!table.move_entry(2, 3));
    assert_eq!(table.len(), 2);
    // And back (the sequence lock, not the id, tells a reader the slot was rewritten).
    table.remove(1);
    assert!(table.move_entry(6, 1));
    assert_eq!(table.get(&key).unwrap().block, 1);
}

#[test]
fn readers_racing_moves_never_see_a_torn_or_wrong_entry() {
    // Entries move between blocks and back, and blocks are refilled with other entries in
    // between (an entry id seen again in the same slot), while readers check every snapshot.
    const BLOCKS: u64 = 16;
    let table = std::sync::Arc::new(Table::new(BLOCKS as usize, 4).unwrap());
    let key_of = |id: u64| TableKey(u128::from(id % 24 + 1) << 100);
    let tokens_of = |id: u64| [id as u32, (id >> 1) as u32, 3 * id as u32, !(id as u32)];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Readers that have found an entry: the writer goes on until both have (a release build
    // can finish its steps before a reader thread first runs).
    let found = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (table, stop, found) = (table.clone(), stop.clone(), found.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for k in 0..24u64 {
                        if let Some(e) = table.get(&key_of(k)) {
                            assert_eq!(key_of(e.id), key_of(k));
                            assert_eq!(&e.tokens[..], &tokens_of(e.id)[..]);
                            assert_eq!(e.parent, Parent::Entry(e.id ^ 1));
                            if seen == 0 {
                                found.fetch_add(1, Ordering::Relaxed);
                            }
                            seen += 1;
                        }
                    }
                }
                seen
            })
        })
        .collect();
    // owner[block] = the entry id it holds; ids from 2 (see the test above).
    let mut owner: Vec<Option<u64>> = vec![None; BLOCKS as usize];
    let mut live = std::collections::HashSet::new();
    let mut state = 99u64;
    let mut next_id = 2u64;
    for step in 0u64.. {
        if step >= 200_000 && found.load(Ordering::Relaxed) == 2 {
            break;
        }
        // Bounded: readers that never find an entry fail the test instead of hanging it.
        assert!(
            step < 20_000_000,
            "a reader found no entry in 20,000,000 steps"
        );
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let block = (state % BLOCKS) as usize;
        let other = ((state >> 8) % BLOCKS) as usize;
        match (owner[block], owner[other]) {
            (Some(_), None) if state & 1 == 0 => {
                assert!(table.move_entry(block as BlockId, other as BlockId));
                owner[other] = owner[block].take();
            }
            (Some(id), _) => {
                table.remove(block as BlockId);
                live.remove(&(id % 24));
                owner[block] = None;
            }
            (None, _) => {
                let id = next_id;
                next_id += 1;
                if live.insert(id % 24) {
                    let e = Entry {
                        id,
                        block: block as BlockId,
                        parent: Parent::Entry(id ^ 1),
                        tokens: SmallVec::from_slice(&tokens_of(id)),
                        extras: Box::default(),
                    };
                    assert!(matches!(
                        table.insert(key_of(id), &e.as_new(), None),
                        Insertion::Inserted(_)
                    ));
                    owner[block] = Some(id);
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }
}

/// A full-width key for content `token` after the entry keyed `parent` (0: a root), so equal
/// content always takes the same key and different content never collides.
fn chained_key(parent: u128, token: u32) -> TableKey {
    let hash = |seed: u64| {
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(&(seed, parent, token), &mut h);
        std::hash::Hasher::finish(&h)
    };
    TableKey(u128::from(hash(1)) << 64 | u128::from(hash(2)))
}

#[derive(Clone, Debug)]
enum RunOp {
    /// Publish content `token` under the live entry picked by the index (or as a root), into
    /// the free block picked by the other index.
    Publish(Option<usize>, u32, usize),
    /// Remove the entry of the live block picked, whatever its children (vLLM's free order
    /// can drop a parent before its child).
    Remove(usize),
    /// Move the entry of the live block picked into the free block picked.
    Move(usize, usize),
}

fn run_op() -> impl proptest::strategy::Strategy<Value = RunOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (proptest::option::weighted(0.8, 0..64usize), 0..3u32, 0..64usize)
            .prop_map(|(p, t, b)| RunOp::Publish(p, t, b)),
        2 => (0..64usize).prop_map(RunOp::Remove),
        1 => (0..64usize, 0..64usize).prop_map(|(f, t)| RunOp::Move(f, t)),
    ]
}

/// What the model knows of one published entry.
#[derive(Clone, Debug)]
struct Published {
    id: u64,
    key: TableKey,
    parent: Parent,
    tokens: [u32; 2],
}

proptest::proptest! {
    /// Runs of linked children against a plain model: publishing (a first child linked, later
    /// siblings indexed, an existing content found wherever it sits), removals in any order,
    /// moves; after every step every live entry whose parent lives is found from that parent
    /// (`get_verified_child`) and reachable, every removed one is not, and a content published
    /// again is found `Present`.
    #[test]
    fn runs_of_linked_children_match_a_plain_model(ops in proptest::collection::vec(run_op(), 1..120)) {
        const BLOCKS: usize = 12;
        let table = Table::new(BLOCKS, 2).unwrap();
        let mut held: Vec<Option<Published>> = vec![None; BLOCKS];
        let mut removed: Vec<Published> = Vec::new();
        let mut next_id = 1u64;
        let root = Parent::Root(BlockKey([7; 32]));
        let block_of = |held: &[Option<Published>], id: u64| {
            held.iter().position(|p| p.as_ref().is_some_and(|p| p.id == id))
        };
        for op in ops {
            let live: Vec<usize> = (0..BLOCKS).filter(|&b| held[b].is_some()).collect();
            let free: Vec<usize> = (0..BLOCKS).filter(|&b| held[b].is_none()).collect();
            match op {
                RunOp::Publish(parent, token, block) => {
                    let Some(&block) = free.get(block % free.len().max(1)) else { continue };
                    let (parent, parent_key, parent_block) = match parent {
                        Some(p) if !live.is_empty() => {
                            let b = live[p % live.len()];
                            let p = held[b].as_ref().unwrap();
                            (Parent::Entry(p.id), p.key.0, Some(b as BlockId))
                        }
                        _ => (root, 0, None),
                    };
                    let key = chained_key(parent_key, token);
                    let tokens = [token, parent_key as u32];
                    let new = NewEntry { id: next_id, block: block as BlockId, parent, tokens: &tokens, extras: &[] };
                    let existing = held.iter().flatten().find(|p| p.key == key && p.parent == parent).cloned();
                    // The same key under a dead parent entry (a child outliving its parent, then
                    // the parent's content published again): other content, as far as the
                    // table can tell. An index probe meets it as a collision; a linked child
                    // is published without that probe.
                    let orphan = held.iter().flatten().any(|p| p.key == key && p.parent != parent);
                    let got = table.insert(key, &new, parent_block);
                    match existing {
                        Some(p) => {
                            let b = block_of(&held, p.id).unwrap() as BlockId;
                            proptest::prop_assert_eq!(got, Insertion::Present(Anchor { id: p.id, block: b, key }));
                        }
                        None if orphan && got == Insertion::Collision => {}
                        None => {
                            proptest::prop_assert_eq!(got, Insertion::Inserted(Anchor { id: next_id, block: block as BlockId, key }));
                            held[block] = Some(Published { id: next_id, key, parent, tokens });
                            next_id += 1;
                        }
                    }
                }
                RunOp::Remove(pick) => {
                    let Some(&block) = live.get(pick % live.len().max(1)) else { continue };
                    table.remove(block as BlockId);
                    removed.push(held[block].take().unwrap());
                }
                RunOp::Move(from, to) => {
                    let (Some(&from), Some(&to)) = (live.get(from % live.len().max(1)), free.get(to % free.len().max(1))) else { continue };
                    proptest::prop_assert!(table.move_entry(from as BlockId, to as BlockId));
                    held[to] = held[from].take();
                }
            }
            proptest::prop_assert_eq!(table.len(), held.iter().flatten().count());
            for block in 0..BLOCKS {
                let expected = held[block].as_ref().map(|p| Anchor { id: p.id, block: block as BlockId, key: p.key });
                proptest::prop_assert_eq!(table.published(block as BlockId), expected);
                let Some(p) = &held[block] else { continue };
                let found = match p.parent {
                    Parent::Root(_) => Some(table.get_verified(&p.key, &p.parent, &p.tokens, &[])),
                    Parent::Entry(pid) => block_of(&held, pid).map(|pb| {
                        let parent = Anchor { id: pid, block: pb as BlockId, key: held[pb].as_ref().unwrap().key };
                        table.get_verified_child(&parent, &p.key, &p.tokens, &[])
                    }),
                };
                if let Some(found) = found {
                    // Its parent lives (or it is a root): a lookup must reach it.
                    let expected = Some(Anchor { id: p.id, block: block as BlockId, key: p.key });
                    proptest::prop_assert_eq!(found, expected);
                    proptest::prop_assert!(table.reachable(block as BlockId));
                    if let Parent::Entry(pid) = p.parent {
                        // Without a key: its parent's linked child, with its key, or nothing.
                        let pb = block_of(&held, pid).unwrap();
                        let parent = Anchor { id: pid, block: pb as BlockId, key: held[pb].as_ref().unwrap().key };
                        let linked = table.get_linked_child(&parent, &p.tokens, &[]);
                        if table.child_of(pb as BlockId) == Some(block as BlockId) {
                            proptest::prop_assert_eq!(linked, expected);
                        } else {
                            proptest::prop_assert_eq!(linked, None);
                        }
                    }
                }
                let entry = table.entry(block as BlockId).unwrap();
                proptest::prop_assert_eq!((entry.id, entry.parent), (p.id, p.parent));
            }
            for gone in &removed {
                if let Parent::Entry(pid) = gone.parent {
                    if let Some(pb) = block_of(&held, pid) {
                        let parent = Anchor { id: pid, block: pb as BlockId, key: held[pb].as_ref().unwrap().key };
                        let again = held.iter().flatten().any(|p| p.key == gone.key && p.parent == gone.parent);
                        proptest::prop_assert_eq!(
                            table.get_verified_child(&parent, &gone.key, &gone.tokens, &[]).is_some(),
                            again
                        );
                        // Without a key, a removed content is found only where it lives again.
                        if let Some(linked) = table.get_linked_child(&parent, &gone.tokens, &[]) {
                            proptest::prop_assert!(again);
                            proptest::prop_assert_eq!(linked.key, gone.key);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_link_is_followed_only_from_the_parent_entry_it_was_published_under() {
    // A reader holds the anchor of entry 1 in block 0; meanwhile 1 and its linked child go, and
    // block 0 takes other content (entry 3) whose linked child (4) has the child's old tokens.
    // Entry 4's KV was computed after other tokens: reached from the old anchor it would be a
    // wrong hit, and only the parent id check stands in the way (the tokens match, and
    // `get_linked_child` compares no key).
    let table = Table::new(4, 2).unwrap();
    let root = Parent::Root(BlockKey([7; 32]));
    let publish = |id: u64, block: BlockId, parent: Parent, tokens: &[u32], key: u128| {
        let new = NewEntry {
            id,
            block,
            parent,
            tokens,
            extras: &[],
        };
        let parent_block = matches!(parent, Parent::Entry(_)).then_some(0);
        match table.insert(TableKey(key), &new, parent_block) {
            Insertion::Inserted(anchor) => anchor,
            other => panic!("entry {id} not inserted: {other:?}"),
        }
    };
    let old_parent = publish(1, 0, root, &[1, 2], 10);
    let child = publish(2, 1, Parent::Entry(1), &[5, 6], 11);
    assert_eq!(table.child_of(0), Some(1));
    assert_eq!(
        table.get_linked_child(&old_parent, &[5, 6], &[]),
        Some(child)
    );
    table.remove(1);
    table.remove(0);
    let new_parent = publish(3, 0, root, &[8, 9], 12);
    let other_child = publish(4, 1, Parent::Entry(3), &[5, 6], 13);
    assert_eq!(table.child_of(0), Some(1));
    assert_eq!(table.get_linked_child(&old_parent, &[5, 6], &[]), None);
    assert_eq!(
        table.get_verified_child(&old_parent, &TableKey(13), &[5, 6], &[]),
        None
    );
    assert_eq!(
        table.get_linked_child(&new_parent, &[5, 6], &[]),
        Some(other_child)
    );
    // Other tokens or other extras under the right parent: no entry either.
    assert_eq!(table.get_linked_child(&new_parent, &[5, 7], &[]), None);
    assert_eq!(table.get_linked_child(&new_parent, &[5, 6], &[1]), None);
}

#[test]
fn readers_following_links_racing_unlink_relink_and_moves_never_see_a_wrong_entry() {
    // Entry n's parent is entry n - 1 and its content is derived from n; keys repeat every 24
    // ids, so a link or index word may name another entry under the same key, which only
    // verification keeps out. The writer links, unlinks, relinks and moves while readers ask
    // for the child of every (parent id, block) they can guess.
    const BLOCKS: u64 = 16;
    let table = std::sync::Arc::new(Table::new(BLOCKS as usize, 4).unwrap());
    let key_of = |id: u64| TableKey(u128::from(id % 24 + 1) << 100 | 1);
    let tokens_of = |id: u64| [id as u32, (id >> 1) as u32, 3 * id as u32, !(id as u32)];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let newest = std::sync::Arc::new(AtomicU64::new(2));
    // Readers that have found an entry: the writer goes on until both have (on a loaded
    // machine a reader may not run at all during the first 200,000 steps).
    let found = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (table, stop, newest, found_any) =
                (table.clone(), stop.clone(), newest.clone(), found.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let top = newest.load(Ordering::Relaxed);
                    for parent in top.saturating_sub(40).max(1)..top {
                        for block in 0..BLOCKS as BlockId {
                            let guess = Anchor {
                                id: parent,
                                block,
                                key: key_of(parent),
                            };
                            let child = parent + 1;
                            if let Some(found) = table.get_verified_child(
                                &guess,
                                &key_of(child),
                                &tokens_of(child),
                                &[],
                            ) {
                                assert_eq!(
                                    found.id, child,
                                    "only entry {child} has this parent and these tokens"
                                );
                                assert_eq!(found.key, key_of(child));
                                seen += 1;
                                if seen == 1 {
                                    found_any.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            // The same without a key: the slot's own key comes with it, or
                            // none (published without, not filled yet), never a torn one.
                            if let Some(found) =
                                table.get_linked_child(&guess, &tokens_of(child), &[])
                            {
                                assert_eq!(found.id, child, "entry {child} alone has this content");
                                assert!(
                                    found.key == key_of(child) || found.key == TableKey::UNKNOWN,
                                    "key {:?} of entry {child}",
                                    found.key
                                );
                            }
                        }
                    }
                }
                seen
            })
        })
        .collect();
    let mut owner: Vec<Option<u64>> = vec![None; BLOCKS as usize];
    let block_of = |owner: &[Option<u64>], id: u64| owner.iter().position(|&o| o == Some(id));
    let mut state = 7u64;
    let mut next_id = 2u64;
    let mut step = 0u64;
    while step < 200_000 || (found.load(Ordering::Relaxed) < 2 && step < 50_000_000) {
        step += 1;
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let block = (state % BLOCKS) as usize;
        let other = ((state >> 8) % BLOCKS) as usize;
        match (owner[block], owner[other]) {
            (Some(id), _) if state & 6 == 2 => {
                // A key left by a request that hashed it (a no-op on a slot that holds one).
                let anchor = Anchor {
                    id,
                    block: block as BlockId,
                    key: TableKey::UNKNOWN,
                };
                table.fill_key(&anchor, key_of(id));
            }
            (Some(_), None) if state & 1 == 0 => {
                assert!(table.move_entry(block as BlockId, other as BlockId));
                owner[other] = owner[block].take();
            }
            (Some(_), _) => {
                table.remove(block as BlockId);
                owner[block] = None;
            }
            (None, _) => {
                let id = next_id;
                // Its parent's block, if the parent lives: then it is linked (or indexed as a
                // sibling); else indexed with an entry parent nobody holds.
                let parent_block = block_of(&owner, id - 1).map(|b| b as BlockId);
                let e = NewEntry {
                    id,
                    block: block as BlockId,
                    parent: Parent::Entry(id - 1),
                    tokens: &tokens_of(id),
                    extras: &[],
                };
                // A first, linked child may be published without its key.
                let key = if state & 8 == 0 && table.takes_first_child(&e.parent, parent_block) {
                    TableKey::UNKNOWN
                } else {
                    key_of(id)
                };
                if matches!(table.insert(key, &e, parent_block), Insertion::Inserted(_)) {
                    owner[block] = Some(id);
                }
                next_id += 1;
                newest.store(next_id, Ordering::Relaxed);
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().unwrap() > 0);
    }
}

#[test]
fn every_token_of_a_row_is_written_and_verified() {
    // 16-token rows take a fixed-length path in `write` and `row_equals`, other sizes the
    // general one: both must store every token, and a difference at any one position must
    // make a verification fail (an unrolled path that skipped a position would pass here).
    for block_size in [16usize, 3, 1, 4] {
        let table = Table::new(8, block_size).unwrap();
        // High bits set too: two tokens share a stored word (`pack`).
        let tokens: Vec<u32> = (0..block_size as u32)
            .map(|t| (7 * t + 1) | (t % 2) << 31)
            .collect();
        let parent = Parent::Root(BlockKey([9; 32]));
        let new = NewEntry {
            id: 1,
            block: 5,
            parent,
            tokens: &tokens,
            extras: &[],
        };
        let key = TableKey(0xABCD << 64 | 17);
        assert!(matches!(
            table.insert(key, &new, None),
            Insertion::Inserted(_)
        ));
        assert_eq!(table.entry(5).unwrap().tokens.as_slice(), &tokens[..]);
        assert!(table.get_verified(&key, &parent, &tokens, &[]).is_some());
        for position in 0..block_size {
            for flip in [1, 1 << 31] {
                let mut other = tokens.clone();
                other[position] ^= flip;
                assert!(
                    table.get_verified(&key, &parent, &other, &[]).is_none(),
                    "block size {block_size}: bit {flip:#x} of token {position} not compared"
                );
            }
        }
        assert!(table
            .get_verified(&key, &parent, &tokens[..block_size - 1], &[])
            .is_none());
    }
}

#[test]
fn slot_fits_one_cache_line_and_rows_start_on_one() {
    // A slot that grew past a line, or lost its alignment, would touch two lines per probe,
    // verify and publish again; a 16-token row off a line boundary would touch two as well
    // (PROFILE.md, issue 24, round 9).
    assert_eq!(std::mem::size_of::<Slot>(), LINE);
    assert_eq!(std::mem::align_of::<Slot>(), LINE);
    assert_eq!(std::mem::size_of::<Root>(), 32);
    for num_blocks in [1, 3, 1000, 70_000] {
        let table = Table::new(num_blocks, 16).unwrap();
        assert_eq!(std::ptr::from_ref(&table.slots[0]) as usize % LINE, 0);
        for block in [0, num_blocks / 2, num_blocks - 1] {
            let start = table.row_start(block as BlockId);
            let row = &table.tokens[start..start + table.row_words];
            assert_eq!(std::ptr::from_ref(&row[0]) as usize % LINE, 0);
        }
    }
}

/// What the side-array model knows of one published first block.
#[derive(Clone, Debug)]
struct WithRoot {
    id: u64,
    key: TableKey,
    root: BlockKey,
    extras: Vec<u8>,
}

#[derive(Clone, Debug)]
enum SideOp {
    /// Publish a first block with root `u8` and extras picked by `u8` (0: none) into the free
    /// block picked.
    Publish(u8, u8, usize),
    Remove(usize),
    Move(usize, usize),
}

fn side_op() -> impl proptest::strategy::Strategy<Value = SideOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..4u8, 0..3u8, 0..64usize).prop_map(|(r, e, b)| SideOp::Publish(r, e, b)),
        2 => (0..64usize).prop_map(SideOp::Remove),
        1 => (0..64usize, 0..64usize).prop_map(|(f, t)| SideOp::Move(f, t)),
    ]
}

proptest::proptest! {
    /// The root keys and extras live beside the slots, one per block (`Table::roots`,
    /// `Table::extras`): after any publishes, removals and moves, each live entry reads back
    /// and verifies with its own root and extras only, never another block's or a removed
    /// entry's left behind.
    #[test]
    fn each_entry_keeps_its_own_root_and_extras(ops in proptest::collection::vec(side_op(), 1..80)) {
        const BLOCKS: usize = 10;
        let table = Table::new(BLOCKS, 2).unwrap();
        let mut held: Vec<Option<WithRoot>> = vec![None; BLOCKS];
        let mut next_id = 1u64;
        let tokens = [5u32, 6];
        for op in ops {
            let live: Vec<usize> = (0..BLOCKS).filter(|&b| held[b].is_some()).collect();
            let free: Vec<usize> = (0..BLOCKS).filter(|&b| held[b].is_none()).collect();
            match op {
                SideOp::Publish(root, extras, block) => {
                    let Some(&block) = free.get(block % free.len().max(1)) else { continue };
                    let root = BlockKey([root + 1; 32]);
                    let extras = vec![extras; usize::from(extras)];
                    // A key per entry: every entry is new content.
                    let key = chained_key(u128::from(next_id), 0);
                    let new = NewEntry { id: next_id, block: block as BlockId, parent: Parent::Root(root), tokens: &tokens, extras: &extras };
                    proptest::prop_assert!(matches!(table.insert(key, &new, None), Insertion::Inserted(_)));
                    held[block] = Some(WithRoot { id: next_id, key, root, extras });
                    next_id += 1;
                }
                SideOp::Remove(pick) => {
                    let Some(&block) = live.get(pick % live.len().max(1)) else { continue };
                    table.remove(block as BlockId);
                    held[block] = None;
                }
                SideOp::Move(from, to) => {
                    let (Some(&from), Some(&to)) = (live.get(from % live.len().max(1)), free.get(to % free.len().max(1))) else { continue };
                    proptest::prop_assert!(table.move_entry(from as BlockId, to as BlockId));
                    held[to] = held[from].take();
                }
            }
            let every: Vec<&WithRoot> = held.iter().flatten().collect();
            for (block, held) in held.iter().enumerate() {
                let Some(p) = held else {
                    proptest::prop_assert!(table.entry(block as BlockId).is_none());
                    continue;
                };
                let entry = table.entry(block as BlockId).unwrap();
                proptest::prop_assert_eq!(entry.parent, Parent::Root(p.root));
                proptest::prop_assert_eq!(&*entry.extras, &p.extras[..]);
                let anchor = Anchor { id: p.id, block: block as BlockId, key: p.key };
                proptest::prop_assert_eq!(table.get_verified(&p.key, &Parent::Root(p.root), &tokens, &p.extras), Some(anchor));
                for other in &every {
                    if other.root != p.root {
                        proptest::prop_assert_eq!(table.get_verified(&p.key, &Parent::Root(other.root), &tokens, &p.extras), None);
                    }
                    if other.extras != p.extras {
                        proptest::prop_assert_eq!(table.get_verified(&p.key, &Parent::Root(p.root), &tokens, &other.extras), None);
                    }
                }
            }
        }
    }
}
