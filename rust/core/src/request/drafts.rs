//! Draft tokens and truncation: what `append_tokens`, `accept_drafts` and `truncate` may change.
//!
//! ## Drafts are never published
//! Draft tokens sit at the tail until `accept_drafts` (or a `truncate` that removes them).
//! `commit` may record KV written for them (the verification pass writes it), but publishes
//! only blocks whose every token is verified: no hit can ever come from a rejected draft. A
//! block once published is never written again, so `truncate` refuses to cut into one.

use super::{with_request, Request};
use crate::cache::{Inner, PrefixCache};
use crate::error::{CacheError, Result};
use crate::pool::BlockId;
use crate::request::RequestId;
use crate::sliding::positions_out_of_window;

impl PrefixCache {
    /// Adds tokens to a request without allocating: sampled tokens, or with `draft` unverified
    /// draft tokens for speculative decoding. Verified tokens cannot follow drafts: resolve
    /// them first (`accept_drafts`, `truncate`).
    pub fn append_tokens(&self, id: &RequestId, tokens: &[u32], draft: bool) -> Result<()> {
        self.check_tokens(tokens)?;
        let mut guard = self.inner.lock();
        let request = guard.requests.get_mut(id)?;
        if !draft {
            no_pending_drafts(id, request)?;
        }
        request.tokens.extend_from_slice(tokens);
        if draft {
            request.num_drafts += tokens.len();
        }
        Ok(())
    }

    /// Keeps the first `num_accepted` draft tokens as verified and drops the others (their
    /// KV and every block left without tokens, as `truncate`). Publishes what became full and
    /// verified. Returns how many leading positions are now committed.
    pub fn accept_drafts(&self, id: &RequestId, num_accepted: usize) -> Result<usize> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let request = inner.requests.get(id)?;
        if num_accepted > request.num_drafts {
            return Err(CacheError::InvalidInput(format!(
                "num_accepted {num_accepted} exceeds the request's {} draft tokens",
                request.num_drafts
            )));
        }
        let keep = request.num_verified() + num_accepted;
        with_request(inner, id, |inner, request| {
            self.truncate_locked(inner, request, keep);
            request.num_drafts = 0;
            self.publish_verified(inner, request);
            self.release_passed_positions(inner, request);
            request.anchors.len()
        })
    }

    /// Drops every token from position `num_tokens` on (drafts or not), their KV, and every
    /// block left without tokens (returned, now freed). Refuses to cut into a published
    /// block: published KV is never rewritten.
    pub fn truncate(&self, id: &RequestId, num_tokens: usize) -> Result<Vec<BlockId>> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        self.truncate_refusal(inner, inner.requests.get(id)?, num_tokens)?;
        with_request(inner, id, |inner, request| {
            self.truncate_locked(inner, request, num_tokens)
        })
    }

    /// Whether `truncate(id, num_tokens)` would be accepted now: `Ok` if so, else the error it
    /// would return. Changes nothing; a caller driving several caches (`groups/mod.rs`) asks each
    /// before cutting any.
    pub fn check_truncate(&self, id: &RequestId, num_tokens: usize) -> Result<()> {
        let inner = self.inner.lock();
        self.truncate_refusal(&inner, inner.requests.get(id)?, num_tokens)
    }

    /// Why `request` may not be truncated to `num_tokens` tokens, if it may not.
    fn truncate_refusal(&self, inner: &Inner, request: &Request, num_tokens: usize) -> Result<()> {
        let len = request.tokens.len();
        let published = request.anchors.len() * self.config.block_size;
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
        if let Some(window) = self.window_of(request) {
            let first_read = positions_out_of_window(window, self.config.block_size, num_tokens);
            if request.released > 0 && first_read < request.released {
                return Err(CacheError::InvalidInput(format!(
                    "cannot truncate to {num_tokens} tokens: the query there reads the last \
                     {window} tokens (the sliding window), and this request already released \
                     the blocks holding some of them"
                )));
            }
        }
        // Every block the cut touches must be the request's alone. After a reset a block of a
        // prefix hit is no longer published (no anchor) but still shared with other requests:
        // writing into it, or freeing it, would corrupt them.
        let first = num_tokens / self.config.block_size;
        if let Some(&shared) = request.block_table.get(first..).and_then(|tail| {
            tail.iter()
                .find(|&&b| inner.pool.is_cached(b) || inner.pool.ref_count(b) != Some(1))
        }) {
            return Err(CacheError::InvalidInput(format!(
                "cannot truncate to {num_tokens} tokens: block {shared} holding them is shared \
                 with another request, and is never rewritten"
            )));
        }
        Ok(())
    }

    fn truncate_locked(
        &self,
        inner: &mut Inner,
        request: &mut Request,
        num_tokens: usize,
    ) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let removed = request.tokens.len() - num_tokens;
        request.tokens.truncate(num_tokens);
        request.num_drafts = request.num_drafts.saturating_sub(removed);
        request.num_computed = request.num_computed.min(num_tokens);
        request.keys.truncate(num_tokens / bs);
        request.export_keys.truncate(num_tokens / bs);
        let keep = num_tokens.div_ceil(bs);
        if !request.scheduled || request.block_table.len() <= keep {
            return Vec::new();
        }
        let freed = request.block_table.split_off(keep);
        for &block in &freed {
            // Past every published position: private blocks, freed right here.
            inner.pool.release(block);
        }
        freed
    }
}

pub(super) fn no_pending_drafts(id: &RequestId, request: &Request) -> Result<()> {
    if request.num_drafts > 0 {
        return Err(CacheError::InvalidInput(format!(
            "request {id} has {} draft tokens: accept_drafts or truncate them before appending \
             verified tokens",
            request.num_drafts
        )));
    }
    Ok(())
}
