//! `CoreCache`: the block manager's methods, each a few lines. Arguments arrive converted
//! (`convert.rs`), results leave as named objects (`results.rs`), and calls release the GIL by
//! the work they do (`gil.rs` has the rule and why). `prefixkv.PrefixCache` (Python) is the
//! documented API on top.

use std::sync::Arc;

use prefixkv_core::{BlockKey, CacheConfig, FullHit, PrefixCache, RequestId, WindowRelease};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::convert::{
    self, block_id, count, int_in, slot_counts, BlockIds, KeyExtras, RequestRef, Tokens,
};
use crate::errors::{invalid, to_py_err};
use crate::gil::{detach_if, many, MANY_BLOCKS};
use crate::results::{Pin, PrefixMatch, Request, Slots};
use crate::stats::CacheStats;

pub(crate) const U32_RANGE: &str = "1 ..= 4294967295";

pub(crate) fn fingerprint(bytes: &[u8]) -> PyResult<BlockKey> {
    let key: [u8; 32] = bytes.try_into().map_err(|_| {
        invalid(format!(
            "a context fingerprint is 32 bytes, got {}",
            bytes.len()
        ))
    })?;
    Ok(BlockKey(key))
}

/// The Rust block manager. Use `prefixkv.PrefixCache`, which documents every method.
/// Shared (`Arc`) so that a `CoreGroups` can drive it while Python keeps using it directly.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreCache(pub(crate) Arc<PrefixCache>);

impl CoreCache {
    /// Whether work over `tokens` tokens is enough to release the GIL for (`gil.rs`).
    fn many(&self, tokens: usize) -> bool {
        many(tokens, self.0.config().block_size)
    }

    /// Whether allocating `tokens` slots is work enough to release the GIL for: many tokens,
    /// or a waiting request's first allocation, which matches its whole prompt however few
    /// tokens it asks for (a full hit asks for one block or one token).
    fn allocation_is_large(&self, id: &RequestId, tokens: usize) -> bool {
        self.many(tokens)
            || (matches!(self.0.num_computed_tokens(id), Ok(0))
                && self.0.num_tokens(id).is_ok_and(|n| self.many(n)))
    }
}

#[pymethods]
impl CoreCache {
    #[new]
    #[allow(clippy::too_many_arguments)] // one per keyword of `prefixkv.PrefixCache`'s constructor
    #[pyo3(signature = (num_blocks, block_size, context_fingerprint, vocab_size=None, key_bits=None, reuse_last_block=false, sliding_window=None, window_release="on_commit"))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        context_fingerprint: &[u8],
        vocab_size: Option<&Bound<'_, PyAny>>,
        key_bits: Option<&Bound<'_, PyAny>>,
        reuse_last_block: bool,
        sliding_window: Option<&Bound<'_, PyAny>>,
        window_release: &str,
    ) -> PyResult<Self> {
        let positive = |v: i128| v > 0;
        let config = CacheConfig {
            num_blocks: int_in(num_blocks, "num_blocks", U32_RANGE, positive)?,
            block_size: int_in::<u32>(block_size, "block_size", U32_RANGE, positive)? as usize,
            vocab_size: vocab_size
                .filter(|v| !v.is_none())
                .map(|v| int_in(v, "vocab_size", U32_RANGE, positive))
                .transpose()?,
            key_bits: key_bits.map_or(Ok(128), |k| {
                int_in(k, "key_bits", "1 ..= 128", |v| (1..=128).contains(&v))
            })?,
            full_hit: if reuse_last_block {
                FullHit::ReuseLastBlock
            } else {
                FullHit::RecomputeLastBlock
            },
            sliding_window: sliding_window
                .filter(|w| !w.is_none())
                .map(|w| int_in::<u32>(w, "sliding_window", U32_RANGE, positive))
                .transpose()?
                .map(|w| w as usize),
            window_release: match window_release {
                "on_commit" => WindowRelease::OnCommit,
                "explicit" => WindowRelease::Explicit,
                other => {
                    return Err(invalid(format!(
                        "window_release must be 'on_commit' or 'explicit', got {other:?}"
                    )))
                }
            },
        };
        PrefixCache::new(config, fingerprint(context_fingerprint)?)
            .map(|cache| Self(Arc::new(cache)))
            .map_err(to_py_err)
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.0.config().num_blocks
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.0.config().block_size
    }

    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        self.0.config().sliding_window
    }

    #[getter]
    fn null_block(&self) -> Option<u32> {
        self.0.null_block()
    }

    fn lookup(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
    ) -> PyResult<PrefixMatch> {
        let view = tokens.view();
        let m = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.lookup(&t, &keys.salt, &keys.extras))
            })
            .map_err(to_py_err)?;
        Ok(m.into())
    }

    /// `lookup` of each prompt under the same keys, the GIL released once (`probes.rs`).
    fn lookup_many(
        &self,
        py: Python<'_>,
        prompts: Vec<Bound<'_, PyAny>>,
        keys: &KeyExtras,
    ) -> PyResult<Vec<PrefixMatch>> {
        let found = crate::probes::lookup_each(
            py,
            &prompts,
            |tokens| self.0.check_tokens(tokens),
            |tokens| Ok(self.0.lookup_checked(tokens, &keys.salt, &keys.extras)),
        )?;
        Ok(found.into_iter().map(Into::into).collect())
    }

    fn lookup_in_window(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
        window: &Bound<'_, PyAny>,
    ) -> PyResult<PrefixMatch> {
        let window = count(window, "window")?;
        let view = tokens.view();
        let m = py
            .detach(|| {
                view.into_vec().and_then(|t| {
                    self.0
                        .lookup_in_window(&t, &keys.salt, &keys.extras, window)
                })
            })
            .map_err(to_py_err)?;
        Ok(m.into())
    }

    #[pyo3(signature = (tokens, keys, priority=None, request=None))]
    fn begin(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
        request: Option<RequestRef>,
    ) -> PyResult<Request> {
        let priority = convert::priority(priority)?;
        let num_prompt_tokens = tokens.len();
        let view = tokens.view();
        let id = request.map(|r| r.0);
        let r = py
            .detach(|| {
                view.into_vec().and_then(|t| {
                    self.0
                        .begin(id, t, &keys.salt, keys.extras.clone(), priority)
                })
            })
            .map_err(to_py_err)?;
        Ok(Request {
            id: r.request_id,
            block_table: r.block_table,
            num_cached_tokens: r.num_cached_tokens,
            full_hit: r.full_hit,
            last_token_shared: r.last_token_shared,
            num_prompt_tokens,
        })
    }

    #[pyo3(signature = (request, tokens, keys, priority=None))]
    fn add_request(
        &self,
        py: Python<'_>,
        request: RequestRef,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let priority = convert::priority(priority)?;
        let view = tokens.view();
        py.detach(|| {
            view.into_vec().and_then(|t| {
                self.0
                    .add_request(request.0, t, &keys.salt, keys.extras.clone(), priority)
            })
        })
        .map_err(to_py_err)
    }

    // The per-step calls below release the GIL only for a prefill-sized amount of work: a
    // decode step takes a few hundred nanoseconds and keeps it (`gil.rs`).

    fn allocate_slots(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: &Bound<'_, PyAny>,
        watermark: &Bound<'_, PyAny>,
    ) -> PyResult<Slots> {
        let (new, lookahead, watermark) =
            slot_counts(num_new_tokens, num_lookahead_tokens, watermark)?;
        // Most decode steps: the slots already cover the tokens, and this is the answer.
        let covered = self
            .0
            .covered_slots(&request.0, new, lookahead, watermark)
            .map_err(to_py_err)?;
        if let Some(slots) = covered {
            return Ok(slots.into());
        }
        let large = self.allocation_is_large(&request.0, new.saturating_add(lookahead));
        detach_if(py, large, || {
            self.0.allocate_slots(&request.0, new, lookahead, watermark)
        })
        .map(Slots::from)
        .map_err(to_py_err)
    }

    fn can_allocate_slots(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: &Bound<'_, PyAny>,
        watermark: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (new, lookahead, watermark) =
            slot_counts(num_new_tokens, num_lookahead_tokens, watermark)?;
        let large = self.allocation_is_large(&request.0, new.saturating_add(lookahead));
        detach_if(py, large, || {
            self.0
                .can_allocate_slots(&request.0, new, lookahead, watermark)
        })
        .map_err(to_py_err)
    }

    fn blocks_needed(
        &self,
        request: RequestRef,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let new = count(num_new_tokens, "num_new_tokens")?;
        let lookahead = count(num_lookahead_tokens, "num_lookahead_tokens")?;
        self.0
            .blocks_needed(&request.0, new, lookahead)
            .map_err(to_py_err)
    }

    fn start_position(&self, request: RequestRef) -> PyResult<usize> {
        self.0.start_position(&request.0).map_err(to_py_err)
    }

    fn limit_cached_prefix(
        &self,
        request: RequestRef,
        max_cached_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let cap = max_cached_tokens
            .filter(|c| !c.is_none())
            .map(|c| count(c, "max_cached_tokens"))
            .transpose()?;
        self.0
            .limit_cached_prefix(&request.0, cap)
            .map_err(to_py_err)
    }

    fn append_tokens(
        &self,
        py: Python<'_>,
        request: RequestRef,
        mut tokens: Tokens<'_>,
        draft: bool,
    ) -> PyResult<()> {
        let large = self.many(tokens.len());
        let view = tokens.view();
        detach_if(py, large, || {
            view.into_vec()
                .and_then(|t| self.0.append_tokens(&request.0, &t, draft))
        })
        .map_err(to_py_err)
    }

    fn append(
        &self,
        py: Python<'_>,
        request: RequestRef,
        mut tokens: Tokens<'_>,
    ) -> PyResult<Vec<u32>> {
        let large = self.many(tokens.len());
        let view = tokens.view();
        detach_if(py, large, || {
            view.into_vec().and_then(|t| self.0.append(&request.0, &t))
        })
        .map_err(to_py_err)
    }

    fn commit(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let num = count(num_computed_tokens, "num_computed_tokens")?;
        // A commit publishing few blocks (most decode steps publish none) runs attached, under
        // the one lock that decides it; a larger one is left undone and runs detached (`gil.rs`).
        match self.0.commit_at_most(&request.0, num, MANY_BLOCKS - 1) {
            Ok(Some(positions)) => Ok(positions),
            Ok(None) => py
                .detach(|| self.0.commit(&request.0, num))
                .map_err(to_py_err),
            Err(error) => Err(to_py_err(error)),
        }
    }

    fn release_out_of_window(
        &self,
        request: RequestRef,
        processed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let num = count(processed_tokens, "processed_tokens")?;
        self.0
            .release_out_of_window(&request.0, num)
            .map_err(to_py_err)
    }

    fn set_request_window(&self, request: RequestRef, window: &Bound<'_, PyAny>) -> PyResult<()> {
        let window = count(window, "window")?;
        self.0
            .set_request_window(&request.0, window)
            .map_err(to_py_err)
    }

    #[getter]
    fn window_release(&self) -> &'static str {
        match self.0.config().window_release {
            WindowRelease::OnCommit => "on_commit",
            WindowRelease::Explicit => "explicit",
        }
    }

    fn accept_drafts(
        &self,
        request: RequestRef,
        num_accepted: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let num = count(num_accepted, "num_accepted")?;
        self.0.accept_drafts(&request.0, num).map_err(to_py_err)
    }

    fn truncate(&self, request: RequestRef, num_tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let num = count(num_tokens, "num_tokens")?;
        self.0.truncate(&request.0, num).map_err(to_py_err)
    }

    fn preempt(&self, py: Python<'_>, request: RequestRef) -> PyResult<()> {
        py.detach(|| self.0.preempt(&request.0)).map_err(to_py_err)
    }

    fn finish(&self, py: Python<'_>, request: RequestRef) -> PyResult<()> {
        py.detach(|| self.0.finish(&request.0)).map_err(to_py_err)
    }

    fn block_table(&self, request: RequestRef) -> PyResult<Vec<u32>> {
        self.0.block_table(&request.0).map_err(to_py_err)
    }

    fn num_tokens(&self, request: RequestRef) -> PyResult<usize> {
        self.0.num_tokens(&request.0).map_err(to_py_err)
    }

    fn num_computed_tokens(&self, request: RequestRef) -> PyResult<usize> {
        self.0.num_computed_tokens(&request.0).map_err(to_py_err)
    }

    fn request_block_keys<'py>(
        &self,
        py: Python<'py>,
        request: RequestRef,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = py
            .detach(|| self.0.request_block_keys(&request.0))
            .map_err(to_py_err)?;
        Ok(keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
    }

    #[pyo3(signature = (tokens, keys, priority=None))]
    fn match_and_acquire(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PrefixMatch> {
        let priority = convert::priority(priority)?;
        let view = tokens.view();
        let m = py
            .detach(|| {
                view.into_vec().and_then(|t| {
                    self.0
                        .match_and_acquire(&t, &keys.salt, &keys.extras, priority)
                })
            })
            .map_err(to_py_err)?;
        Ok(m.into())
    }

    fn allocate(&self, py: Python<'_>, count: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let count = convert::count(count, "count")?;
        py.detach(|| self.0.allocate(count)).map_err(to_py_err)
    }

    fn blocks_obtainable(&self, py: Python<'_>, up_to: &Bound<'_, PyAny>) -> PyResult<usize> {
        let up_to = count(up_to, "up_to")?;
        Ok(py.detach(|| self.0.blocks_obtainable(up_to)))
    }

    #[pyo3(signature = (tokens, blocks, keys, priority=None))]
    fn commit_blocks(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        blocks: BlockIds,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let priority = convert::priority(priority)?;
        let view = tokens.view();
        py.detach(|| {
            view.into_vec().and_then(|t| {
                self.0
                    .commit_blocks(&t, &blocks.0, &keys.salt, &keys.extras, priority)
            })
        })
        .map_err(to_py_err)
    }

    fn release(&self, py: Python<'_>, blocks: BlockIds) -> PyResult<()> {
        py.detach(|| self.0.release(&blocks.0)).map_err(to_py_err)
    }

    fn pin(&self, py: Python<'_>, mut tokens: Tokens<'_>, keys: &KeyExtras) -> PyResult<Pin> {
        let view = tokens.view();
        let (id, num_blocks) = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.pin(&t, &keys.salt, &keys.extras))
            })
            .map_err(to_py_err)?;
        Ok(Pin { id, num_blocks })
    }

    fn unpin(&self, py: Python<'_>, pin: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = match pin.cast::<Pin>() {
            Ok(pin) => pin.get().id,
            Err(_) => int_in(pin, "pin", "0 ..= 2**64-1", |_| true)?,
        };
        py.detach(|| self.0.unpin(id)).map_err(to_py_err)
    }

    fn clear(&self, py: Python<'_>) {
        py.detach(|| self.0.clear());
    }

    fn set_context(&self, py: Python<'_>, context_fingerprint: &[u8]) -> PyResult<()> {
        let key = fingerprint(context_fingerprint)?;
        py.detach(|| self.0.set_context(key));
        Ok(())
    }

    fn block_keys<'py>(
        &self,
        py: Python<'py>,
        mut tokens: Tokens<'py>,
        keys: &KeyExtras,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let view = tokens.view();
        let block_keys = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.block_keys(&t, &keys.salt, &keys.extras))
            })
            .map_err(to_py_err)?;
        Ok(block_keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
    }

    /// Hashes every full block with the table hash and does nothing else (benchmark floor).
    fn hash_prompt(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
    ) -> PyResult<usize> {
        let view = tokens.view();
        py.detach(|| {
            view.into_vec()
                .map(|t| self.0.hash_prompt(&t, &keys.salt, &keys.extras))
        })
        .map_err(to_py_err)
    }

    fn stats(&self) -> CacheStats {
        self.0.stats().into()
    }

    fn set_eviction_log(&self, enabled: bool) {
        self.0.set_eviction_log(enabled);
    }

    fn drain_evicted(&self) -> Vec<u32> {
        self.0.drain_evicted()
    }

    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.0.ref_count(block_id(block)?).map_err(to_py_err)
    }

    fn is_cached(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.0.is_cached(block_id(block)?).map_err(to_py_err)
    }

    /// Raises AssertionError naming the broken invariant (the core panics on it; tests only).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.check_invariants()))
        })
        .map_err(|e| {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
                .unwrap_or_else(|| "invariant broken".into());
            pyo3::exceptions::PyAssertionError::new_err(msg)
        })
    }
}
