//! The lookup table: block key → the cached block's entry, readable without locks.
//!
//! size: the lock-free reader and the single writer share one seqlock protocol per slot; keeping
//! both sides (and the read-ahead hints) in one file keeps that protocol in one place.
//!
//! Readers (`lookup` on any thread) never block and never wait for the writer; only the cache's
//! writer side, under its mutex, inserts and removes.
//!
//! ## Layout: a compact index beside per-block entries
//! A block holds at most one published entry at a time, so the table never holds more entries
//! than the pool has blocks, and it is built once at that size and never grows or rehashes:
//! - **entries** live in one preallocated slot per block (`Slot`: entry id, table key, parent,
//!   extras' length, links; one aligned 64-byte cache line) and one row of `block_size` token
//!   ids per block, two to an atomic word, rows starting on a line (a 16-token row is one line).
//!   The root key of a first block and the extras, which most entries lack, sit in arrays
//!   beside the slots, read only when the slot says so: a probe, verify or publish of a block
//!   then touches two lines, its slot and its row (PROFILE.md, issue 24, round 9). Publishing
//!   writes the block's own slot: no allocation, no node, nothing to reclaim later (papaya, the
//!   map used before, spent a heap node per entry and periodically copied its whole table to
//!   clear the tombstones that eviction leaves: `benches/PROFILE.md`).
//! - the **index** (`slot_index.rs`, shared with the run table) is an open-addressing array of
//!   `u64` words, at least twice the pool's size, probed linearly: each word packs 32 bits of
//!   the key's hash (which also give the home slot) and the block id. A removal shifts the rest
//!   of its probe run back (no tombstones), so probe runs stay short however many blocks are
//!   evicted and refilled.
//!
//! ## Runs: a child linked from its parent instead of indexed
//! Most blocks after a request's first are not in the index but linked from their parent's
//! slot (`child`), so a run of blocks costs one index word: `runs.rs` says when, and why a
//! lookup following a link is as safe as one following an index word.
//!
//! ## Reading without locks, and why a reader never sees a torn entry
//! Every field is an atomic, so no read is ever a data race; consistency comes from a sequence
//! lock per slot. The writer makes the slot's sequence number odd, writes the fields, then makes
//! it even again with `Release`; a reader loads it (`Acquire`, and gives up on an odd one), the
//! fields, then the sequence number again after an `Acquire` fence, and keeps the snapshot only
//! if it did not change (the seqlock pattern of Boehm, "Can seqlocks get along with programming
//! language memory models?", MSPC 2012). The sequence number is the slot's own, not the entry
//! id: an entry can move to another block and, later, back (`move_entry`), so an id seen twice
//! in one slot would not prove the fields unchanged. A slot being rewritten, or whose entry was
//! removed (`remove` zeroes the id), reads as "no entry".
//!
//! An index word is only a hint: the reader compares the slot's full table key, then verifies
//! the entry (below). A word read just before the writer moved it (backward shift) can make a
//! probe run look shorter than it is, which could only hide an entry, never show a wrong one;
//! a lookup that ends in a miss checks the index's shift counter and probes again if a shift
//! ran meanwhile (a few times at most, then the miss stands: a shorter cached prefix is always a
//! correct answer for a lock-free probe).
//!
//! A reader may read an entry that the writer removes right after: as with any lock-free map,
//! what it returns was published at some instant during the call. `cache/mod.rs` says why that is
//! all a lookup needs, and why the calls that take references match under the mutex instead.
//!
//! ## Verification: a hash collision can only cause a miss
//! A key is a hash; the table never trusts it alone. Each entry stores what it was computed
//! from — its exact tokens, its extra keys, and its parent (the full root key for a first
//! block, else the *entry id* of its parent). A lookup walks the chain from the root and accepts
//! an entry only if all three equal what the request has. Entry ids are unique for the life of
//! the cache (block ids are reused, entry ids never are), so a parent check cannot be fooled by
//! a block that was evicted and refilled in between.
//!
//! When two different contents share a key, the first one inserted keeps it and the second is
//! simply not cached (see the publishing rules in `request/publish.rs`): correctness never depends on
//! the hash.
//!
//! The cache reaches the table only through `SharedTable` (`shared.rs`), which has a loom stand-in.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use crossbeam_utils::CachePadded;
use smallvec::SmallVec;

use crate::hugepages::filled;
use crate::key::{BlockKey, TableKey};
use crate::pool::BlockId;
use crate::prefetch::prefetch;
use crate::slot_index::{Candidate, Found, SlotIndex};

/// What a block was computed after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// A first block: the full (never truncated) root key of context and salt. In a
    /// sliding-window cache every entry uses this form, holding the full SHA-256 block key of
    /// the previous block (the root key for block 0), so an entry verifies without its parent
    /// being cached (`sliding.rs`).
    Root(BlockKey),
    /// The entry id of the cached parent block.
    Entry(u64),
}

/// One cached block, as published to readers. Immutable.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Unique for the life of the cache.
    pub id: u64,
    /// The block holding this entry's KV.
    pub block: BlockId,
    /// What the block's KV was computed after.
    pub parent: Parent,
    /// The block's exact token ids.
    pub tokens: SmallVec<[u32; 16]>,
    /// The block's encoded extra keys (see `key.rs`).
    pub extras: Box<[u8]>,
}

/// An entry to publish, borrowed from the request that computed it (`Table::insert`): nothing
/// is copied until the table's own slot and token row are written.
#[derive(Clone, Copy, Debug)]
pub struct NewEntry<'a> {
    /// Unique for the life of the cache.
    pub id: u64,
    /// The block holding this entry's KV.
    pub block: BlockId,
    /// What the block's KV was computed after.
    pub parent: Parent,
    /// The block's exact token ids.
    pub tokens: &'a [u32],
    /// The block's encoded extra keys (see `key.rs`).
    pub extras: &'a [u8],
}

impl Entry {
    /// This entry, borrowed for `Table::insert`.
    #[must_use]
    pub fn as_new(&self) -> NewEntry<'_> {
        NewEntry {
            id: self.id,
            block: self.block,
            parent: self.parent,
            tokens: &self.tokens,
            extras: &self.extras,
        }
    }
}

/// What `Table::insert` found under the key (see the publishing rules in `request/publish.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insertion {
    /// The key was free: the entry is published.
    Inserted(Anchor),
    /// The key holds an entry that verifies against the new one (same parent, tokens and
    /// extras), or the parent's linked child does, whatever key it holds (`runs.rs`): another
    /// sequence published this block first. Nothing was written.
    Present(Anchor),
    /// The key holds other content: a hash collision. Nothing was written.
    Collision,
}

/// A reference to a published entry, kept by requests and by the cache: enough to find it again
/// and to tell whether it is still the one published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Anchor {
    /// The entry's unique id.
    pub id: u64,
    /// The block holding its KV.
    pub block: BlockId,
    /// Its table key, or `TableKey::UNKNOWN` for a linked entry published without one
    /// (`runs.rs`, on keys).
    pub key: TableKey,
}

impl Entry {
    /// The anchor of this entry, published under `key`.
    #[must_use]
    pub fn anchor(&self, key: TableKey) -> Anchor {
        Anchor {
            id: self.id,
            block: self.block,
            key,
        }
    }

    /// True when this entry is exactly the block the caller is looking for.
    #[must_use]
    pub fn verifies(&self, parent: &Parent, tokens: &[u32], extras: &[u8]) -> bool {
        // Compare the cheap, most discriminating field first; extras are usually both empty.
        self.parent == *parent
            && *self.tokens == *tokens
            && (self.extras.is_empty() && extras.is_empty() || *self.extras == *extras)
    }
}

/// Table keys are uniform hash output already, so hashing one is a fold of its two halves.
///
/// A key truncated by `key_bits` (tests) keeps only its leading bits, which land at the top of
/// the folded word: its top six bits are folded into the bottom six too, so truncated keys
/// still reach different slots of a hash map instead of all probing from the same one.
#[derive(Clone, Copy, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u128(&mut self, key: u128) {
        // A `TableKey` (a derived `Hash` over one `u128`) arrives here, as a single call.
        self.0 = fold(key);
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached by key types other than `TableKey`: fold eight bytes at a time.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }
}

/// Builds `KeyHasher`s, for maps keyed by `TableKey`.
#[derive(Clone, Copy, Default)]
pub struct BuildKeyHasher;

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

fn fold(key: u128) -> u64 {
    let folded = (key as u64) ^ ((key >> 64) as u64);
    folded ^ (folded >> 58)
}

/// The index's 32 hash bits of a key: they pick the home slot and sit in the index word.
/// A full key is uniform already; the finalizer of MurmurHash3 (two multiplies) spreads a key
/// truncated by `key_bits` (tests), whose bits all sit at the top, over every home slot.
fn index_hash(key: TableKey) -> u32 {
    let mut h = (key.0 as u64) ^ ((key.0 >> 64) as u64);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h as u32
}

/// The published entry of one block (see the module docs: every field is read under the
/// slot's own sequence lock). One 64-byte cache line, aligned (`slot_fits_one_cache_line`):
/// a probe, a verify or a publish of a block touches this one line and its token row, not
/// two or three lines of a slot that straddles them. What most entries never use lives beside
/// it, read only when the slot says so: the root key of a first block (`Table::roots`) and
/// the extras (`Table::extras`) (PROFILE.md, issue 24, round 9).
#[derive(Default)]
#[repr(align(64))]
struct Slot {
    /// The sequence lock: odd while the writer rewrites the slot (module docs).
    seq: AtomicU64,
    /// Id of the entry in this slot; 0 when there is none.
    id: AtomicU64,
    /// The entry's table key; `TableKey::UNKNOWN` in a linked entry published without one
    /// (`runs.rs`, on keys), until a request that hashed it fills it in.
    key: [AtomicU64; 2],
    /// The parent entry's id, or 0 for a first block (whose root key is the block's
    /// `Table::roots` entry, written and read under this slot's sequence lock).
    parent: AtomicU64,
    /// Length of the extras (0 for almost every block: then the block's `Table::extras` is
    /// not read).
    extras_len: AtomicU32,
    /// The block (plus one; 0: none) of this entry's *linked* child, the one child published
    /// without an index word (`runs.rs`). Readers take it as a hint and verify the
    /// block it names in full, as they do a block an index word names.
    child: AtomicU32,
    /// Writer only: the block (plus one; 0: none) that held this entry's parent entry when it
    /// was published (or moved), checked against that slot's id before any use.
    up: AtomicU32,
    /// Written by the writer only: how many children of this entry may sit in the index (never
    /// fewer than do): while none may, a new child needs no index probe to be known new, and a
    /// walk whose linked child does not match stops there (lock-free readers take it as a
    /// hint, `Table::may_have_indexed_children`).
    indexed_children: AtomicU32,
    /// Writer only: true when this entry is reached through its parent's `child`, not the index.
    linked: AtomicBool,
}

/// The full root key of a first block's entry (`Parent::Root`), four words, read and written
/// under the block's slot's sequence lock. Aligned to 32 bytes so a root never straddles two
/// cache lines.
#[derive(Default)]
#[repr(align(32))]
struct Root([AtomicU64; 4]);

/// Bytes of a cache line, where the table aligns slots and token rows.
const LINE: usize = 64;

/// The lock-free table of published entries, one slot per block (see the module docs).
pub struct Table {
    /// Key hashes to the blocks whose slots hold them (`slot_index.rs`).
    index: SlotIndex,
    slots: Box<[Slot]>,
    /// Per block: the root key of a first block's entry (`Slot::parent` 0), else unused.
    roots: Box<[Root]>,
    /// Per block: the entry's extras, when `Slot::extras_len` is not 0.
    extras: Box<[ArcSwapOption<Box<[u8]>>]>,
    /// `block_size` token ids per block, in block order, two to a word (`pack`): a row of 16
    /// is written and compared in 8 loads or stores, not 16 (PROFILE.md, issue 24, round 6).
    tokens: Box<[AtomicU64]>,
    block_size: usize,
    /// Words per row: `block_size` halved, rounded up.
    row_words: usize,
    /// Words of `tokens` before the first row, so that every row starts on a cache line
    /// (`LINE`) when its size is a multiple of one, or never straddles two when it divides
    /// one: a 16-token row is then exactly one line, where the allocator's 16-byte alignment
    /// split it over two (PROFILE.md, issue 24, round 9).
    row_offset: usize,
    /// Entries, written by every insert and removal, read by no probe: its own line as well.
    len: CachePadded<AtomicUsize>,
    /// Whether children may be linked instead of indexed (full-width keys only: module docs).
    links: bool,
}

impl Table {
    /// Bytes `new` allocates up front for `num_blocks` blocks of `block_size` tokens (`None`
    /// when the figure overflows), so a cache can refuse an absurd size before trying.
    #[must_use]
    pub fn bytes_up_front(num_blocks: usize, block_size: usize) -> Option<usize> {
        let capacity = SlotIndex::capacity(num_blocks)?;
        let index = capacity.checked_mul(std::mem::size_of::<AtomicU64>())?;
        let per_block = std::mem::size_of::<Slot>()
            + std::mem::size_of::<Root>()
            + std::mem::size_of::<ArcSwapOption<Box<[u8]>>>();
        let slots = num_blocks.checked_mul(per_block)?;
        let tokens = num_blocks
            .checked_mul(block_size.div_ceil(2))?
            .checked_add(LINE / 8 - 1)?
            .checked_mul(std::mem::size_of::<AtomicU64>())?;
        index.checked_add(slots)?.checked_add(tokens)
    }
}

/// One word of a token row: the pair's first token in the low half, the second (zero past an
/// odd row's end) in the high half. Every field of a slot is still its own atomic under the
/// slot's sequence lock, so a word torn by a rewrite fails the lock's check as a token did.
#[inline(always)]
pub(crate) fn pack(pair: &[u32]) -> u64 {
    u64::from(pair[0]) | pair.get(1).map_or(0, |&high| u64::from(high) << 32)
}

/// Whether a token row (`cells`, packed by `pack`) holds `tokens`, whose length the caller
/// checked, compared without an early exit (the caller checks its sequence lock after);
/// 16-token rows, the usual block size, as fixed-length arrays, unrolled.
#[inline]
fn row_equals(cells: &[AtomicU64], tokens: &[u32]) -> bool {
    let same = |ok: bool, (cell, pair): (&AtomicU64, &[u32])| {
        ok & (cell.load(Ordering::Relaxed) == pack(pair))
    };
    match (
        <&[AtomicU64; 8]>::try_from(cells),
        <&[u32; 16]>::try_from(tokens),
    ) {
        (Ok(cells), Ok(tokens)) => cells.iter().zip(tokens.chunks_exact(2)).fold(true, same),
        _ => cells.iter().zip(tokens.chunks(2)).fold(true, same),
    }
}

impl Slot {
    /// The table key stored in the slot (a reader checks it under the sequence lock).
    #[inline]
    fn key(&self) -> TableKey {
        TableKey(
            u128::from(self.key[0].load(Ordering::Relaxed))
                | (u128::from(self.key[1].load(Ordering::Relaxed)) << 64),
        )
    }
}

/// What a probe found in a slot.
enum Verified<T> {
    /// The key's entry, and it is the block looked for.
    Yes(T),
    /// The key's entry, holding other content: a collision.
    No,
    /// Not the key's entry (another key with the same index hash, or rewritten meanwhile).
    OtherKey,
}

impl Table {
    /// A table for a pool of `num_blocks` blocks of `block_size` tokens, allocated in full now;
    /// `None` when that memory cannot be had (the cache reports it as `OutOfBlocks`, as it does
    /// for the pool's own metadata).
    #[must_use]
    pub fn new(num_blocks: usize, block_size: usize) -> Option<Self> {
        Self::with_links(num_blocks, block_size, true)
    }

    /// `new`, linking runs of children (`links`) or indexing every entry (`!links`: the table
    /// of truncated test keys, where every key must stay unique: module docs).
    #[must_use]
    pub fn with_links(num_blocks: usize, block_size: usize, links: bool) -> Option<Self> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return None;
        }
        let row_words = block_size.div_ceil(2);
        // Room to start the first row on a line: at most a line's words less one before it.
        let tokens = filled(
            num_blocks
                .checked_mul(row_words)?
                .checked_add(LINE / 8 - 1)?,
            || AtomicU64::new(0),
        )?;
        // The heap copy never moves (a boxed slice), so its address fixes the offset for good.
        let misalignment = tokens.as_ptr() as usize % LINE;
        let row_offset = (LINE - misalignment) % LINE / std::mem::size_of::<AtomicU64>();
        Some(Self {
            index: SlotIndex::new(num_blocks)?,
            slots: filled(num_blocks, Slot::default)?,
            roots: filled(num_blocks, Root::default)?,
            extras: filled(num_blocks, ArcSwapOption::empty)?,
            tokens,
            block_size,
            row_words,
            row_offset,
            len: CachePadded::new(AtomicUsize::new(0)),
            links,
        })
    }

    /// Whether children may be linked (`with_links`).
    #[must_use]
    #[inline]
    pub fn links(&self) -> bool {
        self.links
    }

    /// Entries published now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// True when nothing is published.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The *indexed* entry published under `key`, as an owned snapshot, or `None`. A linked
    /// child has no index word: it is found from its parent (`get_linked_child`) or by its
    /// block (`entry`), which is how the cache reaches every entry. Lock-free.
    #[must_use]
    pub fn get(&self, key: &TableKey) -> Option<Entry> {
        self.probe(key, |block| match self.read(block, key) {
            Some(entry) => Verified::Yes(entry),
            None => Verified::OtherKey,
        })
    }

    /// Starts the memory reads that a `get` or `insert` of `key` will need, without
    /// waiting for them: the index word at its home slot and, for `insert`, the slot and
    /// token row of `block`. The table is several MiB and keys are random, so each probe is a
    /// cache miss; issuing a batch of these loads first lets the CPU overlap the misses
    /// (benches/PROFILE.md). Prefetch hints (`prefetch.rs`): no effect on any answer.
    #[inline]
    ///
    /// `indexed`: whether the insert may probe the index; a child linked from the previous
    /// block of its run does not (`runs.rs`).
    pub fn prefetch(&self, key: &TableKey, block: Option<BlockId>, indexed: bool) {
        if indexed || !self.links {
            self.index.prefetch_home(index_hash(*key));
        }
        if let Some(slot) = block.and_then(|b| self.slots.get(b as usize)) {
            prefetch(slot);
            let start = self.row_start(block.unwrap_or_default());
            if let Some(cell) = self.tokens.get(start) {
                prefetch(cell);
            }
        }
    }

    /// Starts the memory reads a `get` or `get_verified` of `key` will need: the index word at
    /// its home slot, then, when it names a block with the key's hash, that block's slot and
    /// token row. The second reads depend on the first, so a lookup walk issues this for a
    /// batch of keys before verifying any: both tiers of misses then overlap across the batch
    /// instead of coming two per block in turn (benches/PROFILE.md). The index word is read (the
    /// second tier's address depends on it), the rest are prefetch hints; a stale or torn word
    /// only wastes a prefetch: no effect on any answer.
    #[inline]
    pub fn prefetch_entry(&self, key: &TableKey) {
        if let Some(block) = self.index.home_slot(index_hash(*key)) {
            let block = block as usize;
            if let Some(slot) = self.slots.get(block) {
                prefetch(slot);
            }
            if let Some(cell) = self.tokens.get(self.row_start(block as BlockId)) {
                prefetch(cell);
            }
        }
    }

    /// Asks for `block`'s slot line ahead of a `prefetch_removal` of it, which must read the
    /// slot to find the next line: a hint, so a batch of them overlaps without stalling.
    #[inline]
    pub fn prefetch_slot(&self, block: BlockId) {
        if let Some(slot) = self.slots.get(block as usize) {
            prefetch(slot);
        }
    }

    /// Starts the memory reads a removal of `block`'s entry will need: the block's slot (its
    /// key) and then the index word at the key's home slot. Unlike `prefetch` for an insert, not
    /// the token row, which a removal never reads. The slot is read (the next line's address is
    /// in it), the next line prefetched: no effect on any answer.
    #[inline]
    pub fn prefetch_removal(&self, block: BlockId) {
        if let Some(slot) = self.slots.get(block as usize) {
            if slot.linked.load(Ordering::Relaxed) {
                // Its parent's slot, whose link the removal clears.
                if let Some(up) = slot.up.load(Ordering::Relaxed).checked_sub(1) {
                    if let Some(parent) = self.slots.get(up as usize) {
                        prefetch(parent);
                    }
                }
                return;
            }
            let key = TableKey(
                u128::from(slot.key[0].load(Ordering::Relaxed))
                    | (u128::from(slot.key[1].load(Ordering::Relaxed)) << 64),
            );
            self.index.prefetch_home(index_hash(key));
        }
    }

    /// The anchor of the entry `block` holds, if it holds one (`None` for an id outside the
    /// pool, such as the null block). Writer only: the writer is the only one who changes a
    /// slot, so its own reads need no sequence lock. The cache keeps no copy of this per block:
    /// the slot is the one home of a block's published id and key, and a second array would
    /// cost a cold cache line per publish and per eviction (PROFILE.md, issue 24).
    #[must_use]
    pub fn published(&self, block: BlockId) -> Option<Anchor> {
        let slot = self.slots.get(block as usize)?;
        let id = slot.id.load(Ordering::Relaxed);
        (id != 0).then(|| Anchor {
            id,
            block,
            key: self.slot_key(block),
        })
    }

    /// Walks `key`'s probe run, asking `visit` about each block whose index hash matches,
    /// until it answers `Yes` (found) or `No` (the key's entry, refused); a miss at the end of
    /// the run probes again if a backward shift raced it (module docs).
    #[inline]
    fn probe<R>(&self, key: &TableKey, mut visit: impl FnMut(BlockId) -> Verified<R>) -> Option<R> {
        self.index
            .probe(index_hash(*key), |block| match visit(block) {
                Verified::Yes(found) => Candidate::Found(found),
                Verified::No => Candidate::Stop,
                Verified::OtherKey => Candidate::Next,
            })
    }

    /// Panics unless `block` holds no published entry (see `insert`).
    fn claim(&self, block: BlockId) {
        assert_eq!(
            self.slots[block as usize].id.load(Ordering::Relaxed),
            0,
            "block {block} already holds a published entry"
        );
    }

    /// `insert` through the index: the key is probed, and published there if free.
    fn insert_indexed(
        &self,
        key: TableKey,
        entry: &NewEntry<'_>,
        parent_block: Option<BlockId>,
    ) -> Insertion {
        let hash = index_hash(key);
        let position = match self.index.find(hash, |block| self.slot_key(block) == key) {
            // The writer's own slot: never odd, never rewritten while it reads.
            Found::Slot(block) => {
                return match self.verify(block, &key, &entry.parent, entry.tokens, entry.extras) {
                    Verified::Yes(anchor) => Insertion::Present(anchor),
                    Verified::No | Verified::OtherKey => Insertion::Collision,
                };
            }
            Found::Free(position) => position,
        };
        self.claim(entry.block);
        self.write(key, entry, parent_block, false);
        self.index.put(position, hash, entry.block);
        self.count_entries(1);
        Insertion::Inserted(Anchor {
            id: entry.id,
            block: entry.block,
            key,
        })
    }

    /// Removes `block`'s index word (under `key`) and its entry. Writer only.
    fn remove_indexed(&self, key: &TableKey, block: BlockId) {
        // No entry any more before any word moves: a reader holding the old word finds none.
        let removed = self
            .index
            .remove(index_hash(*key), block, || self.clear_slot(block));
        if !removed {
            debug_assert!(false, "indexed entry of block {block} not in the index");
            return;
        }
        self.count_entries(-1);
    }

    /// Moves the entry count by `delta`. Writer only, so a plain load and store: an atomic
    /// read-modify-write (`fetch_add`) is a locked instruction on x86, which waits for every
    /// earlier store to reach the cache, here the cold slot and token row just written; that
    /// wait was a fifth of `insert`'s samples (PROFILE.md, issue 24).
    fn count_entries(&self, delta: isize) {
        let len = self.len.load(Ordering::Relaxed);
        self.len
            .store(len.wrapping_add_signed(delta), Ordering::Relaxed);
    }

    /// The word where `block`'s token row starts.
    #[inline]
    fn row_start(&self, block: BlockId) -> usize {
        self.row_offset + block as usize * self.row_words
    }

    fn slot_key(&self, block: BlockId) -> TableKey {
        self.slots[block as usize].key()
    }

    /// The writer's side of the slot's sequence lock.
    /// `up` and `linked` are the new entry's writer-side fields (`Slot`); it starts with no
    /// children.
    #[inline(always)] // once per published block: no call, no register saves (PROFILE.md)
    fn write(&self, key: TableKey, entry: &NewEntry<'_>, up: Option<BlockId>, linked: bool) {
        debug_assert_eq!(entry.tokens.len(), self.block_size);
        debug_assert!(entry.id != 0);
        let slot = &self.slots[entry.block as usize];
        slot.up
            .store(up.map_or(0, |block| block + 1), Ordering::Relaxed);
        slot.linked.store(linked, Ordering::Relaxed);
        slot.indexed_children.store(0, Ordering::Relaxed);
        slot.child.store(0, Ordering::Relaxed);
        let seq = slot.seq.load(Ordering::Relaxed);
        slot.seq.store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.id.store(entry.id, Ordering::Relaxed);
        slot.key[0].store(key.0 as u64, Ordering::Relaxed);
        slot.key[1].store((key.0 >> 64) as u64, Ordering::Relaxed);
        match entry.parent {
            Parent::Entry(id) => slot.parent.store(id, Ordering::Relaxed),
            Parent::Root(root) => {
                slot.parent.store(0, Ordering::Relaxed);
                let words = &self.roots[entry.block as usize].0;
                for (word, bytes) in words.iter().zip(root.0.chunks_exact(8)) {
                    let bytes: [u8; 8] = bytes.try_into().unwrap_or_default();
                    word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
                }
            }
        }
        let start = self.row_start(entry.block);
        let cells = &self.tokens[start..start + self.row_words];
        if let (Ok(cells), Ok(tokens)) = (
            <&[AtomicU64; 8]>::try_from(cells),
            <&[u32; 16]>::try_from(entry.tokens),
        ) {
            // The usual block size, as fixed-length arrays: the stores unrolled, no loop
            // (PROFILE.md, issue 24, round 5).
            for (cell, pair) in cells.iter().zip(tokens.chunks_exact(2)) {
                cell.store(pack(pair), Ordering::Relaxed);
            }
        } else {
            for (cell, pair) in cells.iter().zip(entry.tokens.chunks(2)) {
                cell.store(pack(pair), Ordering::Relaxed);
            }
        }
        let extras_len = u32::try_from(entry.extras.len()).unwrap_or(u32::MAX);
        // Only the writer stores `extras`, so its own length says whether one is there.
        if extras_len > 0 || slot.extras_len.load(Ordering::Relaxed) > 0 {
            self.extras[entry.block as usize]
                .store((extras_len > 0).then(|| Arc::new(entry.extras.into())));
        }
        slot.extras_len.store(extras_len, Ordering::Relaxed);
        slot.seq.store(seq + 2, Ordering::Release);
    }

    /// Zeroes a slot's entry id under its sequence lock.
    fn clear_slot(&self, block: BlockId) {
        let slot = &self.slots[block as usize];
        let seq = slot.seq.load(Ordering::Relaxed);
        slot.seq.store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.id.store(0, Ordering::Relaxed);
        slot.child.store(0, Ordering::Relaxed);
        slot.seq.store(seq + 2, Ordering::Release);
    }

    /// The entry `block` holds, as an owned snapshot, or `None`. Lock-free.
    #[must_use]
    pub fn entry(&self, block: BlockId) -> Option<Entry> {
        // `read` compares the key again under the slot's sequence lock: a key torn by a
        // rewrite reads as no entry.
        let key = self
            .slots
            .get(block as usize)
            .map(|_| self.slot_key(block))?;
        self.read(block, &key)
    }

    fn read_tokens(&self, block: BlockId) -> SmallVec<[u32; 16]> {
        let start = self.row_start(block);
        let cells = &self.tokens[start..start + self.row_words];
        let unpack = |cell: &AtomicU64| {
            let word = cell.load(Ordering::Relaxed);
            [word as u32, (word >> 32) as u32]
        };
        if self.block_size <= 16 {
            let mut buffer = [0u32; 16];
            for (pair, cell) in buffer.chunks_exact_mut(2).zip(cells) {
                pair.copy_from_slice(&unpack(cell));
            }
            SmallVec::from_buf_and_len(buffer, self.block_size)
        } else {
            let mut tokens: SmallVec<[u32; 16]> = cells.iter().flat_map(unpack).collect();
            tokens.truncate(self.block_size);
            tokens
        }
    }

    /// The indexed entry published under `key` if it verifies against `parent`, `tokens` and
    /// `extras` (`Entry::verifies`), compared in place; `None` for a miss or a collision. For a
    /// block after the first, `get_linked_child` finds a linked one. Lock-free.
    #[must_use]
    #[inline]
    pub fn get_verified(
        &self,
        key: &TableKey,
        parent: &Parent,
        tokens: &[u32],
        extras: &[u8],
    ) -> Option<Anchor> {
        self.probe(key, |block| self.verify(block, key, parent, tokens, extras))
    }

    /// `read` and `Entry::verifies` in one pass over the slot, under its sequence lock.
    #[inline(always)]
    fn verify(
        &self,
        block: BlockId,
        key: &TableKey,
        parent: &Parent,
        tokens: &[u32],
        extras: &[u8],
    ) -> Verified<Anchor> {
        self.verify_keyed(block, Some(key), parent, tokens, extras)
    }

    /// `verify`, with the key compared only when given (`None`: a linked child, whose key is a
    /// function of what is verified, `runs.rs`); the anchor carries the key the slot holds.
    #[inline(always)]
    fn verify_keyed(
        &self,
        block: BlockId,
        key: Option<&TableKey>,
        parent: &Parent,
        tokens: &[u32],
        extras: &[u8],
    ) -> Verified<Anchor> {
        let slot = &self.slots[block as usize];
        let seq = slot.seq.load(Ordering::Acquire);
        let id = slot.id.load(Ordering::Relaxed);
        let stored = slot.key();
        if seq % 2 == 1 || id == 0 || key.is_some_and(|key| stored != *key) {
            return Verified::OtherKey;
        }
        let parent_ok = match parent {
            Parent::Entry(want) => slot.parent.load(Ordering::Relaxed) == *want,
            Parent::Root(root) => {
                slot.parent.load(Ordering::Relaxed) == 0
                    && self.roots[block as usize]
                        .0
                        .iter()
                        .zip(root.0.chunks_exact(8))
                        .all(|(word, bytes)| word.load(Ordering::Relaxed).to_le_bytes() == bytes)
            }
        };
        let start = self.row_start(block);
        let tokens_ok = tokens.len() == self.block_size
            && row_equals(&self.tokens[start..start + self.row_words], tokens);
        let extras_ok = match slot.extras_len.load(Ordering::Relaxed) {
            0 => extras.is_empty(),
            len => {
                len as usize == extras.len()
                    && self.extras[block as usize]
                        .load()
                        .as_ref()
                        .is_some_and(|stored| ***stored == *extras)
            }
        };
        fence(Ordering::Acquire);
        if slot.seq.load(Ordering::Relaxed) != seq {
            // Rewritten while we read: no longer this key's entry.
            return Verified::OtherKey;
        }
        if parent_ok && tokens_ok && extras_ok {
            Verified::Yes(Anchor {
                id,
                block,
                key: stored,
            })
        } else {
            Verified::No
        }
    }

    /// The reader's side: a consistent snapshot of `block`'s entry if it is published under
    /// `key`, else `None`.
    fn read(&self, block: BlockId, key: &TableKey) -> Option<Entry> {
        let slot = self.slots.get(block as usize)?;
        let seq = slot.seq.load(Ordering::Acquire);
        let id = slot.id.load(Ordering::Relaxed);
        if seq % 2 == 1 || id == 0 || slot.key() != *key {
            return None;
        }
        let parent = match slot.parent.load(Ordering::Relaxed) {
            0 => {
                let mut root = [0u8; 32];
                for (bytes, word) in root.chunks_exact_mut(8).zip(&self.roots[block as usize].0) {
                    bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
                }
                Parent::Root(BlockKey(root))
            }
            id => Parent::Entry(id),
        };
        let tokens = self.read_tokens(block);
        let extras = if slot.extras_len.load(Ordering::Relaxed) == 0 {
            Box::default()
        } else {
            self.extras[block as usize]
                .load_full()
                .map(|e| (*e).clone())
                .unwrap_or_default()
        };
        fence(Ordering::Acquire);
        (slot.seq.load(Ordering::Relaxed) == seq).then_some(Entry {
            id,
            block,
            parent,
            tokens,
            extras,
        })
    }
}

mod runs;
mod shared;
pub(crate) use shared::SharedTable;

#[cfg(test)]
mod tests;
