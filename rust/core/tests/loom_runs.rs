//! loom models of the run table's sequence-lock protocol (`src/run_table/`): a lock-free reader
//! matching a run while the writer truncates, splits, extends, replaces or removes it and
//! reuses what it freed.
//!
//! Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p prefixkv-core --test
//! loom_runs --release` (`make loom`).
//!
//! ## What runs under loom
//! Unlike `loom_pool.rs`, whose lookup table is a stand-in with the real table's contract, these
//! models run the run table's own code: under `--cfg loom` its atomics and fences are loom's
//! (`run_table/mod.rs`), so loom explores every interleaving of the writer's and the reader's
//! loads and stores within the preemption bound, and lets a relaxed load return any store the
//! memory model allows, not only the latest. A chunk holds one block id under loom, so a run of
//! two blocks crosses a chunk link. The runs hang under a parent run, not a root: a root key is
//! four more loads on every read, which multiply the interleavings without adding a race.
//!
//! ## What each model checks
//! The reader's answer is one of the states the run in that slot had, exactly: its id, its
//! length, the leading blocks that hold the prompt, and nothing else. Every state the writer
//! passes through is listed beside each model, and an answer none of them explains fails it.
//! Planted bugs the models fail on: the reader skipping its second stamp check or its acquire
//! fence, the writer's window without its release fence (all but one model); `remove` without
//! its window (the first); `extend` storing the new length without its window (the second:
//! a reader sees the new length beside the row stored before it, still old); `replace` storing
//! the new block outside its window (the third); `create` writing a new run's rows after its
//! window (the first). One they do not: `truncate` keeping the run's id (the models list
//! states by the ids the writer returns; the unit test `a_run_cut_and_grown_again_is_a_new_run`
//! catches it). The last model reads a `Tagged` parent (its tag is four more loads, as a root
//! key would be) against a slot reused under another tag. Not modelled: a `Root` parent,
//! `set_parent`,
//! `snapshot` and `find`; the real-thread race test in `run_table/tests.rs` covers those.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use prefixkv_core::pool::BlockId;
use prefixkv_core::run_table::{RunAllocator, RunMatch, RunParent, RunTable};

/// Preemptions loom may insert per execution: each race needs the reader preempted once between
/// its two stamp loads while the writer runs an operation, or twice to see a window half done;
/// 2 keeps every model to seconds (3 took minutes a model).
const PREEMPTION_BOUND: usize = 2;

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(PREEMPTION_BOUND);
    builder.check(f);
}

/// Where the models' runs hang: a parent run the model never creates (its id is beyond any the
/// table hands out), which the reader names as it would a parent it matched.
const UNDER: RunParent = RunParent::Run {
    id: 1 << 40,
    len: 1,
};

/// One token per block: a row is the value itself.
fn rows(values: &[u32]) -> Vec<u32> {
    values.to_vec()
}

/// A state the reader may see: the run's id, its blocks, and the value each block's row holds.
struct State {
    id: u64,
    blocks: Vec<(BlockId, u32)>,
}

/// Whether `answer` (with the blocks it appended) is what matching `prompt` against `state`
/// gives.
fn explains(state: &State, prompt: &[u32], answer: &RunMatch, found: &[BlockId]) -> bool {
    let matched = state
        .blocks
        .iter()
        .zip(prompt)
        .take_while(|((_, value), want)| value == *want)
        .count();
    answer.id == state.id
        && answer.len as usize == state.blocks.len()
        && answer.matched as usize == matched
        && found
            .iter()
            .eq(state.blocks[..matched].iter().map(|(block, _)| block))
}

fn check(states: &[State], prompt: &[u32], answer: Option<RunMatch>, found: &[BlockId]) {
    if let Some(answer) = answer {
        assert!(
            states
                .iter()
                .any(|state| explains(state, prompt, &answer, found)),
            "no state explains {answer:?} with blocks {found:?}"
        );
    } else {
        assert!(found.is_empty(), "a miss appended {found:?}");
    }
}

/// Spawns a reader matching `prompt` against `slot` under `UNDER`, returning its answer and the
/// blocks it appended.
fn reader(
    table: &Arc<RunTable>,
    slot: u32,
    prompt: &'static [u32],
) -> thread::JoinHandle<(Option<RunMatch>, Vec<BlockId>)> {
    let table = table.clone();
    thread::spawn(move || {
        let mut found = Vec::new();
        let answer = table.match_run(slot, &UNDER, &rows(prompt), &mut found);
        (answer, found)
    })
}

#[test]
fn a_run_removed_and_its_slot_chunks_and_blocks_reused_is_read_whole_or_not_at_all() {
    // The run [0, 1] (values 10, 11) is removed and its slot, chunks and blocks taken by a run
    // [1, 0] (10, 21) under the same parent: the reader sees one run or the other (or
    // nothing), never block 1 read from a chunk reused meanwhile, never a row rewritten for
    // the new run beside the old run's id, never the new run's blocks with their old rows.
    model(|| {
        let table = Arc::new(RunTable::new(2, 1, 7).expect("small"));
        let mut alloc = RunAllocator::new(&table);
        let first = table.create(&mut alloc, UNDER, &[0, 1], &rows(&[10, 11]));
        let reading = reader(&table, first.slot, &[10, 11]);
        table.remove(&mut alloc, first);
        let next = table.create(&mut alloc, UNDER, &[1, 0], &rows(&[10, 21]));
        assert_eq!(next.slot, first.slot, "the model reuses the slot");
        let (answer, found) = reading.join().expect("the reader");
        let states = [
            State {
                id: first.id,
                blocks: vec![(0, 10), (1, 11)],
            },
            State {
                id: next.id,
                blocks: vec![(1, 10), (0, 21)],
            },
        ];
        check(&states, &[10, 11], answer, &found);
    });
}

#[test]
fn a_run_cut_and_grown_again_is_read_under_its_new_id() {
    // The run [0, 1] (10, 11) is cut to [0] and grown again with block 1 holding 21: the cut
    // gives the run a fresh id, and the reader sees [0, 1] under the old id with 11, [0] or
    // [0, 1] under the new id with 21, or nothing.
    model(|| {
        let table = Arc::new(RunTable::new(2, 1, 7).expect("small"));
        let mut alloc = RunAllocator::new(&table);
        let run = table.create(&mut alloc, UNDER, &[0, 1], &rows(&[10, 11]));
        let reading = reader(&table, run.slot, &[10, 11]);
        let cut = table.truncate(&mut alloc, run, 1);
        table.extend(&mut alloc, cut, &[1], &rows(&[21]));
        let (answer, found) = reading.join().expect("the reader");
        let states = [
            State {
                id: run.id,
                blocks: vec![(0, 10), (1, 11)],
            },
            State {
                id: cut.id,
                blocks: vec![(0, 10)],
            },
            State {
                id: cut.id,
                blocks: vec![(0, 10), (1, 21)],
            },
        ];
        check(&states, &[10, 11], answer, &found);
    });
}

#[test]
fn a_block_replaced_in_a_run_is_read_as_one_block_or_the_other() {
    // Block 2 takes block 1's place in [0, 1] (the same content, 11), and block 1 is then
    // reused with other content for a new run: the reader sees [0, 1] or [0, 2], both
    // matching, never block 1 with the new run's row.
    model(|| {
        let table = Arc::new(RunTable::new(3, 1, 7).expect("small"));
        let mut alloc = RunAllocator::new(&table);
        let run = table.create(&mut alloc, UNDER, &[0, 1], &rows(&[10, 11]));
        let reading = reader(&table, run.slot, &[10, 11]);
        assert_eq!(table.replace(run, 1, 2), 1);
        let other = table.create(&mut alloc, UNDER, &[1], &rows(&[99]));
        let (answer, found) = reading.join().expect("the reader");
        let states = [
            State {
                id: run.id,
                blocks: vec![(0, 10), (1, 11)],
            },
            State {
                id: run.id,
                blocks: vec![(0, 10), (2, 11)],
            },
        ];
        check(&states, &[10, 11], answer, &found);
        let _ = other;
    });
}

#[test]
fn a_run_split_is_read_whole_or_as_its_head() {
    // [0, 1] split after its first block: the head keeps the slot under a fresh id and the
    // tail goes to another slot; the reader of the slot sees the whole run or the head.
    model(|| {
        let table = Arc::new(RunTable::new(2, 1, 7).expect("small"));
        let mut alloc = RunAllocator::new(&table);
        let run = table.create(&mut alloc, UNDER, &[0, 1], &rows(&[10, 11]));
        let reading = reader(&table, run.slot, &[10, 11]);
        let (head, tail) = table.split(&mut alloc, run, 1);
        assert_ne!(tail.slot, run.slot);
        let (answer, found) = reading.join().expect("the reader");
        let states = [
            State {
                id: run.id,
                blocks: vec![(0, 10), (1, 11)],
            },
            State {
                id: head.id,
                blocks: vec![(0, 10)],
            },
        ];
        check(&states, &[10, 11], answer, &found);
    });
}

#[test]
fn a_tagged_run_replaced_by_one_of_another_tag_is_never_read_under_the_first_tag() {
    // A run hung under `UNDER`'s run with an image tagged 1 is removed, and its slot taken by a
    // run of the same tokens under tag 2 (another image in the same placeholders): a reader
    // asking for tag 1 sees the first run or nothing, never the second, whose tag words the
    // writer stores inside its window (`write_parent`).
    model(|| {
        let table = Arc::new(RunTable::new(2, 1, 7).expect("small"));
        let mut alloc = RunAllocator::new(&table);
        let tagged = |byte| RunParent::Tagged {
            id: 1 << 40,
            len: 1,
            tag: prefixkv_core::BlockKey([byte; 32]),
        };
        let first = table.create(&mut alloc, tagged(1), &[0], &rows(&[10]));
        let reading = {
            let table = table.clone();
            thread::spawn(move || {
                let mut found = Vec::new();
                let answer = table.match_run(first.slot, &tagged(1), &rows(&[10]), &mut found);
                (answer, found)
            })
        };
        table.remove(&mut alloc, first);
        let next = table.create(&mut alloc, tagged(2), &[1], &rows(&[10]));
        assert_eq!(next.slot, first.slot, "the model reuses the slot");
        let (answer, found) = reading.join().expect("the reader");
        let states = [State {
            id: first.id,
            blocks: vec![(0, 10)],
        }];
        check(&states, &[10], answer, &found);
    });
}
