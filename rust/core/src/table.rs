//! The lookup table: block key → the cached block's entry, readable without locks.
//!
//! Readers (`lookup` on any thread) never block: the table is a `papaya` lock-free map and
//! entries are immutable once published (papaya keeps a removed entry alive until every reader
//! that could see it has moved on), so a reader holds either a complete entry or none. Only the
//! cache's writer side, under its mutex, inserts and removes.
//!
//! An entry lives inline in the map's slot, its tokens inline in the entry (up to 16 tokens, the
//! default block size): verifying a hit touches one allocation, not three.
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
//! simply not cached (see `PrefixCache::commit`): correctness never depends on the hash.

use std::hash::{BuildHasher, Hasher};

use smallvec::SmallVec;

use crate::key::{BlockKey, TableKey};
use crate::pool::BlockId;

/// What a block was computed after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// A first block: the full (never truncated) root key of context and salt.
    Root(BlockKey),
    /// The entry id of the cached parent block.
    Entry(u64),
}

/// One cached block, as published to readers. Immutable.
#[derive(Debug)]
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

/// A reference to a published entry, kept by requests and by the cache: enough to find it again
/// and to tell whether it is still the one published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Anchor {
    /// The entry's unique id.
    pub id: u64,
    /// The block holding its KV.
    pub block: BlockId,
    /// Its table key.
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

/// Table keys are uniform hash output already; hashing them again would be wasted work. The map's
/// hasher just reads the first 8 bytes.
#[derive(Clone, Copy, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // A `TableKey` hashes as one 16-byte write; fold every 8 bytes so truncated keys (whose
        // tail is zero) still spread.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }
}

/// Builds `KeyHasher`s for the map.
#[derive(Clone, Copy, Default)]
pub struct BuildKeyHasher;

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;
    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

/// The concurrent map behind lookups.
pub type Table = papaya::HashMap<TableKey, Entry, BuildKeyHasher>;

/// A table sized for `capacity` entries.
#[must_use]
pub fn new_table(capacity: usize) -> Table {
    papaya::HashMap::builder()
        .capacity(capacity)
        .hasher(BuildKeyHasher)
        .build()
}
