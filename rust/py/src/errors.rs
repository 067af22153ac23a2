//! The one mapping of core errors onto Python exceptions.
//!
//! The classes are defined in Python (`prefixkv/errors.py`: each needs two bases, e.g.
//! `PrefixKVError` and `MemoryError`, which PyO3's `create_exception!` cannot give) and imported
//! here, so the binding raises the very classes the pure-Python modules raise.

use prefixkv_core::CacheError;
use pyo3::PyErr;

pyo3::import_exception!(prefixkv.errors, InvalidInputError);
pyo3::import_exception!(prefixkv.errors, UnknownRequestError);
pyo3::import_exception!(prefixkv.errors, DuplicateRequestError);
pyo3::import_exception!(prefixkv.errors, InvalidBlockError);
pyo3::import_exception!(prefixkv.errors, BlockStateError);
pyo3::import_exception!(prefixkv.errors, OutOfBlocksError);
pyo3::import_exception!(prefixkv.errors, UnsupportedFeatureError);

/// Each core error to its own class (each also a built-in: ValueError, KeyError, MemoryError),
/// exhaustively: a new core variant does not compile until it is mapped here.
pub fn to_py_err(err: CacheError) -> PyErr {
    let message = err.to_string();
    with_class_of(&err, message)
}

/// `message` raised as `err`'s class; a KV group's refusal as the class of what the group
/// refused (the message names the group).
fn with_class_of(err: &CacheError, message: String) -> PyErr {
    match err {
        CacheError::InvalidInput(_) => InvalidInputError::new_err(message),
        CacheError::UnknownRequest(_) | CacheError::UnknownPin { .. } => {
            UnknownRequestError::new_err(message)
        }
        CacheError::DuplicateRequest(_) => DuplicateRequestError::new_err(message),
        CacheError::InvalidBlock { .. } => InvalidBlockError::new_err(message),
        CacheError::BlockState { .. } => BlockStateError::new_err(message),
        CacheError::OutOfBlocks { .. } => OutOfBlocksError::new_err(message),
        CacheError::InKvGroup { error, .. } => with_class_of(error, message),
    }
}

/// An `InvalidInputError` with this message.
pub fn invalid(message: String) -> PyErr {
    InvalidInputError::new_err(message)
}

/// An `UnsupportedFeatureError` with this message: a call or setting this core does not serve.
pub fn unsupported(message: String) -> PyErr {
    UnsupportedFeatureError::new_err(message)
}
