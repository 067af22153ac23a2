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
        pub(crate) fn new(num_blocks: usize, block_size: usize, links: bool) -> Option<Self> {
            Table::with_links(num_blocks, block_size, links).map(Self)
        }
        #[inline]
        pub(crate) fn guard(&self) -> TableGuard {
            TableGuard
        }
        #[inline]
        pub(crate) fn entry(&self, block: BlockId, _guard: &TableGuard) -> Option<Entry> {
            self.0.entry(block)
        }
        pub(crate) fn link_of(
            &self,
            block: BlockId,
            _guard: &TableGuard,
        ) -> Option<(u64, Option<BlockId>)> {
            self.0.link_of(block)
        }
        pub(crate) fn child_of(&self, block: BlockId, _guard: &TableGuard) -> Option<BlockId> {
            self.0.child_of(block)
        }
        pub(crate) fn indexed_at(
            &self,
            block: BlockId,
            key: &TableKey,
            _guard: &TableGuard,
        ) -> bool {
            self.0.get(key).is_some_and(|entry| entry.block == block)
        }
        #[inline]
        pub(crate) fn get_linked_child(
            &self,
            parent: &Anchor,
            tokens: &[u32],
            extras: &[u8],
            _guard: &TableGuard,
        ) -> Option<Anchor> {
            self.0.get_linked_child(parent, tokens, extras)
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
            parent_block: Option<BlockId>,
            _guard: &TableGuard,
        ) -> Insertion {
            self.0.insert(key, entry, parent_block)
        }
        #[inline]
        pub(crate) fn links(&self) -> bool {
            self.0.links()
        }
        #[inline]
        pub(crate) fn takes_first_child(
            &self,
            parent: &Parent,
            parent_block: Option<BlockId>,
            _guard: &TableGuard,
        ) -> bool {
            self.0.takes_first_child(parent, parent_block)
        }
        pub(crate) fn fill_key(&self, anchor: &Anchor, key: TableKey, _guard: &TableGuard) {
            self.0.fill_key(anchor, key);
        }
        #[inline]
        pub(crate) fn may_have_indexed_children(
            &self,
            parent: &Anchor,
            _guard: &TableGuard,
        ) -> bool {
            self.0.may_have_indexed_children(parent)
        }
        #[inline(always)]
        pub(crate) fn insert_first_child(
            &self,
            key: TableKey,
            entry: &NewEntry<'_>,
            parent_block: BlockId,
            _guard: &TableGuard,
        ) -> Anchor {
            self.0.insert_first_child(key, entry, parent_block)
        }
        #[inline]
        pub(crate) fn remove(&self, block: BlockId, _guard: &TableGuard) {
            self.0.remove(block);
        }
        pub(crate) fn move_entry(&self, from: BlockId, to: BlockId, _guard: &TableGuard) -> bool {
            self.0.move_entry(from, to)
        }
        #[inline]
        pub(crate) fn prefetch(&self, key: &TableKey, block: Option<BlockId>, indexed: bool) {
            self.0.prefetch(key, block, indexed);
        }
        #[inline]
        pub(crate) fn prefetch_removal(&self, block: BlockId) {
            self.0.prefetch_removal(block);
        }
        #[inline]
        pub(crate) fn prefetch_slot(&self, block: BlockId) {
            self.0.prefetch_slot(block);
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

    use loom::sync::RwLock;

    use crate::table::{Anchor, BlockId, Entry, Insertion, NewEntry, Parent, TableKey};

    /// Nothing to pin: entries are handed out as owned snapshots, as by the real table.
    pub(crate) struct TableGuard;

    /// One block's published entry and the writer's own fields (`Slot` in `table/mod.rs`).
    #[derive(Clone)]
    struct Slot {
        key: TableKey,
        entry: Entry,
        up: Option<BlockId>,
        linked: bool,
        indexed_children: u32,
    }

    /// The real table's three kinds of location: index words (a map by key here), slots, and
    /// the reader-visible child links.
    #[derive(Default)]
    struct State {
        index: HashMap<TableKey, BlockId>,
        slots: HashMap<BlockId, Slot>,
        child: HashMap<BlockId, BlockId>,
    }

    /// The real table's protocol, one loom step per store the writer makes and per load a
    /// reader makes that the protocol's correctness rests on: a linked insert writes the slot,
    /// then the parent's link; a linked removal clears the link, then the slot; a move writes
    /// the new slot, then the link or index word, then clears the old slot; a reader following
    /// a link loads it, then reads (and verifies) the slot it names, then falls back to the
    /// index. An index probe with its slot read stays one step: the real table's tests check
    /// that contract with real threads (`table/tests.rs`).
    pub(crate) struct SharedTable {
        links: bool,
        state: RwLock<State>,
    }

    impl State {
        /// The slot holding `parent`'s entry, if it is `block` (`Table::parent_slot`).
        fn parent_slot(&self, parent: &Parent, block: Option<BlockId>) -> Option<BlockId> {
            let (Parent::Entry(id), Some(block)) = (parent, block) else {
                return None;
            };
            (self.slots.get(&block)?.entry.id == *id).then_some(block)
        }

        /// The slot that holds `slot`'s parent entry, if `slot.up` still does (`Table::up_slot`).
        fn up_slot(&self, slot: &Slot) -> Option<BlockId> {
            let (up, Parent::Entry(parent)) = (slot.up?, slot.entry.parent) else {
                return None;
            };
            (self.slots.get(&up)?.entry.id == parent).then_some(up)
        }

        fn verify(&self, block: BlockId, key: &TableKey, new: &NewEntry<'_>) -> Option<Anchor> {
            let slot = self.slots.get(&block)?;
            (slot.key == *key && slot.entry.verifies(&new.parent, new.tokens, new.extras))
                .then(|| slot.entry.anchor(*key))
        }
    }

    impl SharedTable {
        pub(crate) fn new(_num_blocks: usize, _block_size: usize, links: bool) -> Option<Self> {
            Some(Self {
                links,
                state: RwLock::new(State::default()),
            })
        }
        pub(crate) fn guard(&self) -> TableGuard {
            TableGuard
        }
        fn read(&self) -> loom::sync::RwLockReadGuard<'_, State> {
            self.state.read().unwrap()
        }
        fn write(&self) -> loom::sync::RwLockWriteGuard<'_, State> {
            self.state.write().unwrap()
        }
        pub(crate) fn entry(&self, block: BlockId, _guard: &TableGuard) -> Option<Entry> {
            self.read().slots.get(&block).map(|slot| slot.entry.clone())
        }
        pub(crate) fn link_of(
            &self,
            block: BlockId,
            _guard: &TableGuard,
        ) -> Option<(u64, Option<BlockId>)> {
            let state = self.read();
            let slot = state.slots.get(&block).filter(|slot| slot.linked)?;
            let Parent::Entry(parent) = slot.entry.parent else {
                return None;
            };
            Some((parent, state.up_slot(slot)))
        }
        pub(crate) fn child_of(&self, block: BlockId, _guard: &TableGuard) -> Option<BlockId> {
            self.read().child.get(&block).copied()
        }
        pub(crate) fn indexed_at(
            &self,
            block: BlockId,
            key: &TableKey,
            _guard: &TableGuard,
        ) -> bool {
            self.read().index.get(key) == Some(&block)
        }
        pub(crate) fn get_verified(
            &self,
            key: &TableKey,
            parent: &Parent,
            tokens: &[u32],
            extras: &[u8],
            _guard: &TableGuard,
        ) -> Option<Anchor> {
            let state = self.read();
            let block = *state.index.get(key)?;
            let slot = state.slots.get(&block)?;
            slot.entry
                .verifies(parent, tokens, extras)
                .then(|| slot.entry.anchor(*key))
        }
        pub(crate) fn get_linked_child(
            &self,
            parent: &Anchor,
            tokens: &[u32],
            extras: &[u8],
            _guard: &TableGuard,
        ) -> Option<Anchor> {
            let want = Parent::Entry(parent.id);
            // Two loads, as in the real table: the link, then the slot it names.
            let child = self.read().child.get(&parent.block).copied()?;
            let state = self.read();
            let slot = state.slots.get(&child)?;
            slot.entry
                .verifies(&want, tokens, extras)
                .then(|| slot.entry.anchor(slot.key))
        }
        pub(crate) fn insert(
            &self,
            key: TableKey,
            entry: &NewEntry<'_>,
            parent_block: Option<BlockId>,
            _guard: &TableGuard,
        ) -> Insertion {
            let slot = Slot {
                key,
                entry: Entry {
                    id: entry.id,
                    block: entry.block,
                    parent: entry.parent,
                    tokens: entry.tokens.into(),
                    extras: entry.extras.into(),
                },
                up: None,
                linked: false,
                indexed_children: 0,
            };
            let anchor = slot.entry.anchor(key);
            let found = |block| match self.read().verify(block, &key, entry) {
                Some(anchor) => Insertion::Present(anchor),
                None => Insertion::Collision,
            };
            let parent = if self.links {
                self.read().parent_slot(&entry.parent, parent_block)
            } else {
                None
            };
            if let Some(parent) = parent {
                let (child, indexed) = {
                    let state = self.read();
                    (
                        state.child.get(&parent).copied(),
                        state.slots[&parent].indexed_children,
                    )
                };
                match child {
                    Some(child) => {
                        // The same content as the linked child is that entry, whatever its key.
                        let state = self.read();
                        let linked = &state.slots[&child];
                        if linked
                            .entry
                            .verifies(&entry.parent, entry.tokens, entry.extras)
                        {
                            return Insertion::Present(linked.entry.anchor(linked.key));
                        }
                    }
                    None if indexed == 0 => {
                        self.write().slots.insert(
                            entry.block,
                            Slot {
                                up: Some(parent),
                                linked: true,
                                ..slot
                            },
                        );
                        self.write().child.insert(parent, entry.block);
                        return Insertion::Inserted(anchor);
                    }
                    None => {}
                }
            }
            let existing = self.read().index.get(&key).copied();
            if let Some(existing) = existing {
                return found(existing);
            }
            self.write()
                .slots
                .insert(entry.block, Slot { up: parent, ..slot });
            let mut state = self.write();
            state.index.insert(key, entry.block);
            if let Some(parent) = parent {
                state
                    .slots
                    .get_mut(&parent)
                    .expect("the parent's slot")
                    .indexed_children += 1;
            }
            Insertion::Inserted(anchor)
        }
        pub(crate) fn links(&self) -> bool {
            self.links
        }
        pub(crate) fn fill_key(&self, anchor: &Anchor, key: TableKey, _guard: &TableGuard) {
            let mut state = self.write();
            if let Some(slot) = state.slots.get_mut(&anchor.block) {
                if slot.entry.id == anchor.id && slot.linked && !slot.key.is_known() {
                    slot.key = key;
                }
            }
        }
        pub(crate) fn takes_first_child(
            &self,
            parent: &Parent,
            parent_block: Option<BlockId>,
            _guard: &TableGuard,
        ) -> bool {
            let state = self.read();
            self.links
                && state
                    .parent_slot(parent, parent_block)
                    .is_some_and(|block| {
                        !state.child.contains_key(&block)
                            && state.slots[&block].indexed_children == 0
                    })
        }
        pub(crate) fn may_have_indexed_children(
            &self,
            parent: &Anchor,
            _guard: &TableGuard,
        ) -> bool {
            !self.links
                || self
                    .read()
                    .slots
                    .get(&parent.block)
                    .is_some_and(|slot| slot.indexed_children != 0)
        }
        /// `insert` of a block whose parent has no child: always published.
        pub(crate) fn insert_first_child(
            &self,
            key: TableKey,
            entry: &NewEntry<'_>,
            parent_block: BlockId,
            guard: &TableGuard,
        ) -> Anchor {
            match self.insert(key, entry, Some(parent_block), guard) {
                Insertion::Inserted(anchor) => anchor,
                other => panic!("a first child was not published: {other:?}"),
            }
        }
        pub(crate) fn remove(&self, block: BlockId, _guard: &TableGuard) {
            let (slot, up) = {
                let state = self.read();
                let Some(slot) = state.slots.get(&block).cloned() else {
                    return;
                };
                let up = state.up_slot(&slot);
                (slot, up)
            };
            if slot.linked {
                if let Some(up) = up {
                    let mut state = self.write();
                    if state.child.get(&up) == Some(&block) {
                        state.child.remove(&up);
                    }
                }
            } else if let Some(up) = up {
                let mut state = self.write();
                let count = &mut state.slots.get_mut(&up).expect("up").indexed_children;
                *count = count.saturating_sub(1);
            }
            {
                let mut state = self.write();
                state.slots.remove(&block);
                state.child.remove(&block);
            }
            if !slot.linked {
                self.write().index.remove(&slot.key);
            }
        }
        pub(crate) fn move_entry(&self, from: BlockId, to: BlockId, _guard: &TableGuard) -> bool {
            let (mut slot, child, up) = {
                let state = self.read();
                let Some(slot) = state.slots.get(&from).cloned() else {
                    return false;
                };
                let up = state.up_slot(&slot);
                (slot, state.child.get(&from).copied(), up)
            };
            slot.entry.block = to;
            {
                let mut state = self.write();
                assert!(!state.slots.contains_key(&to), "block {to} holds an entry");
                state.slots.insert(to, slot.clone());
                if let Some(child) = child {
                    state.child.insert(to, child);
                }
            }
            if slot.linked {
                if let Some(up) = up {
                    let mut state = self.write();
                    if state.child.get(&up) == Some(&from) {
                        state.child.insert(up, to);
                    }
                }
            } else {
                self.write().index.insert(slot.key, to);
            }
            if let Some(child) = child {
                let mut state = self.write();
                if let Some(child) = state.slots.get_mut(&child) {
                    if child.entry.parent == Parent::Entry(slot.entry.id) {
                        child.up = Some(to);
                    }
                }
            }
            let mut state = self.write();
            state.slots.remove(&from);
            state.child.remove(&from);
            true
        }
        /// Only a hint to the hardware in the real table: nothing to model.
        pub(crate) fn prefetch(&self, _key: &TableKey, _block: Option<BlockId>, _indexed: bool) {}
        pub(crate) fn prefetch_removal(&self, _block: BlockId) {}
        pub(crate) fn prefetch_slot(&self, _block: BlockId) {}
        pub(crate) fn published(&self, block: BlockId, _guard: &TableGuard) -> Option<Anchor> {
            let state = self.read();
            let slot = state.slots.get(&block)?;
            Some(slot.entry.anchor(slot.key))
        }
        pub(crate) fn prefetch_entry(&self, _key: &TableKey) {}
        pub(crate) fn len(&self) -> usize {
            self.read().slots.len()
        }
    }
}
