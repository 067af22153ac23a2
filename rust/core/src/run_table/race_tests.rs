//! Readers racing the run table's writer on real threads: every answer a reader gets (a match,
//! a `find`, a snapshot) is checked against the log of states the writer published.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::tests::{root, row, rows, BLOCK};
use super::{RunAllocator, RunParent, RunRef, RunTable, CHUNK};
use crate::pool::BlockId;

/// A run's blocks with the value each one's row holds.
type Blocks = Vec<(BlockId, u32)>;

/// One state a run had, logged by the writer.
#[derive(Clone)]
struct Logged {
    slot: u32,
    parent: RunParent,
    blocks: Vec<(BlockId, u32)>,
}

#[test]
fn readers_racing_the_writer_see_only_states_the_run_had() {
    // The writer extends, truncates, splits, replaces and removes runs as fast as it can, and
    // logs each state it publishes (id and length → parent, blocks and row values). Readers
    // match prompts cut from recent states against their slots, keeping every answer; once the
    // writer is done, each answer is checked against the full log: a run id and length the
    // writer published, its leading blocks exactly, the prompt's values on every matched block
    // and a mismatch right after (a torn read would show blocks of a freed chunk, rows of a
    // reused block, or a length beside another state's blocks).
    const BLOCKS: usize = 64;
    let table = Arc::new(RunTable::new(BLOCKS, BLOCK, 7).expect("small"));
    let recent: Arc<Mutex<Vec<Logged>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    // Answers kept by all readers: the writer goes on past its steps until there are enough
    // (a release build can finish them before a reader thread first runs).
    let answered = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..2u64)
        .map(|seed| {
            let (table, recent, done, answered) = (
                table.clone(),
                recent.clone(),
                done.clone(),
                answered.clone(),
            );
            std::thread::spawn(move || {
                let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let mut next = || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state
                };
                let mut answers = Vec::new();
                let mut snapshots = Vec::new();
                while !done.load(Ordering::Relaxed) && answers.len() < 400_000 {
                    let Some(target) = ({
                        let recent = recent.lock().expect("no panic holding it");
                        (!recent.is_empty()).then(|| recent[next() as usize % recent.len()].clone())
                    }) else {
                        continue;
                    };
                    for _ in 0..16 {
                        let mut values: Vec<u32> = target.blocks.iter().map(|b| b.1).collect();
                        values.truncate(1 + next() as usize % values.len());
                        let mut found = Vec::new();
                        if let Some(got) =
                            table.match_run(target.slot, &target.parent, &rows(&values), &mut found)
                        {
                            answers.push((target.parent, values.clone(), got, found));
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                        // The same prompt through the index, which the writer's removals
                        // shift meanwhile: a found run is checked as a match is.
                        let mut found = Vec::new();
                        let hash = table.hash_of(&target.parent, &row(values[0]));
                        if let Some((_, got)) =
                            table.find(hash, &target.parent, &rows(&values), &mut found)
                        {
                            answers.push((target.parent, values, got, found));
                        }
                        if let Some(snapshot) = table.snapshot(target.slot) {
                            snapshots.push(snapshot);
                        }
                    }
                }
                (answers, snapshots)
            })
        })
        .collect();
    let mut log: HashMap<(u64, u32), Vec<Logged>> = HashMap::new();
    let mut record = |run: RunRef, parent: RunParent, blocks: &[(BlockId, u32)]| {
        let logged = Logged {
            slot: run.slot,
            parent,
            blocks: blocks.to_vec(),
        };
        log.entry((run.id, blocks.len() as u32))
            .or_default()
            .push(logged.clone());
        let mut recent = recent.lock().expect("no panic holding it");
        if recent.len() >= 64 {
            recent.remove(0);
        }
        recent.push(logged);
    };
    let mut alloc = RunAllocator::new(&table);
    let mut free: Vec<BlockId> = (0..BLOCKS as BlockId).collect();
    let mut runs: Vec<(RunRef, RunParent, Blocks)> = Vec::new();
    let mut next_value = 1u32;
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for step in 0u64.. {
        if step >= 40_000 && answered.load(Ordering::Relaxed) >= 2_000 {
            break;
        }
        // Bounded: readers that never match fail the test instead of hanging it.
        assert!(
            step < 4_000_000,
            "the readers matched nothing in 4,000,000 steps"
        );
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let pick = (state >> 8) as usize;
        let len = 1 + (state >> 20) as usize % (2 * CHUNK + 3);
        match state % 6 {
            0 | 1 if !free.is_empty() => {
                let len = len.min(free.len());
                let blocks: Vec<(BlockId, u32)> = (0..len)
                    .map(|_| {
                        next_value += 1;
                        (free.pop().expect("len"), next_value)
                    })
                    .collect();
                let values: Vec<u32> = blocks.iter().map(|b| b.1).collect();
                let ids: Vec<BlockId> = blocks.iter().map(|b| b.0).collect();
                if runs.is_empty() || state.is_multiple_of(2) {
                    let parent = root((pick % 3) as u8);
                    let run = table.create(&mut alloc, parent, &ids, &rows(&values));
                    record(run, parent, &blocks);
                    runs.push((run, parent, blocks));
                } else {
                    let index = pick % runs.len();
                    let (run, parent, old) = &mut runs[index];
                    old.extend(blocks);
                    record(*run, *parent, old);
                    table.extend(&mut alloc, *run, &ids, &rows(&values));
                }
            }
            2 if !runs.is_empty() => {
                let index = pick % runs.len();
                let (run, parent, blocks) = &mut runs[index];
                if blocks.len() > 1 {
                    let keep = 1 + len % (blocks.len() - 1);
                    let cut = table.truncate(&mut alloc, *run, keep);
                    free.extend(blocks.drain(keep..).map(|b| b.0));
                    *run = cut;
                    record(cut, *parent, blocks);
                }
            }
            3 if !runs.is_empty() => {
                let index = pick % runs.len();
                let (run, _, blocks) = &mut runs[index];
                if blocks.len() > 1 {
                    let at = 1 + len % (blocks.len() - 1);
                    let (head, tail) = table.split(&mut alloc, *run, at);
                    *run = head;
                    let tail_blocks = blocks.split_off(at);
                    let (parent, head_blocks) = (runs[index].1, runs[index].2.clone());
                    record(head, parent, &head_blocks);
                    let tail_parent = RunParent::Run {
                        id: head.id,
                        len: at as u32,
                    };
                    record(tail, tail_parent, &tail_blocks);
                    runs.push((tail, tail_parent, tail_blocks));
                }
            }
            4 if !runs.is_empty() && !free.is_empty() => {
                let index = pick % runs.len();
                let (run, parent, blocks) = &mut runs[index];
                let at = len % blocks.len();
                let block = free.pop().expect("not empty");
                let mut after = blocks.clone();
                after[at].0 = block;
                record(*run, *parent, &after);
                let old = table.replace(*run, at, block);
                free.push(old);
                *blocks = after;
            }
            5 if !runs.is_empty() => {
                let (run, _, blocks) = runs.swap_remove(pick % runs.len());
                table.remove(&mut alloc, run);
                free.extend(blocks.iter().map(|b| b.0));
            }
            _ => {}
        }
    }
    done.store(true, Ordering::Relaxed);
    let (mut matches, mut blocks_checked, mut snapshots_checked) = (0usize, 0usize, 0usize);
    for reader in readers {
        let (answers, snapshots) = reader.join().expect("no reader panicked");
        for snapshot in snapshots {
            let states = log
                .get(&(snapshot.id, snapshot.blocks.len() as u32))
                .expect("a published id and length");
            assert!(
                states.iter().any(|state| state.parent == snapshot.parent
                    && state
                        .blocks
                        .iter()
                        .map(|b| b.0)
                        .eq(snapshot.blocks.iter().copied())),
                "a snapshot no published state explains: {snapshot:?}"
            );
            snapshots_checked += 1;
        }
        for (parent, values, got, found) in answers {
            let states = log
                .get(&(got.id, got.len))
                .expect("a published id and length");
            let agrees = states.iter().any(|state| {
                state.parent == parent
                    && found.len() == got.matched as usize
                    && state.blocks.iter().zip(&found).all(|(b, f)| b.0 == *f)
                    && state
                        .blocks
                        .iter()
                        .zip(&values)
                        .take(found.len())
                        .all(|(b, v)| b.1 == *v)
                    && (found.len() == values.len().min(state.blocks.len())
                        || state.blocks[found.len()].1 != values[found.len()])
            });
            assert!(
                agrees,
                "a match no published state explains: {got:?} {found:?}"
            );
            matches += 1;
            blocks_checked += found.len();
        }
    }
    assert!(
        matches >= 2_000 && blocks_checked > 1_000 && snapshots_checked > 1_000,
        "the readers read too little to tell: {matches} matches, {blocks_checked} blocks, \
         {snapshots_checked} snapshots"
    );
}
