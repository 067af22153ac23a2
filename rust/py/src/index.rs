//! `PrefixIndex`: which engine instance holds which block, fed by KV events, scored by routers.
//! `prefixkv.events.PrefixIndex` documents it; the invariants are in `prefixkv_core::index`.

use prefixkv_core::index::{self, PrefixIndex as CoreIndex};
use prefixkv_core::BlockKey;
use pyo3::prelude::*;

use crate::convert::{int_in, KeyExtras, Tokens};
use crate::errors::{invalid, to_py_err};

fn instance(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    int_in(obj, "instance", "0 ..= 63", |v| (0..64).contains(&v))
}

/// The index. Frozen: every method takes `&self`; reads are lock-free, writes serialised inside.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct PrefixIndex(CoreIndex);

#[pymethods]
impl PrefixIndex {
    #[new]
    fn new(num_instances: &Bound<'_, PyAny>) -> PyResult<Self> {
        let n: usize = int_in(num_instances, "num_instances", "1 ..= 64", |v| {
            (1..=64).contains(&v)
        })?;
        CoreIndex::new(n).map(Self).map_err(to_py_err)
    }

    #[getter]
    fn num_instances(&self) -> usize {
        self.0.num_instances()
    }

    // A router scores and stores whole prompts' hashes: every call but `__len__` walks many
    // blocks, so each releases the GIL once its arguments are converted (`gil.rs`).

    fn store(
        &self,
        py: Python<'_>,
        instance_id: &Bound<'_, PyAny>,
        hashes: Vec<u64>,
    ) -> PyResult<()> {
        let instance = instance(instance_id)?;
        py.detach(|| self.0.store(instance, &hashes))
            .map_err(to_py_err)
    }

    fn remove(
        &self,
        py: Python<'_>,
        instance_id: &Bound<'_, PyAny>,
        hashes: Vec<u64>,
    ) -> PyResult<()> {
        let instance = instance(instance_id)?;
        py.detach(|| self.0.remove(instance, &hashes))
            .map_err(to_py_err)
    }

    fn clear(&self, py: Python<'_>, instance_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let instance = instance(instance_id)?;
        py.detach(|| self.0.clear(instance)).map_err(to_py_err)
    }

    /// Per instance, the number of leading `hashes` it holds.
    fn score(&self, py: Python<'_>, hashes: Vec<u64>) -> Vec<u32> {
        py.detach(|| self.0.score(&hashes))
    }

    fn blocks_of(&self, py: Python<'_>, instance_id: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let instance = instance(instance_id)?;
        py.detach(|| self.0.blocks_of(instance)).map_err(to_py_err)
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }
}

/// The 64-bit hashes of every full block of `tokens`, as an instance under this context
/// fingerprint publishes them (the GIL is released while hashing).
#[pyfunction]
pub fn prompt_hashes(
    py: Python<'_>,
    context_fingerprint: &[u8],
    block_size: &Bound<'_, PyAny>,
    mut tokens: Tokens<'_>,
    keys: &KeyExtras,
) -> PyResult<Vec<u64>> {
    let context: [u8; 32] = context_fingerprint.try_into().map_err(|_| {
        invalid(format!(
            "a context fingerprint is 32 bytes, got {}",
            context_fingerprint.len()
        ))
    })?;
    let block_size: u32 = int_in(block_size, "block_size", "1 ..= 4294967295", |v| v > 0)?;
    let view = tokens.view();
    py.detach(|| {
        view.into_vec().map(|t| {
            index::prompt_hashes(
                &BlockKey(context),
                block_size as usize,
                &t,
                &keys.salt,
                &keys.extras,
            )
        })
    })
    .map_err(to_py_err)
}
