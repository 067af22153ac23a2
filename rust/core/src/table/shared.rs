//! `SharedTable`: the operations the cache uses, and their loom stand-in.
//!
//! The cache reaches the table only through [`SharedTable`]: `get`, `insert`, `remove`, each
//! one linearizable step, and a guard (nothing to pin here: a reader gets an owned snapshot).
//! Under `--cfg loom` the same calls run on a `loom::sync::RwLock` around a `HashMap` of
//! `Arc`ed entries, a map with exactly that contract whose every step loom can see and schedule
//! around; `tests/loom_pool.rs` says what this covers, and this module's tests race real threads
//! on the real table.

#[cfg(not(loom))]
pub(crate) use lock_free::SharedTable;
#[cfg(loom)]
pub(crate) use model::SharedTable;

#[cfg(not(loom))]
mod lock_free {
    use crate::table::{Anchor, BlockId, Entry, Insertion, NewEntry, Parent, Table, TableKey};

    /// Nothing to pin: a reader gets an owned snapshot. Kept so the cache's call sites read the
    /// same under loom, whose stand-in hands out references.
    pub(crate) struct TableGuard;

    /// The lock-free table, reduced to the calls the cache makes.
    pub(crate) struct SharedTable(Table);

    impl SharedTable {
        pub(crate) fn new(num_blocks: usize, block_size: usize) -> Option<Self> {
            Table::new(num_blocks, block_size).map(Self)
        }
        #[inline]
        pub(crate) fn guard(&self) -> TableGuard {
            TableGuard
        }
        #[inline]
        pub(crate) fn get(&self, key: &TableKey, _guard: &TableGuard) -> Option<Entry> {
            self.0.get(key)
        }
        #[inline]
        pub(crate) fn get_verified(
            &self,
            key: &TableKey,
            parent: &Parent,
            tokens: &[u32],
            extras: &[u8],
            _guard: &TableGuard,
        ) -> Option<Anchor> {
            self.0.get_verified(key, parent, tokens, extras)
        }
        #[inline]
        pub(crate) fn insert(
            &self,
            key: TableKey,
            entry: &NewEntry<'_>,
            _guard: &TableGuard,
        ) -> Insertion {
            self.0.insert(key, entry)
        }
        #[inline]
        pub(crate) fn remove(&self, key: &TableKey, _guard: &TableGuard) {
            self.0.remove(key);
        }
        pub(crate) fn move_entry(&self, key: &TableKey, to: BlockId, _guard: &TableGuard) -> bool {
            self.0.move_entry(key, to)
        }
        #[inline]
        pub(crate) fn prefetch(&self, key: &TableKey, block: Option<BlockId>) {
            self.0.prefetch(key, block);
        }
        #[inline]
        pub(crate) fn prefetch_removal(&self, block: BlockId) {
            self.0.prefetch_removal(block);
        }
        #[inline]
        pub(crate) fn published(&self, block: BlockId, _guard: &TableGuard) -> Option<Anchor> {
            self.0.published(block)
        }
        #[inline]
        pub(crate) fn prefetch_entry(&self, key: &TableKey) {
            self.0.prefetch_entry(key);
        }
        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }
    }
}

#[cfg(loom)]
mod model {
    use std::collections::HashMap;

    use crate::table::{Anchor, BlockId, Entry, Insertion, NewEntry, Parent, TableKey};

    /// Nothing to pin: entries are handed out as owned snapshots, as by the real table.
    pub(crate) struct TableGuard;

    /// A map whose every operation is one step loom schedules (see the module docs).
    pub(crate) struct SharedTable(loom::sync::RwLock<HashMap<TableKey, Entry>>);

    impl SharedTable {
        pub(crate) fn new(_num_blocks: usize, _block_size: usize) -> Option<Self> {
            Some(Self(loom::sync::RwLock::new(HashMap::new())))
        }
        pub(crate) fn guard(&self) -> TableGuard {
            TableGuard
        }
        pub(crate) fn get(&self, key: &TableKey, _guard: &TableGuard) -> Option<Entry> {
            self.0.read().unwrap().get(key).cloned()
        }
        pub(crate) fn get_verified(
            &self,
            key: &TableKey,
            parent: &Parent,
            tokens: &[u32],
            extras: &[u8],
            guard: &TableGuard,
        ) -> Option<Anchor> {
            self.get(key, guard)
                .filter(|entry| entry.verifies(parent, tokens, extras))
                .map(|entry| entry.anchor(*key))
        }
        pub(crate) fn insert(
            &self,
            key: TableKey,
            entry: &NewEntry<'_>,
            _guard: &TableGuard,
        ) -> Insertion {
            let mut map = self.0.write().unwrap();
            if let Some(current) = map.get(&key) {
                return if current.verifies(&entry.parent, entry.tokens, entry.extras) {
                    Insertion::Present(current.anchor(key))
                } else {
                    Insertion::Collision
                };
            }
            let inserted = Entry {
                id: entry.id,
                block: entry.block,
                parent: entry.parent,
                tokens: entry.tokens.into(),
                extras: entry.extras.into(),
            };
            let anchor = inserted.anchor(key);
            map.insert(key, inserted);
            Insertion::Inserted(anchor)
        }
        pub(crate) fn remove(&self, key: &TableKey, _guard: &TableGuard) {
            self.0.write().unwrap().remove(key);
        }
        pub(crate) fn move_entry(&self, key: &TableKey, to: BlockId, _guard: &TableGuard) -> bool {
            let mut map = self.0.write().unwrap();
            map.get_mut(key).map(|entry| entry.block = to).is_some()
        }
        /// Only a hint to the hardware in the real table: nothing to model.
        pub(crate) fn prefetch(&self, _key: &TableKey, _block: Option<BlockId>) {}
        pub(crate) fn prefetch_removal(&self, _block: BlockId) {}
        /// The entry `block` holds: a scan, which the few entries of a loom model allow.
        pub(crate) fn published(&self, block: BlockId, _guard: &TableGuard) -> Option<Anchor> {
            let map = self.0.read().unwrap();
            map.iter()
                .find(|(_, entry)| entry.block == block)
                .map(|(key, entry)| entry.anchor(*key))
        }
        pub(crate) fn prefetch_entry(&self, _key: &TableKey) {}
        pub(crate) fn len(&self) -> usize {
            self.0.read().unwrap().len()
        }
    }
}
