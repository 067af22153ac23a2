//! The block keys a request keeps.
//!
//! ## Keys, computed once
//! A request keeps the table key of each full block it has hashed (`keys`), in order: the
//! first match, each commit, re-matching after `preempt` and exporting SHA-256 keys extend
//! them, never rehash. A reset (`clear`, `set_context`) changes every key; a waiting request
//! notices at its next match and starts over under the new context.

use super::with_request;
use crate::cache::{block_extras, Inner, PrefixCache};
use crate::error::Result;
use crate::key::{block_key_with, BlockKey, TableHasher, TableKey};
use crate::request::{Request, RequestId};

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

/// The table key of block `position` of `tokens`, from `keys` when already computed, else
/// computed from the previous one and appended. Positions are visited in order, so `position`
/// is at most `keys.len()`.
pub(super) fn table_key(
    hasher: &TableHasher,
    scratch: &mut Vec<u8>,
    keys: &mut Vec<TableKey>,
    root: &BlockKey,
    chunk: &[u32],
    block_extras: &[u8],
    position: usize,
) -> TableKey {
    if let Some(&key) = keys.get(position) {
        return key;
    }
    debug_assert_eq!(position, keys.len());
    let parent = match position {
        0 => hasher.root(root),
        _ => keys[position - 1],
    };
    let key = hasher.block(scratch, parent, chunk, block_extras);
    keys.push(key);
    key
}
