//! Publishing a request's blocks (`RunCache::commit`): duplicates of blocks published first,
//! then a run grown in place, split where the request branches, or a new child (a block with
//! multimodal items always starts one: its tag names it in the run table); and reading a
//! request's holds across the splits made since it took them.

use std::collections::VecDeque;

use super::{slab_put, Dup, Held, Run, RunCache, RunRequest, NONE};
use crate::cache::block_extras;
use crate::error::{CacheError, Result};
use crate::key::BlockKey;
use crate::run_table::RunParent;

/// A tagged run's first block: see `Run::tag`.
pub(super) struct RunTag {
    pub(super) key: BlockKey,
    pub(super) extras: Vec<u8>,
}

impl Run {
    /// Its first block's tag, if it has multimodal items.
    pub(super) fn tag_key(&self) -> Option<&BlockKey> {
        self.tag.as_ref().map(|t| &t.key)
    }
}

impl RunRequest {
    /// Block `index`'s tag, if multimodal items overlap it.
    fn tag_at(&self, index: usize) -> Option<&BlockKey> {
        let at = self.tags.partition_point(|&(b, _)| (b as usize) < index);
        self.tags
            .get(at)
            .filter(|&&(b, _)| b as usize == index)
            .map(|(_, tag)| tag)
    }

    /// The first tagged block after block `index` (`usize::MAX`: none).
    fn next_tag_after(&self, index: usize) -> usize {
        let at = self.tags.partition_point(|&(b, _)| (b as usize) <= index);
        self.tags.get(at).map_or(usize::MAX, |&(b, _)| b as usize)
    }
}

impl RunCache {
    /// The KV of the request's first `num_computed_tokens` tokens is written: publishes the
    /// full blocks among them past what it matched or published before (a chunked prefill
    /// commits chunk after chunk; a count past the prompt is the whole prompt). A block another
    /// request published first (the run's next block, a child's first, a first block) is a
    /// duplicate: recorded, the request keeps its own copy (the core's deduplication), and its
    /// later blocks chain on the canonical one. The rest go after the last: the run grows in
    /// place if it ends there with no child, is split if it goes on, or gets a new child.
    ///
    /// Refused by name, with nothing changed, for more tokens than the request has or KV past
    /// its slots (as the core's `commit`).
    pub fn commit(&mut self, request: &mut RunRequest, num_computed_tokens: usize) -> Result<()> {
        let bs = self.block_size;
        Self::check_commit(request, num_computed_tokens, bs)?;
        request.num_computed = request.num_computed.max(num_computed_tokens);
        // Drafts are never published: only blocks whose every token is verified.
        let full = request.num_computed.min(request.num_verified()) / bs;
        let mut at = request.cached_blocks.max(request.committed);
        request.committed = request.committed.max(full);
        if full <= at {
            return Ok(());
        }
        // What the request holds, as the runs are now (another request may have split them).
        request.held = self.resolve(&request.held);
        let (mut run, mut end) = match request.held.last() {
            None => (NONE, 0),
            Some(&Held::Blocks { run, to, .. }) => (run, to),
            Some(&Held::Copy(dup)) => {
                let d = self.dups[dup as usize];
                (d.run, d.pos + 1)
            }
        };
        // A copy this request committed last time (its last block then) parents the block
        // this commit publishes first, in the core's pool: it is that copy's successor now.
        if let Some(&Held::Copy(dup)) = request.held.last() {
            self.set_successor(dup, request.blocks[at]);
            self.counters.copies_with_successor += 1;
        }
        let first_copy = request.held.len();
        let copies_from = at;
        while at < full {
            let block = &request.tokens[at * bs..(at + 1) * bs];
            let tag = request.tag_at(at);
            let Some((canonical_run, pos)) =
                self.cached_after(&request.root, (run, end), block, tag)
            else {
                break;
            };
            let record = Dup {
                run: canonical_run,
                pos,
                block: request.blocks[at],
                segment: NONE,
                priority: request.priority,
                inherited: false,
                successor: NONE,
            };
            let dup = slab_put(&mut self.dups, &mut self.free_dups, record);
            self.runs[canonical_run as usize].dups.push_back(dup);
            request.held.push(Held::Copy(dup));
            (run, end) = (canonical_run, pos + 1);
            at += 1;
        }
        // Each copy's successor is the request's next block, a copy too or published below:
        // its parent in the core's pool.
        for (i, item) in request.held[first_copy..].iter().enumerate() {
            if let Held::Copy(dup) = *item {
                let next = copies_from + i + 1;
                self.counters.copies += 1;
                self.counters.copies_with_successor += u64::from(next < full);
                let successor = if next < full {
                    request.blocks[next]
                } else {
                    NONE
                };
                self.set_successor(dup, successor);
            }
        }
        if at == full {
            return Ok(());
        }
        // The block this commit's first one hangs after: the canonical one, whose key a
        // duplicate of it shares (its KV events' parent).
        let parent_block = (run != NONE).then(|| self.block(run, end - 1));
        let first_published = at;
        // A tagged block (multimodal items) starts a run of its own: the rest is published in
        // stretches, each but the first beginning at one.
        while at < full {
            let stop = request.next_tag_after(at).min(full);
            let target = self.publish_stretch(request, run, end, at..stop);
            (run, end) = (target, self.runs[target as usize].len);
            at = stop;
        }
        if self.events.enabled() {
            self.record_stored(request, parent_block, first_published, full);
        }
        Ok(())
    }

    /// Publishes the request's blocks `range` (no tagged one past its first) after the first
    /// `end` blocks of `run` (`NONE`: at its root): the run grows in place if it ends there with
    /// no child and the first block is untagged, is split if it goes on, or gets a new child.
    /// Returns the run that took them.
    fn publish_stretch(
        &mut self,
        request: &mut RunRequest,
        run: u32,
        end: u32,
        range: std::ops::Range<usize>,
    ) -> u32 {
        let bs = self.block_size;
        let tag = request.tag_at(range.start).copied();
        let target = if run == NONE {
            self.new_run(NONE)
        } else {
            if end < self.runs[run as usize].len {
                self.split(run, end);
            }
            if self.runs[run as usize].children.is_empty() && tag.is_none() {
                run
            } else {
                self.new_run(run)
            }
        };
        if let Some(key) = tag {
            let mut extras = Vec::new();
            block_extras(&request.origin.extras, range.start, bs, &mut extras);
            self.runs[target as usize].tag = Some(Box::new(RunTag { key, extras }));
        }
        // Published (and indexed) before the writer's length grows: a new run hangs under its
        // parent's length as it is.
        let (blocks, tokens) = (
            &request.blocks[range.clone()],
            &request.tokens[range.start * bs..range.end * bs],
        );
        match self.runs[target as usize].shared {
            Some(shared) => self.table.extend(&mut self.alloc, shared, blocks, tokens),
            None => {
                let parent = self.shared_parent(target, request.root);
                let shared = self.table.create(&mut self.alloc, parent, blocks, tokens);
                let origin = (run == NONE).then(|| request.origin.without_multimodal());
                let t = &mut self.runs[target as usize];
                t.shared = Some(shared);
                t.origin = origin;
                self.by_slot[shared.slot as usize] = target;
            }
        }
        if target != run && run != NONE {
            self.runs[run as usize].children.push(target);
        }
        let t = &mut self.runs[target as usize];
        let from = t.len;
        t.one_priority = match t.one_priority {
            _ if from == 0 => Some(request.priority),
            Some(p) if p == request.priority => Some(p),
            _ => None,
        };
        t.len += u32::try_from(range.len()).expect("a run is shorter than the pool");
        t.refs.resize(t.len as usize, 1);
        t.priority.resize(t.len as usize, request.priority);
        if !t.pins.is_empty() {
            t.pins.resize(t.len as usize, 0);
        }
        request.held.push(Held::Blocks {
            run: target,
            from,
            to: t.len,
        });
        target
    }

    /// Why `request` may not record `num_computed_tokens` tokens of KV, if it may not: more
    /// tokens than it has, or KV past its slots (the core's `commit_refusal`).
    pub fn check_commit(
        request: &RunRequest,
        num_computed_tokens: usize,
        block_size: usize,
    ) -> Result<()> {
        let len = request.tokens.len();
        if num_computed_tokens > len {
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {len} tokens"
            )));
        }
        let slots = request.blocks.len() * block_size;
        if num_computed_tokens > slots {
            return Err(CacheError::InvalidInput(format!(
                "num_computed_tokens {num_computed_tokens} exceeds the request's {slots} slots: \
                 no KV can have been written past them (allocate_slots first)"
            )));
        }
        Ok(())
    }

    /// A request's holds as the runs are now: a split since a hold was taken hands the blocks
    /// past it to the run that continues the old one (`continued`), which the holder's own
    /// references keep alive.
    pub(super) fn resolve(&mut self, held: &[Held]) -> Vec<Held> {
        let mut out = Vec::with_capacity(held.len());
        for &item in held {
            let Held::Blocks {
                mut run,
                mut from,
                mut to,
            } = item
            else {
                out.push(item);
                continue;
            };
            loop {
                let len = self.runs[run as usize].len;
                if to <= len {
                    out.push(Held::Blocks { run, from, to });
                    break;
                }
                if from < len {
                    out.push(Held::Blocks { run, from, to: len });
                }
                self.counters.steps_across_splits += 1;
                from = from.saturating_sub(len);
                to -= len;
                run = self.runs[run as usize].continued;
                debug_assert_ne!(run, NONE, "a hold past a run's end crossed a split");
            }
        }
        out
    }

    /// The cached block with tokens `block` (and multimodal items tagged `tag`) right after
    /// the first `matched` blocks of `run` (`NONE`: at `root`), as (run, position).
    fn cached_after(
        &self,
        root: &BlockKey,
        (run, matched): (u32, u32),
        block: &[u32],
        tag: Option<&BlockKey>,
    ) -> Option<(u32, u32)> {
        let under = if run == NONE {
            None
        } else {
            let r = &self.runs[run as usize];
            if matched < r.len {
                // Inside a run every block is untagged (a tagged one starts its run).
                if tag.is_some() {
                    return None;
                }
                let candidate = self.block(run, matched);
                return self
                    .table
                    .block_holds(candidate, block)
                    .then_some((run, matched));
            }
            Some((r.shared?.id, r.len))
        };
        let parent = RunParent::of_block(under, root, tag);
        let hash = self.table.hash_of(&parent, block);
        let (slot, _) = self.table.find(hash, &parent, block, &mut Vec::new())?;
        Some((self.by_slot[slot as usize], 0))
    }

    /// Cuts `run` after `at` blocks: the tail becomes a child run that takes the children, the
    /// queued segments past `at` (one across it is cut in two) and the duplicates past it.
    fn split(&mut self, run: u32, at: u32) {
        self.counters.splits += 1;
        let tail = self.new_run(run);
        // The run table's split: the head keeps its slot under a fresh id, the tail is a run
        // of its own hung under the head.
        let shared = self.runs[run as usize].shared.expect("in the table");
        let (head, tail_shared) = self.table.split(&mut self.alloc, shared, at as usize);
        self.by_slot[tail_shared.slot as usize] = tail;
        let r = &mut self.runs[run as usize];
        r.shared = Some(head);
        let tail_len = r.len - at;
        r.len = at;
        let refs = r.refs.split_off(at as usize);
        let pins = if r.pins.is_empty() {
            Vec::new()
        } else {
            r.pins.split_off(at as usize)
        };
        let tail_pinned = r.pinned.saturating_sub(at);
        r.pinned = r.pinned.min(at);
        let priority = r.priority.split_off(at as usize);
        let children = std::mem::take(&mut r.children);
        let segments = std::mem::take(&mut r.segments);
        let dups = std::mem::take(&mut r.dups);
        let continued = std::mem::replace(&mut r.continued, tail);
        let (stay, moved) = self.order.split_segments(segments, tail, at);
        self.runs[run as usize].segments = stay;
        // Duplicates follow their canonical copies.
        let (moved_dups, kept): (VecDeque<u32>, VecDeque<u32>) = dups
            .into_iter()
            .partition(|&d| self.dups[d as usize].pos >= at);
        let mut moved_with_successor = 0;
        for &d in &moved_dups {
            let record = &mut self.dups[d as usize];
            record.run = tail;
            record.pos -= at;
            moved_with_successor += u32::from(record.successor != NONE);
        }
        let r = &mut self.runs[run as usize];
        r.dups = kept;
        r.with_successor -= moved_with_successor;
        // The children hang under the tail now, in the run table too (each under its tag).
        for &c in &children {
            let child = &mut self.runs[c as usize];
            child.parent = tail;
            let under = Some((tail_shared.id, tail_len));
            let parent = RunParent::of_block(under, &BlockKey([0; 32]), child.tag_key());
            let child = child.shared.expect("in the table");
            self.table.set_parent(&mut self.alloc, child, parent);
        }
        let one_priority = self.runs[run as usize].one_priority;
        let t = &mut self.runs[tail as usize];
        t.shared = Some(tail_shared);
        t.len = tail_len;
        t.refs = refs;
        t.pins = pins;
        t.pinned = tail_pinned;
        t.priority = priority;
        t.one_priority = one_priority;
        t.children = children;
        t.segments = moved;
        t.dups = moved_dups;
        t.with_successor = moved_with_successor;
        t.continued = continued;
        self.runs[run as usize].children.push(tail);
    }
}
