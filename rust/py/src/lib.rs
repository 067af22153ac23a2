//! `prefixkv._core`: thin PyO3 wrappers over `prefixkv-core`.
//!
//! Only conversion lives here: Python values in, core calls (with the GIL released for the
//! calls that hash or walk whole prompts), Python values out, and the one exhaustive mapping
//! of `CacheError` onto the exception classes of `prefixkv.errors`.

use prefixkv_core::{
    BlockKey, CacheConfig, CacheError, CacheStats as CoreStats, MultimodalItem, PrefixCache,
    RequestExtras,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

pyo3::import_exception!(prefixkv.errors, InvalidInputError);
pyo3::import_exception!(prefixkv.errors, UnknownRequestError);
pyo3::import_exception!(prefixkv.errors, InvalidBlockError);
pyo3::import_exception!(prefixkv.errors, BlockStateError);
pyo3::import_exception!(prefixkv.errors, OutOfBlocksError);

/// Maps each core error to its own Python class (each also a built-in: ValueError, KeyError,
/// MemoryError), so callers can catch precisely or broadly.
fn to_py_err(err: CacheError) -> PyErr {
    let message = err.to_string();
    match err {
        CacheError::InvalidInput(_) => InvalidInputError::new_err(message),
        CacheError::UnknownRequest(_) => UnknownRequestError::new_err(message),
        CacheError::InvalidBlock { .. } => InvalidBlockError::new_err(message),
        CacheError::BlockState { .. } => BlockStateError::new_err(message),
        CacheError::OutOfBlocks { .. } => OutOfBlocksError::new_err(message),
    }
}

fn invalid(message: String) -> PyErr {
    InvalidInputError::new_err(message)
}

/// Token ids as received: packed little-endian u32 `bytes` (the form the Python layer gives
/// lists); the raw little-endian bytes of an integer array of another width, checked here
/// (negative or oversized ids); or ints converted one by one from a list or tuple.
enum Tokens<'py> {
    Packed(Bound<'py, PyBytes>),
    Wide {
        data: Bound<'py, PyBytes>,
        width: usize,
        signed: bool,
    },
    Owned(Vec<u32>),
}

/// A borrowed view of `Tokens` that can cross into `detach`: unpacking and checking then run
/// with the GIL released.
enum TokenView<'a> {
    Packed(&'a [u8]),
    Wide {
        data: &'a [u8],
        width: usize,
        signed: bool,
    },
    Owned(&'a [u32]),
}

impl Tokens<'_> {
    fn view(&self) -> TokenView<'_> {
        match self {
            Tokens::Packed(data) => TokenView::Packed(data.as_bytes()),
            Tokens::Wide {
                data,
                width,
                signed,
            } => TokenView::Wide {
                data: data.as_bytes(),
                width: *width,
                signed: *signed,
            },
            Tokens::Owned(tokens) => TokenView::Owned(tokens),
        }
    }

    fn len(&self) -> usize {
        match self {
            Tokens::Packed(data) => data.as_bytes().len() / 4,
            Tokens::Wide { data, width, .. } => data.as_bytes().len() / width,
            Tokens::Owned(tokens) => tokens.len(),
        }
    }
}

impl TokenView<'_> {
    /// The token ids, or the first one that is not a valid id.
    fn into_vec(self) -> Result<Vec<u32>, CacheError> {
        match self {
            TokenView::Packed(data) => widen(data, 4, false),
            TokenView::Wide {
                data,
                width,
                signed,
            } => widen(data, width, signed),
            TokenView::Owned(tokens) => Ok(tokens.to_vec()),
        }
    }
}

/// Little-endian integers of `width` bytes as token ids. One branch-free pass per width that
/// the compiler vectorises, flagging any value outside `0 ..= u32::MAX`; only then a second
/// pass finds the first such value to name it.
fn widen(data: &[u8], width: usize, signed: bool) -> Result<Vec<u32>, CacheError> {
    fn pass<const W: usize>(
        data: &[u8],
        read: impl Fn([u8; W]) -> (u32, bool),
    ) -> (Vec<u32>, bool) {
        let mut out = Vec::with_capacity(data.len() / W);
        let mut valid = true;
        for chunk in data.chunks_exact(W) {
            let (value, ok) = read(chunk.try_into().unwrap_or([0; W]));
            valid &= ok;
            out.push(value);
        }
        (out, valid)
    }
    const MAX: u64 = u32::MAX as u64;
    let (out, valid) = match (width, signed) {
        (8, false) => pass::<8>(data, |b| {
            let v = u64::from_le_bytes(b);
            (v as u32, v <= MAX)
        }),
        (8, true) => pass::<8>(data, |b| {
            let v = i64::from_le_bytes(b);
            (v as u32, (0..=MAX as i64).contains(&v))
        }),
        (4, true) => pass::<4>(data, |b| {
            let v = i32::from_le_bytes(b);
            (v as u32, v >= 0)
        }),
        (4, false) => pass::<4>(data, |b| (u32::from_le_bytes(b), true)),
        (2, true) => pass::<2>(data, |b| {
            let v = i16::from_le_bytes(b);
            (v as u32, v >= 0)
        }),
        (2, false) => pass::<2>(data, |b| (u32::from(u16::from_le_bytes(b)), true)),
        (_, true) => pass::<1>(data, |b| (b[0] as i8 as u32, b[0] < 0x80)),
        (_, false) => pass::<1>(data, |b| (u32::from(b[0]), true)),
    };
    if valid {
        return Ok(out);
    }
    for (position, bytes) in data.chunks_exact(width).enumerate() {
        wide_token(position, bytes, signed)?;
    }
    Err(CacheError::InvalidInput(
        "a token id is out of range".into(),
    ))
}

/// One little-endian integer of 1, 2, 4 or 8 bytes as a token id.
fn wide_token(position: usize, bytes: &[u8], signed: bool) -> Result<u32, CacheError> {
    let mut word = [0u8; 8];
    word[..bytes.len()].copy_from_slice(bytes);
    let negative = signed && bytes[bytes.len() - 1] & 0x80 != 0;
    if negative {
        // Sign-extend to report the value the caller passed.
        word[bytes.len()..].fill(0xFF);
        let value = i64::from_le_bytes(word);
        return Err(CacheError::InvalidInput(format!(
            "token id {value} at position {position} is negative"
        )));
    }
    let value = u64::from_le_bytes(word);
    u32::try_from(value).map_err(|_| {
        CacheError::InvalidInput(format!(
            "token id {value} at position {position} is out of range (0 ..= 4294967295)"
        ))
    })
}

fn tokens_from<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Tokens<'py>> {
    if let Ok(bytes) = obj.cast::<PyBytes>() {
        let len = bytes.as_bytes().len();
        if len % 4 != 0 {
            return Err(invalid(format!(
                "token buffer of {len} bytes is not a whole number of u32"
            )));
        }
        return Ok(Tokens::Packed(bytes.clone()));
    }
    let convert = |index: usize, item: Bound<'_, PyAny>| -> PyResult<u32> {
        let value: i64 = item.extract().map_err(|_| {
            invalid(format!(
                "token at position {index} is not an int (got {})",
                type_name(&item)
            ))
        })?;
        u32::try_from(value).map_err(|_| {
            invalid(format!(
                "token id {value} at position {index} is out of range (0 ..= 4294967295)"
            ))
        })
    };
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .enumerate()
            .map(|(i, item)| convert(i, item))
            .collect::<PyResult<_>>()
            .map(Tokens::Owned);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        if tuple.len() == 3 {
            if let Ok(data) = tuple.get_item(0)?.cast_into::<PyBytes>() {
                let header = || invalid("a packed token array is (bytes, width, signed)".into());
                let width: usize = tuple.get_item(1)?.extract().map_err(|_| header())?;
                let signed: bool = tuple.get_item(2)?.extract().map_err(|_| header())?;
                let len = data.as_bytes().len();
                if !matches!(width, 1 | 2 | 4 | 8) || len % width != 0 {
                    return Err(invalid(format!(
                        "a packed token array needs a width of 1, 2, 4 or 8 bytes dividing its \
                         {len} bytes, got {width}"
                    )));
                }
                return Ok(Tokens::Wide {
                    data,
                    width,
                    signed,
                });
            }
        }
        return tuple
            .iter()
            .enumerate()
            .map(|(i, item)| convert(i, item))
            .collect::<PyResult<_>>()
            .map(Tokens::Owned);
    }
    Err(invalid(format!(
        "token ids must be a list, tuple, numpy array or CPU tensor of ints, not {}",
        type_name(obj)
    )))
}

/// Block ids as packed little-endian u32: one allocation, not one Python int per block, so a
/// probe holds the GIL for as little as possible. `prefixkv.PrefixMatch` unpacks on access.
fn packed_blocks<'py>(py: Python<'py>, blocks: &[u32]) -> Bound<'py, PyBytes> {
    let mut data = Vec::with_capacity(4 * blocks.len());
    for block in blocks {
        data.extend_from_slice(&block.to_le_bytes());
    }
    PyBytes::new(py, &data)
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// `str` (UTF-8), `bytes` or `None` as raw bytes.
fn bytes_from(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Vec<u8>> {
    match obj {
        None => Ok(Vec::new()),
        Some(o) if o.is_none() => Ok(Vec::new()),
        Some(o) => {
            if let Ok(s) = o.cast::<PyString>() {
                let text = s
                    .to_str()
                    .map_err(|_| invalid(format!("{what} is not valid UTF-8 text")))?;
                Ok(text.as_bytes().to_vec())
            } else if let Ok(b) = o.cast::<PyBytes>() {
                Ok(b.as_bytes().to_vec())
            } else {
                Err(invalid(format!(
                    "{what} must be str or bytes, not {}",
                    type_name(o)
                )))
            }
        }
    }
}

fn extras_from(
    adapter: Option<&Bound<'_, PyAny>>,
    multimodal: Option<&Bound<'_, PyAny>>,
) -> PyResult<RequestExtras> {
    let adapter = match adapter {
        Some(a) if !a.is_none() => Some(bytes_from(Some(a), "adapter")?),
        _ => None,
    };
    let mut items = Vec::new();
    if let Some(list) = multimodal.filter(|m| !m.is_none()) {
        let iter = list.try_iter().map_err(|_| {
            invalid(format!(
                "multimodal must be a sequence of (start, length, hash), not {}",
                type_name(list)
            ))
        })?;
        for (index, item) in iter.enumerate() {
            let item = item?;
            let (start, length, hash): (i64, i64, Bound<'_, PyAny>) =
                item.extract().map_err(|_| {
                    invalid(format!(
                        "multimodal item {index} must be (start, length, hash)"
                    ))
                })?;
            if start < 0 || length <= 0 {
                return Err(invalid(format!(
                    "multimodal item {index} has start {start} and length {length}; need start >= 0, length > 0"
                )));
            }
            let hash = bytes_from(Some(&hash), "multimodal item hash")?;
            items.push(MultimodalItem {
                start: start as u64,
                length: length as u64,
                hash,
            });
        }
    }
    Ok(RequestExtras {
        adapter,
        multimodal: items,
    })
}

/// The inputs every lookup-like call takes: token ids, salt and the per-block extra keys.
fn request_inputs<'py>(
    tokens: &Bound<'py, PyAny>,
    salt: Option<&Bound<'_, PyAny>>,
    adapter: Option<&Bound<'_, PyAny>>,
    multimodal: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Tokens<'py>, Vec<u8>, RequestExtras)> {
    Ok((
        tokens_from(tokens)?,
        bytes_from(salt, "salt")?,
        extras_from(adapter, multimodal)?,
    ))
}

fn key_from(bytes: &[u8]) -> PyResult<BlockKey> {
    let key: [u8; 32] = bytes.try_into().map_err(|_| {
        invalid(format!(
            "a context fingerprint is 32 bytes, got {}",
            bytes.len()
        ))
    })?;
    Ok(BlockKey(key))
}

/// Counters since creation and block states now.
#[pyclass(frozen, get_all, module = "prefixkv._core")]
pub struct CacheStats {
    lookups: u64,
    lookup_tokens: u64,
    hit_tokens: u64,
    probes: u64,
    evictions: u64,
    committed_blocks: u64,
    deduplicated_blocks: u64,
    collisions: u64,
    blocks_total: usize,
    blocks_free: usize,
    blocks_cached: usize,
    blocks_in_use: usize,
    blocks_pinned: usize,
    blocks_evictable: usize,
    requests_live: usize,
}

#[pymethods]
impl CacheStats {
    /// Fraction of looked-up tokens whose KV was reused.
    #[getter]
    fn hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "CacheStats(lookups={}, hit_rate={:.3}, hit_tokens={}, lookup_tokens={}, evictions={}, \
             blocks_free={}, blocks_cached={}, blocks_in_use={}, blocks_pinned={})",
            self.lookups,
            self.hit_rate(),
            self.hit_tokens,
            self.lookup_tokens,
            self.evictions,
            self.blocks_free,
            self.blocks_cached,
            self.blocks_in_use,
            self.blocks_pinned
        )
    }
}

impl From<CoreStats> for CacheStats {
    fn from(s: CoreStats) -> Self {
        Self {
            lookups: s.lookups,
            lookup_tokens: s.lookup_tokens,
            hit_tokens: s.hit_tokens,
            probes: s.probes,
            evictions: s.evictions,
            committed_blocks: s.committed_blocks,
            deduplicated_blocks: s.deduplicated_blocks,
            collisions: s.collisions,
            blocks_total: s.blocks_total,
            blocks_free: s.blocks_free,
            blocks_cached: s.blocks_cached,
            blocks_in_use: s.blocks_in_use,
            blocks_pinned: s.blocks_pinned,
            blocks_evictable: s.blocks_evictable,
            requests_live: s.requests_live,
        }
    }
}

/// The Rust block manager. Use `prefixkv.PrefixCache`, which wraps this with typed results.
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreCache(PrefixCache);

type PrefixMatchTuple<'py> = (Bound<'py, PyBytes>, usize, bool);

#[pymethods]
impl CoreCache {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, context_fingerprint, vocab_size=None, key_bits=128))]
    fn new(
        num_blocks: i64,
        block_size: i64,
        context_fingerprint: &[u8],
        vocab_size: Option<i64>,
        key_bits: i64,
    ) -> PyResult<Self> {
        let num_blocks = u32::try_from(num_blocks).map_err(|_| {
            invalid(format!(
                "num_blocks must be in 1 ..= 4294967295, got {num_blocks}"
            ))
        })?;
        let block_size = u32::try_from(block_size).map_err(|_| {
            invalid(format!(
                "block_size must be a positive int, got {block_size}"
            ))
        })?;
        let vocab_size = vocab_size
            .map(|v| {
                u32::try_from(v)
                    .map_err(|_| invalid(format!("vocab_size must be positive, got {v}")))
            })
            .transpose()?;
        let key_bits = u32::try_from(key_bits)
            .map_err(|_| invalid(format!("key_bits {key_bits} out of range")))?;
        let config = CacheConfig {
            num_blocks,
            block_size: block_size as usize,
            vocab_size,
            key_bits,
        };
        PrefixCache::new(config, key_from(context_fingerprint)?)
            .map(Self)
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

    #[pyo3(signature = (tokens, salt=None, adapter=None, multimodal=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
        adapter: Option<&Bound<'py, PyAny>>,
        multimodal: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<PrefixMatchTuple<'py>> {
        let (tokens, salt, extras) = request_inputs(tokens, salt, adapter, multimodal)?;
        let view = tokens.view();
        let m = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.lookup(&t, &salt, &extras))
            })
            .map_err(to_py_err)?;
        Ok((
            packed_blocks(py, &m.blocks),
            m.num_cached_tokens,
            m.full_hit,
        ))
    }

    #[pyo3(signature = (tokens, salt=None, adapter=None, multimodal=None, priority=None))]
    fn begin(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        adapter: Option<&Bound<'_, PyAny>>,
        multimodal: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(u64, Vec<u32>, usize, bool, usize)> {
        let (tokens, salt, extras) = request_inputs(tokens, salt, adapter, multimodal)?;
        let view = tokens.view();
        let num_tokens = tokens.len();
        let priority = priority.map(priority_arg).transpose()?.unwrap_or(0);
        let r = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.begin(t, &salt, extras, priority))
            })
            .map_err(to_py_err)?;
        Ok((
            r.request_id,
            r.block_table,
            r.num_cached_tokens,
            r.full_hit,
            num_tokens,
        ))
    }

    fn append(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let request_id = self::request_id(request_id)?;
        let tokens = tokens_from(tokens)?;
        let view = tokens.view();
        py.detach(|| view.into_vec().and_then(|t| self.0.append(request_id, &t)))
            .map_err(to_py_err)
    }

    fn commit(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let request_id = self::request_id(request_id)?;
        let num_computed_tokens = int_arg(num_computed_tokens, "num_computed_tokens")?;
        let num = usize::try_from(num_computed_tokens).map_err(|_| {
            invalid(format!(
                "num_computed_tokens must be >= 0, got {num_computed_tokens}"
            ))
        })?;
        py.detach(|| self.0.commit(request_id, num))
            .map_err(to_py_err)
    }

    fn finish(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let request_id = self::request_id(request_id)?;
        py.detach(|| self.0.finish(request_id)).map_err(to_py_err)
    }

    fn block_table(&self, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let request_id = self::request_id(request_id)?;
        self.0.block_table(request_id).map_err(to_py_err)
    }

    fn num_tokens(&self, request_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let request_id = self::request_id(request_id)?;
        self.0.num_tokens(request_id).map_err(to_py_err)
    }

    #[pyo3(signature = (tokens, salt=None, adapter=None, multimodal=None, priority=None))]
    fn match_and_acquire<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
        adapter: Option<&Bound<'py, PyAny>>,
        multimodal: Option<&Bound<'py, PyAny>>,
        priority: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<PrefixMatchTuple<'py>> {
        let (tokens, salt, extras) = request_inputs(tokens, salt, adapter, multimodal)?;
        let view = tokens.view();
        let priority = priority.map(priority_arg).transpose()?.unwrap_or(0);
        let m = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.match_and_acquire(&t, &salt, &extras, priority))
            })
            .map_err(to_py_err)?;
        Ok((
            packed_blocks(py, &m.blocks),
            m.num_cached_tokens,
            m.full_hit,
        ))
    }

    fn allocate(&self, py: Python<'_>, count: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let count = int_arg(count, "count")?;
        let count = usize::try_from(count)
            .map_err(|_| invalid(format!("count must be >= 0, got {count}")))?;
        py.detach(|| self.0.allocate(count)).map_err(to_py_err)
    }

    #[pyo3(signature = (tokens, blocks, salt=None, adapter=None, multimodal=None, priority=None))]
    #[allow(clippy::too_many_arguments)]
    fn commit_blocks(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        adapter: Option<&Bound<'_, PyAny>>,
        multimodal: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let tokens = tokens_from(tokens)?;
        let view = tokens.view();
        let blocks = block_args(blocks)?;
        let salt = bytes_from(salt, "salt")?;
        let extras = extras_from(adapter, multimodal)?;
        let priority = priority.map(priority_arg).transpose()?.unwrap_or(0);
        py.detach(|| {
            view.into_vec()
                .and_then(|t| self.0.commit_blocks(&t, &blocks, &salt, &extras, priority))
        })
        .map_err(to_py_err)
    }

    fn release(&self, py: Python<'_>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let blocks = block_args(blocks)?;
        py.detach(|| self.0.release(&blocks)).map_err(to_py_err)
    }

    #[pyo3(signature = (tokens, salt=None, adapter=None, multimodal=None))]
    fn pin(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        adapter: Option<&Bound<'_, PyAny>>,
        multimodal: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(u64, usize)> {
        let (tokens, salt, extras) = request_inputs(tokens, salt, adapter, multimodal)?;
        let view = tokens.view();
        py.detach(|| view.into_vec().and_then(|t| self.0.pin(&t, &salt, &extras)))
            .map_err(to_py_err)
    }

    fn unpin(&self, pin_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let pin_id = u64::try_from(int_arg(pin_id, "pin id")?)
            .map_err(|_| invalid(format!("unknown pin id {pin_id}")))?;
        self.0.unpin(pin_id).map_err(to_py_err)
    }

    fn clear(&self, py: Python<'_>) {
        py.detach(|| self.0.clear());
    }

    fn set_context(&self, py: Python<'_>, context_fingerprint: &[u8]) -> PyResult<()> {
        let key = key_from(context_fingerprint)?;
        py.detach(|| self.0.set_context(key));
        Ok(())
    }

    #[pyo3(signature = (tokens, salt=None, adapter=None, multimodal=None))]
    fn block_keys<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
        adapter: Option<&Bound<'py, PyAny>>,
        multimodal: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let (tokens, salt, extras) = request_inputs(tokens, salt, adapter, multimodal)?;
        let view = tokens.view();
        let keys = py
            .detach(|| {
                view.into_vec()
                    .and_then(|t| self.0.block_keys(&t, &salt, &extras))
            })
            .map_err(to_py_err)?;
        Ok(keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
    }

    /// Hashes every full block with the table hash and does nothing else (benchmark floor).
    #[pyo3(signature = (tokens, salt=None))]
    fn hash_prompt(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let tokens = tokens_from(tokens)?;
        let view = tokens.view();
        let salt = bytes_from(salt, "salt")?;
        py.detach(|| {
            view.into_vec()
                .map(|t| self.0.hash_prompt(&t, &salt, &RequestExtras::default()))
        })
        .map_err(to_py_err)
    }

    fn stats(&self) -> CacheStats {
        self.0.stats().into()
    }

    fn ref_count(&self, block: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.0.ref_count(block_arg(block)?).map_err(to_py_err)
    }

    fn is_cached(&self, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.0.is_cached(block_arg(block)?).map_err(to_py_err)
    }

    /// Raises AssertionError-like RuntimeError if an internal invariant is broken (tests).
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

/// An int argument as i128 (wide enough for any u64 or i64), or `InvalidInputError`.
fn int_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i128> {
    if obj.cast::<pyo3::types::PyInt>().is_err() {
        return Err(invalid(format!(
            "{what} must be an int, not {}",
            type_name(obj)
        )));
    }
    obj.extract::<i128>()
        .map_err(|_| invalid(format!("{what} {obj} is out of range")))
}

/// A request id: any int; one that cannot be an id is simply not a live request.
fn request_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let value = int_arg(obj, "request id")?;
    u64::try_from(value).map_err(|_| {
        UnknownRequestError::new_err(format!(
            "unknown request id {value} (never begun, or already finished)"
        ))
    })
}

fn priority_arg(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    let value = int_arg(obj, "priority")?;
    i32::try_from(value).map_err(|_| {
        invalid(format!(
            "priority {value} is outside -2147483648 ..= 2147483647"
        ))
    })
}

fn block_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let value = int_arg(obj, "block id")?;
    u32::try_from(value).map_err(|_| {
        InvalidBlockError::new_err(format!("invalid block id {value}: outside the pool"))
    })
}

fn block_args(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    obj.try_iter()
        .map_err(|_| {
            invalid(format!(
                "block ids must be a sequence of ints, not {}",
                type_name(obj)
            ))
        })?
        .map(|item| block_arg(&item?))
        .collect()
}

/// SHA-256 fingerprint of a canonical context serialization (see `prefixkv.CacheContext`).
#[pyfunction]
fn context_fingerprint<'py>(py: Python<'py>, canonical: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &prefixkv_core::context_fingerprint(canonical).0)
}

#[pymodule(gil_used = false)]
fn _core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<CoreCache>()?;
    module.add_class::<CacheStats>()?;
    module.add_function(wrap_pyfunction!(context_fingerprint, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
