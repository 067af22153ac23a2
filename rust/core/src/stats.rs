//! A snapshot of the cache's counters and block states.

/// Counters since creation and block states now. Hit counters count `begin` and
/// `match_and_acquire`; lock-free `lookup` probes are counted apart, so a router probing
/// hit lengths does not inflate the hit rate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Requests matched (`begin`, `match_and_acquire`).
    pub lookups: u64,
    /// Prompt tokens of those requests.
    pub lookup_tokens: u64,
    /// Tokens whose KV was reused.
    pub hit_tokens: u64,
    /// Lock-free `lookup` probes.
    pub probes: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
    /// Blocks newly published by commits.
    pub committed_blocks: u64,
    /// Committed blocks that another copy already held: kept as duplicates (`pool.rs`), except
    /// in sliding-window caches and for `commit_blocks`, whose copies are freed at release.
    pub deduplicated_blocks: u64,
    /// Commits refused because a different block held the key.
    pub collisions: u64,
    /// Blocks sliding-window requests dropped as they fell out of the window (0 in a
    /// full-attention cache).
    pub blocks_released: u64,
    /// Blocks in the pool.
    pub blocks_total: usize,
    /// Blocks on the free list.
    pub blocks_free: usize,
    /// Blocks holding cached content: those reachable by lookups (table entries), plus spares
    /// (released duplicates of a cached block, which eviction takes like cached blocks and
    /// vLLM counts cached and free alike: `pool.rs`). Every block is exactly one of free,
    /// cached, or held private (in use and not a table entry: a request's own uncached blocks,
    /// including duplicates it holds), so `blocks_free + blocks_cached == blocks_total`
    /// whenever no request holds a private block, and `blocks_free + blocks_cached <=
    /// blocks_total` always.
    pub blocks_cached: usize,
    /// Blocks with a reference.
    pub blocks_in_use: usize,
    /// Pinned blocks.
    pub blocks_pinned: usize,
    /// Blocks that could be evicted right now without evicting anything else first:
    /// unreferenced, unpinned cached leaves, and spares (released duplicates of cached blocks,
    /// `pool.rs`). A lower bound on what eviction can free.
    pub blocks_evictable: usize,
    /// Blocks an allocation could obtain right now: the free ones, the spares, plus every cached
    /// block that eviction can reach by evicting leaves repeatedly (unreferenced and unpinned,
    /// with no referenced or pinned descendant in its chain). Never counts a block someone
    /// holds. This is the figure for admission.
    pub blocks_obtainable: usize,
    /// Requests begun and not finished.
    pub requests_live: usize,
}

impl CacheStats {
    /// Fraction of looked-up tokens that were reused (0 when nothing was looked up).
    #[must_use]
    pub fn hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }
}
