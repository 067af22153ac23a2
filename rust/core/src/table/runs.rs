//! Runs: a child published under a cached parent is linked from the parent's slot instead of
//! indexed, so a run of blocks pays one index word, as a radix node holds a run.
//!
//! A request's committed blocks form a chain, each the child of the one before, and most
//! parents only ever have one child. So a block published under a cached parent entry
//! (`Parent::Entry`) whose slot links no child yet, and none of whose children may sit in the
//! index (`indexed_children`, a count that only ever errs high), is *linked* from the parent's
//! slot (`child`) and takes no index word: a run of blocks then costs one index word (its
//! head) and a link per block, as a radix node holds a run. Publishing a linked child skips the
//! index probe, and evicting one clears its parent's link (the parent, the next block a cold
//! chain evicts, is read anyway) instead of removing a word with a backward shift: one random
//! miss fewer on each side (`benches/PROFILE.md`, issue 24, round 3). First blocks
//! (`Parent::Root`), and so every entry of a sliding-window cache, are always indexed, as are a
//! parent's later children (branches).
//!
//! A lookup verifies block *i*, then reads its `child` and verifies the block it names as it
//! would a block an index word names (parent entry id, tokens, extras, under that slot's own
//! sequence lock), but for the key, which it takes from the slot instead of hashing the block
//! (`get_linked_child` says why that is exact); on no link or a mismatch it hashes the block
//! and probes the index. So a link is a hint like an index word: one to a slot being
//! rewritten, or read from a parent slot reused since, names an entry whose parent id cannot be
//! the one looked for (entry ids are never reused) and reads as no entry. Duplicates stay exact:
//! a parent's child with given content is its linked child (compared by content, whatever key
//! it holds) or in the index under its key, and a publish looks in both unless the parent has
//! no child at all. What the table no longer knows is whether a *linked* child's key is held
//! elsewhere in the index with other content: a collision of 128-bit keys, which verification
//! makes harmless. Truncated test keys (`key_bits`), whose
//! collisions the reference models count, keep every entry indexed (`Table::with_links`).
//!
//! A commit's fresh run (`request/publish.rs`) publishes each block under the entry it
//! published just before, which has no child yet: `insert_first_child` links it without looking
//! for a child that cannot exist.
//!
//! ## Keys, hashed only where the index needs them
//! A table key is a function of the parent's key, the block's tokens and its extras (`key.rs`),
//! and a linked child is found and verified by its parent entry id, tokens and extras without
//! one (`get_linked_child`). So a key is needed only to probe or enter the index: a first
//! block, a branch (a parent whose linked child is other content and which may have indexed
//! children), a table without links. A linked entry is published with the key its request
//! knows, or with `TableKey::UNKNOWN`; a walk that reaches a branch hashes its own blocks from
//! the last key it knows and, under the mutex, leaves those keys in the slots that held none
//! (`fill_key`), so the next request down that chain does not hash them again (a lock-free
//! lookup, which writes nothing, and a commit that meets a run it duplicates may still hash
//! a run more than once). An indexed entry always
//! holds its key. `check_invariants` checks every key a slot holds against its chain. A miss
//! that extends a chain (a new conversation turn, a fresh prompt past its first block) then
//! hashes nothing but its first block: the per-block hash was a fifth of a miss's
//! instructions and a quarter of a hit's (PROFILE.md, issue 24, round 15).
//!
//! Every writer-side field (`up`, `linked`, `indexed_children`, the last also read by lock-free
//! walks as a hint) names a parent by block and is
//! trusted only while that block still holds the parent's entry id (`up_slot`): an entry can
//! move (`move_entry` carries its link along and repoints its linked child), and in vLLM's free
//! order a child can outlive its parent, whose block is then reused; the child's later removal
//! must not touch the reused slot.
//!
//! The slot fields these rules use (`child`, `up`, `linked`, `indexed_children`) are declared
//! with the others in `mod.rs`; the sequence lock they ride on is described there.

use std::sync::atomic::{fence, Ordering};

use super::index_hash;
use super::{Anchor, BlockId, Insertion, NewEntry, Parent, Slot, Table, TableKey, Verified};

impl Table {
    /// Publishes `entry` under `key` unless the key is taken, or the parent's linked child holds
    /// the same content (compared whatever key it holds); then says whether the entry found
    /// verifies against `entry`, compared in place (no snapshot, no copy of the new entry: a
    /// miss publishes one block per call). `key` may be `TableKey::UNKNOWN` only when the entry
    /// becomes the parent's first child (`takes_first_child`). Writer only (the cache's mutex).
    ///
    /// # Panics
    /// If the key is free but `entry.block` already holds a published entry: a block holds one
    /// entry at a time (the cache removes the old one before reusing a block), which is what
    /// keeps at most half of the index in use.
    ///
    /// `parent_block` is the block holding the entry named by a `Parent::Entry` parent (`None`
    /// for a first block): while that entry has no linked child, and no child of it may be in
    /// the index, the new entry is linked from it instead of indexed (module docs).
    #[inline(always)] // once per published block: no call, no returned enum in memory
    pub fn insert(
        &self,
        key: TableKey,
        entry: &NewEntry<'_>,
        parent_block: Option<BlockId>,
    ) -> Insertion {
        let Some((parent_block, parent)) = self.parent_slot(&entry.parent, parent_block) else {
            return self.insert_indexed(key, entry, None);
        };
        let child = parent.child.load(Ordering::Relaxed);
        if child != 0 {
            // The same content as the linked child is that entry, whatever key either holds
            // (`get_linked_child`); other content is a branch, published through the index.
            // The writer's own slot: never odd, never rewritten while it reads.
            let child = child - 1;
            if let Verified::Yes(anchor) =
                self.verify_keyed(child, None, &entry.parent, entry.tokens, entry.extras)
            {
                return Insertion::Present(anchor);
            }
        } else if parent.indexed_children.load(Ordering::Relaxed) == 0 {
            // No child of this parent exists, so the key is not this parent's already.
            return Insertion::Inserted(self.insert_first_child(key, entry, parent_block));
        }
        let inserted = self.insert_indexed(key, entry, Some(parent_block));
        if matches!(inserted, Insertion::Inserted(_)) {
            let count = parent.indexed_children.load(Ordering::Relaxed);
            parent
                .indexed_children
                .store(count.saturating_add(1), Ordering::Relaxed);
        }
        inserted
    }

    /// Publishes `entry` as the linked child of the entry in `parent_block`, which has no child,
    /// linked or indexed (so no key is this parent's yet: nothing to probe): `insert` finds that
    /// out, a commit's fresh run knows it (the parent is the entry it published just before).
    /// Writer only; the caller checks `links`.
    #[inline(always)] // once per block of a fresh run
    pub fn insert_first_child(
        &self,
        key: TableKey,
        entry: &NewEntry<'_>,
        parent_block: BlockId,
    ) -> Anchor {
        let parent = &self.slots[parent_block as usize];
        debug_assert!(self.links);
        debug_assert_eq!(
            Parent::Entry(parent.id.load(Ordering::Relaxed)),
            entry.parent
        );
        debug_assert_eq!(parent.child.load(Ordering::Relaxed), 0);
        debug_assert_eq!(parent.indexed_children.load(Ordering::Relaxed), 0);
        self.claim(entry.block);
        self.write(key, entry, Some(parent_block), true);
        parent.child.store(entry.block + 1, Ordering::Release);
        self.count_entries(1);
        Anchor {
            id: entry.id,
            block: entry.block,
            key,
        }
    }

    /// Writes `key` into the slot of the entry `anchor` names if it holds none (a linked entry
    /// published without one), under the slot's sequence lock: a request that hashed a hit's
    /// keys at a branch leaves them for the next request down the same chain, which then does
    /// not hash them again (module docs, on keys). The caller vouches that
    /// `key` is the one the entry's chain computes (`check_invariants` checks it). Writer only.
    pub fn fill_key(&self, anchor: &Anchor, key: TableKey) {
        let Some(slot) = self.slots.get(anchor.block as usize) else {
            return;
        };
        // Only a linked entry is ever published without its key: an indexed one holds its key,
        // which a truncated test key (`key_bits`) may make equal to `UNKNOWN`.
        if slot.id.load(Ordering::Relaxed) != anchor.id
            || !slot.linked.load(Ordering::Relaxed)
            || slot.key().is_known()
        {
            return;
        }
        let seq = slot.seq.load(Ordering::Relaxed);
        slot.seq.store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        slot.key[0].store(key.0 as u64, Ordering::Relaxed);
        slot.key[1].store((key.0 >> 64) as u64, Ordering::Relaxed);
        slot.seq.store(seq + 2, Ordering::Release);
    }

    /// Whether `insert` of a child of `parent` (held in `parent_block`) publishes it as the
    /// parent's first, linked child: links are on, the block holds the parent and it has no
    /// child, linked or indexed. Such a child needs no key (`UNKNOWN` will do: module docs,
    /// on keys); any other insert probes the index, with the key. Writer only.
    #[must_use]
    #[inline]
    pub fn takes_first_child(&self, parent: &Parent, parent_block: Option<BlockId>) -> bool {
        self.parent_slot(parent, parent_block)
            .is_some_and(|(_, slot)| {
                slot.child.load(Ordering::Relaxed) == 0
                    && slot.indexed_children.load(Ordering::Relaxed) == 0
            })
    }

    /// Whether a child of the entry `parent` names may sit in the index: for the writer, never
    /// false while one does (the count only errs high); for a lock-free reader, a hint, read
    /// while the slot may change under it, which can only make a lookup stop short (a
    /// shorter cached prefix is always a correct answer), never match a wrong entry.
    #[must_use]
    #[inline]
    pub fn may_have_indexed_children(&self, parent: &Anchor) -> bool {
        !self.links
            || self
                .slots
                .get(parent.block as usize)
                .is_some_and(|slot| slot.indexed_children.load(Ordering::Relaxed) != 0)
    }

    /// The slot holding the parent entry `parent` names, if it is in `block` and children may
    /// be linked. Writer only.
    fn parent_slot(&self, parent: &Parent, block: Option<BlockId>) -> Option<(BlockId, &Slot)> {
        let (Parent::Entry(id), Some(block)) = (parent, block) else {
            return None;
        };
        let slot = self.slots.get(block as usize)?;
        (self.links && slot.id.load(Ordering::Relaxed) == *id).then_some((block, slot))
    }

    /// The slot that held `slot`'s parent entry when it was written, if it still holds it.
    /// Writer only.
    fn up_slot(&self, slot: &Slot) -> Option<&Slot> {
        let up = slot.up.load(Ordering::Relaxed).checked_sub(1)?;
        let parent = slot.parent.load(Ordering::Relaxed);
        let holder = self.slots.get(up as usize)?;
        (parent != 0 && holder.id.load(Ordering::Relaxed) == parent).then_some(holder)
    }

    /// Removes the entry `block` holds, if any: a linked entry is unlinked from its parent's
    /// slot, an indexed one leaves the index. Writer only.
    #[inline(always)] // once per evicted block: no call, no register saves (PROFILE.md)
    pub fn remove(&self, block: BlockId) {
        let Some(slot) = self.slots.get(block as usize) else {
            return;
        };
        if slot.id.load(Ordering::Relaxed) == 0 {
            return;
        }
        let parent = self.up_slot(slot);
        if slot.linked.load(Ordering::Relaxed) {
            if let Some(parent) = parent {
                if parent.child.load(Ordering::Relaxed) == block + 1 {
                    parent.child.store(0, Ordering::Release);
                }
            }
            self.clear_slot(block);
            self.count_entries(-1);
            return;
        }
        if let Some(parent) = parent {
            let count = parent.indexed_children.load(Ordering::Relaxed);
            parent
                .indexed_children
                .store(count.saturating_sub(1), Ordering::Relaxed);
        }
        self.remove_indexed(&self.slot_key(block), block);
    }

    /// Moves the entry `from` holds into block `to`, whose slot is empty: same id, key, parent,
    /// tokens, extras and children, so its children still verify against it (`pool.rs`, on
    /// duplicates), and its link or index word now names `to`. Readers see it in one block or
    /// the other, or miss it while it moves, which a lock-free probe may. Writer only; returns
    /// false if `from` holds no entry.
    pub fn move_entry(&self, from: BlockId, to: BlockId) -> bool {
        let Some(anchor) = self.published(from) else {
            return false;
        };
        let mut entry = self
            .read(from, &anchor.key)
            .expect("the writer reads its own published entry");
        self.claim(to);
        let (source, target) = (&self.slots[from as usize], &self.slots[to as usize]);
        let up = source.up.load(Ordering::Relaxed).checked_sub(1);
        let linked = source.linked.load(Ordering::Relaxed);
        let child = source.child.load(Ordering::Relaxed);
        entry.block = to;
        self.write(anchor.key, &entry.as_new(), up, linked);
        target.indexed_children.store(
            source.indexed_children.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        target.child.store(child, Ordering::Release);
        if linked {
            if let Some(parent) = self.up_slot(target) {
                if parent.child.load(Ordering::Relaxed) == from + 1 {
                    parent.child.store(to + 1, Ordering::Release);
                }
            }
        } else {
            let repointed = self.index.repoint(index_hash(anchor.key), from, to);
            assert!(repointed, "indexed entry of block {from} not in the index");
        }
        // The linked child now finds its parent in `to` (indexed children keep the old block,
        // which `up_slot` then refuses: their parent's count only ever errs high).
        if let Some(child) = child.checked_sub(1) {
            let child = &self.slots[child as usize];
            if child.parent.load(Ordering::Relaxed) == entry.id {
                child.up.store(to + 1, Ordering::Relaxed);
            }
        }
        self.clear_slot(from);
        true
    }

    /// For the entry `block` holds, if it is linked rather than indexed: its parent entry's id
    /// and the block its writer-side `up` names (`None` when that block no longer holds the
    /// parent: the parent is gone or moved). Writer only (for `check_invariants`).
    #[must_use]
    pub fn link_of(&self, block: BlockId) -> Option<(u64, Option<BlockId>)> {
        let slot = self.slots.get(block as usize)?;
        if slot.id.load(Ordering::Relaxed) == 0 || !slot.linked.load(Ordering::Relaxed) {
            return None;
        }
        let up = self
            .up_slot(slot)
            .map(|_| slot.up.load(Ordering::Relaxed) - 1);
        Some((slot.parent.load(Ordering::Relaxed), up))
    }

    /// The block the entry in `block` links as its child, if any. Writer only.
    #[must_use]
    pub fn child_of(&self, block: BlockId) -> Option<BlockId> {
        let slot = self.slots.get(block as usize)?;
        slot.child.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Whether a lookup can reach the entry `block` holds: its index word, or its parent's link.
    /// Writer only (tests).
    #[must_use]
    pub fn reachable(&self, block: BlockId) -> bool {
        let Some(slot) = self.slots.get(block as usize) else {
            return false;
        };
        if slot.id.load(Ordering::Relaxed) == 0 {
            return false;
        }
        if slot.linked.load(Ordering::Relaxed) {
            return self
                .up_slot(slot)
                .is_some_and(|parent| parent.child.load(Ordering::Relaxed) == block + 1);
        }
        self.get(&self.slot_key(block))
            .is_some_and(|entry| entry.block == block)
    }

    /// `get_verified` of a child of `parent`: the entry `parent`'s slot links first (no index
    /// read), then the index. The link is a hint like an index word: the block it names is
    /// verified in full under its own sequence lock, so a link to a slot being rewritten, or
    /// to another parent's child after the parent's block was reused, reads as no entry.
    /// Lock-free.
    #[must_use]
    #[inline]
    pub fn get_verified_child(
        &self,
        parent: &Anchor,
        key: &TableKey,
        tokens: &[u32],
        extras: &[u8],
    ) -> Option<Anchor> {
        self.linked_child(parent, Some(key), tokens, extras)
            .or_else(|| self.get_verified(key, &Parent::Entry(parent.id), tokens, extras))
    }

    /// The child `parent`'s slot links, if it verifies against `tokens` and `extras` (parent
    /// entry id, exact tokens, extras, under its own sequence lock), without a key to compare:
    /// the anchor carries the key its slot holds. `None`: no link, a slot being rewritten, or
    /// other content (a branch; then `get_verified` with the key looks in the index).
    ///
    /// Why no key is needed: a table key is a function of the parent's key, the tokens and the
    /// extras (`key.rs`), and every key in the table was computed by the cache from the chain
    /// its entry was published under. What is verified here pins all three: the tokens and
    /// extras compared, and the parent, whose entry id (never reused) is the one the walker
    /// verified a step earlier, back to a first block verified with its key and full root
    /// key. So the stored key is the key the walker would compute: a walk down a cached chain
    /// follows links without hashing the blocks it matches (the hash was a quarter of a hit's
    /// instructions: PROFILE.md, issue 24, round 15), and only a branch or the first block
    /// past the hit is hashed. Lock-free.
    #[must_use]
    #[inline]
    pub fn get_linked_child(
        &self,
        parent: &Anchor,
        tokens: &[u32],
        extras: &[u8],
    ) -> Option<Anchor> {
        self.linked_child(parent, None, tokens, extras)
    }

    /// The child `parent`'s slot links, verified (with `key` when given).
    #[inline(always)]
    fn linked_child(
        &self,
        parent: &Anchor,
        key: Option<&TableKey>,
        tokens: &[u32],
        extras: &[u8],
    ) -> Option<Anchor> {
        let slot = self.slots.get(parent.block as usize)?;
        let child = slot.child.load(Ordering::Acquire).checked_sub(1)?;
        if child as usize >= self.slots.len() {
            return None;
        }
        match self.verify_keyed(child, key, &Parent::Entry(parent.id), tokens, extras) {
            Verified::Yes(anchor) => Some(anchor),
            Verified::No | Verified::OtherKey => None,
        }
    }
}
