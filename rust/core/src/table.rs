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
//! simply not cached (see the publishing rules in `request.rs`): correctness never depends on
//! the hash.
//!
//! ## `SharedTable`: the operations the cache uses, and their loom stand-in
//! The cache reaches the map only through [`SharedTable`]: `get`, `try_insert`, `remove`, each
//! one linearizable step, and a guard that keeps every entry read through it alive. That is
//! papaya's contract. Under `--cfg loom` the same five calls run on a `loom::sync::RwLock`
//! around a `HashMap` of `Arc`ed entries, a map with exactly that contract whose every step loom
//! can see and schedule around; `tests/loom_pool.rs` says what this covers and what it cannot.

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

/// Table keys are uniform hash output already, so the map's hasher does not hash them again.
///
/// papaya picks a key's slot from the low bits of its hash and a one-byte tag from the top seven.
/// A full 128-bit key folds its two halves into one uniform word. A key truncated by `key_bits`
/// (tests) keeps only its leading bits, which land at the top of that word: its top six bits are
/// folded into the bottom six too, so truncated keys still reach different slots instead of all
/// probing from slot 0.
#[derive(Clone, Copy, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u128(&mut self, key: u128) {
        // A `TableKey` (a derived `Hash` over one `u128`) arrives here, as a single call.
        let folded = (key as u64) ^ ((key >> 64) as u64);
        self.0 = folded ^ (folded >> 58);
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

/// A `try_insert` that found the key taken: the entry holding it, and the one not inserted.
pub(crate) struct Occupied<'g> {
    pub(crate) current: EntryRef<'g>,
    pub(crate) not_inserted: Entry,
}

pub(crate) use shared::{EntryRef, SharedTable};

#[cfg(not(loom))]
mod shared {
    use super::{new_table, Entry, Occupied, Table, TableKey};

    /// An entry read through a guard, valid while the guard lives.
    pub(crate) type EntryRef<'g> = &'g Entry;
    /// Keeps every entry read through it alive (papaya's deferred reclamation).
    pub(crate) type TableGuard<'t> = papaya::LocalGuard<'t>;

    /// The lock-free table, reduced to the calls the cache makes.
    pub(crate) struct SharedTable(Table);

    impl SharedTable {
        pub(crate) fn with_capacity(capacity: usize) -> Self {
            Self(new_table(capacity))
        }
        #[inline]
        pub(crate) fn guard(&self) -> TableGuard<'_> {
            self.0.guard()
        }
        #[inline]
        pub(crate) fn get<'g>(
            &self,
            key: &TableKey,
            guard: &'g TableGuard<'_>,
        ) -> Option<&'g Entry> {
            self.0.get(key, guard)
        }
        #[inline]
        // Large error, as papaya's own: it hands the entry that was not inserted back. Boxing it
        // would allocate on every deduplicated commit.
        #[allow(clippy::result_large_err)]
        pub(crate) fn try_insert<'g>(
            &self,
            key: TableKey,
            entry: Entry,
            guard: &'g TableGuard<'_>,
        ) -> Result<&'g Entry, Occupied<'g>> {
            self.0.try_insert(key, entry, guard).map_err(|e| Occupied {
                current: e.current,
                not_inserted: e.not_inserted,
            })
        }
        #[inline]
        pub(crate) fn remove(&self, key: &TableKey, guard: &TableGuard<'_>) {
            self.0.remove(key, guard);
        }
        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }
    }
}

#[cfg(loom)]
mod shared {
    use std::collections::HashMap;
    use std::marker::PhantomData;
    use std::sync::Arc;

    use super::{Entry, Occupied, TableKey};

    /// An entry read from the table: shared ownership stands in for papaya's guard.
    pub(crate) struct EntryRef<'g>(Arc<Entry>, PhantomData<&'g Entry>);

    impl std::ops::Deref for EntryRef<'_> {
        type Target = Entry;
        fn deref(&self) -> &Entry {
            &self.0
        }
    }
    /// Nothing to pin: an `EntryRef` keeps its entry alive by itself.
    pub(crate) struct TableGuard<'t>(PhantomData<&'t ()>);

    /// A map whose every operation is one step loom schedules (see the module docs).
    pub(crate) struct SharedTable(loom::sync::RwLock<HashMap<TableKey, Arc<Entry>>>);

    impl SharedTable {
        pub(crate) fn with_capacity(_capacity: usize) -> Self {
            Self(loom::sync::RwLock::new(HashMap::new()))
        }
        pub(crate) fn guard(&self) -> TableGuard<'_> {
            TableGuard(PhantomData)
        }
        pub(crate) fn get<'g>(
            &self,
            key: &TableKey,
            _guard: &'g TableGuard<'_>,
        ) -> Option<EntryRef<'g>> {
            let map = self.0.read().unwrap();
            map.get(key).map(|e| EntryRef(Arc::clone(e), PhantomData))
        }
        // Large error, as papaya's own: it hands the entry that was not inserted back. Boxing it
        // would allocate on every deduplicated commit.
        #[allow(clippy::result_large_err)]
        pub(crate) fn try_insert<'g>(
            &self,
            key: TableKey,
            entry: Entry,
            _guard: &'g TableGuard<'_>,
        ) -> Result<EntryRef<'g>, Occupied<'g>> {
            let mut map = self.0.write().unwrap();
            if let Some(current) = map.get(&key) {
                return Err(Occupied {
                    current: EntryRef(Arc::clone(current), PhantomData),
                    not_inserted: entry,
                });
            }
            let entry = Arc::new(entry);
            map.insert(key, Arc::clone(&entry));
            Ok(EntryRef(entry, PhantomData))
        }
        pub(crate) fn remove(&self, key: &TableKey, _guard: &TableGuard<'_>) {
            self.0.write().unwrap().remove(key);
        }
        pub(crate) fn len(&self) -> usize {
            self.0.read().unwrap().len()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn truncated_keys_still_spread_over_slots() {
        // 6-bit keys, as the stress test uses: every key's low 64 bits are zero.
        let low_bits: std::collections::HashSet<u64> = (0..64u128)
            .map(|k| BuildKeyHasher.hash_one(TableKey(k << 122)) & 63)
            .collect();
        assert_eq!(low_bits.len(), 64, "each 6-bit key gets its own slot of 64");
    }
}
