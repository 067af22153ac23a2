//! The low-level calls, for engines that keep their own block tables: references the caller owns
//! (`match_and_acquire`, `allocate`, dropped by `release`) and publishing whole chains
//! (`commit_blocks`). Who owns which reference: `mod.rs`.

use std::collections::HashMap;

use super::{PrefixCache, PrefixMatch};
use crate::error::{CacheError, Result};
use crate::key::RequestExtras;
use crate::pool::BlockId;
use crate::request::Request;

impl PrefixCache {
    /// Matches the cached prefix and takes a reference on each matched block, atomically.
    /// The caller owns those references and drops them with `release`. In a sliding-window
    /// cache the leading blocks the hit does not need are the null block: not referenced, so
    /// never released (`sliding.rs`).
    pub fn match_and_acquire(
        &self,
        tokens: &[u32],
        salt: &[u8],
        extras: &RequestExtras,
        priority: i32,
    ) -> Result<PrefixMatch> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let matched = match self.config.sliding_window {
            Some(window) => self.sliding_lookup(&mut inner.scratch, window, tokens, salt, extras),
            None => {
                let blocks = self.matched_blocks(&mut inner.scratch, tokens, salt, extras);
                // Only the blocks the hit uses (a `RecomputeLastBlock` full hit leaves the last
                // out).
                self.prefix_match(blocks, tokens.len())
            }
        };
        inner.tick += 1;
        let null = self.null_block();
        for &block in matched.blocks.iter().filter(|&&b| Some(b) != null) {
            inner.pool.acquire(block);
            inner.external_refs[block as usize] += 1;
            inner.pool.touch(block, inner.tick, priority);
        }
        inner.counters.lookups += 1;
        inner.counters.lookup_tokens += tokens.len() as u64;
        inner.counters.hit_tokens += matched.num_cached_tokens as u64;
        Ok(matched)
    }

    /// How many blocks `allocate` could hand out right now, capped at `up_to`, changing nothing.
    /// Costs O(1) when the free list covers `up_to`; otherwise it plans the eviction (about
    /// O(k log n) for k blocks planned), so ask for what you need rather than the pool size.
    #[must_use]
    pub fn blocks_obtainable(&self, up_to: usize) -> usize {
        self.inner.lock().pool.available(up_to)
    }

    /// Takes `count` free blocks (evicting if needed), each with one reference the caller owns.
    pub fn allocate(&self, count: usize) -> Result<Vec<BlockId>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = self.acquire_and_allocate(inner, &[], count)?;
        for &block in &blocks {
            inner.external_refs[block as usize] += 1;
        }
        Ok(blocks)
    }

    /// Publishes full blocks of a sequence the caller manages itself. `blocks[i]` holds the KV
    /// of tokens `i*block_size .. (i+1)*block_size`; the caller must hold a reference on each,
    /// taken with `allocate` or `match_and_acquire` since the last `clear` / `set_context`.
    /// Returns the canonical block of each position that is now cached: the caller's own, or an
    /// existing identical one (then the caller's copy is a duplicate, freed at its release).
    /// The result can be shorter than `blocks` if a key collision stops the chain.
    pub fn commit_blocks(
        &self,
        tokens: &[u32],
        blocks: &[BlockId],
        salt: &[u8],
        extras: &RequestExtras,
        priority: i32,
    ) -> Result<Vec<BlockId>> {
        self.check_tokens(tokens)?;
        self.refuse_in_sliding_mode("commit_blocks")?;
        let bs = self.config.block_size;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        for (position, &block) in blocks.iter().enumerate() {
            inner.pool.check_id(block)?;
            if inner.external_refs[block as usize] == 0 {
                return Err(CacheError::InvalidBlock {
                    block,
                    reason: "not held by the caller (take it with allocate or match_and_acquire)",
                });
            }
            if inner.pool.is_stale(block) {
                return Err(CacheError::BlockState {
                    block,
                    reason: "its KV was computed before clear() or set_context(): never published",
                });
            }
            if (position + 1) * bs > tokens.len() {
                return Err(CacheError::BlockState {
                    block,
                    reason: "not full: too few tokens to commit it",
                });
            }
        }
        // Published exactly as a request's commit would publish them (`request/publish.rs`).
        let mut sequence = Request::computed(
            tokens[..blocks.len() * bs].to_vec(),
            blocks.to_vec(),
            self.root_key(salt),
            inner.epoch,
            extras.clone(),
            priority,
        );
        inner.tick += 1;
        self.publish(inner, &mut sequence, blocks.len());
        Ok(sequence.anchors.iter().map(|e| e.block).collect())
    }

    /// Drops one reference per listed block (a block may be listed as often as it is held).
    /// Only references taken with `allocate` / `match_and_acquire` can be dropped here.
    pub fn release(&self, blocks: &[BlockId]) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let mut counts: HashMap<BlockId, u32> = HashMap::new();
        for &block in blocks {
            if Some(block) == self.null_block() {
                return Err(CacheError::InvalidBlock {
                    block,
                    reason: "the null block of a sliding-window cache: never referenced, so \
                             never released",
                });
            }
            inner.pool.check_id(block)?;
            let count = counts.entry(block).or_insert(0);
            *count += 1;
            if *count > inner.external_refs[block as usize] {
                return Err(CacheError::BlockState {
                    block,
                    reason: "released more often than it was acquired with allocate or \
                             match_and_acquire (a double release, or a block a request owns)",
                });
            }
        }
        inner.tick += 1;
        for &block in blocks {
            if inner.pool.is_cached(block) {
                // The lowest priority: a release refreshes recency but never protects a block.
                inner.pool.touch(block, inner.tick, i32::MIN);
            }
            inner.external_refs[block as usize] -= 1;
            inner.pool.release(block);
        }
        Ok(())
    }
}
