//! `prefixkv._core`: thin PyO3 wrappers over `prefixkv-core`, split by concern:
//!
//! - `convert`: Python values in (token ids, key extras, integers, block ids, requests);
//! - `results`: named frozen results out (`PrefixMatch`, `Request`, `Pin`);
//! - `stats`: `CacheStats`;
//! - `errors`: the one mapping of core errors onto `prefixkv.errors`;
//! - `gil`: which calls release the GIL, and why not all of them;
//! - `cache`: `CoreCache`, a list of thin methods.
//! - `groups`: `CoreGroups`, a hybrid model's KV groups driven as one over shared `CoreCache`s;
//! - `events`: KV event recording on a `CoreCache` or `CoreRunCache`, drained as `CoreEvent`s;
//! - `index`: `PrefixIndex`, the router-side prefix index, and `prompt_hashes`;
//! - `runs`: `CoreRunCache`, the cache on runs of blocks (issue 24), experimental: for benches.

mod cache;
mod convert;
mod errors;
mod events;
mod gil;
mod groups;
mod index;
mod narrow;
mod probes;
mod results;
mod runs;
mod stats;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// SHA-256 fingerprint of a canonical context serialization (see `prefixkv.CacheContext`).
#[pyfunction]
fn context_fingerprint<'py>(py: Python<'py>, canonical: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &prefixkv_core::context_fingerprint(canonical).0)
}

#[pymodule(gil_used = false)]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<cache::CoreCache>()?;
    module.add_class::<convert::KeyExtras>()?;
    module.add_class::<results::PrefixMatch>()?;
    module.add_class::<results::Request>()?;
    module.add_class::<results::Pin>()?;
    module.add_class::<results::Slots>()?;
    module.add_class::<stats::CacheStats>()?;
    module.add_class::<groups::CoreGroups>()?;
    module.add_class::<groups::GroupSlots>()?;
    module.add_function(wrap_pyfunction!(context_fingerprint, module)?)?;
    module.add_class::<events::CoreEvent>()?;
    module.add_class::<events::EventDrain>()?;
    module.add_class::<events::EventCounters>()?;
    module.add_function(wrap_pyfunction!(events::event_counters, module)?)?;
    module.add_function(wrap_pyfunction!(events::enable_events, module)?)?;
    module.add_function(wrap_pyfunction!(events::disable_events, module)?)?;
    module.add_function(wrap_pyfunction!(events::events_enabled, module)?)?;
    module.add_function(wrap_pyfunction!(events::drain_events, module)?)?;
    module.add_function(wrap_pyfunction!(events::cached_keys, module)?)?;
    module.add_function(wrap_pyfunction!(events::encode_events, module)?)?;
    module.add_class::<index::PrefixIndex>()?;
    module.add_class::<runs::CoreRunCache>()?;
    module.add_function(wrap_pyfunction!(index::prompt_hashes, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
