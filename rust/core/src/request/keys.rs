//! The block keys a request keeps.
//!
//! ## Keys, computed at most once, where the index needs them
//! A request keeps the table key of each leading full block it knows (`keys`), in order. A
//! block's key is needed only to probe or enter the index: a first block, a branch (a
//! parent with more than one child), a table without links. A walk down a cached run and a
//! commit that extends a chain need none (`table/runs.rs`, on keys), so a request hashes its
//! blocks only up to the last position where it meets the index (`extend_keys`, from the last
//! key it knows), takes a matched block's key from its slot when the slot holds one, and
//! leaves the keys it hashed in its matched blocks' slots that held none (`fill_keys`), so the
//! next request down the same chain does not hash them again. Nothing is rehashed: re-matching after `preempt`
//! and each commit extend the same list. A reset (`clear`, `set_context`) changes every key; a
//! waiting request notices at its next match and starts over under the new context.

use super::with_request;
use crate::cache::{block_extras, Inner, PrefixCache};
use crate::error::Result;
use crate::key::{block_key_with, BlockKey, RequestExtras, TableKey};

use crate::request::{Request, RequestId};
use crate::table::Anchor;

impl PrefixCache {
    /// SHA-256 keys of every full block of a request's verified tokens (see `block_keys`),
    /// each computed once for the life of the request (after a reset, once more for a request
    /// that waits: it is re-keyed under the new context).
    pub fn request_block_keys(&self, id: &RequestId) -> Result<Vec<BlockKey>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        with_request(inner, id, |inner, request| {
            if !request.scheduled {
                self.refresh_epoch(inner, request);
            }
            let bs = self.config.block_size;
            let target = request.num_verified() / bs;
            let mut extras_buffer = Vec::new();
            for position in request.export_keys.len()..target {
                let parent = request.export_keys.last().copied().unwrap_or(request.root);
                let chunk = &request.tokens[position * bs..(position + 1) * bs];
                let extras = block_extras(&request.extras, position, bs, &mut extras_buffer);
                let key = block_key_with(&mut inner.scratch, &parent, chunk, extras);
                request.export_keys.push(key);
            }
            request.export_keys[..target].to_vec()
        })
    }

    /// The table key of block `position` of a request, from `keys` (the keys it has hashed,
    /// a prefix of its blocks') when known, else hashed from the last known one on, each key
    /// on the way kept. `origin`: the request's root key, tokens and extras. Keys are hashed
    /// only where the index needs them (`table/runs.rs`), so this may hash a whole hit that
    /// was matched through links: never more than hashing every block up front did.
    pub(crate) fn extend_keys(
        &self,
        scratch: &mut Vec<u8>,
        keys: &mut Vec<TableKey>,
        (root, tokens, extras): (&BlockKey, &[u32], &RequestExtras),
        position: usize,
    ) -> TableKey {
        if let Some(&key) = keys.get(position) {
            return key;
        }
        let previous = match keys.last() {
            Some(&key) => key,
            None => self.hasher.root(root),
        };
        let from = keys.len();
        self.hash_blocks(
            scratch,
            previous,
            (tokens, extras),
            from..=position,
            |key| {
                keys.push(key);
            },
        )
    }

    /// Hashes the blocks `range` of `tokens` in order, chained on from `previous` (the key of
    /// the block before the first, or the root's), calling `each` with each key; returns the
    /// last one (`previous` for an empty range). The one loop that hashes a prompt's blocks
    /// for a match or a commit (`extend_keys`, the lock-free `match_chain`).
    pub(crate) fn hash_blocks(
        &self,
        scratch: &mut Vec<u8>,
        mut previous: TableKey,
        (tokens, extras): (&[u32], &RequestExtras),
        range: std::ops::RangeInclusive<usize>,
        mut each: impl FnMut(TableKey),
    ) -> TableKey {
        let bs = self.config.block_size;
        let mut extras_buffer = Vec::new();
        for p in range {
            let chunk = &tokens[p * bs..(p + 1) * bs];
            let block_extras = block_extras(extras, p, bs, &mut extras_buffer);
            previous = self.hasher.block(scratch, previous, chunk, block_extras);
            each(previous);
        }
        previous
    }

    /// Leaves each of `keys` (the keys of `anchors`' positions, in order) in the slot of an
    /// anchor that holds none, and in the anchor (`Table::fill_key`): the blocks a request
    /// hashed at a branch are not hashed again by the next request down the same chain.
    pub(super) fn fill_keys(&self, anchors: &mut [Anchor], keys: &[TableKey]) {
        let guard = self.table.guard();
        for (anchor, &key) in anchors.iter_mut().zip(keys) {
            if !anchor.key.is_known() {
                self.table.fill_key(anchor, key, &guard);
                anchor.key = key;
            }
        }
    }

    /// A waiting request keyed under an older epoch starts over under the current one.
    pub(super) fn refresh_epoch(&self, inner: &Inner, request: &mut Request) {
        if request.epoch != inner.epoch {
            request.root = self.root_key(&request.salt);
            request.epoch = inner.epoch;
            request.keys.clear();
            request.export_keys.clear();
            request.cacheable = true;
        }
    }
}
