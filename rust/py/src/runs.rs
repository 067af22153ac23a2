//! `CoreRunCache`: the cache on runs of blocks (`prefixkv_core::run_cache::RunPrefixCache`,
//! issue 24), behind `prefixkv.PrefixCache(core="runs")`. Its methods are `CoreCache`'s, with
//! the same conversions and the same GIL rule (`gil.rs`); what the run cache does not serve
//! yet (sliding windows, the low-level block calls) is refused by name with
//! an `UnsupportedFeatureError`, changing nothing. KV events are `events.rs`' functions, as for
//! `CoreCache`.

use prefixkv_core::run_cache::{RunLookup, RunPrefixCache, RunSlots};
use prefixkv_core::{FullHit, RequestId};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::cache::{fingerprint, U32_RANGE};
use crate::convert::{
    self, block_id, count, int_in, slot_counts, BlockIds, KeyExtras, RequestRef, Tokens,
};
use crate::errors::{invalid, to_py_err, unsupported};
use crate::gil::{detach_if, many, MANY_BLOCKS};
use crate::results::{Pin, PrefixMatch, Request, Slots};
use crate::stats::CacheStats;

/// The cache on runs of blocks. Use `prefixkv.PrefixCache(core="runs")`, which documents
/// every method.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreRunCache(pub(crate) RunPrefixCache);

/// Refuses a call the run core does not serve yet, by name.
fn unserved(call: &str) -> PyErr {
    unsupported(format!(
        "{call} is not served by the run core yet (PrefixCache(core=\"runs\")); use \
         core=\"blocks\" for it"
    ))
}

/// What a lookup found, as `CoreCache`'s lookups answer.
fn prefix_match(found: RunLookup) -> PrefixMatch {
    PrefixMatch {
        num_cached_tokens: found.num_cached_tokens,
        full_hit: found.full_hit,
        last_token_shared: found.last_token_shared,
        block_ids: found.blocks,
    }
}

impl From<RunSlots> for Slots {
    fn from(slots: RunSlots) -> Self {
        Self {
            block_ids: slots.block_ids,
            num_computed_tokens: slots.num_computed_tokens,
            num_cached_tokens: slots.num_cached_tokens,
            full_hit: slots.full_hit,
            last_token_shared: slots.last_token_shared,
        }
    }
}

impl CoreRunCache {
    /// Whether work over `tokens` tokens is enough to release the GIL for (`gil.rs`).
    fn many(&self, tokens: usize) -> bool {
        many(tokens, self.0.block_size())
    }

    /// As `CoreCache`'s: many tokens, or a waiting request's first allocation, which matches
    /// its whole prompt however few tokens it asks for.
    fn allocation_is_large(&self, id: &RequestId, tokens: usize) -> bool {
        self.many(tokens)
            || (matches!(self.0.num_computed_tokens(id), Ok(0))
                && self.0.num_tokens(id).is_ok_and(|n| self.many(n)))
    }
}

#[pymethods]
impl CoreRunCache {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, context_fingerprint, vocab_size=None, reuse_last_block=false))]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        context_fingerprint: &[u8],
        vocab_size: Option<&Bound<'_, PyAny>>,
        reuse_last_block: bool,
    ) -> PyResult<Self> {
        let positive = |v: i128| v > 0;
        let num_blocks: u32 = int_in(num_blocks, "num_blocks", U32_RANGE, positive)?;
        let block_size = int_in::<u32>(block_size, "block_size", U32_RANGE, positive)? as usize;
        let vocab_size = vocab_size
            .filter(|v| !v.is_none())
            .map(|v| int_in(v, "vocab_size", U32_RANGE, positive))
            .transpose()?;
        let context = fingerprint(context_fingerprint)?;
        let full_hit = if reuse_last_block {
            FullHit::ReuseLastBlock
        } else {
            FullHit::RecomputeLastBlock
        };
        RunPrefixCache::new(num_blocks, block_size, context, vocab_size, full_hit)
            .map(Self)
            .map_err(to_py_err)
    }

    #[getter]
    fn num_blocks(&self) -> u32 {
        self.0.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.0.block_size()
    }

    #[getter]
    fn sliding_window(&self) -> Option<usize> {
        None
    }

    #[getter]
    fn null_block(&self) -> Option<u32> {
        None
    }

    #[getter]
    fn window_release(&self) -> &'static str {
        "on_commit"
    }

    fn lookup(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
    ) -> PyResult<PrefixMatch> {
        let view = tokens.view();
        let found = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.lookup(&t, &keys.salt, &keys.extras))
            })
            .map_err(to_py_err)?;
        Ok(prefix_match(found))
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
            |tokens| self.0.lookup_checked(tokens, &keys.salt, &keys.extras),
        )?;
        Ok(found.into_iter().map(prefix_match).collect())
    }

    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn lookup_in_window(
        &self,
        tokens: &Bound<'_, PyAny>,
        keys: &KeyExtras,
        window: &Bound<'_, PyAny>,
    ) -> PyResult<PrefixMatch> {
        let _ = (tokens, keys);
        // The block core's words for the same refusal.
        Err(invalid(format!(
            "lookup_in_window: window {window} in a full-attention cache (a sliding-window \
             cache and a window of at least 1 token are needed)"
        )))
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
        let (id, slots) = py
            .detach(|| {
                view.into_vec().and_then(|t| {
                    self.0
                        .begin(id, t, &keys.salt, keys.extras.clone(), priority)
                })
            })
            .map_err(to_py_err)?;
        Ok(Request {
            id,
            block_table: slots.block_ids,
            num_cached_tokens: slots.num_cached_tokens,
            full_hit: slots.full_hit,
            last_token_shared: slots.last_token_shared,
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
        // Most steps (a decode token, a small chunk) run attached, decided and done under one
        // lock; a large one is left undone and runs detached (`gil.rs`).
        let small = self
            .0
            .allocate_slots_unless_large(&request.0, new, lookahead, watermark, |n| self.many(n))
            .map_err(to_py_err)?;
        match small {
            Some(slots) => Ok(slots.into()),
            None => py
                .detach(|| self.0.allocate_slots(&request.0, new, lookahead, watermark))
                .map(Slots::from)
                .map_err(to_py_err),
        }
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

    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn set_request_window(&self, request: RequestRef, window: &Bound<'_, PyAny>) -> PyResult<()> {
        let _ = (request, window);
        Err(invalid(
            "set_request_window: only a sliding-window cache with window_release Explicit \
             serves requests with their own windows"
                .into(),
        ))
    }

    fn release_out_of_window(
        &self,
        request: RequestRef,
        processed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let processed = count(processed_tokens, "processed_tokens")?;
        // Full attention: nothing leaves a window before `finish`.
        let tokens = self.0.num_tokens(&request.0).map_err(to_py_err)?;
        if processed > tokens {
            return Err(invalid(format!(
                "processed_tokens {processed} exceeds the request's {tokens} tokens"
            )));
        }
        Ok(0)
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
    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn match_and_acquire(
        &self,
        tokens: &Bound<'_, PyAny>,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PrefixMatch> {
        let _ = (tokens, keys, priority);
        Err(unserved("match_and_acquire"))
    }

    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn allocate(&self, count: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let _ = (count,);
        Err(unserved("allocate"))
    }

    fn blocks_obtainable(&self, up_to: &Bound<'_, PyAny>) -> PyResult<usize> {
        let up_to = count(up_to, "up_to")?;
        self.0.blocks_obtainable(up_to).map_err(to_py_err)
    }

    #[pyo3(signature = (tokens, blocks, keys, priority=None))]
    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn commit_blocks(
        &self,
        tokens: &Bound<'_, PyAny>,
        blocks: BlockIds,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let _ = (tokens, blocks, keys, priority);
        Err(unserved("commit_blocks"))
    }

    #[allow(clippy::unused_self)] // `CoreCache`'s signature
    fn release(&self, blocks: BlockIds) -> PyResult<()> {
        let _ = (blocks,);
        Err(unserved("release"))
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

    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.0.reset(None)).map_err(to_py_err)
    }

    fn set_context(&self, py: Python<'_>, context_fingerprint: &[u8]) -> PyResult<()> {
        let key = fingerprint(context_fingerprint)?;
        py.detach(|| self.0.reset(Some(key))).map_err(to_py_err)
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

    fn stats(&self, py: Python<'_>) -> PyResult<CacheStats> {
        py.detach(|| self.0.stats())
            .map(CacheStats::from)
            .map_err(to_py_err)
    }

    fn set_eviction_log(&self, enabled: bool) -> PyResult<()> {
        self.0.set_eviction_log(enabled).map_err(to_py_err)
    }

    fn drain_evicted(&self) -> PyResult<Vec<u32>> {
        self.0.drain_evicted().map_err(to_py_err)
    }

    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.0.ref_count(block_id(block)?).map_err(to_py_err)
    }

    fn is_cached(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.0.is_cached(block_id(block)?).map_err(to_py_err)
    }

    /// Raises AssertionError naming the broken invariant (tests only).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        let outcome = py.detach(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.check_invariants()))
        });
        match outcome {
            Ok(result) => result.map_err(to_py_err),
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_string()))
                    .unwrap_or_else(|| "invariant broken".into());
                Err(pyo3::exceptions::PyAssertionError::new_err(msg))
            }
        }
    }
}
