//! The run table against a plain model (proptest) and its id rule; readers racing a writer on
//! real threads are in `race_tests.rs`, the loom models of the protocol in `tests/loom_runs.rs`.

use proptest::prelude::*;

use super::{RunAllocator, RunMatch, RunParent, RunRef, RunTable};
use crate::key::BlockKey;
use crate::pool::BlockId;

pub(super) const BLOCK: usize = 4;

pub(super) fn root(byte: u8) -> RunParent {
    RunParent::Root(BlockKey([byte; 32]))
}

/// A block's row of `BLOCK` tokens, all `value`.
pub(super) fn row(value: u32) -> Vec<u32> {
    vec![value; BLOCK]
}

pub(super) fn rows(values: &[u32]) -> Vec<u32> {
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
    // A difference on either side of a chunk boundary (`CHUNK` ids to a chunk, read a chunk
    // at a time): the match stops right there.
    for at in [0, 1, 15, 16, 17, 31, 32, 33, 39] {
        let mut prompt = rows(&values);
        prompt[at * BLOCK] += 1;
        found.clear();
        let some = table.match_run(run.slot, &root(1), &prompt, &mut found);
        assert_eq!(
            some.map(|m| m.matched),
            Some(at as u32),
            "a difference in block {at}"
        );
        assert_eq!(found, blocks[..at]);
    }
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
    // Ids a run no longer has (cut, split or removed): none may come back.
    let mut retired = std::collections::HashSet::new();
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
                retired.insert(model.run.id);
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
                retired.insert(model.run.id);
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
                retired.insert(model.run.id);
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
            // The writer's reads through its chunk lists: every block, and every range that
            // starts or ends at a chunk's edge or inside one.
            for (position, &block) in blocks.iter().enumerate() {
                assert_eq!(table.block_at(&alloc, model.run, position), block);
            }
            let len = blocks.len();
            let ranges = [(0, len), (len / 3, len), (1.min(len), len * 2 / 3)];
            for (from, to) in ranges.into_iter().filter(|(from, to)| from <= to) {
                let mut ids = vec![7];
                table.read_ids(&alloc, model.run, from, to, &mut ids);
                assert_eq!(ids[1..], blocks[from..to], "ids {from}..{to} of {len}");
            }
            assert!(
                !retired.contains(&model.run.id),
                "id {} given again",
                model.run.id
            );
        }
        assert_eq!(alloc.num_runs(), runs.len());
        assert_eq!(table.index_entries(), runs.len(), "one index word a run");
        let in_runs: usize = runs.iter().map(|model| model.blocks.len()).sum();
        assert_eq!(in_runs + free.len(), BLOCKS);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn the_table_reads_as_its_model_after_every_step(ops in proptest::collection::vec(op(), 1..80)) {
        run_ops(&ops);
    }
}

#[test]
fn a_tagged_child_is_found_only_under_its_tag_and_keeps_it_when_moved() {
    let table = RunTable::new(64, BLOCK, 7).expect("small");
    let mut alloc = RunAllocator::new(&table);
    let key = BlockKey([9; 32]);
    let head = table.create(&mut alloc, RunParent::Root(key), &[1, 2], &rows(&[5, 6]));
    let tag = |byte| BlockKey([byte; 32]);
    let under = |tag| RunParent::Tagged {
        id: head.id,
        len: 2,
        tag,
    };
    // Two children with the same tokens: one plain, one with an image (tag 3).
    let plain = table.create(
        &mut alloc,
        RunParent::Run {
            id: head.id,
            len: 2,
        },
        &[3],
        &row(7),
    );
    let tagged = table.create(&mut alloc, under(tag(3)), &[4, 5], &rows(&[7, 8]));
    let prompt = rows(&[5, 6, 7, 8]);
    let matched = |tags: &[(u32, BlockKey)]| {
        let mut blocks = Vec::new();
        table.match_prompt(&key, &prompt, tags, &mut blocks, |_, _| true);
        blocks
    };
    assert_eq!(matched(&[]), vec![1, 2, 3]);
    assert_eq!(matched(&[(2, tag(3))]), vec![1, 2, 4, 5]);
    // Another image in the same place: neither child.
    assert_eq!(matched(&[(2, tag(4))]), vec![1, 2]);
    // A tagged block inside the run stops the comparison there.
    assert_eq!(matched(&[(1, tag(3))]), vec![1]);
    assert_eq!(
        table.snapshot(tagged.slot).map(|s| s.parent),
        Some(under(tag(3)))
    );
    assert_eq!(
        table.snapshot(plain.slot).map(|s| s.parent),
        Some(RunParent::Run {
            id: head.id,
            len: 2
        })
    );
    // Hung elsewhere (a split moved what it continues), it keeps its tag.
    let moved = RunParent::Tagged {
        id: plain.id,
        len: 1,
        tag: tag(3),
    };
    table.set_parent(&mut alloc, tagged, moved);
    assert_eq!(table.snapshot(tagged.slot).map(|s| s.parent), Some(moved));
    assert_eq!(matched(&[(2, tag(3))]), vec![1, 2]);
}
