//! The step API on runs, as a scheduler drives a request (the life in `request/mod.rs`): `add`
//! registers it waiting, holding nothing; the first `allocate_slots` matches its cached prefix,
//! holds it and allocates the first chunk's blocks in one step; later calls allocate for the
//! next chunk or decode tokens; `commit` publishes what became full (`publish.rs`); `preempt`
//! drops everything it holds, keeping its tokens, so that its next `allocate_slots` matches
//! again; `finish` ends it. Every call refuses, changing nothing, exactly where
//! [`crate::PrefixCache`]'s own does (the tests run both side by side).

use super::{Held, RunCache, RunRequest};
use crate::error::{CacheError, Result};
use crate::key::BlockKey;
use crate::pool::BlockId;

/// What `allocate_slots` hands the engine (the core's `Slots`; a full hit here always
/// recomputes the last block, so no token of it is shared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunSlots {
    /// Blocks this call appended to the request's block table: on its first call (or the first
    /// after `preempt`) the cached prefix's blocks first.
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV the request has: the scheduled tokens start here.
    pub num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (0 on a later call).
    pub num_cached_tokens: usize,
    /// This call matched every block of the prompt (its last one is recomputed).
    pub full_hit: bool,
}

/// Where a scheduling call starts, and the blocks it appended (`request.blocks[from..]`).
pub(super) struct Scheduled {
    from: usize,
    start: usize,
    num_cached: usize,
    full_hit: bool,
}

impl RunRequest {
    /// Adds tokens without allocating (sampled tokens; their slots come from the next
    /// `allocate_slots`).
    pub fn append_tokens(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    /// Caps the cached prefix its matches may use at `max_cached_tokens` (`None` lifts the
    /// cap); kept until changed, so it also applies after `preempt`.
    pub fn limit_cached_prefix(&mut self, max_cached_tokens: Option<usize>) {
        self.max_cached_tokens = max_cached_tokens;
    }
}

impl RunCache {
    /// A request for `tokens` under `root`, waiting: nothing matched, nothing held.
    #[must_use]
    pub fn add(root: BlockKey, tokens: Vec<u32>, priority: i32) -> RunRequest {
        RunRequest {
            root,
            tokens,
            priority,
            held: Vec::new(),
            blocks: Vec::new(),
            cached_blocks: 0,
            full_hit: false,
            committed: 0,
            num_computed: 0,
            scheduled: false,
            max_cached_tokens: None,
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
        let found = self.lookup(&request.root, &request.tokens);
        let matched = found.blocks.len() + usize::from(found.full_hit);
        let (keep, _) = self.hit_blocks(matched, request.tokens.len(), request.max_cached_tokens);
        keep * self.block_size
    }

    /// Drops every reference the request holds, as `finish` does; it keeps its tokens and
    /// waits, so that its next `allocate_slots` matches its committed blocks again (cached,
    /// evictable meanwhile). Preempting a waiting request changes nothing.
    pub fn preempt(&mut self, request: &mut RunRequest) {
        if !request.scheduled {
            return;
        }
        self.release(request);
        request.held.clear();
        request.blocks.clear();
        request.cached_blocks = 0;
        request.full_hit = false;
        request.committed = 0;
        request.num_computed = 0;
        request.scheduled = false;
    }

    /// Blocks of a `matched`-block hit on a `len`-token prompt the request may use under `cap`
    /// (tokens), and whether that is a full hit: a full hit leaves its last block to recompute
    /// (`FullHit::RecomputeLastBlock`); a cap below the hit cuts it to the whole blocks under
    /// the cap, never a full hit then (as the core's `hit_length`).
    fn hit_blocks(&self, matched: usize, len: usize, cap: Option<usize>) -> (usize, bool) {
        let bs = self.block_size;
        let (keep, full_hit) = if self.is_full_hit(matched, len) {
            (matched - 1, true)
        } else {
            (matched, false)
        };
        match cap {
            Some(cap) if keep * bs > cap => (matched.min(cap / bs), false),
            _ => (keep, full_hit),
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
        let bs = self.block_size;
        let len = request.tokens.len();
        if request.scheduled {
            let start = request.num_computed;
            let fresh = blocks_past(bs, start, len, num_new, lookahead, request.blocks.len())?;
            let want = with_watermark(fresh, watermark)?;
            if want > self.order.free_count {
                return Err(CacheError::OutOfBlocks {
                    needed: want,
                    available: self.order.free_count,
                });
            }
            let from = request.blocks.len();
            self.allocate(fresh, &mut request.blocks);
            return Ok(Scheduled {
                from,
                start,
                num_cached: 0,
                full_hit: false,
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
        let full = len / bs;
        // (run, its first n blocks): the match's prefixes.
        let mut held: Vec<(u32, u32)> = Vec::new();
        let mut blocks: Vec<BlockId> = Vec::with_capacity(len.div_ceil(bs));
        // Through the run table, as a lock-free reader would (its index, then each run's
        // chunks and rows under the run's stamp); a run with no child ends the walk.
        self.table.match_prompt(
            &request.root,
            &request.tokens[..full * bs],
            &mut blocks,
            |slot, found| {
                let run = self.by_slot[slot as usize];
                held.push((run, found.matched));
                !self.runs[run as usize].children.is_empty()
            },
        );
        let (keep, full_hit) = self.hit_blocks(blocks.len(), len, cap);
        // The blocks past the hit leave the holds, last run first.
        let mut excess = blocks.len() - keep;
        blocks.truncate(keep);
        while excess > 0 {
            let last = held.last_mut().expect("a hit holds its runs");
            let cut = excess.min(last.1 as usize);
            last.1 -= cut as u32;
            excess -= cut;
            if last.1 == 0 {
                held.pop();
            }
        }
        let start = keep * bs;
        let fresh = blocks_past(bs, start, len, num_new, lookahead, keep)?;
        let want = with_watermark(fresh, watermark)?;
        // Refused before anything changes, as the core refuses: the free blocks the hit takes
        // out of the order are not there to allocate.
        let taken: usize = held
            .iter()
            .map(|&(run, upto)| {
                self.order
                    .queued_below(&self.runs[run as usize].segments, upto)
            })
            .sum();
        let obtainable = self.order.free_count - taken;
        if want > obtainable {
            return Err(CacheError::OutOfBlocks {
                needed: want,
                available: obtainable,
            });
        }
        for &(run, upto) in &held {
            self.acquire(run, upto);
        }
        self.allocate(fresh, &mut blocks);
        request.held = held
            .into_iter()
            .map(|(run, to)| Held::Blocks { run, from: 0, to })
            .collect();
        request.blocks = blocks;
        request.cached_blocks = keep;
        request.full_hit = full_hit;
        request.committed = 0;
        request.num_computed = start;
        request.scheduled = true;
        Ok(Scheduled {
            from: 0,
            start,
            num_cached: start,
            full_hit,
        })
    }
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
