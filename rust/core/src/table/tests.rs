use std::hash::BuildHasher;

use super::*;

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
            table.remove(&TableKey(key));
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
                table.insert(TableKey(key), &e.as_new()),
                Insertion::Inserted(anchor)
            );
            // The key taken: the same content (from another block) verifies in place and
            // writes nothing; other tokens, another parent or other extras are a collision.
            let mut again = e.as_new();
            again.block = (block + 1) % 64;
            assert_eq!(
                table.insert(TableKey(key), &again),
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
                assert_eq!(table.insert(TableKey(key), &other), Insertion::Collision);
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
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (table, stop) = (table.clone(), stop.clone());
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
    for id in 2..200_000u64 {
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
            table.remove(&key_of(old));
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
                table.insert(key_of(id), &e.as_new()),
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
        table.insert(key, &entry(5, 1, 7).as_new()),
        Insertion::Inserted(_)
    ));
    assert!(table.move_entry(&key, 6));
    let got = table.get(&key).unwrap();
    assert_eq!((got.id, got.block, got.parent), (5, 6, Parent::Entry(1005)));
    assert_eq!(&got.tokens[..], &[7, 8]);
    // The old block holds nothing: a new entry may take it; an unknown key does not move.
    assert!(matches!(
        table.insert(TableKey(43 << 100), &entry(9, 1, 1).as_new()),
        Insertion::Inserted(_)
    ));
    assert!(!table.move_entry(&TableKey(44 << 100), 2));
    assert_eq!(table.len(), 2);
    // And back (the sequence lock, not the id, tells a reader the slot was rewritten).
    table.remove(&TableKey(43 << 100));
    assert!(table.move_entry(&key, 1));
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
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (table, stop) = (table.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut seen = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for k in 0..24u64 {
                        if let Some(e) = table.get(&key_of(k)) {
                            assert_eq!(key_of(e.id), key_of(k));
                            assert_eq!(&e.tokens[..], &tokens_of(e.id)[..]);
                            assert_eq!(e.parent, Parent::Entry(e.id ^ 1));
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
    for _ in 0..200_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let block = (state % BLOCKS) as usize;
        let other = ((state >> 8) % BLOCKS) as usize;
        match (owner[block], owner[other]) {
            (Some(id), None) if state & 1 == 0 => {
                assert!(table.move_entry(&key_of(id), other as BlockId));
                owner[other] = owner[block].take();
            }
            (Some(id), _) => {
                table.remove(&key_of(id));
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
                        table.insert(key_of(id), &e.as_new()),
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
