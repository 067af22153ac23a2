//! The run table's reader-visible half: runs of blocks that lock-free readers verify while
//! the single writer extends, truncates, splits or rewrites them.
//!
//! Step 1 of the plan in `benches/PROFILE.md` (issue 24, round 18): the per-block table
//! (`table/`) pays a slot, a token row and a metadata line for every block it publishes,
//! evicts or releases; a *run* (a chain of blocks with no branch inside, a radix node) pays
//! one record, and eviction truncates it from its tail in one store. The stand-in
//! (`benches/core_profile/src/run_segments.rs`) showed that this unit hands out the core's
//! block tables, block for block, at 2.6–2.7× less CPU a request on the production trace. This
//! module is the part of it another thread can see, built so that a reader never takes a lock
//! and never returns a block that did not hold the prefix it asked for. Not yet used by the
//! cache: the writer's bookkeeping (holds, the eviction order by segment, duplicates) and the
//! index of run heads and branches are the plan's next steps.
//!
//! ## What a run is, to a reader
//! A run lives in a *run slot* (`RunSlot`, one cache line) and has:
//! - an **id**, unique for the life of the table and never reused;
//! - a **parent**: the full root key (a first run: its first block is a prompt's first block),
//!   or the parent run's id and the parent's length when this run was hung under it (the run
//!   continues the parent's first `parent_len` blocks);
//! - a **length** and its **block ids**, kept in fixed-size chunks of an arena (`CHUNK` ids
//!   to a chunk, a chunk to a cache line), chained;
//! - each block's **token row**, stored per block (two tokens to an atomic word, a row to a
//!   line when the block size allows, as in `table/`), so a hit verifies every token.
//!
//! ## One rule that makes run ids safe: a run only grows under one id
//! A reader that matched run `r` to length `n` and looks for what follows trusts a child only
//! if the child names `r`'s id and `n` as its parent. That is exact only if, for as long as an
//! id lives, the run's first `n` blocks keep the content they had. So every writer operation
//! that *shortens* a run gives it a fresh id (`truncate`, `split`): under one id a run only
//! grows at its end, and a block replaced in place (`replace`, a duplicate taking over its
//! canonical copy's place) has the same content. Without the rule a run truncated and grown
//! again with other tokens would still carry children and readers' expectations of its old
//! content: a wrong hit, the worst bug this crate can have (the unit test
//! `a_run_cut_and_grown_again_is_a_new_run` pins it).
//!
//! ## Reading without locks
//! Every field is an atomic, so no read is a data race; consistency comes from a sequence
//! lock per run slot, the protocol `table/mod.rs` uses per block (Boehm, MSPC 2012). The
//! writer makes the slot's stamp odd, then (after a release fence) stores the fields, then
//! makes it even with `Release`; a reader loads it with `Acquire` (giving up on an odd stamp),
//! reads the fields, the chunks and the token rows, then, after an `Acquire` fence, loads it
//! again and keeps what it read only if it did not change.
//!
//! The block ids and token rows a reader reads are not inside the slot, so the writer keeps
//! one more rule: **nothing a reader of a run may read is changed while the run's stamp is
//! unchanged**. Chunks beyond a run's length and the rows of blocks in no run are written
//! outside any window (no reader of a run reaches them before the stamp that publishes them);
//! a chunk or a block leaves a run only inside that run's window (truncate, split, replace,
//! remove), so a reader that read it before sees the stamp move and drops what it read, even
//! if the chunk or the block's row was rewritten for another run meanwhile. A reader may then
//! read ids that are not blocks at all (a reused chunk): it checks every id against the pool's
//! size before using it, and the stamp check throws the result away.
//!
//! ## Who writes
//! One writer at a time, as for the per-block table: the cache's mutex will serialise the
//! writer operations (`writer.rs`), which also keep the writer-only bookkeeping
//! (`RunAllocator`: free slots, free chunks, the next id). Readers may run on any thread.
//!
//! Under `--cfg loom` the atomics are loom's, so the loom model (`tests/loom_runs.rs`) explores
//! the real protocol, weak orderings included.

mod writer;

#[cfg(test)]
mod race_tests;
#[cfg(test)]
mod tests;

pub use writer::RunAllocator;

#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicU32, AtomicU64};
use std::sync::atomic::Ordering;
#[cfg(not(loom))]
use std::sync::atomic::{fence, AtomicU32, AtomicU64};

use crate::hugepages::filled;
use crate::key::BlockKey;
use crate::pool::BlockId;
use crate::prefetch::prefetch;
use crate::slot_index::{Candidate, SlotIndex};
// One word of a token row, as the per-block table packs it (rows are laid out alike).
use crate::table::pack;

/// Block ids to a chunk: 16 `u32`s, one 64-byte line.
#[cfg(not(loom))]
pub const CHUNK: usize = 16;
/// Block ids to a chunk: one under loom, so a model's run of two blocks crosses a chunk link.
#[cfg(loom)]
pub const CHUNK: usize = 1;

/// "No chunk" in a chunk's `next` link and a slot's `first_chunk`.
const NO_CHUNK: u32 = u32::MAX;

/// Bytes of a cache line, where token rows start.
const LINE: usize = 64;

/// Attempts a reader makes when the writer keeps changing the run it reads, before it reports
/// no match (a shorter match is always a correct answer for a lock-free probe).
#[cfg(not(loom))]
const READ_ROUNDS: usize = 4;
/// Two under loom: a retry is then explored, and the models stay small enough to be exhaustive.
#[cfg(loom)]
const READ_ROUNDS: usize = 2;

/// Where a run's blocks hang.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunParent {
    /// A first run: its first block is a prompt's first block, computed after this root key
    /// (context and salt, `key::root_key`).
    Root(BlockKey),
    /// A run continuing the first `len` blocks of the run whose id is `id`.
    Run {
        /// The parent run's id.
        id: u64,
        /// The parent's length when this run was hung under it.
        len: u32,
    },
    /// As `Run`, for a run whose first block carries multimodal items (`key::run_tag`): only
    /// a prompt block with the same tag finds it. A tagged block is always its run's first
    /// (the run cache's rule), so a reader comparing tokens inside a run never passes one; a
    /// first run's tagged first block hangs under `Root(key::tagged_root(..))`.
    Tagged {
        /// The parent run's id.
        id: u64,
        /// The parent's length when this run was hung under it.
        len: u32,
        /// The first block's tag.
        tag: BlockKey,
    },
}

impl RunParent {
    /// Where a prompt's block hangs: after the first `len` blocks of run `id` (`None`: at the
    /// prompt's start, under `root`), with the block's tag if it has one.
    #[must_use]
    pub fn of_block(under: Option<(u64, u32)>, root: &BlockKey, tag: Option<&BlockKey>) -> Self {
        match (under, tag) {
            (None, None) => Self::Root(*root),
            (None, Some(tag)) => Self::Root(crate::key::tagged_root(root, tag)),
            (Some((id, len)), None) => Self::Run { id, len },
            (Some((id, len)), Some(&tag)) => Self::Tagged { id, len, tag },
        }
    }
}

/// Set in a slot's `parent_len` for a `Tagged` parent (the tag is then in `roots`). Runs are
/// shorter than the pool, which `RunTable::new` keeps under 2^31 blocks.
const TAGGED: u32 = 1 << 31;

/// A run slot and the run's id in it: what the writer's operations take. The id guards the
/// slot's reuse (a writer-side check: `writer.rs` asserts it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunRef {
    /// The slot.
    pub slot: u32,
    /// The run's id.
    pub id: u64,
}

/// One run as a reader saw it at one instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunSnapshot {
    /// The run's id.
    pub id: u64,
    /// Where it hangs.
    pub parent: RunParent,
    /// Its block ids, in order.
    pub blocks: Vec<BlockId>,
}

/// What `RunTable::match_run` found: the run's id and length at the instant it read them,
/// and how many of its leading blocks hold the prompt's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunMatch {
    /// The run's id.
    pub id: u64,
    /// The run's length.
    pub len: u32,
    /// Leading blocks that hold the prompt's blocks.
    pub matched: u32,
}

/// One run's record; one aligned cache line.
#[repr(align(64))]
struct RunSlot {
    /// The sequence lock: odd while the writer changes the run.
    stamp: AtomicU64,
    /// The run's id; 0 when the slot holds none.
    id: AtomicU64,
    /// The parent run's id, or 0 for a first run (whose root key is the slot's `roots` entry,
    /// read and written under this slot's sequence lock).
    parent: AtomicU64,
    /// The parent's length when this run was hung under it (0 for a first run).
    parent_len: AtomicU32,
    /// Blocks in the run.
    len: AtomicU32,
    /// The chunk holding the first `CHUNK` block ids; `NO_CHUNK` when the slot is empty.
    first_chunk: AtomicU32,
}

impl RunSlot {
    fn new() -> Self {
        Self {
            stamp: AtomicU64::new(0),
            id: AtomicU64::new(0),
            parent: AtomicU64::new(0),
            parent_len: AtomicU32::new(0),
            len: AtomicU32::new(0),
            first_chunk: AtomicU32::new(NO_CHUNK),
        }
    }
}

/// The runs, their chunks and the blocks' token rows; see the module docs.
pub struct RunTable {
    /// Where each run is found: a first run by its root key and first block, a run hung under
    /// another by that parent's id and length and its own first block (`head_hash`,
    /// `branch_hash`). A hint, as in the per-block table: `find` verifies every candidate.
    index: SlotIndex,
    /// Seeds the index hashes, so that prompts cannot be chosen to pile up in one probe run.
    seed: u64,
    slots: Box<[RunSlot]>,
    /// Per slot: the root key of a first run, four words (under the slot's sequence lock).
    roots: Box<[[AtomicU64; 4]]>,
    /// `CHUNK` block ids per chunk.
    chunk_blocks: Box<[AtomicU32]>,
    /// Per chunk: the next chunk of its run, or `NO_CHUNK`.
    chunk_next: Box<[AtomicU32]>,
    /// `block_size` token ids per block, two to a word, each row starting on a line when its
    /// size is a multiple of one (as `table/mod.rs` lays them out).
    tokens: Box<[AtomicU64]>,
    num_blocks: usize,
    block_size: usize,
    row_words: usize,
    row_offset: usize,
}

impl RunTable {
    /// A table for a pool of `num_blocks` blocks of `block_size` tokens, allocated in full now
    /// (a run holds at least one block, so there are never more runs than blocks, and the
    /// chunks of all runs fit in `num_blocks + num_blocks / CHUNK + 1`); `None` when the
    /// memory cannot be had or the sizes are out of range.
    #[must_use]
    pub fn new(num_blocks: usize, block_size: usize, seed: u64) -> Option<Self> {
        if block_size == 0 || num_blocks >= u32::MAX as usize / 2 {
            return None;
        }
        let num_chunks = num_blocks + num_blocks / CHUNK + 1;
        let row_words = block_size.div_ceil(2);
        let line_words = LINE / 8;
        let tokens = filled(
            num_blocks
                .checked_mul(row_words)?
                .checked_add(line_words - 1)?,
            || AtomicU64::new(0),
        )?;
        // Words to skip so that the first row starts on a line (then every row of a size
        // that is a multiple of a line does too).
        let row_offset = (line_words - (tokens.as_ptr() as usize / 8) % line_words) % line_words;
        Some(Self {
            index: SlotIndex::new(num_blocks)?,
            seed,
            slots: filled(num_blocks, RunSlot::new)?,
            roots: filled(num_blocks, || std::array::from_fn(|_| AtomicU64::new(0)))?,
            chunk_blocks: filled(num_chunks.checked_mul(CHUNK)?, || AtomicU32::new(0))?,
            chunk_next: filled(num_chunks, || AtomicU32::new(NO_CHUNK))?,
            tokens,
            num_blocks,
            block_size,
            row_words,
            row_offset,
        })
    }

    /// The bytes `new` allocates for these sizes (the run slots and roots, the index, the
    /// chunk arena, the token rows), or `None` past `usize`.
    #[must_use]
    pub fn bytes_up_front(num_blocks: usize, block_size: usize) -> Option<usize> {
        let index =
            SlotIndex::capacity(num_blocks)?.checked_mul(std::mem::size_of::<AtomicU64>())?;
        let per_block = std::mem::size_of::<RunSlot>() + std::mem::size_of::<[AtomicU64; 4]>();
        let chunks = (num_blocks + num_blocks / CHUNK + 1).checked_mul(
            CHUNK * std::mem::size_of::<AtomicU32>() + std::mem::size_of::<AtomicU32>(),
        )?;
        let tokens = num_blocks
            .checked_mul(block_size.div_ceil(2))?
            .checked_add(LINE / 8 - 1)?
            .checked_mul(std::mem::size_of::<AtomicU64>())?;
        num_blocks
            .checked_mul(per_block)?
            .checked_add(index)?
            .checked_add(chunks)?
            .checked_add(tokens)
    }

    /// Tokens per block.
    #[must_use]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Run slots (one per block of the pool).
    #[must_use]
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Chunks in the arena.
    fn num_chunks(&self) -> usize {
        self.chunk_next.len()
    }

    /// `block`'s token row.
    #[inline]
    fn row(&self, block: BlockId) -> &[AtomicU64] {
        let start = self.row_offset + block as usize * self.row_words;
        &self.tokens[start..start + self.row_words]
    }

    /// Whether `block`'s row holds `tokens` (`block_size` of them), compared without an early
    /// exit: the caller checks a stamp after.
    #[inline]
    fn row_equals(&self, block: BlockId, tokens: &[u32]) -> bool {
        let same = |same: bool, (cell, pair): (&AtomicU64, &[u32])| {
            same & (cell.load(Ordering::Relaxed) == pack(pair))
        };
        let cells = self.row(block);
        // 16-token rows, the usual block size, as fixed-length arrays: unrolled, no bounds
        // checks (as `table/mod.rs` compares them).
        match (
            <&[AtomicU64; 8]>::try_from(cells),
            <&[u32; 16]>::try_from(tokens),
        ) {
            (Ok(cells), Ok(tokens)) => cells.iter().zip(tokens.chunks_exact(2)).fold(true, same),
            _ => cells.iter().zip(tokens.chunks(2)).fold(true, same),
        }
    }

    /// The index hash of a first run under `root` whose first block holds `first` (one
    /// block's tokens).
    #[must_use]
    pub fn head_hash(&self, root: &BlockKey, first: &[u32]) -> u32 {
        self.hash_first(&root.0, first)
    }

    /// The index hash of a run hung under the first `parent_len` blocks of run `parent_id`,
    /// whose first block holds `first` (one block's tokens).
    #[must_use]
    pub fn branch_hash(&self, parent_id: u64, parent_len: u32, first: &[u32]) -> u32 {
        let mut prefix = [0u8; 12];
        prefix[..8].copy_from_slice(&parent_id.to_le_bytes());
        prefix[8..].copy_from_slice(&parent_len.to_le_bytes());
        self.hash_first(&prefix, first)
    }

    /// The index hash of a run hung under `parent` whose first block holds `first`.
    #[must_use]
    pub fn hash_of(&self, parent: &RunParent, first: &[u32]) -> u32 {
        match *parent {
            RunParent::Root(ref root) => self.head_hash(root, first),
            RunParent::Run { id, len } => self.branch_hash(id, len, first),
            RunParent::Tagged { id, len, ref tag } => {
                let mut prefix = [0u8; 44];
                prefix[..8].copy_from_slice(&id.to_le_bytes());
                prefix[8..12].copy_from_slice(&len.to_le_bytes());
                prefix[12..].copy_from_slice(&tag.0);
                self.hash_first(&prefix, first)
            }
        }
    }

    fn hash_first(&self, prefix: &[u8], first: &[u32]) -> u32 {
        // A block of 16 tokens and a root key: 96 bytes on the stack, one XXH3 call. Sized
        // once and filled by slices: extending it token by token was one call a token (a
        // third of a one-block request's lookup).
        let mut input = smallvec::SmallVec::<[u8; 128]>::new();
        input.resize(prefix.len() + 4 * first.len(), 0);
        let (head, rest) = input.split_at_mut(prefix.len());
        head.copy_from_slice(prefix);
        for (bytes, token) in rest.chunks_exact_mut(4).zip(first) {
            bytes.copy_from_slice(&token.to_le_bytes());
        }
        xxhash_rust::xxh3::xxh3_64_with_seed(&input, self.seed) as u32
    }

    /// Finds the run hung under `parent` whose first block holds the first block of `tokens`
    /// (whole blocks), through the index under `hash` (`hash_of` that parent and block), and
    /// matches it against `tokens` as `match_run` does. Returns its slot and the match, with at
    /// least one block matched, the matched block ids appended to `blocks`; `None` for a miss.
    /// Lock-free.
    pub fn find(
        &self,
        hash: u32,
        parent: &RunParent,
        tokens: &[u32],
        blocks: &mut Vec<BlockId>,
    ) -> Option<(u32, RunMatch)> {
        if tokens.len() < self.block_size {
            return None;
        }
        self.index.probe(hash, |slot| {
            match self.match_run(slot, parent, tokens, blocks) {
                Some(found) if found.matched > 0 => Candidate::Found((slot, found)),
                // Another run with the same 32 bits, or one rewritten meanwhile: probe on
                // (no run under a parent shares another's first block, so none can be both
                // this key's and other content).
                _ => Candidate::Next,
            }
        })
    }

    /// Matches a prompt's whole blocks (`tokens`, a multiple of the block size) under `root`:
    /// the first run by the root and the first block, each next one by the run it continues
    /// and its own first block, every token verified (`find`). `tags` are the prompt's tagged
    /// blocks (`key::run_tag`, by block index, ascending; empty for a text prompt): a tagged
    /// block is matched only as a run's first block, under a parent with its tag, so a run is
    /// compared only up to the prompt's next tagged block. The matched block ids are appended
    /// to `blocks`; `each_run(slot, found)` sees each run matched into and says whether to look
    /// for a run continuing it (the writer knows when it has no child; a reader asks the
    /// index). Lock-free.
    pub fn match_prompt(
        &self,
        root: &BlockKey,
        tokens: &[u32],
        tags: &[(u32, BlockKey)],
        blocks: &mut Vec<BlockId>,
        mut each_run: impl FnMut(u32, &RunMatch) -> bool,
    ) {
        let bs = self.block_size;
        let full = tokens.len() / bs;
        let first = blocks.len();
        if full == 0 {
            return;
        }
        let mut at = 0;
        let mut under = None;
        loop {
            // Tags from here on: the block at `at` may be one, the next one ends the run's
            // comparison.
            let ahead = &tags[tags.partition_point(|&(b, _)| (b as usize) < at)..];
            let tag = ahead.first().filter(|&&(b, _)| b as usize == at);
            let stop = ahead
                .iter()
                .map(|&(b, _)| b as usize)
                .find(|&b| b > at)
                .map_or(full, |b| b.min(full));
            let parent = RunParent::of_block(under, root, tag.map(|(_, t)| t));
            let hash = self.hash_of(&parent, &tokens[at * bs..(at + 1) * bs]);
            let Some((slot, found)) = self.find(hash, &parent, &tokens[at * bs..stop * bs], blocks)
            else {
                return;
            };
            at = blocks.len() - first;
            if !each_run(slot, &found) || found.matched < found.len || at == full {
                return;
            }
            under = Some((found.id, found.len));
        }
    }

    /// The run in `slot` as one consistent snapshot, or `None` when the slot holds no run (or
    /// the writer kept changing it). Lock-free.
    #[must_use]
    pub fn snapshot(&self, slot: u32) -> Option<RunSnapshot> {
        let record = self.slots.get(slot as usize)?;
        for _ in 0..READ_ROUNDS {
            let stamp = record.stamp.load(Ordering::Acquire);
            if stamp & 1 == 1 {
                continue;
            }
            let id = record.id.load(Ordering::Relaxed);
            let parent = self.read_parent(slot, record);
            let len = record.len.load(Ordering::Relaxed) as usize;
            let mut blocks = Vec::with_capacity(len.min(self.num_blocks));
            let whole = self.read_blocks(record, len, |block| {
                blocks.push(block);
                true
            });
            fence(Ordering::Acquire);
            if record.stamp.load(Ordering::Relaxed) != stamp {
                continue;
            }
            if id == 0 || !whole {
                return None;
            }
            return Some(RunSnapshot { id, parent, blocks });
        }
        None
    }

    /// Matches the run in `slot` against a prompt's blocks: the run must hang under `parent`,
    /// and its leading blocks must hold `tokens` block by block (`tokens` holds whole blocks;
    /// compared up to the shorter of the two). The matched block ids are appended to `blocks`.
    /// `None` when the slot holds no run, the run hangs elsewhere, or the writer kept changing
    /// it; then `blocks` is as it was. Lock-free: what it returns is what the run held at one
    /// instant during the call.
    pub fn match_run(
        &self,
        slot: u32,
        parent: &RunParent,
        tokens: &[u32],
        blocks: &mut Vec<BlockId>,
    ) -> Option<RunMatch> {
        let record = self.slots.get(slot as usize)?;
        let wanted = tokens.len() / self.block_size;
        let start = blocks.len();
        for _ in 0..READ_ROUNDS {
            let stamp = record.stamp.load(Ordering::Acquire);
            if stamp & 1 == 1 {
                continue;
            }
            let id = record.id.load(Ordering::Relaxed);
            let hangs = self.read_parent(slot, record) == *parent;
            let len = record.len.load(Ordering::Relaxed);
            let mut matched = Some(0);
            if hangs && id != 0 {
                matched = self.match_blocks(record, (len as usize).min(wanted), tokens, blocks);
            }
            fence(Ordering::Acquire);
            if record.stamp.load(Ordering::Relaxed) != stamp {
                blocks.truncate(start);
                continue;
            }
            let Some(matched) = matched.filter(|_| id != 0 && hangs) else {
                blocks.truncate(start);
                return None;
            };
            return Some(RunMatch { id, len, matched });
        }
        None
    }

    /// Compares the first `count` blocks of the run in `record` with `tokens`' blocks, in
    /// order, appending each matching block's id to `blocks` until one differs. Returns the
    /// blocks matched, or `None` for an id or chunk link out of range (only a read racing the
    /// writer meets one; the caller's stamp check drops the read). A chunk at a time: its ids
    /// first, then a prefetch of each of their rows, then the comparisons, so the rows' cache
    /// misses (scattered over the table on real traffic) overlap across the chunk.
    #[inline]
    fn match_blocks(
        &self,
        record: &RunSlot,
        count: usize,
        tokens: &[u32],
        blocks: &mut Vec<BlockId>,
    ) -> Option<u32> {
        let mut chunk = record.first_chunk.load(Ordering::Relaxed);
        let mut expected = tokens.chunks_exact(self.block_size);
        let mut matched = 0;
        let mut ids = [0 as BlockId; CHUNK];
        while (matched as usize) < count {
            let cells = self
                .chunk_blocks
                .get(chunk as usize * CHUNK..(chunk as usize + 1) * CHUNK)?;
            let here = CHUNK.min(count - matched as usize);
            for (id, cell) in ids[..here].iter_mut().zip(cells) {
                *id = cell.load(Ordering::Relaxed);
                if *id as usize >= self.num_blocks {
                    return None;
                }
                prefetch(&self.row(*id)[0]);
            }
            chunk = self.chunk_next[chunk as usize].load(Ordering::Relaxed);
            if let Some(next) = self.chunk_blocks.get(chunk as usize * CHUNK) {
                prefetch(next);
            }
            for &id in &ids[..here] {
                let Some(want) = expected.next() else {
                    return Some(matched);
                };
                if !self.row_equals(id, want) {
                    return Some(matched);
                }
                blocks.push(id);
                matched += 1;
            }
        }
        Some(matched)
    }

    /// The parent fields of the run in `record` (under the caller's stamp).
    fn read_parent(&self, slot: u32, record: &RunSlot) -> RunParent {
        let id = record.parent.load(Ordering::Relaxed);
        let read_key = || {
            let mut key = [0u8; 32];
            for (bytes, word) in key.chunks_exact_mut(8).zip(&self.roots[slot as usize]) {
                bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
            }
            BlockKey(key)
        };
        if id == 0 {
            return RunParent::Root(read_key());
        }
        let len = record.parent_len.load(Ordering::Relaxed);
        if len & TAGGED == 0 {
            RunParent::Run { id, len }
        } else {
            RunParent::Tagged {
                id,
                len: len & !TAGGED,
                tag: read_key(),
            }
        }
    }

    /// Calls `visit` with the first `count` block ids of the run in `record`, in order, until
    /// it returns false. Returns false if it met an id or a chunk link out of range, which only
    /// a read racing the writer can (the caller's stamp check then drops the read).
    fn read_blocks(
        &self,
        record: &RunSlot,
        count: usize,
        mut visit: impl FnMut(BlockId) -> bool,
    ) -> bool {
        let mut chunk = record.first_chunk.load(Ordering::Relaxed);
        let mut read = 0;
        while read < count {
            if chunk as usize >= self.num_chunks() {
                return false;
            }
            let base = chunk as usize * CHUNK;
            for cell in &self.chunk_blocks[base..base + CHUNK.min(count - read)] {
                let block = cell.load(Ordering::Relaxed);
                if block as usize >= self.num_blocks {
                    return false;
                }
                read += 1;
                if !visit(block) {
                    return true;
                }
            }
            chunk = self.chunk_next[chunk as usize].load(Ordering::Relaxed);
        }
        true
    }
}
