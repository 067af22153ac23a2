//! Snapshots: the cached set rebuilt from the table as events, with its block keys.
//!
//! A drain after an overflow, or the first after enabling events on a warm cache, replaces the
//! queue by `Cleared` and one `Stored` per cached block, parents first; `cached_keys` gives the
//! set itself. Keys are recomputed from each entry's tokens, extras and parent chain, exactly as
//! `publish` would have computed them (`key.rs`).

use std::collections::HashMap;

use super::{stored_event, KvEvent};
use crate::cache::{Inner, PrefixCache};
use crate::key::{block_key_with, root_key, BlockKey};
use crate::pool::BlockId;
use crate::table::{Anchor, Parent};

impl PrefixCache {
    /// `Cleared`, then one `Stored` per cached block, parents first.
    pub(super) fn snapshot(&self, inner: &mut Inner) -> Vec<KvEvent> {
        let keys = self.cached_block_keys(inner);
        let unsalted_root = root_key(&self.context(), b"");
        let policy = inner.events.token_policy();
        let guard = self.table.guard();
        let mut events = vec![KvEvent::Cleared];
        for (block, parent, root) in self.cached_in_chain_order(inner) {
            let entry = self
                .table
                .entry(block, &guard)
                .expect("cached blocks have entries");
            events.push(stored_event(
                (
                    keys[block as usize].expect("computed for every cached block"),
                    parent.map(|p| keys[p as usize].expect("a cached parent")),
                ),
                &entry.tokens,
                (&root, &unsalted_root),
                &entry.extras,
                adapter_of(&entry.extras),
                policy,
            ));
        }
        events
    }

    /// Every cached block with its cached parent and its chain's root key, parents first.
    fn cached_in_chain_order(&self, inner: &Inner) -> Vec<(BlockId, Option<BlockId>, BlockKey)> {
        let guard = self.table.guard();
        let published: Vec<Anchor> = inner
            .pool
            .cached_blocks()
            .into_iter()
            .map(|block| {
                self.table
                    .published(block, &guard)
                    .expect("cached blocks have entries")
            })
            .collect();
        let by_entry: HashMap<u64, BlockId> = published
            .iter()
            .map(|anchor| (anchor.id, anchor.block))
            .collect();
        let mut parent_of: HashMap<BlockId, Result<BlockId, BlockKey>> = HashMap::new();
        for anchor in &published {
            let entry = self.table.entry(anchor.block, &guard).expect("published");
            let parent = match entry.parent {
                Parent::Root(root) => Err(root),
                Parent::Entry(id) => {
                    Ok(*by_entry.get(&id).expect("a cached child keeps its parent"))
                }
            };
            parent_of.insert(anchor.block, parent);
        }
        // Depth of each block, then sort by it: parents come before their children.
        let mut out: Vec<(usize, BlockId, Option<BlockId>, BlockKey)> = Vec::new();
        for &block in parent_of.keys() {
            let mut depth = 0;
            let mut cursor = block;
            let root = loop {
                match parent_of[&cursor] {
                    Ok(parent) => {
                        depth += 1;
                        cursor = parent;
                    }
                    Err(root) => break root,
                }
            };
            out.push((depth, block, parent_of[&block].ok(), root));
        }
        out.sort_unstable_by_key(|&(depth, block, _, _)| (depth, block));
        out.into_iter().map(|(_, b, p, r)| (b, p, r)).collect()
    }

    /// The block key of every cached block, indexed by block id, computed from the table.
    pub(super) fn cached_block_keys(&self, inner: &mut Inner) -> Vec<Option<BlockKey>> {
        let guard = self.table.guard();
        let mut keys = vec![None; inner.pool.num_blocks()];
        for (block, parent, root) in self.cached_in_chain_order(inner) {
            let entry = self
                .table
                .entry(block, &guard)
                .expect("cached blocks have entries");
            let parent_key = parent.map_or(root, |p| keys[p as usize].expect("parents first"));
            keys[block as usize] = Some(block_key_with(
                &mut inner.scratch,
                &parent_key,
                &entry.tokens,
                &entry.extras,
            ));
        }
        keys
    }
}

/// The adapter name in a block's encoded extras (`key.rs`: it comes first when present).
fn adapter_of(extras: &[u8]) -> Option<Vec<u8>> {
    let (&tag, rest) = extras.split_first()?;
    if tag != 0x01 || rest.len() < 4 {
        return None;
    }
    let len = u32::from_le_bytes(rest[..4].try_into().ok()?) as usize;
    rest.get(4..4 + len).map(<[u8]>::to_vec)
}
