//! The run cache the replays time beside the core: since round 20 of issue 24 the core's own
//! writer half on runs (`prefixkv_core::run_cache::RunCache`, step 2 of the plan in
//! `benches/PROFILE.md`), which grew from the stand-in this file held in rounds 18 and 19. Its
//! tests against the core's block tables moved into the core's suite
//! (`rust/core/src/run_cache/tests.rs`).

use prefixkv_core::key::BlockKey;
use prefixkv_core::run_cache::{RunCache, RunRequest};

use crate::stand_in::StandIn;

/// The root every first run hangs under (the replays have no context or salt).
const ROOT_KEY: BlockKey = BlockKey([0; 32]);

/// A run cache of `num_blocks` blocks.
pub fn new(num_blocks: u32, block_size: usize) -> RunCache {
    RunCache::new(num_blocks, block_size, 0x7072_6566).expect("memory")
}

impl StandIn for RunCache {
    type Request = RunRequest;
    fn begin(&mut self, tokens: Vec<u32>) -> Option<RunRequest> {
        RunCache::begin(self, ROOT_KEY, tokens, 0).ok()
    }
    fn commit(&mut self, request: &mut RunRequest) {
        let len = request.num_tokens();
        RunCache::commit(self, request, len).expect("a whole prompt's KV is in its slots");
    }
    fn finish(&mut self, request: RunRequest) {
        RunCache::finish(self, request);
    }
    fn blocks(request: &RunRequest) -> &[u32] {
        request.blocks()
    }
    fn cached_blocks(request: &RunRequest) -> usize {
        request.cached_blocks()
    }
}
