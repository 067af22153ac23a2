//! What a lookup hands out: a hit of whole blocks shaped by the cache's `FullHit` mode (a full
//! hit's last block recomputed, or held shared: `FullHit::shape`, as the default core shapes
//! its own), read lock-free on the shared run table by any thread beside the writer.

use crate::cache::FullHit;
use crate::key::BlockKey;
use crate::pool::BlockId;
use crate::run_table::RunTable;

/// What `RunCache::lookup` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunLookup {
    /// Cached blocks, in prompt order.
    pub blocks: Vec<BlockId>,
    /// Tokens whose KV can be read from the cache.
    pub num_cached_tokens: usize,
    /// Every block of the prompt is cached: with `FullHit::RecomputeLastBlock` `blocks` stops
    /// one short (`begin` recomputes the last block); with `FullHit::ReuseLastBlock` it has
    /// every block and `num_cached_tokens` is `n - 1`.
    pub full_hit: bool,
    /// The last token's KV is in a shared block (`FullHit::ReuseLastBlock` full hits).
    pub last_token_shared: bool,
}

/// The cached prefix of `tokens` under `root` in `table` (its multimodal blocks tagged by
/// `tags`: `RequestExtras::run_tags`), without taking references, a full hit shaped by
/// `full_hit`: what a `RunCache` writing it would answer to `lookup`, read
/// lock-free (a reader on another thread sees some recent state: every block it returns was
/// in that prompt's chain at some instant of the call, `run_table`'s stamps tell it so).
#[must_use]
pub fn lookup_in(
    table: &RunTable,
    root: &BlockKey,
    tokens: &[u32],
    tags: &[(u32, BlockKey)],
    full_hit: FullHit,
) -> RunLookup {
    let bs = table.block_size();
    let full = tokens.len() / bs;
    let mut blocks = Vec::with_capacity(full);
    table.match_prompt(root, &tokens[..full * bs], tags, &mut blocks, |_, _| true);
    let shape = full_hit.shape(blocks.len(), tokens.len(), bs);
    blocks.truncate(shape.keep);
    RunLookup {
        blocks,
        num_cached_tokens: shape.num_cached,
        full_hit: shape.full_hit,
        last_token_shared: shape.last_token_shared,
    }
}
