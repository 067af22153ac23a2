//! The step API on runs, as a scheduler drives a request (the life in `request/mod.rs`): `add`
//! registers it waiting, holding nothing; the first `allocate_slots` matches its cached prefix,
//! holds it and allocates the first chunk's blocks in one step; later calls allocate for the
//! next chunk or decode tokens; `commit` publishes what became full (`publish.rs`); `preempt`
//! drops everything it holds, keeping its tokens, so that its next `allocate_slots` matches
//! again; `finish` ends it. Every call refuses, changing nothing, exactly where
//! [`crate::PrefixCache`]'s own does (the tests run both side by side).

use std::sync::Arc;

use super::{Held, Origin, RunCache, RunRequest};
use crate::cache::HitShape;
use crate::error::{CacheError, Result};
use crate::key::{BlockKey, RequestExtras};
use crate::pool::BlockId;

/// What `allocate_slots` hands the engine (the core's `Slots`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunSlots {
    /// Blocks this call appended to the request's block table: on its first call (or the first
    /// after `preempt`) the cached prefix's blocks first.
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV the request has: the scheduled tokens start here.
    pub num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (0 on a later call).
    pub num_cached_tokens: usize,
    /// This call matched every block of the prompt (its last one is recomputed, or shared
    /// under `FullHit::ReuseLastBlock`).
    pub full_hit: bool,
    /// The last prompt token's KV is in a shared block: compute its logits reading that KV,
    /// and do not write it (`FullHit::ReuseLastBlock` full hits).
    pub last_token_shared: bool,
}

/// Where a scheduling call starts, and the blocks it appended (`request.blocks[from..]`).
pub(super) struct Scheduled {
    pub(super) from: usize,
    pub(super) start: usize,
    pub(super) num_cached: usize,
    pub(super) full_hit: bool,
    pub(super) last_token_shared: bool,
}

impl RunRequest {
    /// Adds tokens without allocating (their slots come from the next `allocate_slots`):
    /// sampled tokens, or with `draft` unverified draft tokens, never published until
    /// `RunCache::accept_drafts` keeps them. Verified tokens cannot follow pending drafts.
    pub fn append_tokens(&mut self, tokens: &[u32], draft: bool) -> Result<()> {
        if !draft {
            self.no_pending_drafts()?;
        }
        self.tokens.extend_from_slice(tokens);
        if draft {
            self.num_drafts += tokens.len();
        }
        self.extend_tags();
        Ok(())
    }

    /// Tags the full blocks its tokens now reach (an item may reach past the prompt into
    /// decode tokens, which the default core keys with it too). A tag depends only on the
    /// block's index and the items, so tags past a truncation stay right.
    fn extend_tags(&mut self) {
        let bs = self.tag_block_size;
        if bs == 0 {
            return;
        }
        let full = self.tokens.len() / bs;
        if full > self.tagged_to {
            let more = self.origin.extras.run_tags(self.tagged_to..full, bs);
            self.tags.extend(more);
            self.tagged_to = full;
        }
    }

    /// Tokens not drafts.
    pub(super) fn num_verified(&self) -> usize {
        self.tokens.len() - self.num_drafts
    }

    /// Leading positions whose blocks are cached: the hit's, then what commits published.
    #[must_use]
    pub fn cached_positions(&self) -> usize {
        self.cached_blocks.max(self.committed)
    }

    fn no_pending_drafts(&self) -> Result<()> {
        if self.num_drafts > 0 {
            return Err(CacheError::InvalidInput(format!(
                "the request has {} draft tokens: accept_drafts or truncate them before \
                 appending verified tokens",
                self.num_drafts
            )));
        }
        Ok(())
    }

    /// Caps the cached prefix its matches may use at `max_cached_tokens` (`None` lifts the
    /// cap); kept until changed, so it also applies after `preempt`.
    pub fn limit_cached_prefix(&mut self, max_cached_tokens: Option<usize>) {
        self.max_cached_tokens = max_cached_tokens;
    }
}

impl RunCache {
    /// A request for `tokens` under `root` (a `key::root_key`, with no adapter), waiting:
    /// nothing matched, nothing held.
    #[must_use]
    pub fn add(root: BlockKey, tokens: Vec<u32>, priority: i32) -> RunRequest {
        let origin = Origin {
            root,
            extras: RequestExtras::default(),
        };
        Self::add_untagged(Arc::new(origin), tokens, priority)
    }

    /// A request for `tokens` keyed from `origin` (its root, adapter and multimodal items),
    /// waiting.
    #[must_use]
    pub fn add_from(&self, origin: Arc<Origin>, tokens: Vec<u32>, priority: i32) -> RunRequest {
        let mut request = Self::add_untagged(origin, tokens, priority);
        if !request.origin.extras.multimodal.is_empty() {
            request.tag_block_size = self.block_size;
            request.extend_tags();
        }
        request
    }

    fn add_untagged(origin: Arc<Origin>, tokens: Vec<u32>, priority: i32) -> RunRequest {
        RunRequest {
            root: origin.run_root(),
            tags: Vec::new(),
            tagged_to: 0,
            tag_block_size: 0,
            origin,
            tokens,
            priority,
            held: Vec::new(),
            blocks: Vec::new(),
            cached_blocks: 0,
            full_hit: false,
            last_token_shared: false,
            committed: 0,
            num_computed: 0,
            scheduled: false,
            max_cached_tokens: None,
            num_drafts: 0,
        }
    }

    /// Makes room for the request's next `num_new_tokens` tokens (they must be known) plus
    /// `num_lookahead_tokens` slots past them, keeping at least `watermark` blocks obtainable
    /// afterwards. On a waiting request it first matches the cached prefix and holds it, the
    /// hit cut back to leave room for the tokens asked for. Refused (`OutOfBlocks`, or
    /// `InvalidInput` for counts the request cannot have) with nothing changed.
    pub fn allocate_slots(
        &mut self,
        request: &mut RunRequest,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<RunSlots> {
        let done = self.schedule(
            request,
            Some(num_new_tokens),
            num_lookahead_tokens,
            watermark,
        )?;
        Ok(RunSlots {
            block_ids: request.blocks[done.from..].to_vec(),
            num_computed_tokens: done.start,
            num_cached_tokens: done.num_cached,
            full_hit: done.full_hit,
            last_token_shared: done.last_token_shared,
        })
    }

    /// The position the next `allocate_slots` would start computing from, changing nothing:
    /// for a waiting request the length of its cached prefix (under its cap), for a scheduled
    /// one its computed tokens.
    #[must_use]
    pub fn start_position(&self, request: &RunRequest) -> usize {
        if request.scheduled {
            return request.num_computed;
        }
        let bs = self.block_size;
        let verified = &request.tokens[..request.num_verified()];
        let mut matched = Vec::new();
        let full = verified.len() / bs;
        self.table.match_prompt(
            &request.root,
            &verified[..full * bs],
            &request.tags,
            &mut matched,
            |_, _| true,
        );
        self.hit_shape(matched.len(), verified.len(), request.max_cached_tokens)
            .num_cached
    }

    /// Drops every reference the request holds, as `finish` does; it keeps its tokens and
    /// waits, so that its next `allocate_slots` matches its committed blocks again (cached,
    /// evictable meanwhile). Preempting a waiting request changes nothing.
    pub fn preempt(&mut self, request: &mut RunRequest) {
        if !request.scheduled {
            return;
        }
        self.release(request);
        let verified = request.num_verified();
        request.tokens.truncate(verified);
        request.num_drafts = 0;
        request.held.clear();
        request.blocks.clear();
        request.cached_blocks = 0;
        request.full_hit = false;
        request.last_token_shared = false;
        request.committed = 0;
        request.num_computed = 0;
        request.scheduled = false;
    }

    /// How a `matched`-block hit on a `len`-token prompt is served under `cap` (tokens): a
    /// full hit by the cache's `FullHit` mode; a cap below the hit cuts it to the whole blocks
    /// under the cap, never a full hit then (as the core's `hit_length`).
    fn hit_shape(&self, matched: usize, len: usize, cap: Option<usize>) -> HitShape {
        let bs = self.block_size;
        let shape = self.full_hit.shape(matched, len, bs);
        match cap {
            Some(cap) if shape.num_cached > cap => {
                self.full_hit.shape(matched.min(cap / bs), len, bs)
            }
            _ => shape,
        }
    }

    /// `allocate_slots`, or with `num_new` `None` every known token not yet computed (`begin`,
    /// whose hit no room cuts back).
    pub(super) fn schedule(
        &mut self,
        request: &mut RunRequest,
        num_new: Option<usize>,
        lookahead: usize,
        watermark: usize,
    ) -> Result<Scheduled> {
        let plan = self.plan(request, num_new, lookahead)?;
        let want = with_watermark(plan.fresh, watermark)?;
        // Refused before anything changes, as the core refuses: the free blocks the hit takes
        // out of the order are not there to allocate.
        if want > plan.obtainable {
            return Err(CacheError::OutOfBlocks {
                needed: want,
                available: plan.obtainable,
            });
        }
        if request.scheduled {
            let from = request.blocks.len();
            self.allocate(plan.fresh, &mut request.blocks);
            return Ok(Scheduled {
                from,
                start: plan.start,
                num_cached: 0,
                full_hit: false,
                last_token_shared: false,
            });
        }
        for &(run, upto) in &plan.held {
            self.acquire(run, upto);
        }
        let mut blocks = plan.hit;
        self.allocate(plan.fresh, &mut blocks);
        request.held = plan
            .held
            .into_iter()
            .map(|(run, to)| Held::Blocks { run, from: 0, to })
            .collect();
        request.blocks = blocks;
        request.cached_blocks = plan.keep;
        request.full_hit = plan.full_hit;
        request.last_token_shared = plan.last_token_shared;
        request.committed = 0;
        request.num_computed = plan.start;
        request.scheduled = true;
        Ok(Scheduled {
            from: 0,
            start: plan.start,
            num_cached: plan.start,
            full_hit: plan.full_hit,
            last_token_shared: plan.last_token_shared,
        })
    }

    /// Whether `allocate_slots` with these arguments would succeed now: `Err(OutOfBlocks)`
    /// with the blocks it needs (watermark included) and those the pool could supply when it
    /// would be refused for blocks, its `InvalidInput` for counts. Changes nothing.
    pub fn check_allocate_slots(
        &self,
        request: &RunRequest,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
        watermark: usize,
    ) -> Result<()> {
        let plan = self.plan(request, Some(num_new_tokens), num_lookahead_tokens)?;
        let want = with_watermark(plan.fresh, watermark)?;
        if want > plan.obtainable {
            return Err(CacheError::OutOfBlocks {
                needed: want,
                available: plan.obtainable,
            });
        }
        Ok(())
    }

    /// Blocks `allocate_slots(request, num_new_tokens, num_lookahead_tokens)` would take from
    /// the pool now (cached blocks it would hold are not counted). Changes nothing.
    pub fn blocks_needed(
        &self,
        request: &RunRequest,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> Result<usize> {
        Ok(self
            .plan(request, Some(num_new_tokens), num_lookahead_tokens)?
            .fresh)
    }

    /// What scheduling the request would take, changing nothing: on a waiting request the
    /// match (cut to the request's cap and to room for `num_new` tokens), then the fresh
    /// blocks and what the pool could supply besides the hit.
    fn plan(&self, request: &RunRequest, num_new: Option<usize>, lookahead: usize) -> Result<Plan> {
        let bs = self.block_size;
        let len = request.tokens.len();
        if request.scheduled {
            let start = request.num_computed;
            return Ok(Plan {
                held: Vec::new(),
                hit: Vec::new(),
                keep: 0,
                start,
                full_hit: false,
                last_token_shared: false,
                fresh: blocks_past(bs, start, len, num_new, lookahead, request.blocks.len())?,
                obtainable: self.order.free_count,
            });
        }
        // The longest hit the call may use: the request's cap, and room for the tokens asked
        // for before its end (a hit that grew since the scheduler asked `start_position` is
        // cut back rather than the call refused).
        let cap = match num_new {
            None => request.max_cached_tokens,
            Some(num_new) => {
                let room = len.checked_sub(num_new).ok_or_else(|| {
                    CacheError::InvalidInput(format!(
                        "num_new_tokens {num_new} is more than the request's {len} tokens \
                         (append them first)"
                    ))
                })?;
                Some(request.max_cached_tokens.map_or(room, |cap| cap.min(room)))
            }
        };
        // Drafts are never matched: only whole blocks of verified tokens.
        let verified = request.num_verified();
        let full = verified / bs;
        // (run, its first n blocks): the match's prefixes.
        let mut held: Vec<(u32, u32)> = Vec::new();
        let mut hit: Vec<BlockId> = Vec::with_capacity(len.div_ceil(bs));
        // Through the run table, as a lock-free reader would (its index, then each run's
        // chunks and rows under the run's stamp); a run with no child ends the walk.
        self.table.match_prompt(
            &request.root,
            &request.tokens[..full * bs],
            &request.tags,
            &mut hit,
            |slot, found| {
                let run = self.by_slot[slot as usize];
                held.push((run, found.matched));
                !self.runs[run as usize].children.is_empty()
            },
        );
        let shape = self.hit_shape(hit.len(), verified, cap);
        let keep = shape.keep;
        // The blocks past the hit leave the holds, last run first.
        let mut excess = hit.len() - keep;
        hit.truncate(keep);
        while excess > 0 {
            let last = held.last_mut().expect("a hit holds its runs");
            let cut = excess.min(last.1 as usize);
            last.1 -= cut as u32;
            excess -= cut;
            if last.1 == 0 {
                held.pop();
            }
        }
        // A shared last block leaves only the last token to compute: it starts there.
        let start = shape.num_cached;
        let fresh = blocks_past(bs, start, len, num_new, lookahead, keep)?;
        // The obtainable blocks the hit would take out of the order (its pinned ones were
        // never counted obtainable).
        let taken: usize = held
            .iter()
            .map(|&(run, upto)| {
                let r = &self.runs[run as usize];
                self.order.queued_below(&r.segments, upto)
                    - self.order.queued_below(&r.segments, upto.min(r.pinned))
            })
            .sum();
        Ok(Plan {
            held,
            hit,
            keep,
            start,
            full_hit: shape.full_hit,
            last_token_shared: shape.last_token_shared,
            fresh,
            obtainable: self.order.free_count - taken,
        })
    }

    /// Adds verified tokens and allocates their slots if the request is scheduled: its new
    /// blocks. Refused with nothing changed while it has drafts, or when the blocks are not
    /// there.
    pub fn append(&mut self, request: &mut RunRequest, tokens: &[u32]) -> Result<Vec<BlockId>> {
        request.no_pending_drafts()?;
        let needed = if request.scheduled {
            (request.tokens.len() + tokens.len())
                .div_ceil(self.block_size)
                .saturating_sub(request.blocks.len())
        } else {
            0
        };
        if needed > self.order.free_count {
            return Err(CacheError::OutOfBlocks {
                needed,
                available: self.order.free_count,
            });
        }
        let from = request.blocks.len();
        self.allocate(needed, &mut request.blocks);
        request.tokens.extend_from_slice(tokens);
        request.extend_tags();
        Ok(request.blocks[from..].to_vec())
    }

    /// Keeps the first `num_accepted` draft tokens as verified and drops the others (their KV,
    /// and every block left without tokens, as `truncate`); publishes what became full and
    /// verified. Returns the leading blocks now cached.
    pub fn accept_drafts(
        &mut self,
        request: &mut RunRequest,
        num_accepted: usize,
    ) -> Result<usize> {
        if num_accepted > request.num_drafts {
            return Err(CacheError::InvalidInput(format!(
                "num_accepted {num_accepted} exceeds the request's {} draft tokens",
                request.num_drafts
            )));
        }
        let keep = request.num_verified() + num_accepted;
        self.cut(request, keep);
        request.num_drafts = 0;
        let computed = request.num_computed;
        self.commit(request, computed)?;
        Ok(request.cached_positions())
    }

    /// Drops every token from position `num_tokens` on (drafts or not), their KV, and every
    /// block left without tokens (returned, freed: they are the request's own). Refuses to cut
    /// into a published block (published KV is never rewritten) or to leave no token.
    pub fn truncate(
        &mut self,
        request: &mut RunRequest,
        num_tokens: usize,
    ) -> Result<Vec<BlockId>> {
        let len = request.tokens.len();
        let published = request.cached_positions() * self.block_size;
        if num_tokens > len || num_tokens == 0 {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: the request has {len}, and keeps at \
                 least one"
            )));
        }
        if num_tokens < published {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: the first {published} are in published \
                 blocks, which are never rewritten"
            )));
        }
        Ok(self.cut(request, num_tokens))
    }

    /// `truncate`, checked: the blocks past `num_tokens` go back to the free list in table
    /// order (private: past every published position).
    fn cut(&mut self, request: &mut RunRequest, num_tokens: usize) -> Vec<BlockId> {
        let removed = request.tokens.len() - num_tokens;
        request.tokens.truncate(num_tokens);
        request.num_drafts = request.num_drafts.saturating_sub(removed);
        request.num_computed = request.num_computed.min(num_tokens);
        let keep = num_tokens.div_ceil(self.block_size);
        if !request.scheduled || request.blocks.len() <= keep {
            return Vec::new();
        }
        let freed = request.blocks.split_off(keep);
        self.order.free_private(&freed);
        freed
    }
}

/// What scheduling a request would do (`RunCache::plan`).
struct Plan {
    /// On a waiting request: (run, its first n blocks) held by the hit, and the hit's blocks.
    held: Vec<(u32, u32)>,
    hit: Vec<BlockId>,
    /// Blocks of the hit (`hit.len()` on a waiting request).
    keep: usize,
    /// Position the scheduled tokens start at (the hit's cached tokens on a waiting request).
    start: usize,
    full_hit: bool,
    last_token_shared: bool,
    fresh: usize,
    /// Blocks the pool could supply once the hit is held.
    obtainable: usize,
}

/// Fresh blocks for `num_new` tokens (`None`: all `len - start` known ones) from `start`, plus
/// `lookahead` slots, past the `held` blocks a request has; refused by name for tokens it does
/// not have or counts that overflow.
fn blocks_past(
    block_size: usize,
    start: usize,
    len: usize,
    num_new: Option<usize>,
    lookahead: usize,
    held: usize,
) -> Result<usize> {
    let known = len - start;
    let num_new = num_new.unwrap_or(known);
    if num_new > known {
        return Err(CacheError::InvalidInput(format!(
            "num_new_tokens {num_new} is more than the request's {known} tokens not yet \
             computed (append them first)"
        )));
    }
    let end = (start + num_new).checked_add(lookahead).ok_or_else(|| {
        CacheError::InvalidInput(format!(
            "num_lookahead_tokens {lookahead} past position {} overflows a 64-bit count",
            start + num_new
        ))
    })?;
    Ok(end.div_ceil(block_size).saturating_sub(held))
}

/// `fresh` blocks plus the `watermark` that must stay obtainable, refused by name when the sum
/// overflows.
fn with_watermark(fresh: usize, watermark: usize) -> Result<usize> {
    fresh.checked_add(watermark).ok_or_else(|| {
        CacheError::InvalidInput(format!(
            "watermark_blocks {watermark} plus the {fresh} blocks the call takes overflows a \
             64-bit count"
        ))
    })
}
