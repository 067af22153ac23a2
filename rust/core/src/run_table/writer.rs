//! The writer's operations on runs: create, extend, truncate, split, replace a block, hang a
//! run elsewhere, remove. One writer at a time (the caller serialises them); readers run
//! alongside on any thread.
//!
//! Each operation keeps the module rule (`mod.rs`): what a reader of a run may read changes
//! only after that run's stamp went odd. Rows of blocks joining a run and chunks beyond a
//! run's length are written before the window that publishes them; chunks leaving a run are
//! freed after the window that drops them, and whatever reuses them later is stored after that
//! window's release fence, so a reader that sees the new value sees the stamp moved (the
//! fence-to-fence argument in `mod.rs`). An operation that shortens a run gives it a fresh id.
//!
//! A writer-side misuse (a slot that does not hold the run named, a position out of range,
//! a block out of the pool) is a bug in the caller, not bad input from a user: it panics with
//! a message, as the pool does for a double release.

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::{fence, RunParent, RunRef, RunSlot, RunTable, CHUNK, NO_CHUNK};
use crate::pool::BlockId;

/// The writer's own bookkeeping: free slots, free chunks, the next run id, and each slot's
/// chunks in order (so an extension appends and a truncation cuts in O(1), where following the
/// chunk links of a long run took a dependent load per 16 blocks). Never read by a reader.
pub struct RunAllocator {
    free_slots: Vec<u32>,
    free_chunks: Vec<u32>,
    /// Run ids start at 1 (0 marks an empty slot) and are never reused.
    next_id: u64,
    /// Inline up to four chunks (a run of up to 64 blocks, most of them): the list then sits
    /// in its header, one line fewer to fetch when an evicted run's ids are read and its
    /// chunks freed.
    chunks: Vec<SmallVec<[u32; 4]>>,
    /// Per slot: the index hash its run is found under (its parent and first block).
    hash: Vec<u32>,
}

/// How many blocks ahead `create` asks for the token row it will write: each row is a cold
/// line, and a store to a missing line waits in the store buffer, which holds a few rows'
/// stores; asked for ahead, the lines arrive in parallel.
const ROW_PREFETCH_AHEAD: usize = 16;

impl RunAllocator {
    /// The bookkeeping of an empty `table`.
    #[must_use]
    pub fn new(table: &RunTable) -> Self {
        let slots = u32::try_from(table.num_slots()).expect("RunTable::new bounds the size");
        let chunks = u32::try_from(table.num_chunks()).expect("RunTable::new bounds the size");
        Self {
            // Popped from the end: the lowest slot and chunk first.
            free_slots: (0..slots).rev().collect(),
            free_chunks: (0..chunks).rev().collect(),
            next_id: 1,
            chunks: vec![SmallVec::new(); slots as usize],
            hash: vec![0; slots as usize],
        }
    }

    /// Runs the table holds.
    #[must_use]
    pub fn num_runs(&self) -> usize {
        self.chunks.len() - self.free_slots.len()
    }

    fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn take_chunk(&mut self) -> u32 {
        self.free_chunks
            .pop()
            .expect("the arena holds every run's chunks (RunTable::new)")
    }
}

impl RunSlot {
    /// Opens the writer's window: the stamp goes odd, and a release fence orders it before
    /// every store that follows. Returns the stamp to close with.
    #[inline]
    fn open(&self) -> u64 {
        let stamp = self.stamp.load(Ordering::Relaxed);
        debug_assert_eq!(stamp & 1, 0, "one writer at a time");
        self.stamp.store(stamp + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        stamp + 2
    }

    #[inline]
    fn close(&self, stamp: u64) {
        self.stamp.store(stamp, Ordering::Release);
    }
}

impl RunTable {
    /// The slot of `run`, checked to hold it.
    fn record(&self, run: RunRef) -> &RunSlot {
        let record = &self.slots[run.slot as usize];
        assert_eq!(
            record.id.load(Ordering::Relaxed),
            run.id,
            "slot {} does not hold run {}",
            run.slot,
            run.id
        );
        record
    }

    /// Blocks in `run` (writer side).
    #[must_use]
    pub fn run_len(&self, run: RunRef) -> usize {
        self.record(run).len.load(Ordering::Relaxed) as usize
    }

    /// `run`'s block ids, in order (writer side).
    #[must_use]
    pub fn run_blocks(&self, run: RunRef) -> Vec<BlockId> {
        let record = self.record(run);
        let len = record.len.load(Ordering::Relaxed) as usize;
        let mut blocks = Vec::with_capacity(len);
        self.read_blocks(record, len, |block| {
            blocks.push(block);
            true
        });
        blocks
    }

    /// The block at `position` of `run` (writer side), found through the writer's list of
    /// the run's chunks: one load, where the chunk links cost one per 16 blocks before it.
    #[must_use]
    pub fn block_at(&self, alloc: &RunAllocator, run: RunRef, position: usize) -> BlockId {
        debug_assert!(
            position < self.run_len(run),
            "position {position} beyond run {}",
            run.id
        );
        let chunk = alloc.chunks[run.slot as usize][position / CHUNK];
        self.chunk_blocks[chunk as usize * CHUNK + position % CHUNK].load(Ordering::Relaxed)
    }

    /// Appends the ids of `run`'s blocks `from..to` to `out`, in order (writer side).
    pub fn read_ids(
        &self,
        alloc: &RunAllocator,
        run: RunRef,
        from: usize,
        to: usize,
        out: &mut Vec<BlockId>,
    ) {
        debug_assert!(
            from <= to && to <= self.run_len(run),
            "blocks {from}..{to} of run {}",
            run.id
        );
        let chunks = &alloc.chunks[run.slot as usize];
        if to > from {
            // An evicted tail's chunks are cold lines scattered over the arena: asked for all
            // at once, their misses overlap instead of queueing one chunk after another.
            for &chunk in &chunks[from / CHUNK..=(to - 1) / CHUNK] {
                crate::prefetch::prefetch(&self.chunk_blocks[chunk as usize * CHUNK]);
            }
        }
        let mut position = from;
        while position < to {
            // The chunk holding `position`: positions `start..start + CHUNK` of the run.
            let start = position / CHUNK * CHUNK;
            let end = to.min(start + CHUNK);
            let base = chunks[position / CHUNK] as usize * CHUNK;
            out.extend(
                self.chunk_blocks[base + position - start..base + end - start]
                    .iter()
                    .map(|cell| cell.load(Ordering::Relaxed)),
            );
            position = end;
        }
    }

    /// Whether `block`'s row holds `tokens` (one block's; writer side: a reader compares rows
    /// only under a run's stamp, `match_run`).
    #[must_use]
    pub fn block_holds(&self, block: BlockId, tokens: &[u32]) -> bool {
        tokens.len() == self.block_size && self.row_equals(block, tokens)
    }

    /// `block`'s tokens, read back from its row (writer side).
    pub(crate) fn read_row(&self, block: BlockId) -> smallvec::SmallVec<[u32; 16]> {
        let mut tokens: smallvec::SmallVec<[u32; 16]> = self
            .row(block)
            .iter()
            .flat_map(|cell| {
                let word = cell.load(Ordering::Relaxed);
                [word as u32, (word >> 32) as u32]
            })
            .collect();
        tokens.truncate(self.block_size);
        tokens
    }

    /// The index hash of a run hung under `parent` whose first block is `first` (its row
    /// written).
    fn hash_under(&self, parent: &RunParent, first: BlockId) -> u32 {
        self.hash_of(parent, &self.read_row(first))
    }

    /// Writes `block`'s token row. Only for a block in no run: no reader of a run reaches it
    /// before the window that puts it in one.
    #[inline]
    fn write_row(&self, block: BlockId, tokens: &[u32]) {
        debug_assert_eq!(tokens.len(), self.block_size);
        let cells = self.row(block);
        if let (Ok(cells), Ok(tokens)) = (
            <&[super::AtomicU64; 8]>::try_from(cells),
            <&[u32; 16]>::try_from(tokens),
        ) {
            // The usual block size, as fixed-length arrays: the stores unrolled, no loop.
            for (cell, pair) in cells.iter().zip(tokens.chunks_exact(2)) {
                cell.store(crate::table::pack(pair), Ordering::Relaxed);
            }
        } else {
            for (cell, pair) in cells.iter().zip(tokens.chunks(2)) {
                cell.store(crate::table::pack(pair), Ordering::Relaxed);
            }
        }
    }

    fn check_blocks(&self, blocks: &[BlockId], tokens: Option<&[u32]>) {
        assert!(!blocks.is_empty(), "a run holds at least one block");
        // Debug only: an id beyond the pool panics anyway at its row, and this pass over every
        // id would be a second one on each publish.
        debug_assert!(
            blocks
                .iter()
                .all(|&block| (block as usize) < self.num_blocks),
            "a block id beyond the pool"
        );
        if let Some(tokens) = tokens {
            assert_eq!(
                tokens.len(),
                blocks.len() * self.block_size,
                "one row of tokens per block"
            );
        }
    }

    /// Stores `blocks` in chunks from position `len` of the run whose last chunk is
    /// the last of `alloc.chunks[slot]` (none yet: the run's first), linking new chunks. Returns the run's
    /// first chunk when it had none. All of it beyond the run's published length.
    fn append_ids(
        &self,
        alloc: &mut RunAllocator,
        slot: u32,
        len: usize,
        blocks: &[BlockId],
    ) -> Option<u32> {
        let mut first = None;
        let mut chunk = alloc.chunks[slot as usize]
            .last()
            .copied()
            .unwrap_or(NO_CHUNK);
        let mut position = len;
        let mut rest = blocks;
        while !rest.is_empty() {
            // A chunk's worth at a time: the room left in the last chunk, else a new one.
            if position.is_multiple_of(CHUNK) {
                let next = alloc.take_chunk();
                self.chunk_next[next as usize].store(NO_CHUNK, Ordering::Relaxed);
                if chunk == NO_CHUNK {
                    first = Some(next);
                } else {
                    self.chunk_next[chunk as usize].store(next, Ordering::Relaxed);
                }
                alloc.chunks[slot as usize].push(next);
                chunk = next;
            }
            let offset = position % CHUNK;
            let base = chunk as usize * CHUNK;
            let cells = &self.chunk_blocks[base + offset..base + CHUNK];
            let (here, later) = rest.split_at(rest.len().min(cells.len()));
            for (cell, &block) in cells.iter().zip(here) {
                cell.store(block, Ordering::Relaxed);
            }
            position += here.len();
            rest = later;
        }
        first
    }

    /// Publishes a new run of `blocks` (in no run now) hanging under `parent`, with the token
    /// rows `tokens` (`block_size` per block), and indexes it. Returns where it lives. No other
    /// run under `parent` may begin with the same first block (one content, one run: the
    /// caller extends or splits the run it matched instead).
    pub fn create(
        &self,
        alloc: &mut RunAllocator,
        parent: RunParent,
        blocks: &[BlockId],
        tokens: &[u32],
    ) -> RunRef {
        self.check_blocks(blocks, Some(tokens));
        for (i, (&block, row)) in blocks
            .iter()
            .zip(tokens.chunks_exact(self.block_size))
            .enumerate()
        {
            if let Some(&ahead) = blocks.get(i + ROW_PREFETCH_AHEAD) {
                crate::prefetch::prefetch(&self.row(ahead)[0]);
            }
            self.write_row(block, row);
        }
        let hash = self.hash_of(&parent, &tokens[..self.block_size]);
        self.create_with_rows(alloc, parent, blocks, hash)
    }

    /// `create` for blocks whose rows already hold their tokens (a split's tail), found under
    /// `hash` (`hash_of` the parent and the first block's tokens).
    fn create_with_rows(
        &self,
        alloc: &mut RunAllocator,
        parent: RunParent,
        blocks: &[BlockId],
        hash: u32,
    ) -> RunRef {
        let slot = alloc
            .free_slots
            .pop()
            .expect("a run holds a block, so there are never more runs than blocks");
        let first = self
            .append_ids(alloc, slot, 0, blocks)
            .expect("a run starts with a chunk");
        let id = alloc.new_id();
        let record = &self.slots[slot as usize];
        let stamp = record.open();
        record.id.store(id, Ordering::Relaxed);
        self.write_parent(slot, record, parent);
        record.len.store(blocks.len() as u32, Ordering::Relaxed);
        record.first_chunk.store(first, Ordering::Relaxed);
        record.close(stamp);
        // Indexed once complete: a reader that finds the word finds the run.
        debug_assert_eq!(hash, self.hash_under(&parent, blocks[0]));
        debug_assert!(
            self.find(hash, &parent, &self.read_row(blocks[0]), &mut Vec::new())
                .is_none(),
            "two runs under one parent begin with the same block"
        );
        alloc.hash[slot as usize] = hash;
        self.index.insert(hash, slot);
        RunRef { slot, id }
    }

    /// The parent fields, inside the caller's window.
    fn write_parent(&self, slot: u32, record: &RunSlot, parent: RunParent) {
        let write_key = |key: &crate::key::BlockKey| {
            for (word, bytes) in self.roots[slot as usize].iter().zip(key.0.chunks_exact(8)) {
                let bytes: [u8; 8] = bytes.try_into().unwrap_or_default();
                word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
            }
        };
        match parent {
            RunParent::Root(key) => {
                record.parent.store(0, Ordering::Relaxed);
                record.parent_len.store(0, Ordering::Relaxed);
                write_key(&key);
            }
            RunParent::Run { id, len } => {
                assert!(id != 0 && len != 0, "a parent run has an id and blocks");
                debug_assert!(len < super::TAGGED, "runs are shorter than 2^31 blocks");
                record.parent.store(id, Ordering::Relaxed);
                record.parent_len.store(len, Ordering::Relaxed);
            }
            RunParent::Tagged { id, len, tag } => {
                assert!(id != 0 && len != 0, "a parent run has an id and blocks");
                debug_assert!(len < super::TAGGED, "runs are shorter than 2^31 blocks");
                record.parent.store(id, Ordering::Relaxed);
                record
                    .parent_len
                    .store(len | super::TAGGED, Ordering::Relaxed);
                write_key(&tag);
            }
        }
    }

    /// Appends `blocks` (in no run now) with their rows to `run`'s end. The run keeps its id:
    /// under one id a run only grows.
    pub fn extend(
        &self,
        alloc: &mut RunAllocator,
        run: RunRef,
        blocks: &[BlockId],
        tokens: &[u32],
    ) {
        self.check_blocks(blocks, Some(tokens));
        let record = self.record(run);
        for (&block, row) in blocks.iter().zip(tokens.chunks_exact(self.block_size)) {
            self.write_row(block, row);
        }
        let len = record.len.load(Ordering::Relaxed) as usize;
        let first = self.append_ids(alloc, run.slot, len, blocks);
        debug_assert!(first.is_none(), "a run in a slot has its first chunk");
        let stamp = record.open();
        record
            .len
            .store((len + blocks.len()) as u32, Ordering::Relaxed);
        record.close(stamp);
    }

    /// Cuts `run` to its first `len` blocks (`0 < len <` its length), under a fresh id (module
    /// docs: a run only grows under one id), and frees the chunks it no longer needs. The
    /// blocks cut off are in no run afterwards.
    pub fn truncate(&self, alloc: &mut RunAllocator, run: RunRef, len: usize) -> RunRef {
        let record = self.record(run);
        let old = record.len.load(Ordering::Relaxed) as usize;
        assert!(0 < len && len < old, "truncate {old} blocks to {len}");
        let id = alloc.new_id();
        let stamp = record.open();
        record.id.store(id, Ordering::Relaxed);
        record.len.store(len as u32, Ordering::Relaxed);
        record.close(stamp);
        // After the window: the kept chunks' tail and the freed chunks.
        let chunks = &mut alloc.chunks[run.slot as usize];
        let keep = len.div_ceil(CHUNK);
        self.chunk_next[chunks[keep - 1] as usize].store(NO_CHUNK, Ordering::Relaxed);
        alloc.free_chunks.extend(chunks.drain(keep..));
        RunRef { slot: run.slot, id }
    }

    /// Removes `run`: its slot reads as empty, and its blocks are in no run afterwards.
    pub fn remove(&self, alloc: &mut RunAllocator, run: RunRef) {
        let record = self.record(run);
        let unindexed = self
            .index
            .remove(alloc.hash[run.slot as usize], run.slot, || {});
        assert!(unindexed, "run {} in slot {} was indexed", run.id, run.slot);
        let stamp = record.open();
        record.id.store(0, Ordering::Relaxed);
        record.len.store(0, Ordering::Relaxed);
        record.first_chunk.store(NO_CHUNK, Ordering::Relaxed);
        record.close(stamp);
        let chunks = &mut alloc.chunks[run.slot as usize];
        alloc.free_chunks.extend(chunks.drain(..));
        alloc.free_slots.push(run.slot);
    }

    /// Splits `run` before position `at` (`0 < at <` its length), as a radix tree splits a
    /// node where a prompt branches: the head keeps the slot under a fresh id, the tail becomes
    /// a run of its own hung under the head. Returns both. The caller hangs the old run's
    /// children under the tail (`set_parent`): until then a reader that matched head and tail
    /// misses them, and one that matched the old run whole before the split still finds them,
    /// which is right (the content the old id names did not change, and the id is never
    /// given again).
    pub fn split(&self, alloc: &mut RunAllocator, run: RunRef, at: usize) -> (RunRef, RunRef) {
        let len = self.run_len(run);
        assert!(0 < at && at < len, "split {len} blocks at {at}");
        // The tail's ids, read from its chunks (found through the writer's list, not the
        // links), before the truncation frees them.
        let mut tail_blocks = Vec::with_capacity(len - at);
        let chunks = &alloc.chunks[run.slot as usize];
        for (index, &chunk) in chunks.iter().enumerate().skip(at / CHUNK) {
            let base = chunk as usize * CHUNK;
            let from = if index == at / CHUNK { at % CHUNK } else { 0 };
            let to = CHUNK.min(len - index * CHUNK);
            tail_blocks.extend(
                self.chunk_blocks[base + from..base + to]
                    .iter()
                    .map(|cell| cell.load(Ordering::Relaxed)),
            );
        }
        debug_assert_eq!(tail_blocks.len(), len - at);
        let head = self.truncate(alloc, run, at);
        let parent = RunParent::Run {
            id: head.id,
            len: at as u32,
        };
        let hash = self.hash_under(&parent, tail_blocks[0]);
        let tail = self.create_with_rows(alloc, parent, &tail_blocks, hash);
        (head, tail)
    }

    /// Puts `block` (in no run now) in `run`'s place `position`, with the row of the block
    /// there now: the same content computed twice (a duplicate taking over its canonical
    /// copy's place). Returns the block it replaced, which is in no run afterwards. The run
    /// keeps its id: its content does not change.
    pub fn replace(&self, run: RunRef, position: usize, block: BlockId) -> BlockId {
        self.check_blocks(&[block], None);
        let record = self.record(run);
        let len = record.len.load(Ordering::Relaxed) as usize;
        assert!(position < len, "position {position} of a run of {len}");
        let mut chunk = record.first_chunk.load(Ordering::Relaxed);
        for _ in 0..position / CHUNK {
            chunk = self.chunk_next[chunk as usize].load(Ordering::Relaxed);
        }
        let cell = &self.chunk_blocks[chunk as usize * CHUNK + position % CHUNK];
        let old = cell.load(Ordering::Relaxed);
        for (to, from) in self.row(block).iter().zip(self.row(old)) {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let stamp = record.open();
        cell.store(block, Ordering::Relaxed);
        record.close(stamp);
        old
    }

    /// Hangs `run` under `parent` (a split moved what it continues to another run), and
    /// finds it there.
    pub fn set_parent(&self, alloc: &mut RunAllocator, run: RunRef, parent: RunParent) {
        let record = self.record(run);
        let slot = run.slot as usize;
        let unindexed = self.index.remove(alloc.hash[slot], run.slot, || {});
        assert!(unindexed, "run {} in slot {} was indexed", run.id, run.slot);
        let stamp = record.open();
        self.write_parent(run.slot, record, parent);
        record.close(stamp);
        let mut first = Vec::with_capacity(1);
        self.read_blocks(record, 1, |block| {
            first.push(block);
            false
        });
        let hash = self.hash_under(&parent, first[0]);
        debug_assert!(
            self.find(hash, &parent, &self.read_row(first[0]), &mut Vec::new())
                .is_none(),
            "two runs under one parent begin with the same block"
        );
        alloc.hash[slot] = hash;
        self.index.insert(hash, run.slot);
    }

    /// Index words in use: one per run, or something leaked (tests).
    #[cfg(test)]
    pub(crate) fn index_entries(&self) -> usize {
        self.index.count()
    }
}
