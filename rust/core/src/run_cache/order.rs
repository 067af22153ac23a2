//! The eviction order by segments (module docs of `mod.rs`): the free list, then one queue of
//! segments per retention priority, lowest first, each in order of release; and allocation,
//! which takes blocks from it and evicts what they hold.

use super::{Dup, RunCache, NONE};
use crate::pool::BlockId;

/// A stretch of the eviction order: blocks `lo..hi` of `run`, highest first, or a spare.
#[derive(Clone, Copy, Debug)]
pub(super) struct Segment {
    pub(super) run: u32,
    pub(super) lo: u32,
    pub(super) hi: u32,
    /// For a spare: its record in `RunCache::dups` (`run`, `lo` and `hi` unused); `NONE` for
    /// a run's blocks.
    pub(super) dup: u32,
    pub(super) priority: i32,
    /// When it joined the order: blocks released by one finish share a tick, and among those
    /// the lowest block id goes first (the core's eviction key).
    pub(super) tick: u64,
    prev: u32,
    next: u32,
}

/// The segments of one priority, oldest first.
#[derive(Clone, Copy, Debug)]
struct Queue {
    priority: i32,
    head: u32,
    tail: u32,
}

/// The free list and the queues of segments.
pub(super) struct Order {
    pub(super) segments: Vec<Segment>,
    free_segments: Vec<u32>,
    /// By priority, ascending; a queue is dropped when it empties (priorities in use are few).
    queues: Vec<Queue>,
    /// Blocks holding no entry, taken before any eviction, top first (the core's free list).
    pub(super) free: Vec<BlockId>,
    /// Blocks obtainable now: the free list, the queued blocks, the spares.
    pub(super) free_count: usize,
}

impl Order {
    pub(super) fn new(num_blocks: u32) -> Self {
        Self {
            segments: Vec::new(),
            free_segments: Vec::new(),
            queues: Vec::new(),
            free: (0..num_blocks).rev().collect(),
            free_count: num_blocks as usize,
        }
    }

    /// The position of `priority`'s queue, made if there is none.
    fn queue(&mut self, priority: i32) -> usize {
        match self.queues.binary_search_by_key(&priority, |q| q.priority) {
            Ok(at) => at,
            Err(at) => {
                self.queues.insert(
                    at,
                    Queue {
                        priority,
                        head: NONE,
                        tail: NONE,
                    },
                );
                at
            }
        }
    }

    /// Appends a segment at the back of `priority`'s queue: blocks `lo..hi` of `run`, or
    /// (`dup`) a spare; counts its blocks obtainable. Returns its id.
    pub(super) fn push(
        &mut self,
        run: u32,
        lo: u32,
        hi: u32,
        dup: u32,
        priority: i32,
        tick: u64,
    ) -> u32 {
        let q = self.queue(priority);
        let segment = Segment {
            run,
            lo,
            hi,
            dup,
            priority,
            tick,
            prev: self.queues[q].tail,
            next: NONE,
        };
        let id = super::slab_put(&mut self.segments, &mut self.free_segments, segment);
        let queue = &mut self.queues[q];
        if queue.tail == NONE {
            queue.head = id;
        } else {
            self.segments[queue.tail as usize].next = id;
        }
        queue.tail = id;
        self.free_count += if dup == NONE { (hi - lo) as usize } else { 1 };
        id
    }

    /// Puts a segment of `run`'s blocks `lo..hi` just before segment `id`, with its priority
    /// and tick (the blocks were counted obtainable already).
    fn insert_before(&mut self, id: u32, run: u32, lo: u32, hi: u32) -> u32 {
        let Segment {
            priority,
            tick,
            prev,
            ..
        } = self.segments[id as usize];
        let segment = Segment {
            run,
            lo,
            hi,
            dup: NONE,
            priority,
            tick,
            prev,
            next: id,
        };
        let new = super::slab_put(&mut self.segments, &mut self.free_segments, segment);
        if prev == NONE {
            let q = self.queue(priority);
            self.queues[q].head = new;
        } else {
            self.segments[prev as usize].next = new;
        }
        self.segments[id as usize].prev = new;
        new
    }

    /// Unlinks segment `id` from its queue and frees its record (its run's list is the
    /// caller's).
    pub(super) fn unlink(&mut self, id: u32) {
        let Segment {
            priority,
            prev,
            next,
            ..
        } = self.segments[id as usize];
        let q = self.queue(priority);
        if prev == NONE {
            self.queues[q].head = next;
        } else {
            self.segments[prev as usize].next = next;
        }
        if next == NONE {
            self.queues[q].tail = prev;
        } else {
            self.segments[next as usize].prev = prev;
        }
        if self.queues[q].head == NONE {
            self.queues.remove(q);
        }
        self.free_segments.push(id);
    }

    /// Queued blocks among a run's first `upto` (`of`: the run's segments).
    pub(super) fn queued_below(&self, of: &[u32], upto: u32) -> usize {
        of.iter()
            .map(|&id| {
                let s = &self.segments[id as usize];
                s.hi.min(upto).saturating_sub(s.lo) as usize
            })
            .sum()
    }

    /// Takes a run's first `upto` blocks out of the order (`of`: the run's segments; a prefix
    /// of a segment's range is the end popped last, so a segment only shrinks). Its first
    /// `pinned` blocks were not counted obtainable.
    pub(super) fn take_below(&mut self, of: &mut Vec<u32>, upto: u32, pinned: u32) {
        let mut i = 0;
        while i < of.len() {
            let id = of[i];
            let s = &mut self.segments[id as usize];
            if s.lo < upto {
                let new_lo = s.hi.min(upto);
                self.free_count -= new_lo.saturating_sub(s.lo.max(pinned)) as usize;
                s.lo = new_lo;
                if s.lo == s.hi {
                    self.unlink(id);
                    of.swap_remove(i);
                    continue;
                }
            }
            i += 1;
        }
    }

    /// A run's segments when it splits after `at` blocks: those before the branch stay, those
    /// past it go to `tail` (renumbered), one across it is cut in two, the tail's part just
    /// before the rest (it is popped first). Returns (staying, moved).
    pub(super) fn split_segments(
        &mut self,
        segments: Vec<u32>,
        tail: u32,
        at: u32,
    ) -> (Vec<u32>, Vec<u32>) {
        let mut stay = Vec::new();
        let mut moved = Vec::new();
        for id in segments {
            let Segment { lo, hi, .. } = self.segments[id as usize];
            if hi <= at {
                stay.push(id);
            } else if lo >= at {
                let s = &mut self.segments[id as usize];
                s.run = tail;
                s.lo -= at;
                s.hi -= at;
                moved.push(id);
            } else {
                let part = self.insert_before(id, tail, 0, hi - at);
                self.segments[id as usize].hi = at;
                moved.push(part);
                stay.push(id);
            }
        }
        (stay, moved)
    }

    /// A finished request's private blocks join the free list.
    pub(super) fn free_private(&mut self, blocks: &[BlockId]) {
        self.free.extend_from_slice(blocks);
        self.free_count += blocks.len();
    }

    /// The queues' segments, lowest priority first, each queue oldest first (invariants).
    pub(super) fn in_order(&self) -> Vec<Vec<u32>> {
        self.queues
            .iter()
            .map(|q| {
                let mut ids = Vec::new();
                let mut id = q.head;
                while id != NONE {
                    ids.push(id);
                    id = self.segments[id as usize].next;
                }
                ids
            })
            .collect()
    }

    /// The queues' priorities, in order (invariants).
    pub(super) fn priorities(&self) -> Vec<i32> {
        self.queues.iter().map(|q| q.priority).collect()
    }
}

impl RunCache {
    /// Unlinks segment `id` (emptied, or a taken spare's) from the order and its run's list.
    fn drop_segment(&mut self, id: u32) {
        let Segment { run, dup, .. } = self.order.segments[id as usize];
        self.order.unlink(id);
        if dup == NONE {
            let list = &mut self.runs[run as usize].segments;
            let at = list.iter().position(|&s| s == id).expect("listed");
            list.swap_remove(at);
        }
    }

    /// Whether segment `id` can give a block now: a spare always; a run's blocks from the
    /// top, if the top block is a leaf of the core's pool (`evictable`). Otherwise the
    /// segment is blocked (the core's leaf rule) and keeps its place until it is not.
    fn can_give(&self, id: u32) -> bool {
        let s = &self.order.segments[id as usize];
        s.dup != NONE
            || (s.hi > self.runs[s.run as usize].pinned && self.evictable(s.run, s.hi - 1))
    }

    /// The block segment `id` gives next (its key's last part).
    fn next_victim(&self, id: u32) -> BlockId {
        let s = &self.order.segments[id as usize];
        if s.dup == NONE {
            self.block(s.run, s.hi - 1)
        } else {
            self.dups[s.dup as usize].block
        }
    }

    /// Whether block `pos` of `run` is a leaf of the core's pool: every block hanging right
    /// after it (the run's next block, or its children's first blocks at its end) is a
    /// duplicate's successor, whose pool parent is that copy.
    fn evictable(&self, run: u32, pos: u32) -> bool {
        let r = &self.runs[run as usize];
        let last = pos + 1 == r.len;
        if r.with_successor == 0 {
            // No copy with anything hanging under it.
            return last && r.children.is_empty();
        }
        let under_a_copy = |block: BlockId| {
            r.dups.iter().any(|&d| {
                let d = &self.dups[d as usize];
                d.pos == pos && !d.inherited && d.successor == block
            })
        };
        if last {
            r.children.iter().all(|&c| under_a_copy(self.block(c, 0)))
        } else {
            under_a_copy(self.block(run, pos + 1))
        }
    }

    /// Block `block`, at `pos` of `run` (or a duplicate of that block), leaves: a duplicate at
    /// the position before (or at the parent run's last block, for a first block) whose
    /// successor it was has none now. (A stale successor would only matter if the block came
    /// back right after that position: its id is reused once handed out.)
    fn forget_as_successor(&mut self, run: u32, pos: u32, block: BlockId) {
        let (owner, at) = if pos > 0 {
            (run, pos - 1)
        } else {
            let parent = self.runs[run as usize].parent;
            if parent == NONE {
                return;
            }
            (parent, self.runs[parent as usize].len - 1)
        };
        let r = &self.runs[owner as usize];
        if r.with_successor == 0 {
            return;
        }
        let stale: Vec<u32> = r
            .dups
            .iter()
            .copied()
            .filter(|&d| {
                self.dups[d as usize].pos == at && self.dups[d as usize].successor == block
            })
            .collect();
        for d in stale {
            self.set_successor(d, NONE);
        }
    }

    /// `forget_as_successor` for blocks `stop..hi` of `run`, evicted together (`blocks[i]` was
    /// at `stop + i`), in one pass over the run's duplicates: per block, that pass was
    /// O(blocks × duplicates) for a run whose copies have successors.
    fn forget_as_successors(&mut self, run: u32, stop: u32, hi: u32, blocks: &[BlockId]) {
        debug_assert_eq!(blocks.len(), (hi - stop) as usize);
        if stop == 0 {
            // A first block's predecessor is the parent run's last block.
            self.forget_as_successor(run, 0, blocks[0]);
        }
        let r = &self.runs[run as usize];
        if r.with_successor == 0 {
            return;
        }
        // A duplicate at `pos` has its successor at `pos + 1`, evicted here when that position
        // is in `stop.max(1)..hi`.
        let from = stop.max(1);
        let stale: Vec<u32> = r
            .dups
            .iter()
            .copied()
            .filter(|&d| {
                let dup = &self.dups[d as usize];
                let next = dup.pos + 1;
                dup.successor != NONE
                    && (from..hi).contains(&next)
                    && dup.successor == blocks[(next - stop) as usize]
            })
            .collect();
        for d in stale {
            self.set_successor(d, NONE);
        }
    }

    /// The segment to take from next, and whether another of the same tick could give a
    /// block too (then one block at a time: the core takes the lowest id among them). The
    /// lowest priority's queue first; a queue whose segments are all blocked gives none.
    fn pick(&self) -> (u32, bool) {
        for queue in &self.order.queues {
            let mut id = queue.head;
            // (segment, its tick, its block once a rival of the same tick needs comparing:
            // without one the block is not read, a line of the table saved per victim run).
            let mut best: Option<(u32, u64, Option<BlockId>)> = None;
            let mut rivals = false;
            while id != NONE {
                let s = &self.order.segments[id as usize];
                if let Some((_, tick, _)) = best {
                    if s.tick != tick {
                        break;
                    }
                }
                if self.can_give(id) {
                    match best {
                        None => best = Some((id, s.tick, None)),
                        Some((first, tick, block)) => {
                            rivals = true;
                            let b = block.unwrap_or_else(|| self.next_victim(first));
                            let mine = self.next_victim(id);
                            best = Some(if mine < b {
                                (id, tick, Some(mine))
                            } else {
                                (first, tick, Some(b))
                            });
                        }
                    }
                }
                id = s.next;
            }
            if let Some((id, _, _)) = best {
                return (id, rivals);
            }
        }
        unreachable!("the obtainable count promised a block")
    }

    /// Takes `count` blocks: the free list's first, top first, then from the order's front,
    /// evicting what they hold (a run's tail, truncated in one step, or an entry moved into a
    /// duplicate), as the core's pool does.
    pub(super) fn allocate(&mut self, count: usize, into: &mut Vec<BlockId>) {
        assert!(
            count <= self.order.free_count,
            "the cache cannot hold this request"
        );
        let free = &mut self.order.free;
        let listed = count.min(free.len());
        into.extend(free.drain(free.len() - listed..).rev());
        self.order.free_count -= listed;
        let mut need = (count - listed) as u32;
        while need > 0 {
            let (id, rivals) = self.pick();
            let Segment {
                run, lo, hi, dup, ..
            } = self.order.segments[id as usize];
            if dup != NONE {
                // A spare goes like any free block; its canonical copy keeps the entry.
                let Dup {
                    run, pos, block, ..
                } = self.dups[dup as usize];
                self.forget_as_successor(run, pos, block);
                into.push(block);
                need -= 1;
                self.order.free_count -= 1;
                self.drop_segment(id);
                self.drop_dup(dup);
                continue;
            }
            let top = hi - 1;
            if self.earliest_dup(run, top).is_some() {
                // The canonical copy at `top` goes; its earliest duplicate takes the entry,
                // with the canonical copy's place in the order if it is a spare, held by its
                // request otherwise.
                self.replace(run, top, into);
                need -= 1;
                self.order.free_count -= 1;
                self.order.segments[id as usize].hi = top;
            } else {
                // Down to the first position a duplicate would take over.
                let r = &self.runs[run as usize];
                // (And never into the pinned blocks.)
                let floor = r
                    .dups
                    .iter()
                    .map(|&d| self.dups[d as usize])
                    .filter(|d| !d.inherited && d.pos >= lo && d.pos < hi)
                    .map(|d| d.pos + 1)
                    .max()
                    .unwrap_or(lo)
                    .max(r.pinned);
                let most = if rivals { 1 } else { need };
                let stop = floor.max(hi - most.min(hi - lo));
                debug_assert_eq!(hi, r.len, "truncation takes a run's tail");
                let shared = r.shared.expect("a run with blocks is in the table");
                let first = into.len();
                self.table
                    .read_ids(&self.alloc, shared, stop as usize, hi as usize, into);
                if r.with_successor > 0 || (stop == 0 && r.parent != NONE) {
                    // When no copy of this run's blocks has a successor, an evicted block
                    // can be one only at the run's first position (a copy in the parent run):
                    // skipped otherwise, the pass would find nothing.
                    self.forget_as_successors(run, stop, hi, &into[first..]);
                }
                // Handed out top first, as the core's pool evicts a chain from its tail.
                into[first..].reverse();
                if let Some(log) = self.eviction_log.as_mut() {
                    log.extend_from_slice(&into[first..]);
                }
                if self.events.enabled() {
                    for &block in &into[first..] {
                        self.events.removed(block);
                    }
                }
                let r = &mut self.runs[run as usize];
                r.refs.truncate(stop as usize);
                r.priority.truncate(stop as usize);
                if !r.pins.is_empty() {
                    r.pins.truncate(stop as usize);
                }
                r.len = stop;
                if stop > 0 {
                    // A leaf (its tail goes first), so no run hangs under it: the fresh id
                    // the truncation gives it is no child's concern.
                    r.shared = Some(self.table.truncate(&mut self.alloc, shared, stop as usize));
                }
                let take = hi - stop;
                self.counters.evictions += u64::from(take);
                need -= take;
                self.order.free_count -= take as usize;
                self.order.segments[id as usize].hi = stop;
                if stop == 0 {
                    // The whole run went, all of it in this segment (`floor` is 0).
                    self.drop_segment(id);
                    self.unhook(run);
                    continue;
                }
            }
            let s = self.order.segments[id as usize];
            if s.lo == s.hi {
                self.drop_segment(id);
            }
        }
    }

    /// Evicts block `pos` of `run`, which has a duplicate: the earliest one takes the entry
    /// (its token row copied), as the core's pool moves it.
    fn replace(&mut self, run: u32, pos: u32, into: &mut Vec<BlockId>) {
        let dup = self
            .earliest_dup(run, pos)
            .expect("a duplicate to take the entry");
        let Dup {
            block: copy,
            segment,
            priority,
            ..
        } = self.dups[dup as usize];
        let shared = self.runs[run as usize].shared.expect("in the table");
        // The copy's row takes the canonical block's; the run keeps its id (its content is
        // the same), so its children stay found under it.
        let canonical = self.table.replace(shared, pos as usize, copy);
        // The content stays cached under the same key: nothing for a router to learn.
        self.events.moved(canonical, copy);
        self.forget_as_successor(run, pos, canonical);
        let r = &self.runs[run as usize];
        if pos + 1 == r.len && !r.children.is_empty() {
            self.counters.ends_replaced_under_children += 1;
        }
        into.push(canonical);
        if segment == NONE {
            // The entry is the copy's block now, with the copy's priority (its request's; the
            // request's finish raises it again, as every holder's does).
            let r = &mut self.runs[run as usize];
            r.set_priority(pos, priority);
            r.refs[pos as usize] = 1;
            // Still listed with the run (a split moves it): its request's finish releases it
            // as the run's block.
            self.dups[dup as usize].inherited = true;
            self.counters.held_take_overs += 1;
        } else {
            // A spare's holder is gone: it takes the canonical copy's place under the same
            // parent (the core's pool), not under the copy before it.
            self.forget_as_successor(run, pos, copy);
            let s = &mut self.order.segments[segment as usize];
            (s.run, s.lo, s.hi, s.dup) = (run, pos, pos + 1, NONE);
            self.runs[run as usize].set_priority(pos, s.priority);
            self.runs[run as usize].segments.push(segment);
            self.drop_dup(dup);
            self.counters.spare_take_overs += 1;
        }
    }

    /// Removes the emptied `run` from its parent and the run table, and recycles it.
    fn unhook(&mut self, run: u32) {
        let r = &mut self.runs[run as usize];
        debug_assert!(
            r.dups.is_empty() && r.segments.is_empty() && r.children.is_empty(),
            "an emptied run has no duplicates, children or queued blocks"
        );
        debug_assert_eq!(r.pinned, 0, "an emptied run had no pinned block");
        r.pins.clear();
        r.origin = None;
        r.tag = None;
        let shared = r.shared.take().expect("a run with blocks was in the table");
        let parent = r.parent;
        self.table.remove(&mut self.alloc, shared);
        self.by_slot[shared.slot as usize] = NONE;
        if parent != NONE {
            self.runs[parent as usize].children.retain(|&c| c != run);
        }
        self.free_runs.push(run);
    }
}
