//! A prefix index over many engine instances, fed by their KV events, for routers.
//!
//! A router embeds one [`PrefixIndex`]; a subscriber applies each instance's `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared` events to it, and for every new request the router asks
//! [`PrefixIndex::score`] how many leading blocks of the prompt each instance holds.
//!
//! ## Invariants
//! - **Blocks are 64-bit hashes** ([`hash64`]): what vLLM publishes with
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, and what a 32-byte key on the wire is folded to (the
//!   low 64 bits of the key read as a big-endian integer, vLLM's own conversion). One derivation,
//!   so events from prefixkv and from vLLM land in one index.
//! - **Readers never block.** The map from block hash to the bit set of instances holding it is
//!   a papaya map: `score` reads it without a lock while events are applied.
//! - **Writers are serialised** by one mutex, which also guards each instance's own multiset of
//!   blocks. An instance may report the same hash twice (vLLM can hold duplicate blocks), so
//!   its bit is set on the first store and cleared on the last removal, and a clear drops
//!   exactly the blocks that instance holds. The map is a function of those multisets: after
//!   any sequence of events, `blocks_of(i)` is the set of hashes stored and not yet removed.
//! - **At most 64 instances** (one bit each): a router shards beyond that.
//! - A score is a probe, as `PrefixCache::lookup` is: the instance may evict the blocks before
//!   the request arrives. Routing on a stale score costs a miss, never a wrong answer.

use std::collections::HashMap;

use parking_lot::Mutex;

use crate::cache::block_extras;
use crate::error::{CacheError, Result};
use crate::key::{block_key_with, root_key, BlockKey, RequestExtras};

/// Most instances one index tracks.
pub const MAX_INSTANCES: usize = 64;

pub use crate::events::hash64;

/// The 64-bit hashes of every full block of a prompt, as a prefixkv instance under context
/// `context` publishes them: what a router scores with.
#[must_use]
pub fn prompt_hashes(
    context: &BlockKey,
    block_size: usize,
    tokens: &[u32],
    salt: &[u8],
    extras: &RequestExtras,
) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = root_key(context, salt);
    let mut buffer = Vec::new();
    let mut extras_buffer = Vec::new();
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(index, chunk)| {
            parent = block_key_with(
                &mut buffer,
                &parent,
                chunk,
                block_extras(extras, index, block_size, &mut extras_buffer),
            );
            hash64(&parent)
        })
        .collect()
}

/// Which instances hold which blocks; see the module docs.
pub struct PrefixIndex {
    num_instances: usize,
    /// Block hash to the bit set of instances holding it (never zero: emptied entries go).
    holders: papaya::HashMap<u64, u64>,
    /// Each instance's multiset of blocks.
    writer: Mutex<Vec<HashMap<u64, u32>>>,
}

impl PrefixIndex {
    /// An empty index for instances `0 .. num_instances`.
    pub fn new(num_instances: usize) -> Result<Self> {
        if num_instances == 0 || num_instances > MAX_INSTANCES {
            return Err(CacheError::InvalidInput(format!(
                "num_instances must be in 1..={MAX_INSTANCES}, got {num_instances}"
            )));
        }
        Ok(Self {
            num_instances,
            holders: papaya::HashMap::new(),
            writer: Mutex::new(vec![HashMap::new(); num_instances]),
        })
    }

    /// How many instances this index tracks.
    #[must_use]
    pub fn num_instances(&self) -> usize {
        self.num_instances
    }

    fn check(&self, instance: usize) -> Result<u64> {
        if instance >= self.num_instances {
            return Err(CacheError::InvalidInput(format!(
                "instance {instance} is out of range 0..{}",
                self.num_instances
            )));
        }
        Ok(1u64 << instance)
    }

    /// `instance` now holds `hashes` (a `BlockStored`).
    pub fn store(&self, instance: usize, hashes: &[u64]) -> Result<()> {
        let bit = self.check(instance)?;
        let mut writer = self.writer.lock();
        let holders = self.holders.pin();
        for &hash in hashes {
            let count = writer[instance].entry(hash).or_insert(0);
            *count += 1;
            if *count == 1 {
                let mask = holders.get(&hash).copied().unwrap_or(0);
                holders.insert(hash, mask | bit);
            }
        }
        Ok(())
    }

    /// `instance` no longer holds `hashes` (a `BlockRemoved`). Unknown hashes are ignored: a
    /// subscriber that joined late may see removals of blocks it never saw stored.
    pub fn remove(&self, instance: usize, hashes: &[u64]) -> Result<()> {
        let bit = self.check(instance)?;
        let mut writer = self.writer.lock();
        let holders = self.holders.pin();
        for &hash in hashes {
            let blocks = &mut writer[instance];
            let Some(count) = blocks.get_mut(&hash) else {
                continue;
            };
            *count -= 1;
            if *count == 0 {
                blocks.remove(&hash);
                let mask = holders.get(&hash).copied().unwrap_or(0) & !bit;
                if mask == 0 {
                    holders.remove(&hash);
                } else {
                    holders.insert(hash, mask);
                }
            }
        }
        Ok(())
    }

    /// `instance` holds nothing (an `AllBlocksCleared`, a reconnect that cannot be replayed, or
    /// an instance that went away).
    pub fn clear(&self, instance: usize) -> Result<()> {
        let bit = self.check(instance)?;
        let mut writer = self.writer.lock();
        let holders = self.holders.pin();
        for (hash, _) in std::mem::take(&mut writer[instance]) {
            let mask = holders.get(&hash).copied().unwrap_or(0) & !bit;
            if mask == 0 {
                holders.remove(&hash);
            } else {
                holders.insert(hash, mask);
            }
        }
        Ok(())
    }

    /// For each instance, how many leading blocks of `hashes` (a prompt's chain) it holds.
    /// Lock-free; O(longest match) map reads.
    #[must_use]
    pub fn score(&self, hashes: &[u64]) -> Vec<u32> {
        let all = if self.num_instances == MAX_INSTANCES {
            u64::MAX
        } else {
            (1u64 << self.num_instances) - 1
        };
        let mut scores = vec![0u32; self.num_instances];
        let mut active = all;
        let holders = self.holders.pin();
        let mut matched = 0u32;
        for hash in hashes {
            let mask = holders.get(hash).copied().unwrap_or(0);
            let dropped = active & !mask;
            set_scores(&mut scores, dropped, matched);
            active &= mask;
            if active == 0 {
                return scores;
            }
            matched += 1;
        }
        set_scores(&mut scores, active, matched);
        scores
    }

    /// The hashes `instance` holds, sorted (tests and debugging).
    pub fn blocks_of(&self, instance: usize) -> Result<Vec<u64>> {
        self.check(instance)?;
        let mut hashes: Vec<u64> = self.writer.lock()[instance].keys().copied().collect();
        hashes.sort_unstable();
        Ok(hashes)
    }

    /// Distinct hashes held by any instance.
    #[must_use]
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// True when no instance holds anything.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }
}

fn set_scores(scores: &mut [u32], mut instances: u64, value: u32) {
    while instances != 0 {
        let instance = instances.trailing_zeros() as usize;
        scores[instance] = value;
        instances &= instances - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::{cache, no_extras};
    use crate::events::{EventConfig, KvEvent, TokenIds};

    #[test]
    fn scores_are_longest_held_prefixes() {
        let index = PrefixIndex::new(3).unwrap();
        index.store(0, &[1, 2, 3]).unwrap();
        index.store(1, &[1, 2]).unwrap();
        index.store(2, &[2, 3]).unwrap();
        assert_eq!(index.score(&[1, 2, 3, 4]), vec![3, 2, 0]);
        index.remove(0, &[2]).unwrap();
        assert_eq!(index.score(&[1, 2, 3]), vec![1, 2, 0]);
        index.clear(1).unwrap();
        assert_eq!(index.score(&[1, 2, 3]), vec![1, 0, 0]);
        assert_eq!(index.blocks_of(0).unwrap(), vec![1, 3]);
        assert!(index.store(3, &[1]).is_err());
        assert!(PrefixIndex::new(65).is_err());
    }

    #[test]
    fn readers_score_without_waiting_while_a_writer_churns() {
        let index = std::sync::Arc::new(PrefixIndex::new(2).unwrap());
        let chain: Vec<u64> = (1..=64).collect();
        index.store(0, &chain).unwrap();
        let writer = {
            let index = std::sync::Arc::clone(&index);
            let chain = chain.clone();
            std::thread::spawn(move || {
                for round in 0..200 {
                    let upto = (round % 64) + 1;
                    index.store(1, &chain[..upto]).unwrap();
                    index.remove(1, &chain[..upto]).unwrap();
                }
            })
        };
        for _ in 0..2000 {
            let scores = index.score(&chain);
            // Instance 0 never changes; instance 1 only ever holds a prefix of the chain.
            assert_eq!(scores[0], 64);
            assert!(scores[1] <= 64);
        }
        writer.join().unwrap();
        assert_eq!(index.score(&chain), vec![64, 0]);
    }

    #[test]
    fn a_duplicate_store_needs_two_removals() {
        let index = PrefixIndex::new(1).unwrap();
        index.store(0, &[7, 7]).unwrap();
        index.remove(0, &[7]).unwrap();
        assert_eq!(index.score(&[7]), vec![1]);
        index.remove(0, &[7, 7]).unwrap();
        assert_eq!(index.score(&[7]), vec![0]);
        assert!(index.is_empty());
    }

    #[test]
    fn prompt_hashes_match_the_keys_a_cache_publishes() {
        let c = cache(8, 2);
        c.enable_events(EventConfig {
            capacity: 64,
            token_ids: TokenIds::All,
        });
        let r = c
            .begin(None, vec![5, 6, 7, 8, 9], b"s", no_extras(), 0)
            .unwrap();
        c.commit(&r.request_id, 5).unwrap();
        let Some(KvEvent::Stored { keys, .. }) = c.drain_events().events.pop() else {
            panic!("a stored event");
        };
        let published: Vec<u64> = keys.iter().map(hash64).collect();
        let routed = prompt_hashes(&c.context(), 2, &[5, 6, 7, 8, 9], b"s", &no_extras());
        assert_eq!(published, routed);
    }
}
