//! The run table against a plain model (proptest), its id rule, and readers racing a writer on
//! real threads. The loom model of the same protocol is `tests/loom_runs.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;

use super::{RunAllocator, RunMatch, RunParent, RunRef, RunTable, CHUNK};
use crate::key::BlockKey;
use crate::pool::BlockId;

const BLOCK: usize = 4;

fn root(byte: u8) -> RunParent {
    RunParent::Root(BlockKey([byte; 32]))
}

/// A block's row of `BLOCK` tokens, all `value`.
fn row(value: u32) -> Vec<u32> {
    vec![value; BLOCK]
}

fn rows(values: &[u32]) -> Vec<u32> {
    values.iter().flat_map(|&value| row(value)).collect()
}

#[test]
fn a_run_matches_its_rows_block_by_block_and_stops_at_the_first_difference() {
    let table = RunTable::new(64, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let blocks: Vec<BlockId> = (10..50).collect();
    let values: Vec<u32> = (100..140).collect();
    let run = table.create(&mut alloc, root(1), &blocks, &rows(&values));
    let mut found = Vec::new();
    let all = table.match_run(run.slot, &root(1), &rows(&values), &mut found);
    assert_eq!(
        all,
        Some(RunMatch {
            id: run.id,
            len: 40,
            matched: 40
        })
    );
    assert_eq!(found, blocks);
    // A prompt that differs in one token of block 20 matches 20 blocks.
    let mut prompt = rows(&values);
    prompt[20 * BLOCK + 3] += 1;
    found.clear();
    let some = table.match_run(run.slot, &root(1), &prompt, &mut found);
    assert_eq!(some.map(|m| m.matched), Some(20));
    assert_eq!(found, blocks[..20]);
    // A shorter prompt, and one with a partial block at its end: whole blocks only.
    found.clear();
    let short = table.match_run(run.slot, &root(1), &prompt[..5 * BLOCK + 2], &mut found);
    assert_eq!(short.map(|m| m.matched), Some(5));
    // Another root: no match, and nothing appended.
    found = vec![7];
    assert_eq!(
        table.match_run(run.slot, &root(2), &rows(&values), &mut found),
        None
    );
    assert_eq!(found, vec![7]);
    // An empty slot.
    assert_eq!(table.match_run(5, &root(1), &prompt, &mut found), None);
    assert_eq!(table.snapshot(5), None);
}

#[test]
fn a_run_cut_and_grown_again_is_a_new_run() {
    // A reader that matched a run to length 3 and looks for what follows must not find a
    // child hung after the run was cut to 2 and grown to 3 with other content: the cut gives
    // the run a fresh id, so the child names another parent.
    let table = RunTable::new(16, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let run = table.create(&mut alloc, root(1), &[0, 1, 2], &rows(&[10, 11, 12]));
    let before = RunParent::Run { id: run.id, len: 3 };
    let cut = table.truncate(&mut alloc, run, 2);
    assert_ne!(cut.id, run.id);
    table.extend(&mut alloc, cut, &[2], &row(99));
    let child = table.create(
        &mut alloc,
        RunParent::Run { id: cut.id, len: 3 },
        &[3],
        &row(13),
    );
    let mut found = Vec::new();
    assert_eq!(
        table.match_run(child.slot, &before, &row(13), &mut found),
        None
    );
    // Growing in place keeps the id: what hung before still hangs.
    table.extend(&mut alloc, child, &[4], &row(14));
    let hung = RunParent::Run { id: cut.id, len: 3 };
    assert_eq!(
        table
            .match_run(child.slot, &hung, &rows(&[13, 14]), &mut found)
            .map(|m| m.matched),
        Some(2)
    );
}

#[test]
fn split_hangs_the_tail_under_the_head_and_replace_keeps_the_content() {
    let table = RunTable::new(64, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let blocks: Vec<BlockId> = (0..40).collect();
    let values: Vec<u32> = (200..240).collect();
    let run = table.create(&mut alloc, root(3), &blocks, &rows(&values));
    let (head, tail) = table.split(&mut alloc, run, 17);
    assert_eq!(head.slot, run.slot);
    assert_ne!(head.id, run.id);
    assert_eq!(table.run_blocks(head), blocks[..17]);
    assert_eq!(table.run_blocks(tail), blocks[17..]);
    let mut found = Vec::new();
    let under = RunParent::Run {
        id: head.id,
        len: 17,
    };
    let matched = table.match_run(tail.slot, &under, &rows(&values[17..]), &mut found);
    assert_eq!(matched.map(|m| m.matched), Some(23));
    assert_eq!(found, blocks[17..]);
    // Block 20 (the tail's fourth) replaced by block 50: same content, same id.
    let old = table.replace(tail, 3, 50);
    assert_eq!(old, 20);
    found.clear();
    let matched = table.match_run(tail.slot, &under, &rows(&values[17..]), &mut found);
    assert_eq!(matched.map(|m| (m.id, m.matched)), Some((tail.id, 23)));
    assert_eq!(found[3], 50);
    // Hung elsewhere.
    table.set_parent(&mut alloc, tail, root(9));
    assert_eq!(
        table.match_run(tail.slot, &under, &rows(&values[17..]), &mut found),
        None
    );
    assert_eq!(table.snapshot(tail.slot).map(|s| s.parent), Some(root(9)));
}

#[test]
fn runs_are_found_by_their_parent_and_first_block() {
    let table = RunTable::new(64, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let find = |parent: &RunParent, values: &[u32]| {
        let first = row(values[0]);
        let mut found = Vec::new();
        table
            .find(
                table.hash_of(parent, &first),
                parent,
                &rows(values),
                &mut found,
            )
            .map(|(slot, matched)| (slot, matched.matched, found))
    };
    // The same first block under two roots: two runs, each found under its own root.
    let one = table.create(&mut alloc, root(1), &[0, 1, 2], &rows(&[5, 6, 7]));
    let two = table.create(&mut alloc, root(2), &[3, 4], &rows(&[5, 8]));
    assert_eq!(
        find(&root(1), &[5, 6, 7]),
        Some((one.slot, 3, vec![0, 1, 2]))
    );
    assert_eq!(find(&root(2), &[5, 8, 9]), Some((two.slot, 2, vec![3, 4])));
    assert_eq!(find(&root(3), &[5, 6, 7]), None);
    assert_eq!(find(&root(1), &[6, 6, 7]), None);
    // Two branches under `one`'s end.
    let under = RunParent::Run { id: one.id, len: 3 };
    let left = table.create(&mut alloc, under, &[10, 11], &rows(&[20, 21]));
    let right = table.create(&mut alloc, under, &[12], &rows(&[30]));
    assert_eq!(find(&under, &[20, 21]), Some((left.slot, 2, vec![10, 11])));
    assert_eq!(find(&under, &[30, 31]), Some((right.slot, 1, vec![12])));
    assert_eq!(find(&under, &[40]), None);
    // A split of `one` after its first block: the tail is found under the head's new id, and
    // the branches only once hung under the tail.
    let (head, tail) = table.split(&mut alloc, one, 1);
    let at = RunParent::Run {
        id: head.id,
        len: 1,
    };
    assert_eq!(find(&root(1), &[5, 6, 7]), Some((head.slot, 1, vec![0])));
    assert_eq!(find(&at, &[6, 7]), Some((tail.slot, 2, vec![1, 2])));
    let moved = RunParent::Run {
        id: tail.id,
        len: 2,
    };
    assert_eq!(find(&moved, &[20, 21]), None, "not hung under the tail yet");
    // A reader that matched `one` whole before the split still finds what follows it: the
    // content that id names did not change, and no run will have that id again.
    assert_eq!(find(&under, &[20, 21]), Some((left.slot, 2, vec![10, 11])));
    table.set_parent(&mut alloc, left, moved);
    table.set_parent(&mut alloc, right, moved);
    assert_eq!(find(&moved, &[20, 21]), Some((left.slot, 2, vec![10, 11])));
    assert_eq!(find(&moved, &[30]), Some((right.slot, 1, vec![12])));
    // Removed: not found, and its slot's next run is found under its own key only.
    table.remove(&mut alloc, right);
    assert_eq!(find(&moved, &[30]), None);
    let again = table.create(&mut alloc, moved, &[12], &rows(&[31]));
    assert_eq!(again.slot, right.slot);
    assert_eq!(find(&moved, &[30]), None);
    assert_eq!(find(&moved, &[31]), Some((again.slot, 1, vec![12])));
}

#[test]
#[should_panic(expected = "begin with the same block")]
#[cfg(debug_assertions)]
fn two_runs_under_one_parent_with_one_first_block_are_refused() {
    let table = RunTable::new(8, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    table.create(&mut alloc, root(1), &[0, 1], &rows(&[5, 6]));
    table.create(&mut alloc, root(1), &[2], &rows(&[5]));
}

#[test]
#[should_panic(expected = "does not hold run")]
fn an_operation_on_a_run_that_left_its_slot_is_refused() {
    let table = RunTable::new(8, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let run = table.create(&mut alloc, root(1), &[0, 1], &rows(&[1, 2]));
    let cut = table.truncate(&mut alloc, run, 1);
    let _ = cut;
    table.extend(&mut alloc, run, &[2], &row(3));
}

#[test]
fn every_run_fits_the_arena_at_its_worst() {
    // As many runs as blocks (one block each), then as few as possible (one run of all), then
    // splits everywhere: the arena never runs out.
    for num_blocks in [1, 15, 16, 17, 100] {
        let table = RunTable::new(num_blocks, BLOCK, 7).expect("small");
        let mut alloc = RunAllocator::new(&table);
        let ones: Vec<RunRef> = (0..num_blocks as BlockId)
            .map(|block| table.create(&mut alloc, root(1), &[block], &row(block)))
            .collect();
        for run in ones {
            table.remove(&mut alloc, run);
        }
        let blocks: Vec<BlockId> = (0..num_blocks as BlockId).collect();
        let values: Vec<u32> = blocks.clone();
        let mut run = table.create(&mut alloc, root(1), &blocks, &rows(&values));
        let mut tails = Vec::new();
        while table.run_len(run) > 1 {
            let len = table.run_len(run);
            let (head, tail) = table.split(&mut alloc, run, len - 1);
            tails.push(tail);
            run = head;
        }
        assert_eq!(alloc.num_runs(), num_blocks);
        for tail in tails {
            table.remove(&mut alloc, tail);
        }
        table.remove(&mut alloc, run);
        assert_eq!(alloc.num_runs(), 0);
    }
}

/// The model's view of one run.
#[derive(Clone, Debug)]
struct ModelRun {
    run: RunRef,
    parent: RunParent,
    /// (block, the value its row holds)
    blocks: Vec<(BlockId, u32)>,
}

#[derive(Clone, Debug)]
enum Op {
    Create {
        len: usize,
        parent: u8,
    },
    Extend {
        run: usize,
        len: usize,
    },
    Truncate {
        run: usize,
        keep: usize,
    },
    Split {
        run: usize,
        at: usize,
    },
    Replace {
        run: usize,
        at: usize,
    },
    Remove {
        run: usize,
    },
    SetParent {
        run: usize,
        parent: u8,
    },
    Match {
        run: usize,
        cut: usize,
        change: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..40, 0u8..3).prop_map(|(len, parent)| Op::Create { len, parent }),
        (0usize..8, 1usize..20).prop_map(|(run, len)| Op::Extend { run, len }),
        (0usize..8, 0usize..40).prop_map(|(run, keep)| Op::Truncate { run, keep }),
        (0usize..8, 0usize..40).prop_map(|(run, at)| Op::Split { run, at }),
        (0usize..8, 0usize..40).prop_map(|(run, at)| Op::Replace { run, at }),
        (0usize..8).prop_map(|run| Op::Remove { run }),
        (0usize..8, 0u8..8).prop_map(|(run, parent)| Op::SetParent { run, parent }),
        (0usize..8, 0usize..45, any::<bool>()).prop_map(|(run, cut, change)| Op::Match {
            run,
            cut,
            change
        }),
    ]
}

/// Drives the table and a model of plain vectors through `ops`, comparing every run's
/// snapshot and every match with the model's answer after each step.
fn run_ops(ops: &[Op]) {
    const BLOCKS: usize = 96;
    let table = RunTable::new(BLOCKS, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let mut free: Vec<BlockId> = (0..BLOCKS as BlockId).rev().collect();
    let mut runs: Vec<ModelRun> = Vec::new();
    let mut next_value = 1u32;
    let mut ids_seen = std::collections::HashSet::new();
    for op in ops {
        match *op {
            Op::Create { len, parent } => {
                let len = len.min(free.len());
                if len == 0 {
                    continue;
                }
                let blocks: Vec<BlockId> = (0..len).map(|_| free.pop().expect("len")).collect();
                let values: Vec<u32> = (0..len as u32).map(|i| next_value + i).collect();
                next_value += len as u32;
                // Under a root, or under the end of a run chosen by `parent`.
                let parent = match runs.get(usize::from(parent)) {
                    Some(model) if parent > 0 => RunParent::Run {
                        id: model.run.id,
                        len: model.blocks.len() as u32,
                    },
                    _ => root(parent),
                };
                let run = table.create(&mut alloc, parent, &blocks, &rows(&values));
                runs.push(ModelRun {
                    run,
                    parent,
                    blocks: blocks.into_iter().zip(values).collect(),
                });
            }
            Op::Extend { run, len } => {
                let len = len.min(free.len());
                let Some(model) = runs.get_mut(run) else {
                    continue;
                };
                if len == 0 {
                    continue;
                }
                let blocks: Vec<BlockId> = (0..len).map(|_| free.pop().expect("len")).collect();
                let values: Vec<u32> = (0..len as u32).map(|i| next_value + i).collect();
                next_value += len as u32;
                table.extend(&mut alloc, model.run, &blocks, &rows(&values));
                model.blocks.extend(blocks.into_iter().zip(values));
            }
            Op::Truncate { run, keep } => {
                let Some(model) = runs.get_mut(run) else {
                    continue;
                };
                if keep == 0 || keep >= model.blocks.len() {
                    continue;
                }
                model.run = table.truncate(&mut alloc, model.run, keep);
                free.extend(model.blocks.drain(keep..).map(|(block, _)| block));
            }
            Op::Split { run, at } => {
                let Some(model) = runs.get_mut(run) else {
                    continue;
                };
                if at == 0 || at >= model.blocks.len() {
                    continue;
                }
                let (head, tail) = table.split(&mut alloc, model.run, at);
                model.run = head;
                let blocks = model.blocks.split_off(at);
                runs.push(ModelRun {
                    run: tail,
                    parent: RunParent::Run {
                        id: head.id,
                        len: at as u32,
                    },
                    blocks,
                });
            }
            Op::Replace { run, at } => {
                let Some(model) = runs.get_mut(run) else {
                    continue;
                };
                let Some(block) = free.pop() else { continue };
                if at >= model.blocks.len() {
                    free.push(block);
                    continue;
                }
                let old = table.replace(model.run, at, block);
                assert_eq!(old, model.blocks[at].0);
                model.blocks[at].0 = block;
                free.push(old);
            }
            Op::Remove { run } => {
                if run >= runs.len() {
                    continue;
                }
                let model = runs.remove(run);
                table.remove(&mut alloc, model.run);
                free.extend(model.blocks.iter().map(|&(block, _)| block));
            }
            Op::SetParent { run, parent } => {
                if run >= runs.len() {
                    continue;
                }
                // Under a root, or under the end of another run (values are unique, so no two
                // runs under one parent ever begin with the same block).
                let parent = match runs.get(usize::from(parent)) {
                    Some(other) if usize::from(parent) != run => RunParent::Run {
                        id: other.run.id,
                        len: other.blocks.len() as u32,
                    },
                    _ => root(parent % 3),
                };
                table.set_parent(&mut alloc, runs[run].run, parent);
                runs[run].parent = parent;
            }
            Op::Match { run, cut, change } => {
                let Some(model) = runs.get(run) else {
                    continue;
                };
                let mut values: Vec<u32> = model.blocks.iter().map(|&(_, value)| value).collect();
                values.truncate(cut.max(1));
                if change {
                    let last = values.len() - 1;
                    values[last] = 0;
                }
                let expected = model
                    .blocks
                    .iter()
                    .zip(&values)
                    .take_while(|((_, value), want)| value == *want)
                    .count();
                let mut found = vec![u32::MAX];
                let got =
                    table.match_run(model.run.slot, &model.parent, &rows(&values), &mut found);
                assert_eq!(
                    got,
                    Some(RunMatch {
                        id: model.run.id,
                        len: model.blocks.len() as u32,
                        matched: expected as u32
                    })
                );
                let blocks: Vec<BlockId> = model.blocks[..expected].iter().map(|b| b.0).collect();
                assert_eq!(found[1..], blocks);
            }
        }
        // Every run found through the index under its parent and first block, whole.
        for model in &runs {
            let values: Vec<u32> = model.blocks.iter().map(|&(_, value)| value).collect();
            let mut found = Vec::new();
            let hash = table.hash_of(&model.parent, &row(values[0]));
            let got = table.find(hash, &model.parent, &rows(&values), &mut found);
            assert_eq!(
                got.map(|(slot, matched)| (slot, matched.matched)),
                Some((model.run.slot, values.len() as u32))
            );
        }
        // Every run as the model has it; ids never reused.
        for model in &runs {
            let snapshot = table.snapshot(model.run.slot).expect("a run");
            assert_eq!(snapshot.id, model.run.id);
            assert_eq!(snapshot.parent, model.parent);
            let blocks: Vec<BlockId> = model.blocks.iter().map(|b| b.0).collect();
            assert_eq!(snapshot.blocks, blocks);
            ids_seen.insert(model.run.id);
        }
        assert_eq!(alloc.num_runs(), runs.len());
        assert_eq!(table.index_entries(), runs.len(), "one index word a run");
        let in_runs: usize = runs.iter().map(|model| model.blocks.len()).sum();
        assert_eq!(in_runs + free.len(), BLOCKS);
    }
    let _ = ids_seen;
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_table_reads_as_its_model_after_every_step(ops in proptest::collection::vec(op(), 1..80)) {
        run_ops(&ops);
    }
}

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
