//! What a match hands out: a hit of whole blocks shaped by the cache's `FullHit` mode (a full
//! hit's last block recomputed, or held shared), and the lock-free lookup that any thread may
//! run on the shared run table beside the writer.

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

/// The cached prefix of `tokens` under `root` in `table`, without taking references, a full
/// hit shaped by `full_hit`: what a `RunCache` writing it would answer to `lookup`, read
/// lock-free (a reader on another thread sees some recent state: every block it returns was
/// in that prompt's chain at some instant of the call, `run_table`'s stamps tell it so).
#[must_use]
pub fn lookup_in(
    table: &RunTable,
    root: &BlockKey,
    tokens: &[u32],
    full_hit: FullHit,
) -> RunLookup {
    let bs = table.block_size();
    let full = tokens.len() / bs;
    let mut blocks = Vec::with_capacity(full);
    table.match_prompt(root, &tokens[..full * bs], &mut blocks, |_, _| true);
    let shape = HitShape::of(blocks.len(), tokens.len(), bs, full_hit);
    blocks.truncate(shape.keep);
    RunLookup {
        blocks,
        num_cached_tokens: shape.num_cached,
        full_hit: shape.full_hit,
        last_token_shared: shape.last_token_shared,
    }
}

/// How a hit of whole blocks is served (the core's `hit_shape`): the blocks it holds, the
/// tokens cached, and whether it is a full hit and shares the last token's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HitShape {
    pub(crate) keep: usize,
    pub(crate) num_cached: usize,
    pub(crate) full_hit: bool,
    pub(crate) last_token_shared: bool,
}

impl HitShape {
    /// A hit of `matched` leading whole blocks of a `len`-token prompt: a full hit (every
    /// block cached) recomputes the last block or shares it, by `mode`.
    pub(crate) fn of(matched: usize, len: usize, block_size: usize, mode: FullHit) -> Self {
        let full_hit = matched > 0 && matched * block_size == len;
        match (full_hit, mode) {
            (false, _) => Self {
                keep: matched,
                num_cached: matched * block_size,
                full_hit: false,
                last_token_shared: false,
            },
            (true, FullHit::RecomputeLastBlock) => Self {
                keep: matched - 1,
                num_cached: len - block_size,
                full_hit: true,
                last_token_shared: false,
            },
            (true, FullHit::ReuseLastBlock) => Self {
                keep: matched,
                num_cached: len - 1,
                full_hit: true,
                last_token_shared: true,
            },
        }
    }
}
