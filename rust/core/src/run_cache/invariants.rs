//! `check_invariants`: what the writer's records of runs, the eviction order and the
//! duplicates promise each other and the run table, checked by the tests after their steps.

use std::collections::HashSet;

use super::{RunCache, NONE};
use crate::key::BlockKey;
use crate::pool::BlockId;
use crate::run_table::RunParent;

impl RunCache {
    /// Checks every invariant of the runs, the order and the duplicates (module docs of
    /// `mod.rs`), for tests.
    ///
    /// # Panics
    /// With an assertion message naming the broken invariant.
    pub fn check_invariants(&self) {
        let live: Vec<u32> = (0..self.runs.len() as u32)
            .filter(|&run| self.runs[run as usize].shared.is_some())
            .collect();
        let free_runs: HashSet<u32> = self.free_runs.iter().copied().collect();
        assert_eq!(
            live.len() + free_runs.len(),
            self.runs.len(),
            "every run record is live or recycled, once"
        );
        assert_eq!(
            self.alloc.num_runs(),
            live.len(),
            "one table slot per live run"
        );
        // Every block id is in at most one place: the free list, a run, a spare or a held copy.
        let mut seen: HashSet<BlockId> = HashSet::new();
        let mut place = |block: BlockId, what: &str| {
            assert!(
                seen.insert(block),
                "block {block} is twice in the cache ({what})"
            );
        };
        for &block in &self.order.free {
            place(block, "free list");
        }
        assert_eq!(
            live.iter()
                .map(|&run| self.runs[run as usize].pinned as usize)
                .sum::<usize>(),
            self.num_pinned,
            "the pinned blocks are counted"
        );
        for &run in &live {
            self.check_run(run);
            let r = &self.runs[run as usize];
            let shared = r.shared.expect("live");
            let mut ids = Vec::new();
            self.table
                .read_ids(&self.alloc, shared, 0, r.len as usize, &mut ids);
            for block in ids {
                place(block, "a run");
            }
            for &d in &r.dups {
                if !self.dups[d as usize].inherited {
                    place(self.dups[d as usize].block, "a duplicate");
                }
            }
        }
        self.check_order(&live);
    }

    /// One live run against its records, its parent, its children and the table.
    fn check_run(&self, run: u32) {
        let r = &self.runs[run as usize];
        let shared = r.shared.expect("live");
        assert!(r.len > 0, "run {run} is empty");
        assert_eq!(
            self.table.run_len(shared),
            r.len as usize,
            "run {run}'s length"
        );
        assert_eq!(r.refs.len(), r.len as usize, "run {run}'s counts");
        assert_eq!(r.priority.len(), r.len as usize, "run {run}'s priorities");
        if let Some(p) = r.one_priority {
            assert!(
                r.priority.iter().all(|&q| q == p),
                "run {run} has one priority"
            );
        }
        assert_eq!(self.by_slot[shared.slot as usize], run, "run {run}'s slot");
        let snapshot = self.table.snapshot(shared.slot).expect("a live run reads");
        assert_eq!(snapshot.id, shared.id, "run {run}'s id");
        // Found where it hangs: the index under its parent and first block's tokens leads to
        // its slot (so two runs under one parent, first runs under one root included, never
        // begin with the same tokens: `find` would give one of them for both).
        let first = self.table.read_row(self.block(run, 0));
        let hash = self.table.hash_of(&snapshot.parent, &first);
        let found = self
            .table
            .find(hash, &snapshot.parent, &first, &mut Vec::new())
            .map(|(slot, _)| slot);
        assert_eq!(
            found,
            Some(shared.slot),
            "run {run} is found where it hangs"
        );
        match snapshot.parent {
            RunParent::Root(_) => assert_eq!(r.parent, NONE, "run {run} is a first run"),
            RunParent::Run { len, .. } | RunParent::Tagged { len, .. } => {
                assert_eq!(
                    snapshot.parent,
                    self.shared_parent(run, BlockKey([0; 32])),
                    "run {run}'s parent"
                );
                // Children hang at their parent's end: a split moves them to the tail.
                assert_eq!(
                    len, self.runs[r.parent as usize].len,
                    "run {run} hangs at the end"
                );
            }
        }
        if r.parent != NONE {
            assert!(
                self.runs[r.parent as usize].children.contains(&run),
                "run {run} is listed by its parent"
            );
        }
        let mut firsts = HashSet::new();
        for &c in &r.children {
            let child = &self.runs[c as usize];
            assert!(
                child.shared.is_some() && child.parent == run,
                "child {c} of {run}"
            );
            // (Children with multimodal items are told apart by their tags too.)
            assert!(
                firsts.insert((
                    self.table.read_row(self.block(c, 0)),
                    child.tag_key().copied()
                )),
                "two children of run {run} begin with the same tokens and tag"
            );
        }
        assert!(r.pinned <= r.len, "run {run}'s pinned blocks are its own");
        if r.pins.is_empty() {
            assert_eq!(r.pinned, 0, "run {run} has pins counted");
        } else {
            assert_eq!(
                r.pins.len(),
                r.len as usize,
                "run {run} counts pins per block"
            );
            assert!(
                r.pins.windows(2).all(|w| w[0] >= w[1]),
                "run {run}'s pin counts never rise along it: {:?}",
                r.pins
            );
            assert_eq!(
                r.pins.partition_point(|&c| c > 0) as u32,
                r.pinned,
                "run {run}'s pinned prefix"
            );
        }
        assert_eq!(
            r.with_successor as usize,
            r.dups
                .iter()
                .filter(|&&d| self.dups[d as usize].successor != NONE)
                .count(),
            "run {run} counts its duplicates with a successor"
        );
        for &d in &r.dups {
            let dup = &self.dups[d as usize];
            assert_eq!(dup.run, run, "duplicate {d} names its run");
            assert!(dup.pos < r.len, "duplicate {d} within its run");
            let canonical = self.block(run, dup.pos);
            assert_eq!(
                dup.inherited,
                dup.block == canonical,
                "duplicate {d} is in its run exactly when it inherited the entry"
            );
            if dup.inherited {
                assert!(r.refs[dup.pos as usize] > 0, "an inherited copy is held");
                assert_eq!(dup.segment, NONE, "an inherited copy is no spare");
            }
            if dup.successor != NONE {
                // It hangs right after the copy: at the next position of the run (its block
                // there or a copy of it), or first in a child run (or a copy of that). Once
                // evicted it is forgotten, never left naming an id handed out again.
                let next = dup.pos + 1;
                let mut after: Vec<(u32, u32)> = vec![];
                if next < r.len {
                    after.push((run, next));
                } else {
                    after.extend(r.children.iter().map(|&child| (child, 0)));
                }
                let hangs_after = after.iter().any(|&(owner, pos)| {
                    self.block(owner, pos) == dup.successor
                        || self.runs[owner as usize].dups.iter().any(|&other| {
                            let other = &self.dups[other as usize];
                            other.pos == pos && other.block == dup.successor
                        })
                });
                assert!(
                    hangs_after,
                    "duplicate {d}'s successor {} hangs right after it",
                    dup.successor
                );
            }
        }
    }

    /// The order: each queue's priority and ticks, each segment's run and range, the runs'
    /// lists, and the obtainable count.
    fn check_order(&self, live: &[u32]) {
        let priorities = self.order.priorities();
        assert!(
            priorities.windows(2).all(|w| w[0] < w[1]),
            "queues by priority, one each"
        );
        let mut obtainable = self.order.free.len();
        let mut listed = HashSet::new();
        // Per run, the positions the queued segments cover.
        let mut queued: Vec<Vec<bool>> = self
            .runs
            .iter()
            .map(|r| vec![false; r.len as usize])
            .collect();
        for (queue, &priority) in self.order.in_order().iter().zip(&priorities) {
            assert!(!queue.is_empty(), "an empty queue is dropped");
            let mut tick = 0;
            for &id in queue {
                let s = &self.order.segments[id as usize];
                assert_eq!(s.priority, priority, "segment {id} in its priority's queue");
                assert!(s.tick >= tick, "a queue is in order of release");
                tick = s.tick;
                assert!(listed.insert(id), "segment {id} queued once");
                if s.dup != NONE {
                    let dup = &self.dups[s.dup as usize];
                    assert_eq!(dup.segment, id, "spare {} knows its segment", s.dup);
                    assert!(!dup.inherited, "a spare holds no entry");
                    obtainable += 1;
                    continue;
                }
                let r = &self.runs[s.run as usize];
                assert!(r.shared.is_some(), "segment {id} of a live run");
                assert!(s.lo < s.hi && s.hi <= r.len, "segment {id}'s range");
                assert!(r.segments.contains(&id), "segment {id} in its run's list");
                for pos in s.lo..s.hi {
                    assert_eq!(r.refs[pos as usize], 0, "a queued block is held by none");
                    assert_eq!(
                        r.priority[pos as usize], priority,
                        "a queued block is in its priority's queue"
                    );
                    assert!(
                        !std::mem::replace(&mut queued[s.run as usize][pos as usize], true),
                        "block {pos} of run {} queued twice",
                        s.run
                    );
                }
                // Pinned blocks are queued in their place but not obtainable.
                obtainable += s.hi.saturating_sub(s.lo.max(r.pinned)) as usize;
            }
        }
        assert_eq!(obtainable, self.order.free_count, "the obtainable count");
        for &run in live {
            let r = &self.runs[run as usize];
            assert_eq!(
                r.segments.len(),
                r.segments.iter().collect::<HashSet<_>>().len(),
                "run {run} lists a segment once"
            );
            for &id in &r.segments {
                assert!(listed.contains(&id), "run {run}'s segment {id} is queued");
            }
            for pos in 0..r.len {
                assert_eq!(
                    queued[run as usize][pos as usize],
                    r.refs[pos as usize] == 0,
                    "block {pos} of run {run} is queued exactly when nobody holds it"
                );
            }
        }
    }
}
