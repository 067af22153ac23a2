//! Python values in: token ids, the per-request key extras, integers and block ids.
//!
//! Every conversion refuses what a buggy engine could pass by mistake, with an
//! `InvalidInputError` that names the argument: integers follow `operator.index` (ints and
//! numpy ints; never `bool`, `float`, `str` or `None`), so `finish(1.9)` cannot retire request 1.

use prefixkv_core::{CacheError, MultimodalItem, RequestExtras, RequestId};
use pyo3::exceptions::PyOverflowError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};
use pyo3::Borrowed;

use crate::errors::{invalid, InvalidBlockError};
use crate::narrow;

pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// An integer with `operator.index` semantics, refusing `bool`; `what` names it in errors.
pub fn index(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i128> {
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{what} must be an int, not bool")));
    }
    obj.extract::<i128>().map_err(|err| {
        if err.is_instance_of::<PyOverflowError>(obj.py()) {
            invalid(format!("{what} {obj} is out of range"))
        } else {
            invalid(format!("{what} must be an int, not {}", type_name(obj)))
        }
    })
}

/// An integer in `T`'s range (further narrowed by `check`), or an error naming `what` and the
/// accepted `range`.
pub fn int_in<T: TryFrom<i128>>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    range: &str,
    check: impl Fn(i128) -> bool,
) -> PyResult<T> {
    let value = index(obj, what)?;
    match T::try_from(value) {
        Ok(v) if check(value) => Ok(v),
        _ => Err(invalid(format!("{what} must be in {range}, got {value}"))),
    }
}

/// A retention priority (`None`: 0).
pub fn priority(obj: Option<&Bound<'_, PyAny>>) -> PyResult<i32> {
    obj.map_or(Ok(0), |p| {
        int_in(p, "priority", "-2147483648 ..= 2147483647", |_| true)
    })
}

/// A count of tokens or blocks; `what` names it in errors.
pub fn count(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    int_in(obj, what, "0 ..= 2**64-1", |_| true)
}

/// The counts every `allocate_slots`-shaped call takes: new tokens, lookahead slots and
/// watermark blocks.
pub fn slot_counts(
    num_new_tokens: &Bound<'_, PyAny>,
    num_lookahead_tokens: &Bound<'_, PyAny>,
    watermark: &Bound<'_, PyAny>,
) -> PyResult<(usize, usize, usize)> {
    Ok((
        count(num_new_tokens, "num_new_tokens")?,
        count(num_lookahead_tokens, "num_lookahead_tokens")?,
        count(watermark, "watermark_blocks")?,
    ))
}

/// Token ids as received: packed little-endian u32 `bytes`; `(array, width, signed)`, an integer
/// array (numpy's) of `width`-byte little-endian ids read in place, or `(bytes, width, signed)`,
/// such ids' raw bytes, checked here; or ints converted one by one from a list or tuple.
pub enum Tokens<'py> {
    Packed(Bound<'py, PyBytes>),
    Wide {
        data: Bound<'py, PyBytes>,
        width: usize,
        signed: bool,
    },
    /// An integer array read in place (`Exported`).
    Array {
        data: Exported,
        width: usize,
        signed: bool,
    },
    Owned(Vec<u32>),
}

/// A view of `Tokens` that can cross into `detach`: unpacking and checking then run with the
/// GIL released. Ids already converted (from a list or tuple) are moved into it, not copied.
pub enum TokenView<'a> {
    Packed(&'a [u8]),
    Wide {
        data: &'a [u8],
        width: usize,
        signed: bool,
    },
    Owned(Vec<u32>),
}

impl<'py> FromPyObject<'_, 'py> for Tokens<'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        if let Ok(bytes) = obj.cast::<PyBytes>() {
            let len = bytes.as_bytes().len();
            if len % 4 != 0 {
                return Err(invalid(format!(
                    "token buffer of {len} bytes is not a whole number of u32"
                )));
            }
            return Ok(Tokens::Packed(bytes.clone()));
        }
        if let Ok(tuple) = obj.cast::<PyTuple>() {
            // `(data, width, signed)`: told from a tuple of ids by its last item, a bool (which
            // no tuple of ids may hold), and its first, not an int.
            if tuple.len() == 3 {
                let (data, signed) = (tuple.get_item(0)?, tuple.get_item(2)?);
                if signed.is_instance_of::<PyBool>() && !data.is_instance_of::<PyInt>() {
                    return wide(data, &tuple.get_item(1)?, &signed);
                }
            }
            return sequence_tokens(tuple, tuple.len(), ffi::PyTuple_GetItem, tuple.iter())
                .map(Tokens::Owned);
        }
        if let Ok(list) = obj.cast::<PyList>() {
            return sequence_tokens(list, list.len(), ffi::PyList_GetItem, list.iter())
                .map(Tokens::Owned);
        }
        Err(invalid(format!(
            "token ids must be a list, tuple, numpy array or CPU tensor of ints, not {}",
            type_name(&obj)
        )))
    }
}

/// `(data, width, signed)`: `data` is `bytes`, or a one-dimensional integer array (numpy's, as
/// the Python layer hands it over) of `width`-byte little-endian ids, `signed` or not.
fn wide<'py>(
    data: Bound<'py, PyAny>,
    width: &Bound<'py, PyAny>,
    signed: &Bound<'py, PyAny>,
) -> PyResult<Tokens<'py>> {
    let header = || {
        invalid(
            "a packed token array is (bytes or a one-dimensional integer array, width, signed)"
                .into(),
        )
    };
    let width: usize = width.extract().map_err(|_| header())?;
    let signed: bool = signed.extract().map_err(|_| header())?;
    if !matches!(width, 1 | 2 | 4 | 8) {
        return Err(invalid(format!(
            "a packed token array needs a width of 1, 2, 4 or 8 bytes, got {width}"
        )));
    }
    let data = match data.cast_into::<PyBytes>() {
        Ok(bytes) => bytes,
        Err(error) => {
            let array = Exported::new(&error.into_inner(), width)?.ok_or_else(header)?;
            return Ok(Tokens::Array {
                data: array,
                width,
                signed,
            });
        }
    };
    let len = data.as_bytes().len();
    if len % width != 0 {
        return Err(invalid(format!(
            "a packed token array of {len} bytes is not a whole number of {width}-byte ids"
        )));
    }
    Ok(Tokens::Wide {
        data,
        width,
        signed,
    })
}

/// A one-dimensional array of `width`-byte integers, exported through the buffer protocol
/// (`PyObject_GetBuffer`, in the stable ABI since CPython 3.11) and read in place: its ids are
/// narrowed to `u32` with the GIL released, and no copy is made while the GIL is held (`tobytes`
/// held it for ~0.3 µs per 1k int64 ids, ~2 µs per 12k). The export keeps the memory allocated
/// and in place until it is released, with the GIL, when this drops.
///
/// The export asks for shape and strides but no format string (numpy builds one at each export
/// that asks): the ids' width must be the array's item size, and their sign is the one
/// announced beside it, as for `bytes`. A strided array (a view such as `a[::2]`) is gathered
/// into one run here, with the GIL held: the rare case.
///
/// As with `hashlib` reading a buffer with the GIL released, the array must not be *written*
/// while a call that takes it runs (`as_token_ids` says so): the ids are read once, into the
/// core's own copy, so such a write could only change which ids the request has.
pub struct Exported {
    /// Boxed: an exporter may point into its own `Py_buffer`, so it must not move.
    view: Box<ffi::Py_buffer>,
    /// The ids of a strided array, gathered into one run.
    gathered: Option<Vec<u8>>,
}

#[allow(unsafe_code)] // the binding's second `unsafe`: exporting a buffer and reading it in place
impl Exported {
    /// `array`'s memory; `None` (no error left pending) when it exports none. Refused: an
    /// export of another shape or item size, and a strided one too large to gather.
    fn new(array: &Bound<'_, PyAny>, width: usize) -> PyResult<Option<Self>> {
        let mut view = Box::new(std::mem::MaybeUninit::<ffi::Py_buffer>::zeroed());
        // Safety: `view` is writable memory of a `Py_buffer`'s size, which `PyObject_GetBuffer`
        // fills on success (returning 0); on failure it sets an error, taken here.
        if unsafe { ffi::PyObject_GetBuffer(array.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_STRIDES) }
            != 0
        {
            drop(PyErr::take(array.py()));
            return Ok(None);
        }
        // Safety: filled by the successful call above (`MaybeUninit<T>` has `T`'s layout); from
        // here on `Drop` releases the export, whatever `new` returns.
        let view = unsafe { Box::from_raw(Box::into_raw(view).cast::<ffi::Py_buffer>()) };
        let mut exported = Self {
            view,
            gathered: None,
        };
        let view = &exported.view;
        if view.ndim != 1 || view.shape.is_null() || view.strides.is_null() {
            return Err(invalid(format!(
                "a packed token array must be one-dimensional, got {} dimensions",
                view.ndim
            )));
        }
        if usize::try_from(view.itemsize).ok() != Some(width) {
            return Err(invalid(format!(
                "a packed token array announced {width}-byte ids, its items are {} bytes",
                view.itemsize
            )));
        }
        // Safety: a `PyBUF_STRIDES` export of one dimension has a `shape` and a `strides` of
        // one element each (checked non-null above).
        let (count, stride) = unsafe { (*view.shape, *view.strides) };
        let count = usize::try_from(count).unwrap_or(0);
        if stride != view.itemsize && count > 1 {
            // A zero stride (a broadcast view) can announce any count: reserve fallibly.
            let mut gathered = Vec::new();
            if count
                .checked_mul(width)
                .is_none_or(|bytes| gathered.try_reserve_exact(bytes).is_err())
            {
                return Err(invalid(format!(
                    "a strided token array of {count} ids is too large to copy"
                )));
            }
            for index in 0..count {
                // Safety: item `index < count` of the export starts `index * stride` bytes from
                // `buf` (negative strides included) and is `width` bytes long.
                let item = unsafe {
                    std::slice::from_raw_parts(
                        view.buf.cast::<u8>().offset(index as isize * stride),
                        width,
                    )
                };
                gathered.extend_from_slice(item);
            }
            exported.gathered = Some(gathered);
        }
        Ok(Some(exported))
    }

    /// Bytes of the ids (`width` each).
    fn len(&self) -> usize {
        match &self.gathered {
            Some(gathered) => gathered.len(),
            // `new` checked one dimension of `itemsize`-byte items, contiguous.
            None => usize::try_from(self.view.len).unwrap_or(0),
        }
    }

    fn bytes(&self) -> &[u8] {
        if let Some(gathered) = &self.gathered {
            return gathered;
        }
        if self.view.buf.is_null() || self.len() == 0 {
            return &[];
        }
        // Safety: a contiguous one-dimensional export is `len` initialized bytes at `buf`,
        // allocated and in place until the export is released in `drop`, after `self`'s last
        // use. Writes to it during the call are the caller's error (see the type's docs).
        unsafe { std::slice::from_raw_parts(self.view.buf.cast::<u8>(), self.len()) }
    }
}

#[allow(unsafe_code)]
impl Drop for Exported {
    fn drop(&mut self) {
        // Safety: `view` holds a successful export, released exactly once, with the GIL.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.view) });
    }
}

/// A list or tuple of ints in one pass straight into the `Vec<u32>` the core takes: each item
/// must be exactly an `int` (a type-pointer compare, so `bool` and subclasses take the slow
/// path) and is read with one C-API call, no intermediate buffer and no reference count
/// traffic. PyO3's per-item `extract` costs ~12 ns a token, `array('I')` ~7; this ~3. Anything
/// else (a negative id, one above 2³² − 1, a bool, a numpy int, a non-int) falls back to
/// `one_by_one`, whose error names the value and its position.
///
/// Only in the abi3 build, which CPython loads only with a GIL: a free-threaded build (no abi3,
/// `docs/release.md`) has no lock keeping another thread from changing the list between the
/// reads, and takes the safe path below.
#[cfg(feature = "abi3")]
#[allow(unsafe_code)] // one of the binding's three `unsafe` sites (with `Exported` and `narrow.rs`): the workspace denies it, the core allows only its two hints
fn sequence_tokens<'py>(
    sequence: &Bound<'py, PyAny>,
    len: usize,
    item_at: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(len);
    for index in 0..len {
        // Safety: the GIL is held (`sequence` is bound) and nothing below runs Python code (an
        // exact int is read without `__index__`), so no thread can change the sequence while
        // it is read; `index < len` is in range, and `item_at` (`PyList_GetItem` or
        // `PyTuple_GetItem`) returns a borrowed reference that `sequence` keeps alive, which is
        // only read here. `PyLong_AsLongAndOverflow` on an exact int never raises: a value out
        // of `long`'s range sets `overflow` instead.
        let token = unsafe {
            let item = item_at(sequence.as_ptr(), index as ffi::Py_ssize_t);
            if item.is_null() || ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
                None
            } else {
                let mut overflow = 0;
                let value = ffi::PyLong_AsLongAndOverflow(item, &mut overflow);
                (overflow == 0).then(|| u32::try_from(value).ok()).flatten()
            }
        };
        match token {
            Some(token) => out.push(token),
            None => {
                // A null item set an IndexError (the sequence shrank: impossible with the GIL
                // held, but never leave an error pending); the slow path re-reads everything.
                drop(PyErr::take(sequence.py()));
                return one_by_one(items);
            }
        }
    }
    Ok(out)
}

/// The free-threaded build's `sequence_tokens`: each item held by a strong reference, read
/// through PyO3 (~12 ns a token).
#[cfg(not(feature = "abi3"))]
fn sequence_tokens<'py>(
    _sequence: &Bound<'py, PyAny>,
    _len: usize,
    _item_at: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Vec<u32>> {
    let items: Vec<Bound<'py, PyAny>> = items.collect();
    let exact: Option<Vec<u32>> = items
        .iter()
        .map(|item| {
            item.is_exact_instance_of::<pyo3::types::PyInt>()
                .then(|| item.extract::<u32>().ok())
                .flatten()
        })
        .collect();
    exact.map_or_else(|| one_by_one(items.into_iter()), Ok)
}

fn one_by_one<'py>(items: impl Iterator<Item = Bound<'py, PyAny>>) -> PyResult<Vec<u32>> {
    items
        .enumerate()
        .map(|(position, item)| {
            let out_of_range = |value: &dyn std::fmt::Display| {
                invalid(format!(
                    "token id {value} at position {position} is out of range (0 ..= 4294967295)"
                ))
            };
            let value = index(&item, &format!("token at position {position}")).map_err(|err| {
                // An int beyond i128 is out of range like any other, and said in the same
                // words (hypothesis drew -2**127 - 1).
                if item.is_instance_of::<PyInt>() && !item.is_instance_of::<PyBool>() {
                    out_of_range(&item)
                } else {
                    err
                }
            })?;
            u32::try_from(value).map_err(|_| out_of_range(&value))
        })
        .collect()
}

impl Tokens<'_> {
    /// The view to unpack with the GIL released. Converted ids move into it (a 12k-token
    /// list's copy is ~2 µs, 1-2% of a request), so take it once and read `len` before.
    pub fn view(&mut self) -> TokenView<'_> {
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
            Tokens::Array {
                data,
                width,
                signed,
            } => TokenView::Wide {
                data: data.bytes(),
                width: *width,
                signed: *signed,
            },
            Tokens::Owned(tokens) => TokenView::Owned(std::mem::take(tokens)),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Tokens::Packed(data) => data.as_bytes().len() / 4,
            Tokens::Wide { data, width, .. } => data.as_bytes().len() / width,
            Tokens::Array { data, width, .. } => data.len() / width,
            Tokens::Owned(tokens) => tokens.len(),
        }
    }
}

impl TokenView<'_> {
    /// The token ids, or the first one that is not a valid id.
    pub fn into_vec(self) -> Result<Vec<u32>, CacheError> {
        match self {
            TokenView::Packed(data) => widen(data, 4, false),
            TokenView::Wide {
                data,
                width,
                signed,
            } => widen(data, width, signed),
            TokenView::Owned(tokens) => Ok(tokens),
        }
    }

    /// The token ids, narrowed and appended to `out` (`None`), or when already converted (a
    /// list's) handed back as they are (`Some`), not copied; or the first id that is not valid
    /// (then `out` may hold part of them past its old length).
    pub fn read_into(self, out: &mut Vec<u32>) -> Result<Option<Vec<u32>>, CacheError> {
        match self {
            TokenView::Packed(data) => widen_into(data, 4, false, out).map(|()| None),
            TokenView::Wide {
                data,
                width,
                signed,
            } => widen_into(data, width, signed, out).map(|()| None),
            TokenView::Owned(tokens) => Ok(Some(tokens)),
        }
    }
}

/// Little-endian integers of `width` bytes as token ids. One branch-free pass per width that
/// the compiler vectorises (even for plain x86-64, SSE2): each value's bits outside
/// `0 ..= u32::MAX` are OR-ed together, and only if any is set does a second pass find the
/// first such value to name it.
fn widen(data: &[u8], width: usize, signed: bool) -> Result<Vec<u32>, CacheError> {
    let mut out = Vec::new();
    widen_into(data, width, signed, &mut out)?;
    Ok(out)
}

/// `widen`, appending to `out` (a batch's buffer, reused across calls: `probes.rs`). On a
/// refusal `out` may hold part of the ids past its old length.
fn widen_into(
    data: &[u8],
    width: usize,
    signed: bool,
    out: &mut Vec<u32>,
) -> Result<(), CacheError> {
    let narrowed = narrow::narrow(
        narrow::Units::best(),
        data,
        width,
        signed,
        std::mem::take(out),
    );
    let (widened, valid) = narrowed.map_err(too_large)?;
    *out = widened;
    if valid {
        return Ok(());
    }
    for (position, bytes) in data.chunks_exact(width).enumerate() {
        wide_token(position, bytes, signed)?;
    }
    Err(CacheError::InvalidInput(
        "a token id is out of range".into(),
    ))
}

/// The refusal of ids that do not fit in memory once converted.
fn too_large(count: usize) -> CacheError {
    CacheError::InvalidInput(format!(
        "{count} token ids are too large to convert (a prompt, or a batch's prompts together)"
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

/// Everything besides the token ids that goes into a request's block keys: the tenant salt,
/// the adapter, the multimodal items. Parsed and checked once, frozen, then passed by reference
/// to every call that hashes the same request (lookup, begin, pin, block_keys...).
#[pyclass(frozen, module = "prefixkv._core")]
pub struct KeyExtras {
    pub salt: Vec<u8>,
    pub extras: RequestExtras,
}

#[pymethods]
impl KeyExtras {
    #[new]
    #[pyo3(signature = (salt=None, adapter=None, multimodal=None))]
    fn new(
        salt: Option<&Bound<'_, PyAny>>,
        adapter: Option<&Bound<'_, PyAny>>,
        multimodal: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let salt = text_or_bytes(salt, "salt")?.unwrap_or_default();
        let adapter = text_or_bytes(adapter, "adapter")?;
        let multimodal = match multimodal.filter(|m| !m.is_none()) {
            Some(items) => multimodal_items(items)?,
            None => Vec::new(),
        };
        Ok(Self {
            salt,
            extras: RequestExtras {
                adapter,
                multimodal,
            },
        })
    }

    #[getter]
    fn salt<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.salt)
    }

    #[getter]
    fn adapter<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.extras.adapter.as_ref().map(|a| PyBytes::new(py, a))
    }

    #[getter]
    fn num_multimodal_items(&self) -> usize {
        self.extras.multimodal.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "KeyExtras(salt={} bytes, adapter={}, multimodal={} items)",
            self.salt.len(),
            if self.extras.adapter.is_some() {
                "set"
            } else {
                "None"
            },
            self.extras.multimodal.len()
        )
    }
}

/// `str` (UTF-8) or `bytes` as raw bytes; `None` as `None`.
fn text_or_bytes(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<Vec<u8>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    if let Ok(text) = obj.cast::<PyString>() {
        let text = text
            .to_str()
            .map_err(|_| invalid(format!("{what} is not valid UTF-8 text")))?;
        Ok(Some(text.as_bytes().to_vec()))
    } else if let Ok(bytes) = obj.cast::<PyBytes>() {
        Ok(Some(bytes.as_bytes().to_vec()))
    } else {
        Err(invalid(format!(
            "{what} must be str or bytes, not {}",
            type_name(obj)
        )))
    }
}

fn multimodal_items(items: &Bound<'_, PyAny>) -> PyResult<Vec<MultimodalItem>> {
    let not_a_sequence = || {
        invalid(format!(
            "multimodal must be a sequence of (start, length, hash), not {}",
            type_name(items)
        ))
    };
    if items.is_instance_of::<PyString>() || items.is_instance_of::<PyBytes>() {
        return Err(not_a_sequence());
    }
    let mut out = Vec::new();
    for (position, item) in items.try_iter().map_err(|_| not_a_sequence())?.enumerate() {
        let item = item?;
        let shape = || {
            invalid(format!(
                "multimodal item {position} must be (start, length, hash)"
            ))
        };
        let tuple = item.cast::<PyTuple>().map_err(|_| shape())?;
        if tuple.len() != 3 {
            return Err(shape());
        }
        let what = format!("multimodal item {position}");
        let start: u64 = int_in(
            &tuple.get_item(0)?,
            &format!("{what} start"),
            "0 ..= 2**64-1",
            |_| true,
        )?;
        let length: u64 = int_in(
            &tuple.get_item(1)?,
            &format!("{what} length"),
            "1 ..= 2**64-1",
            |v| v > 0,
        )?;
        let hash =
            text_or_bytes(Some(&tuple.get_item(2)?), &format!("{what} hash"))?.ok_or_else(shape)?;
        out.push(MultimodalItem {
            start,
            length,
            hash,
        });
    }
    Ok(out)
}

/// A block id (u32); one outside u32 is outside every pool.
pub fn block_id(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let value = index(obj, "block id")?;
    u32::try_from(value).map_err(|_| {
        InvalidBlockError::new_err(format!("invalid block id {value}: outside the pool"))
    })
}

/// Block ids from any iterable of ints.
pub struct BlockIds(pub Vec<u32>);

impl FromPyObject<'_, '_> for BlockIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        obj.try_iter()
            .map_err(|_| {
                invalid(format!(
                    "block ids must be a sequence of ints, not {}",
                    type_name(&obj)
                ))
            })?
            .map(|item| block_id(&item?))
            .collect::<PyResult<_>>()
            .map(BlockIds)
    }
}

/// A request: the `Request` that `begin` returned, or the engine's id for it, an int (with
/// `operator.index` semantics, so never a bool or float) or a str.
pub struct RequestRef(pub RequestId);

impl FromPyObject<'_, '_> for RequestRef {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        if let Ok(request) = obj.cast::<crate::results::Request>() {
            return Ok(RequestRef(request.get().id.clone()));
        }
        if let Ok(name) = obj.cast::<PyString>() {
            // A str with a lone surrogate has no UTF-8 form: no id can be made of it.
            let name = name.to_str().map_err(|_| {
                invalid("request id must be valid Unicode text (it has a lone surrogate)".into())
            })?;
            return Ok(RequestRef(RequestId::Str(name.into())));
        }
        let obj = obj.to_owned();
        let value = index(&obj, "request").map_err(|_| {
            invalid(format!(
                "request must be a Request or its id (an int or a str), not {}",
                type_name(&obj)
            ))
        })?;
        i64::try_from(value)
            .map(|id| RequestRef(RequestId::Int(id)))
            .map_err(|_| {
                invalid(format!(
                    "request id {value} is outside the 64-bit signed range"
                ))
            })
    }
}

/// A request id, as Python sees it.
pub fn request_id_to_py<'py>(py: Python<'py>, id: &RequestId) -> PyResult<Bound<'py, PyAny>> {
    Ok(match id {
        RequestId::Int(value) => value.into_pyobject(py)?.into_any(),
        RequestId::Str(name) => PyString::new(py, name).into_any(),
    })
}
