//! Pins on runs: keeping a cached prefix from eviction without holding it, as the core's pins
//! do (`crate::pins`).
//!
//! A pin matches the cached prefix of a prompt and pins each of its blocks once. It is not a
//! reference: a pinned block nobody holds stays *queued* in its segment, in its place in the
//! order (so that when the pin goes it is evicted when the core would evict it, by the tick of
//! its release), but it is never given and not counted obtainable. A pin covers a prefix of
//! every run it crosses, so a run's pinned blocks are always its first `pinned`: eviction,
//! which takes a run from its tail, stops there (`order.rs`: `can_give`, the truncation's
//! floor), and every count of queued blocks leaves them out (`push_blocks`, `take_below`).
//!
//! What a pin covers is kept as the runs' ranges it crossed (`Held`), read back through later
//! splits as a request's holds are (`resolve`).

use super::{Held, RunCache};
use crate::key::BlockKey;

impl RunCache {
    /// Pins the cached prefix of `tokens` under `root` (every full block matched, the last one
    /// of a full hit too); the runs' ranges pinned, and how many blocks.
    pub(super) fn pin(
        &mut self,
        root: &BlockKey,
        tokens: &[u32],
        tags: &[(u32, BlockKey)],
    ) -> (Vec<Held>, usize) {
        let bs = self.block_size;
        let full = tokens.len() / bs;
        let mut matched = Vec::new();
        let mut spans: Vec<(u32, u32)> = Vec::new();
        self.table.match_prompt(
            root,
            &tokens[..full * bs],
            tags,
            &mut matched,
            |slot, found| {
                let run = self.by_slot[slot as usize];
                spans.push((run, found.matched));
                !self.runs[run as usize].children.is_empty()
            },
        );
        let mut held = Vec::with_capacity(spans.len());
        for (run, to) in spans {
            if to == 0 {
                continue;
            }
            self.pin_prefix(run, to);
            held.push(Held::Blocks { run, from: 0, to });
        }
        (held, matched.len())
    }

    /// Drops a pin taken by `pin` (its ranges as `pin` returned them).
    pub(super) fn unpin(&mut self, held: &[Held]) {
        for item in self.resolve(held) {
            if let Held::Blocks { run, from, to } = item {
                debug_assert_eq!(from, 0, "a pin covers a prefix of each run");
                self.unpin_prefix(run, to);
            }
        }
    }

    /// Blocks pinned at least once.
    #[must_use]
    pub fn num_pinned(&self) -> usize {
        self.num_pinned
    }

    /// One more pin on `run`'s first `to` blocks.
    fn pin_prefix(&mut self, run: u32, to: u32) {
        let r = &mut self.runs[run as usize];
        if r.pins.is_empty() {
            r.pins.resize(r.len as usize, 0);
        }
        for count in &mut r.pins[..to as usize] {
            *count += 1;
        }
        let before = r.pinned;
        if to > before {
            r.pinned = to;
            self.num_pinned += (to - before) as usize;
            // The blocks newly pinned that were queued are no longer obtainable.
            let queued = self.order.queued_below(&r.segments, to)
                - self.order.queued_below(&r.segments, before);
            self.order.free_count -= queued;
        }
    }

    /// One pin less on `run`'s first `to` blocks.
    fn unpin_prefix(&mut self, run: u32, to: u32) {
        let r = &mut self.runs[run as usize];
        for count in &mut r.pins[..to as usize] {
            *count -= 1;
        }
        let before = r.pinned;
        // The counts never rise along the run: the pinned blocks are those before the first 0.
        let after = r.pins[..before as usize].partition_point(|&count| count > 0) as u32;
        if after < before {
            r.pinned = after;
            self.num_pinned -= (before - after) as usize;
            // The blocks unpinned that are queued are obtainable again, in their old places.
            let queued = self.order.queued_below(&r.segments, before)
                - self.order.queued_below(&r.segments, after);
            self.order.free_count += queued;
        }
    }
}
