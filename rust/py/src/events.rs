//! KV events: turning recording on and off on a `CoreCache` or a `CoreRunCache`, and draining
//! what it recorded. Free functions over the cache (not methods) so that this concern stays in
//! its own file; `prefixkv.events.EventRecorder` is the documented API on top.

use prefixkv_core::{
    BlockKey, EventConfig, EventCounters as CoreCounters, EventDrain as CoreDrain, HashForm,
    KvEvent, TokenIds,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::cache::CoreCache;
use crate::convert::int_in;
use crate::errors::{invalid, to_py_err};
use crate::runs::CoreRunCache;

/// Either core: both record the same events (`prefixkv_core::run_cache` hooks them where runs
/// change).
#[derive(FromPyObject)]
pub enum EventCore<'py> {
    Blocks(PyRef<'py, CoreCache>),
    Runs(PyRef<'py, CoreRunCache>),
}

impl EventCore<'_> {
    fn enable(&self, config: EventConfig) -> PyResult<()> {
        match self {
            Self::Blocks(cache) => {
                cache.0.enable_events(config);
                Ok(())
            }
            Self::Runs(cache) => cache.0.enable_events(config).map_err(to_py_err),
        }
    }

    fn disable(&self) -> PyResult<()> {
        match self {
            Self::Blocks(cache) => {
                cache.0.disable_events();
                Ok(())
            }
            Self::Runs(cache) => cache.0.disable_events().map_err(to_py_err),
        }
    }

    fn enabled(&self) -> PyResult<bool> {
        match self {
            Self::Blocks(cache) => Ok(cache.0.events_enabled()),
            Self::Runs(cache) => cache.0.events_enabled().map_err(to_py_err),
        }
    }

    fn counters(&self) -> PyResult<CoreCounters> {
        match self {
            Self::Blocks(cache) => Ok(cache.0.event_counters()),
            Self::Runs(cache) => cache.0.event_counters().map_err(to_py_err),
        }
    }

    fn drain(&self) -> PyResult<CoreDrain> {
        match self {
            Self::Blocks(cache) => Ok(cache.0.drain_events()),
            Self::Runs(cache) => cache.0.drain_events().map_err(to_py_err),
        }
    }

    /// Walks every cached block (hashing each): the GIL is released meanwhile.
    fn cached_keys(&self, py: Python<'_>) -> PyResult<Vec<BlockKey>> {
        match self {
            Self::Blocks(cache) => {
                let core = &*cache.0;
                Ok(py.detach(|| core.cached_keys()))
            }
            Self::Runs(cache) => {
                let core = &cache.0;
                py.detach(|| core.cached_keys()).map_err(to_py_err)
            }
        }
    }
}

/// One recorded change: `kind` is "stored", "removed" or "cleared". For "stored", `keys` are
/// SHA-256 block keys in chain order, `parent` the key `keys[0]` chains on (None: a first
/// block), `token_ids` the blocks' tokens (empty when withheld), `adapter` the adapter name and
/// `extras` each block's encoded extra keys.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreEvent(KvEvent);

#[pymethods]
impl CoreEvent {
    #[getter]
    fn kind(&self) -> &'static str {
        match self.0 {
            KvEvent::Stored { .. } => "stored",
            KvEvent::Removed { .. } => "removed",
            KvEvent::Cleared => "cleared",
        }
    }

    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        match &self.0 {
            KvEvent::Stored { keys, .. } | KvEvent::Removed { keys } => {
                keys.iter().map(|k| PyBytes::new(py, &k.0)).collect()
            }
            KvEvent::Cleared => Vec::new(),
        }
    }

    /// The keys in their 64-bit form (`prefixkv_core::index::hash64`).
    #[getter]
    fn hashes64(&self) -> Vec<u64> {
        match &self.0 {
            KvEvent::Stored { keys, .. } | KvEvent::Removed { keys } => {
                keys.iter().map(prefixkv_core::index::hash64).collect()
            }
            KvEvent::Cleared => Vec::new(),
        }
    }

    #[getter]
    fn parent<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        match &self.0 {
            KvEvent::Stored {
                parent: Some(key), ..
            } => Some(PyBytes::new(py, &key.0)),
            _ => None,
        }
    }

    #[getter]
    fn token_ids(&self) -> Vec<u32> {
        match &self.0 {
            KvEvent::Stored { token_ids, .. } => token_ids.clone(),
            _ => Vec::new(),
        }
    }

    #[getter]
    fn adapter<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        match &self.0 {
            KvEvent::Stored {
                adapter: Some(name),
                ..
            } => Some(PyBytes::new(py, name)),
            _ => None,
        }
    }

    #[getter]
    fn extras<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        match &self.0 {
            KvEvent::Stored { extras, .. } => extras.iter().map(|e| PyBytes::new(py, e)).collect(),
            _ => Vec::new(),
        }
    }

    fn __repr__(&self) -> String {
        format!("CoreEvent({:?})", self.0)
    }
}

/// What one drain returned, with the recorder's counters after it.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct EventDrain {
    #[pyo3(get)]
    events: Vec<Py<CoreEvent>>,
    /// True when this drain replaces lost events: `cleared`, then every cached block.
    #[pyo3(get)]
    resynchronised: bool,
    #[pyo3(get)]
    recorded_blocks: u64,
    #[pyo3(get)]
    dropped_blocks: u64,
    #[pyo3(get)]
    overflows: u64,
}

impl EventDrain {
    fn new(py: Python<'_>, drain: CoreDrain) -> PyResult<Self> {
        Ok(Self {
            events: drain
                .events
                .into_iter()
                .map(|e| Py::new(py, CoreEvent(e)))
                .collect::<PyResult<_>>()?,
            resynchronised: drain.resynchronised,
            recorded_blocks: drain.counters.recorded_blocks,
            dropped_blocks: drain.counters.dropped_blocks,
            overflows: drain.counters.overflows,
        })
    }
}

/// The recorder's counters: blocks recorded, blocks dropped by overflows, overflows.
#[pyclass(frozen, get_all, module = "prefixkv._core")]
pub struct EventCounters {
    recorded_blocks: u64,
    dropped_blocks: u64,
    overflows: u64,
}

/// `cache`'s event counters now (they survive disable and enable).
#[pyfunction]
pub fn event_counters(cache: EventCore<'_>) -> PyResult<EventCounters> {
    let c = cache.counters()?;
    Ok(EventCounters {
        recorded_blocks: c.recorded_blocks,
        dropped_blocks: c.dropped_blocks,
        overflows: c.overflows,
    })
}

/// Starts (or reconfigures) event recording on `cache`.
#[pyfunction]
pub fn enable_events(
    cache: EventCore<'_>,
    capacity: &Bound<'_, PyAny>,
    token_ids: &str,
) -> PyResult<()> {
    let capacity = int_in(capacity, "capacity", "1 ..= 2**63-1", |v| v > 0)?;
    let token_ids = match token_ids {
        "all" => TokenIds::All,
        "unsalted" => TokenIds::Unsalted,
        "none" => TokenIds::None,
        other => {
            return Err(invalid(format!(
                "token_ids must be 'all', 'unsalted' or 'none', got {other:?}"
            )))
        }
    };
    cache.enable(EventConfig {
        capacity,
        token_ids,
    })
}

/// Stops event recording on `cache` (queued events are discarded, counters kept).
#[pyfunction]
pub fn disable_events(cache: EventCore<'_>) -> PyResult<()> {
    cache.disable()
}

/// Whether `cache` records events.
#[pyfunction]
pub fn events_enabled(cache: EventCore<'_>) -> PyResult<bool> {
    cache.enabled()
}

/// The events `cache` recorded since the last drain.
#[pyfunction]
pub fn drain_events(py: Python<'_>, cache: EventCore<'_>) -> PyResult<EventDrain> {
    EventDrain::new(py, cache.drain()?)
}

/// The SHA-256 block key of every block `cache` holds now, in no particular order.
#[pyfunction]
pub fn cached_keys<'py>(
    py: Python<'py>,
    cache: EventCore<'py>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let keys = cache.cached_keys(py)?;
    Ok(keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
}

/// `events` as the msgpack array of vLLM's `KVEventBatch.events` (see
/// `prefixkv_core::encode_events`); `hashes` is "int64" or "bytes".
#[pyfunction]
#[pyo3(signature = (events, block_size, hashes, medium))]
pub fn encode_events<'py>(
    py: Python<'py>,
    events: Vec<Bound<'py, CoreEvent>>,
    block_size: &Bound<'py, PyAny>,
    hashes: &str,
    medium: Option<&str>,
) -> PyResult<Bound<'py, PyBytes>> {
    let block_size: u32 = int_in(block_size, "block_size", "1 ..= 4294967295", |v| v > 0)?;
    let form = match hashes {
        "int64" => HashForm::Int64,
        "bytes" => HashForm::Bytes,
        other => {
            return Err(invalid(format!(
                "hashes must be 'int64' or 'bytes', got {other:?}"
            )))
        }
    };
    let refs: Vec<&KvEvent> = events.iter().map(|e| &e.get().0).collect();
    let encoded = prefixkv_core::encode_events(&refs, block_size as usize, form, medium);
    Ok(PyBytes::new(py, &encoded))
}
