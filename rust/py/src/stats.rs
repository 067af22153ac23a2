//! `CacheStats`: the core's counters and block states, as a frozen Python object.

use prefixkv_core::CacheStats as CoreStats;
use pyo3::prelude::*;

/// Counters since creation and block states now (see `prefixkv_core::CacheStats` for what
/// each figure means).
#[pyclass(frozen, get_all, module = "prefixkv._core")]
pub struct CacheStats {
    lookups: u64,
    lookup_tokens: u64,
    hit_tokens: u64,
    probes: u64,
    evictions: u64,
    committed_blocks: u64,
    deduplicated_blocks: u64,
    collisions: u64,
    blocks_released: u64,
    blocks_total: usize,
    blocks_free: usize,
    blocks_cached: usize,
    blocks_in_use: usize,
    blocks_pinned: usize,
    blocks_evictable: usize,
    blocks_obtainable: usize,
    requests_live: usize,
}

#[pymethods]
impl CacheStats {
    /// Fraction of looked-up tokens whose KV was reused.
    #[getter]
    fn hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }

    /// These block states with `earlier`'s counters added: the figures of a
    /// `PrefixCache(core="auto")` that moved to its block core, `earlier` being the run core's
    /// at the move (`cache.py`, `PrefixCache._block_core`).
    fn _after(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            lookups: self.lookups + earlier.lookups,
            lookup_tokens: self.lookup_tokens + earlier.lookup_tokens,
            hit_tokens: self.hit_tokens + earlier.hit_tokens,
            probes: self.probes + earlier.probes,
            evictions: self.evictions + earlier.evictions,
            committed_blocks: self.committed_blocks + earlier.committed_blocks,
            deduplicated_blocks: self.deduplicated_blocks + earlier.deduplicated_blocks,
            collisions: self.collisions + earlier.collisions,
            blocks_released: self.blocks_released + earlier.blocks_released,
            ..*self
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheStats(lookups={}, hit_rate={:.3}, hit_tokens={}, lookup_tokens={}, evictions={}, \
             blocks_free={}, blocks_cached={}, blocks_in_use={}, blocks_pinned={}, \
             blocks_obtainable={})",
            self.lookups,
            self.hit_rate(),
            self.hit_tokens,
            self.lookup_tokens,
            self.evictions,
            self.blocks_free,
            self.blocks_cached,
            self.blocks_in_use,
            self.blocks_pinned,
            self.blocks_obtainable
        )
    }
}

impl From<CoreStats> for CacheStats {
    fn from(s: CoreStats) -> Self {
        Self {
            lookups: s.lookups,
            lookup_tokens: s.lookup_tokens,
            hit_tokens: s.hit_tokens,
            probes: s.probes,
            evictions: s.evictions,
            committed_blocks: s.committed_blocks,
            deduplicated_blocks: s.deduplicated_blocks,
            collisions: s.collisions,
            blocks_released: s.blocks_released,
            blocks_total: s.blocks_total,
            blocks_free: s.blocks_free,
            blocks_cached: s.blocks_cached,
            blocks_in_use: s.blocks_in_use,
            blocks_pinned: s.blocks_pinned,
            blocks_evictable: s.blocks_evictable,
            blocks_obtainable: s.blocks_obtainable,
            requests_live: s.requests_live,
        }
    }
}
