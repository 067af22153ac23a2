//! Lookups: the cached prefix of a prompt, matched without taking references (`lookup`), and the
//! chain walk every match shares (`match_chain`). Why a lock-free lookup is only a probe: `mod.rs`.

use std::sync::atomic::Ordering;

use super::{block_extras, PrefixCache, PrefixMatch};
use crate::error::{CacheError, Result};
use crate::key::{block_key_with, BlockKey, RequestExtras};
use crate::pool::BlockId;
use crate::table::{Anchor, Parent};

impl PrefixCache {
    /// The cached prefix of `tokens`, without taking references. Lock-free; the answer is a
    /// probe (blocks may be evicted right after), for routing and hit-length estimates.
    pub fn lookup(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<PrefixMatch> {
        self.check_tokens(tokens)?;
        Ok(self.lookup_checked(tokens, salt, extras))
    }

    /// `lookup` of tokens that already passed `check_tokens` (a batch checks every prompt
    /// before its first lookup: `lookup_many`), not scanned again.
    pub fn lookup_checked(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> PrefixMatch {
        // A statistics counter, not part of any protocol: relaxed.
        self.probes.fetch_add(1, Ordering::Relaxed);
        if let Some(window) = self.config.sliding_window {
            return self.sliding_lookup(&mut Vec::new(), window, tokens, salt, extras);
        }
        let blocks = self.matched_blocks(&mut Vec::new(), tokens, salt, extras);
        self.prefix_match(blocks, tokens.len())
    }

    /// `lookup` under a sliding window of `window` tokens in place of the cache's: what a
    /// request with that window (`set_request_window`) would hit. Refused (`InvalidInput`) in
    /// a full-attention cache and for a window of 0.
    pub fn lookup_in_window(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
        window: usize,
    ) -> Result<PrefixMatch> {
        self.check_tokens(tokens)?;
        if self.config.sliding_window.is_none() || window == 0 {
            return Err(CacheError::InvalidInput(format!(
                "lookup_in_window: window {window} in a {} cache (a sliding-window cache and a \
                 window of at least 1 token are needed)",
                if self.config.sliding_window.is_none() {
                    "full-attention"
                } else {
                    "sliding-window"
                }
            )));
        }
        self.probes.fetch_add(1, Ordering::Relaxed);
        Ok(self.sliding_lookup(&mut Vec::new(), window, tokens, salt, extras))
    }

    /// SHA-256 block keys of every full block of `tokens` under the current context: the keys
    /// that may leave the process (events, external tiers, routers). Lookups never need them.
    pub fn block_keys(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Result<Vec<BlockKey>> {
        self.check_tokens(tokens)?;
        let mut parent = self.root_key(salt);
        let mut buffer = Vec::new();
        let mut extras_buffer = Vec::new();
        let bs = self.config.block_size;
        Ok(tokens
            .chunks_exact(bs)
            .enumerate()
            .map(|(i, chunk)| {
                let block_extras = block_extras(extras, i, bs, &mut extras_buffer);
                parent = block_key_with(&mut buffer, &parent, chunk, block_extras);
                parent
            })
            .collect())
    }

    /// Computes the table key of every full block of `tokens` and nothing else; returns how
    /// many. The floor under `lookup` and `begin`, for benchmarks.
    pub fn hash_prompt(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> usize {
        let root = self.root_key(salt);
        let mut parent = self.hasher.root(&root);
        let mut buffer = Vec::new();
        let mut extras_buffer = Vec::new();
        let bs = self.config.block_size;
        let mut count = 0;
        for (index, chunk) in tokens.chunks_exact(bs).enumerate() {
            let block_extras = block_extras(extras, index, bs, &mut extras_buffer);
            parent = self.hasher.block(&mut buffer, parent, chunk, block_extras);
            count += 1;
        }
        std::hint::black_box(parent);
        count
    }

    /// The blocks of the cached prefix of `tokens` under the current context and `salt`.
    pub(crate) fn matched_blocks(
        &self,
        buffer: &mut Vec<u8>,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
    ) -> Vec<BlockId> {
        // Room for every block at once, taken at the first hit (a miss allocates nothing):
        // grown push by push, a long hit reallocated a dozen times, and on two threads each
        // reallocation could wait for the allocator's lock. No hit is longer than the pool.
        let room = (tokens.len() / self.config.block_size).min(self.config.num_blocks as usize);
        let mut blocks = Vec::new();
        self.match_chain(buffer, self.root_key(salt), tokens, extras, |anchor| {
            if blocks.capacity() == 0 {
                blocks.reserve_exact(room);
            }
            blocks.push(anchor.block);
        });
        // The list may live on in a `PrefixMatch` or a pin: a short hit of a long prompt keeps
        // no room it never used.
        if blocks.capacity() > 2 * blocks.len() {
            blocks.shrink_to_fit();
        }
        blocks
    }

    /// Walks the cached chain of `tokens` from the root, verifying every entry, calling
    /// `on_hit` with the anchor of each matched entry in order.
    pub(crate) fn match_chain(
        &self,
        buffer: &mut Vec<u8>,
        root: BlockKey,
        tokens: &[u32],
        extras: &RequestExtras,
        mut on_hit: impl FnMut(Anchor),
    ) {
        let bs = self.config.block_size;
        let guard = self.table.guard();
        // The key of block `known - 1` (the root's for 0): blocks are hashed only where the
        // index needs a key, from the last known one on (`PrefixCache::hash_blocks`).
        let mut key = self.hasher.root(&root);
        let mut known = 0;
        let mut parent: Option<Anchor> = None;
        let mut extras_buffer = Vec::new();
        for (index, chunk) in tokens.chunks_exact(bs).enumerate() {
            let this_extras = block_extras(extras, index, bs, &mut extras_buffer);
            if let Some(last) = &parent {
                // Down a run, the linked child verifies without a key and carries its own or
                // none (`Table::get_linked_child`): matched blocks are not hashed.
                if let Some(anchor) = self
                    .table
                    .get_linked_child(last, chunk, this_extras, &guard)
                {
                    if known == index && anchor.key.is_known() {
                        debug_assert_eq!(
                            anchor.key,
                            self.hasher.block(buffer, key, chunk, this_extras),
                            "a linked child's stored key is the one its chain computes"
                        );
                        key = anchor.key;
                        known += 1;
                    }
                    on_hit(anchor);
                    parent = Some(anchor);
                    continue;
                }
                if !self.table.may_have_indexed_children(last, &guard) {
                    return;
                }
            }
            // A first block or a branch: through the index, with the key.
            key = self.hash_blocks(buffer, key, (tokens, extras), known..=index, |_| {});
            known = index + 1;
            let want = match &parent {
                Some(last) => Parent::Entry(last.id),
                None => Parent::Root(root),
            };
            match self
                .table
                .get_verified(&key, &want, chunk, this_extras, &guard)
            {
                Some(anchor) => {
                    on_hit(anchor);
                    parent = Some(anchor);
                }
                None => return,
            }
        }
    }

    pub(crate) fn prefix_match(&self, mut blocks: Vec<BlockId>, num_tokens: usize) -> PrefixMatch {
        let shape = self.hit_shape(blocks.len(), num_tokens);
        blocks.truncate(self.hit_blocks(shape));
        let (num_cached_tokens, full_hit, last_token_shared) = shape;
        PrefixMatch {
            blocks,
            num_cached_tokens,
            full_hit,
            last_token_shared,
        }
    }
}
