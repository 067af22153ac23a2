//! `CoreGroups`: a hybrid model's KV groups (`prefixkv_core::KvGroups`) over `CoreCache`s that
//! Python keeps using directly. `prefixkv.GroupedPrefixCache` (Python) is the documented API on
//! top; the rules (one hit length, all or nothing) are in `rust/core/src/groups/`.

use std::sync::Arc;

use prefixkv_core::{KvGroups, RequestId};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::cache::CoreCache;
use crate::convert::{count, priority, slot_counts, KeyExtras, RequestRef, Tokens};
use crate::errors::to_py_err;
use crate::gil::{detach_if, many};

/// What `GroupedPrefixCache.allocate_slots` hands the engine (as `Slots`, per group).
#[pyclass(frozen, eq, hash, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct GroupSlots {
    group_block_ids: Vec<Vec<u32>>,
    /// Tokens with KV already, in every group: the scheduled tokens start at this position.
    #[pyo3(get)]
    num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (0 on later calls).
    #[pyo3(get)]
    num_cached_tokens: usize,
    /// This call matched every block of the prompt in every group.
    #[pyo3(get)]
    full_hit: bool,
}

#[pymethods]
impl GroupSlots {
    /// Blocks appended to each group's block table by this call: a tuple, one list per group.
    #[getter]
    fn group_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        per_group(py, &self.group_block_ids)
    }

    /// Always False: KV groups serve only ``recompute_last_block`` full hits.
    #[getter]
    fn last_token_shared(&self) -> bool {
        false
    }

    fn __repr__(&self) -> String {
        let new_blocks: Vec<usize> = self.group_block_ids.iter().map(Vec::len).collect();
        format!(
            "GroupSlots(num_computed_tokens={}, num_cached_tokens={}, full_hit={}, new_blocks={:?})",
            self.num_computed_tokens,
            self.num_cached_tokens,
            if self.full_hit { "True" } else { "False" },
            new_blocks
        )
    }
}

impl From<prefixkv_core::GroupSlots> for GroupSlots {
    fn from(s: prefixkv_core::GroupSlots) -> Self {
        Self {
            group_block_ids: s.group_block_ids,
            num_computed_tokens: s.num_computed_tokens,
            num_cached_tokens: s.num_cached_tokens,
            full_hit: s.full_hit,
        }
    }
}

/// One list of block ids per group, as a tuple.
fn per_group<'py>(py: Python<'py>, blocks: &[Vec<u32>]) -> PyResult<Bound<'py, PyTuple>> {
    let lists = blocks
        .iter()
        .map(|group| PyList::new(py, group))
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, lists)
}

/// The KV groups' block managers driven as one. Use `prefixkv.GroupedPrefixCache`, which
/// documents every method.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreGroups(KvGroups);

impl CoreGroups {
    /// Whether work over `tokens` tokens is enough to release the GIL for (`gil.rs`), counted
    /// in blocks of the group with the smallest blocks (the most blocks to touch).
    fn many(&self, tokens: usize) -> bool {
        let block_size = self.0.groups().iter().map(|g| g.config().block_size).min();
        many(tokens, block_size.unwrap_or(1))
    }

    /// As `CoreCache::allocation_is_large`: many tokens, or a waiting request's first
    /// allocation (asked of the first group: every group holds the request alike).
    fn allocation_is_large(&self, id: &RequestId, tokens: usize) -> bool {
        self.many(tokens)
            || self.0.groups().first().is_some_and(|group| {
                matches!(group.num_computed_tokens(id), Ok(0))
                    && group.num_tokens(id).is_ok_and(|n| self.many(n))
            })
    }
}

#[pymethods]
impl CoreGroups {
    #[new]
    fn new(caches: Vec<PyRef<'_, CoreCache>>) -> PyResult<Self> {
        let groups = caches.iter().map(|cache| Arc::clone(&cache.0)).collect();
        KvGroups::new(groups).map(Self).map_err(to_py_err)
    }

    #[getter]
    fn hit_granularity(&self) -> usize {
        self.0.hit_granularity()
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
        let priority = self::priority(priority)?;
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

    fn start_position(&self, request: RequestRef) -> PyResult<usize> {
        self.0.start_position(&request.0).map_err(to_py_err)
    }

    fn allocate_slots(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_new_tokens: &Bound<'_, PyAny>,
        num_lookahead_tokens: &Bound<'_, PyAny>,
        watermark: &Bound<'_, PyAny>,
    ) -> PyResult<GroupSlots> {
        let (new, lookahead, watermark) =
            slot_counts(num_new_tokens, num_lookahead_tokens, watermark)?;
        let large = self.allocation_is_large(&request.0, new.saturating_add(lookahead));
        detach_if(py, large, || {
            self.0.allocate_slots(&request.0, new, lookahead, watermark)
        })
        .map(GroupSlots::from)
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

    fn commit(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let num = count(num_computed_tokens, "num_computed_tokens")?;
        // What the commit may publish is what it adds to the computed tokens (`gil.rs`).
        let large = self
            .0
            .num_computed_tokens(&request.0)
            .is_ok_and(|done| self.many(num.saturating_sub(done)));
        detach_if(py, large, || self.0.commit(&request.0, num)).map_err(to_py_err)
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

    fn accept_drafts(
        &self,
        request: RequestRef,
        num_accepted: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let num = count(num_accepted, "num_accepted")?;
        self.0.accept_drafts(&request.0, num).map_err(to_py_err)
    }

    fn truncate(&self, request: RequestRef, num_tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let num = count(num_tokens, "num_tokens")?;
        self.0.truncate(&request.0, num).map_err(to_py_err)
    }

    fn preempt(&self, py: Python<'_>, request: RequestRef) -> PyResult<()> {
        py.detach(|| self.0.preempt(&request.0)).map_err(to_py_err)
    }

    fn finish(&self, py: Python<'_>, request: RequestRef) -> PyResult<()> {
        py.detach(|| self.0.finish(&request.0)).map_err(to_py_err)
    }

    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        request: RequestRef,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let tables = self.0.block_tables(&request.0).map_err(to_py_err)?;
        per_group(py, &tables)
    }

    fn num_computed_tokens(&self, request: RequestRef) -> PyResult<usize> {
        self.0.num_computed_tokens(&request.0).map_err(to_py_err)
    }
}
