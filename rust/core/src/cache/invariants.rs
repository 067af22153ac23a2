//! `check_invariants`: every invariant of the pool, of the table and of the ownership rules
//! (`cache/mod.rs`), checked by the tests after their steps.

use std::collections::HashMap;

use super::{Inner, PrefixCache};
use crate::key::TableKey;
use crate::pool::BlockId;
use crate::table::Parent;

impl PrefixCache {
    /// Checks every invariant of the pool (`pool.rs`), of the table and of the ownership rules
    /// (`cache/mod.rs`), for tests.
    ///
    /// # Panics
    /// With an assertion message naming the broken invariant. (The binding catches the panic
    /// and raises it as Python's `AssertionError`.)
    pub fn check_invariants(&self) {
        let inner = self.inner.lock();
        inner.pool.check_invariants();
        let guard = self.table.guard();
        assert_eq!(self.table.len(), inner.pool.num_cached(), "table size");
        let held_by: HashMap<u64, BlockId> = (0..inner.pool.num_blocks())
            .filter_map(|block| self.table.published(block as BlockId, &guard))
            .map(|anchor| (anchor.id, anchor.block))
            .collect();
        for block in 0..inner.pool.num_blocks() {
            let entry = self.table.published(block as BlockId, &guard);
            assert_eq!(
                entry.is_some(),
                inner.pool.is_cached(block as BlockId),
                "entry of {block}"
            );
            if let Some(entry) = entry {
                // Indexed under its key, or linked from its parent's block while the parent
                // is cached (a child outliving its parent is reachable by no lookup anyway).
                match self.table.link_of(block as BlockId, &guard) {
                    None => assert!(
                        self.table.indexed_at(block as BlockId, &entry.key, &guard),
                        "indexed entry of {block} not in the index"
                    ),
                    Some((parent, up)) => {
                        if let Some(&parent_block) = held_by.get(&parent) {
                            assert_eq!(up, Some(parent_block), "parent block of linked {block}");
                            assert_eq!(
                                self.table.child_of(parent_block, &guard),
                                Some(block as BlockId),
                                "link from {parent_block} to its child {block}"
                            );
                        }
                    }
                }
                assert!(
                    !inner.pool.is_stale(block as BlockId),
                    "cached block {block} was computed before the last reset"
                );
            }
        }
        // Every reference has one owner: a request, or the low-level caller.
        let mut owned = inner.external_refs.clone();
        for block in inner.requests.held_blocks() {
            owned[block as usize] += 1;
        }
        // Every pin count is a live pin's.
        let mut pinned = vec![0u32; owned.len()];
        for block in inner.pins.pinned_blocks() {
            pinned[block as usize] += 1;
        }
        for block in 0..owned.len() {
            let id = block as BlockId;
            assert_eq!(
                inner.pool.ref_count(id),
                Some(owned[block]),
                "refcount of block {block} vs. the references its owners hold"
            );
            assert_eq!(
                inner.pool.pin_count(id),
                Some(pinned[block]),
                "pin count of block {block} vs. live pins"
            );
        }
        if let Some(window) = self.config.sliding_window {
            inner
                .requests
                .check_sliding(window, self.config.block_size, self.config.num_blocks);
        }
        self.check_table_keys(&inner);
    }

    /// Every key a slot holds is the key its chain computes, and only a linked entry holds
    /// `UNKNOWN` (published without its key: `table/runs.rs`), so a walk may take a linked
    /// child's key from its slot instead of hashing the block. Checked from each entry's
    /// tokens, extras and parent chain, for entries whose chain is cached back to its first
    /// block (that an indexed entry holds a key, for every entry); in caches with links
    /// (full-width keys), not sliding ones (keyed on SHA-256).
    fn check_table_keys(&self, inner: &Inner) {
        // Not under loom: each read of its stand-in table is a step loom would interleave
        // with the other threads; the real table's tests check it after every step.
        if cfg!(loom) || !self.table.links() || self.config.sliding_window.is_some() {
            return;
        }
        let guard = self.table.guard();
        let num_blocks = inner.pool.num_blocks() as BlockId;
        let by_id: HashMap<u64, BlockId> = (0..num_blocks)
            .filter_map(|block| self.table.published(block, &guard))
            .map(|anchor| (anchor.id, anchor.block))
            .collect();
        for &block in by_id.values() {
            let anchor = self.table.published(block, &guard);
            assert!(
                anchor.is_some_and(|anchor| anchor.key.is_known())
                    || self.table.link_of(block, &guard).is_some(),
                "indexed entry of block {block} without its key"
            );
        }
        // The chain key of each block checked so far (`None`: its chain is not all cached).
        let mut chain_keys: HashMap<BlockId, Option<TableKey>> = HashMap::new();
        let mut scratch = Vec::new();
        for block in 0..num_blocks {
            // Up to a block already checked or a first block, then down again.
            let mut path = Vec::new();
            let mut cursor = Some(block);
            let mut key = None;
            while let Some(at) = cursor {
                if let Some(&known) = chain_keys.get(&at) {
                    key = known;
                    break;
                }
                let Some(entry) = self.table.entry(at, &guard) else {
                    break;
                };
                cursor = match entry.parent {
                    Parent::Root(root) => {
                        key = Some(self.hasher.root(&root));
                        None
                    }
                    Parent::Entry(id) => by_id.get(&id).copied(),
                };
                path.push((at, entry));
            }
            for (at, entry) in path.into_iter().rev() {
                key = key.map(|parent| {
                    self.hasher
                        .block(&mut scratch, parent, &entry.tokens, &entry.extras)
                });
                let stored = self.table.published(at, &guard).map(|anchor| anchor.key);
                let linked = self.table.link_of(at, &guard).is_some();
                if let (Some(key), Some(stored)) = (key, stored) {
                    assert!(
                        stored == key || (linked && !stored.is_known()),
                        "table key of block {at}: {stored:?} stored, {key:?} computed"
                    );
                }
                chain_keys.insert(at, key);
            }
        }
    }
}
