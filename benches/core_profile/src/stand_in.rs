//! What the run caches the replays time (`run_segments.rs`, `run_queue.rs`) share: a hash
//! index, and the request cycle the replays time.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// "No run, block, segment or record".
pub const NONE: u32 = u32::MAX;

/// The keys of the indexes are already hashes: used as they are.
#[derive(Default)]
pub struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map from `block_key` to a run.
pub type Index = HashMap<u64, u32, BuildHasherDefault<Identity>>;

/// The XXH3 key of a block's tokens, after `parent` (a run or block naming where the block
/// hangs) when it has one: a first block is found by its tokens alone.
pub fn block_key(parent: Option<u32>, tokens: &[u32]) -> u64 {
    let mut bytes = [0u8; 4 + 64];
    let start = match parent {
        Some(parent) => {
            bytes[..4].copy_from_slice(&parent.to_le_bytes());
            4
        }
        None => 0,
    };
    for (b, t) in bytes[start..].chunks_exact_mut(4).zip(tokens) {
        b.copy_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[..start + 4 * tokens.len()], 0x7072_6566_6978_6b76)
}

/// A stand-in's request cycle, as the replays time it.
pub trait StandIn {
    type Request;
    /// `None` when the blocks are not there (the trace's requests always fit).
    fn begin(&mut self, tokens: Vec<u32>) -> Option<Self::Request>;
    fn commit(&mut self, request: &mut Self::Request);
    fn finish(&mut self, request: Self::Request);
    /// The request's block table.
    fn blocks(request: &Self::Request) -> &[u32];
    fn cached_blocks(request: &Self::Request) -> usize;
}
