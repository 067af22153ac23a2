//! Python values out: named, frozen results (never positional tuples, so a reordering cannot
//! silently swap two fields). Block lists stay Rust vectors until Python reads them: a probe
//! that only wants the hit length never builds a list of Python ints.

use pyo3::prelude::*;

/// The cached prefix of a prompt (`PrefixCache.lookup`, `match_and_acquire`).
#[pyclass(frozen, eq, hash, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct PrefixMatch {
    /// Tokens whose KV is reused; the engine computes from this position on.
    #[pyo3(get)]
    pub num_cached_tokens: usize,
    /// Every block is cached: compute only the final token (for its logits), write nothing.
    #[pyo3(get)]
    pub full_hit: bool,
    pub block_ids: Vec<u32>,
}

#[pymethods]
impl PrefixMatch {
    /// The matched blocks, in prompt order.
    #[getter]
    fn block_ids(&self) -> Vec<u32> {
        self.block_ids.clone()
    }

    /// How many blocks matched (without building the list).
    #[getter]
    fn num_cached_blocks(&self) -> usize {
        self.block_ids.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixMatch(num_cached_tokens={}, full_hit={}, blocks={})",
            self.num_cached_tokens,
            if self.full_hit { "True" } else { "False" },
            self.block_ids.len()
        )
    }
}

impl From<prefixkv_core::PrefixMatch> for PrefixMatch {
    fn from(m: prefixkv_core::PrefixMatch) -> Self {
        Self {
            num_cached_tokens: m.num_cached_tokens,
            full_hit: m.full_hit,
            block_ids: m.blocks,
        }
    }
}

/// A live request, as `PrefixCache.begin` returned it.
#[pyclass(frozen, eq, hash, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct Request {
    /// The handle to pass to `append`, `commit`, `finish` (the request itself works too).
    #[pyo3(get)]
    pub id: u64,
    pub block_table: Vec<u32>,
    /// Prompt tokens whose KV is reused.
    #[pyo3(get)]
    pub num_cached_tokens: usize,
    /// Every block of the prompt was cached (see `PrefixCache.begin`).
    #[pyo3(get)]
    pub full_hit: bool,
    #[pyo3(get)]
    pub num_prompt_tokens: usize,
}

#[pymethods]
impl Request {
    /// Blocks covering every prompt token at `begin`: the shared cached ones first, then
    /// private ones. (`PrefixCache.block_table` gives the current table after appends.)
    #[getter]
    fn block_table(&self) -> Vec<u32> {
        self.block_table.clone()
    }

    /// Prompt positions the engine must compute (at least one).
    #[getter]
    fn num_tokens_to_compute(&self) -> usize {
        self.num_prompt_tokens - self.num_cached_tokens
    }

    fn __repr__(&self) -> String {
        format!(
            "Request(id={}, num_prompt_tokens={}, num_cached_tokens={}, full_hit={}, blocks={})",
            self.id,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            if self.full_hit { "True" } else { "False" },
            self.block_table.len()
        )
    }
}

/// A pinned prefix; pass it to `PrefixCache.unpin`.
#[pyclass(frozen, eq, hash, get_all, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct Pin {
    pub id: u64,
    pub num_blocks: usize,
}

#[pymethods]
impl Pin {
    fn __repr__(&self) -> String {
        format!("Pin(id={}, num_blocks={})", self.id, self.num_blocks)
    }
}
