//! Python values out: named, frozen results (never positional tuples, so a reordering cannot
//! silently swap two fields). Block lists stay Rust vectors until Python reads them: a probe
//! that only wants the hit length never builds a list of Python ints.

use prefixkv_core::RequestId;
use pyo3::prelude::*;

use crate::convert::request_id_to_py;

/// The cached prefix of a prompt (`PrefixCache.lookup`, `match_and_acquire`).
#[pyclass(frozen, eq, hash, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct PrefixMatch {
    /// Tokens whose KV is reused; the engine computes from this position on.
    #[pyo3(get)]
    pub num_cached_tokens: usize,
    /// Every block of the prompt is cached (see `PrefixCache`'s `full_hit` setting).
    #[pyo3(get)]
    pub full_hit: bool,
    /// The last token's KV is in a shared block: compute it without writing KV.
    #[pyo3(get)]
    pub last_token_shared: bool,
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
            last_token_shared: m.last_token_shared,
            block_ids: m.blocks,
        }
    }
}

/// A live request, as `PrefixCache.begin` returned it.
#[pyclass(frozen, eq, hash, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct Request {
    pub id: RequestId,
    pub block_table: Vec<u32>,
    /// Prompt tokens whose KV is reused.
    #[pyo3(get)]
    pub num_cached_tokens: usize,
    /// Every block of the prompt was cached (see `PrefixCache.begin`).
    #[pyo3(get)]
    pub full_hit: bool,
    /// The last prompt token's KV is in a shared block: compute it without writing KV.
    #[pyo3(get)]
    pub last_token_shared: bool,
    #[pyo3(get)]
    pub num_prompt_tokens: usize,
}

#[pymethods]
impl Request {
    /// The handle for every other call (the request itself works too): the engine's id, or
    /// the int `begin` picked.
    #[getter]
    fn id<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        request_id_to_py(py, &self.id)
    }

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

/// Room made for a request's next tokens (`PrefixCache.allocate_slots`).
#[pyclass(frozen, eq, hash, get_all, module = "prefixkv._core")]
#[derive(PartialEq, Eq, Hash)]
pub struct Slots {
    /// Blocks appended to the request's block table, in order (on the call that matched the
    /// cached prefix: those blocks first, then fresh ones).
    pub block_ids: Vec<u32>,
    /// Tokens with KV already: the scheduled tokens start at this position.
    pub num_computed_tokens: usize,
    /// Tokens of the cached prefix this call matched (0 on later calls).
    pub num_cached_tokens: usize,
    /// This call matched every block of the prompt.
    pub full_hit: bool,
    /// The last prompt token's KV is in a shared block: compute it without writing KV.
    pub last_token_shared: bool,
}

#[pymethods]
impl Slots {
    fn __repr__(&self) -> String {
        format!(
            "Slots(num_computed_tokens={}, num_cached_tokens={}, new_blocks={})",
            self.num_computed_tokens,
            self.num_cached_tokens,
            self.block_ids.len()
        )
    }
}

impl From<prefixkv_core::Slots> for Slots {
    fn from(s: prefixkv_core::Slots) -> Self {
        Self {
            block_ids: s.block_ids,
            num_computed_tokens: s.num_computed_tokens,
            num_cached_tokens: s.num_cached_tokens,
            full_hit: s.full_hit,
            last_token_shared: s.last_token_shared,
        }
    }
}
