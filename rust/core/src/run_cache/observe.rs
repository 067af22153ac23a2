//! What the run cache's blocks are, read for stats and tests: which are cached (a run's, or a
//! spare copy of one), which are free. The writer keeps no per-block state: the counts `stats`
//! reads add up runs and duplicate records (O(runs), as `stats` is polled by metrics and by
//! `prefixkv analyze` after every request); the per-block maps walk the runs' blocks
//! (O(blocks)), for tests, `is_cached` and a reset, never on the request path.

use super::{RunCache, NONE};
use crate::pool::BlockId;

/// Blocks by state (the core's `CacheStats` counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunBlockCounts {
    /// On the free list: holding no entry.
    pub free: usize,
    /// A run's blocks, and spare copies of them (the core counts both).
    pub cached: usize,
    /// Obtainable now: the free list, and cached blocks nobody holds.
    pub obtainable: usize,
}

impl RunCache {
    /// Whether each block is cached, by block id: a run's block (reachable by lookups), and
    /// with `spares` a spare copy of one too (eviction takes those like cached blocks).
    #[must_use]
    pub fn cached_map(&self, spares: bool) -> Vec<bool> {
        let mut cached = vec![false; self.num_blocks()];
        let mut ids = Vec::new();
        for r in &self.runs {
            if let Some(shared) = r.shared {
                ids.clear();
                self.table
                    .read_ids(&self.alloc, shared, 0, r.len as usize, &mut ids);
                for &block in &ids {
                    cached[block as usize] = true;
                }
            }
        }
        if spares {
            for d in self.live_dups() {
                if self.dups[d].segment != NONE {
                    cached[self.dups[d].block as usize] = true;
                }
            }
        }
        cached
    }

    /// Blocks by state.
    #[must_use]
    pub fn block_counts(&self) -> RunBlockCounts {
        RunBlockCounts {
            free: self.order.free.len(),
            cached: self.num_cached(),
            obtainable: self.order.free_count,
        }
    }

    /// Blocks cached, spares included: each shared run's length plus the spare records. A
    /// block is in at most one run, and a spare is a copy outside every run, so nothing is
    /// counted twice (`check_block_states` compares this with the per-block map).
    fn num_cached(&self) -> usize {
        let in_runs: usize = self
            .runs
            .iter()
            .filter(|r| r.shared.is_some())
            .map(|r| r.len as usize)
            .sum();
        let spares = self
            .live_dups()
            .filter(|&d| self.dups[d].segment != NONE)
            .count();
        in_runs + spares
    }

    /// Blocks in the pool.
    #[must_use]
    pub fn num_blocks(&self) -> usize {
        self.num_blocks as usize
    }

    /// Whether block `block` is cached: reachable by lookups (a spare is not).
    #[must_use]
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.cached_map(false)
            .get(block as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Records of `dups` in use (not on the free list of records).
    fn live_dups(&self) -> impl Iterator<Item = usize> + '_ {
        let mut free = vec![false; self.dups.len()];
        for &d in &self.free_dups {
            free[d as usize] = true;
        }
        (0..self.dups.len()).filter(move |&d| !free[d])
    }

    /// Checks that every block is exactly one of free (on the free list), cached, or held
    /// private (in one of the live requests' `tables` and not cached): none lost, none
    /// counted twice, none free while held (tests).
    pub fn check_block_states<'a>(&self, tables: impl IntoIterator<Item = &'a [BlockId]>) {
        let cached = self.cached_map(true);
        let mut private = vec![false; self.num_blocks()];
        for table in tables {
            for &block in table {
                private[block as usize] = !cached[block as usize];
            }
        }
        let mut free = vec![false; self.num_blocks()];
        for &block in &self.order.free {
            assert!(
                !free[block as usize],
                "block {block} twice on the free list"
            );
            assert!(
                !cached[block as usize] && !private[block as usize],
                "block {block} on the free list is cached or held"
            );
            free[block as usize] = true;
        }
        let count = |states: &[bool]| states.iter().filter(|&&s| s).count();
        assert_eq!(
            self.num_cached(),
            count(&cached),
            "the cached count (runs' lengths and spares) matches the blocks cached"
        );
        assert_eq!(
            count(&free) + count(&cached) + count(&private),
            self.num_blocks(),
            "every block is free, cached or held private"
        );
    }

    /// The free list a reset leaves, as the core's `clear` leaves it when no request is live:
    /// the free list as it is, then every block of a run in id order, then the spares in id
    /// order (the last pushed is handed out first).
    #[must_use]
    pub(super) fn free_order_after_reset(&self) -> Vec<BlockId> {
        let mut free = self.order.free.clone();
        let entries = self.cached_map(false);
        free.extend((0..self.num_blocks).filter(|&b| entries[b as usize]));
        let mut spares: Vec<BlockId> = self
            .live_dups()
            .filter(|&d| self.dups[d].segment != NONE)
            .map(|d| self.dups[d].block)
            .collect();
        spares.sort_unstable();
        free.extend(spares);
        free
    }
}
