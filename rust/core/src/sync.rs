//! The cache's two synchronisation primitives, and their loom stand-ins.
//!
//! - [`Mutex`] serialises every call that changes state (`parking_lot`: small and fast, no
//!   poisoning to handle).
//! - [`ContextCell`] holds the context fingerprint: the writer swaps it, lock-free lookups read it
//!   (`arc-swap`).
//!
//! Under `--cfg loom` both become loom types with the same contract (mutual exclusion; a
//! linearizable load and store), so the loom model runs the cache's real code and loom schedules
//! around every one of these steps. The lookup table has its stand-in in `table/shared.rs`; what the
//! model covers and what it cannot is written at the top of `tests/loom_pool.rs`.

use crate::key::{root_key, BlockKey};

/// A context fingerprint with the root key of the requests that have no salt, computed once
/// when the context is set: a root key is a SHA-256, and nearly every request would hash the
/// same one again.
#[derive(Clone, Copy)]
pub(crate) struct Context {
    fingerprint: BlockKey,
    unsalted_root: BlockKey,
}

impl Context {
    pub(crate) fn new(fingerprint: BlockKey) -> Self {
        Self {
            fingerprint,
            unsalted_root: root_key(&fingerprint, b""),
        }
    }

    pub(crate) fn fingerprint(&self) -> BlockKey {
        self.fingerprint
    }

    /// The root key of a request with `salt` under this context.
    pub(crate) fn root(&self, salt: &[u8]) -> BlockKey {
        if salt.is_empty() {
            self.unsalted_root
        } else {
            root_key(&self.fingerprint, salt)
        }
    }
}

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

/// The context fingerprint, replaced by the writer, read by lock-free lookups.
#[cfg(not(loom))]
pub(crate) struct ContextCell(arc_swap::ArcSwap<Context>);

#[cfg(not(loom))]
impl ContextCell {
    pub(crate) fn new(context: BlockKey) -> Self {
        Self(arc_swap::ArcSwap::from_pointee(Context::new(context)))
    }
    #[inline]
    pub(crate) fn load(&self) -> BlockKey {
        self.0.load().fingerprint
    }
    /// The root key of a request with `salt` under the current context (one load: the
    /// fingerprint and the root are never of two contexts).
    #[inline]
    pub(crate) fn root(&self, salt: &[u8]) -> BlockKey {
        self.0.load().root(salt)
    }
    pub(crate) fn store(&self, context: BlockKey) {
        self.0.store(std::sync::Arc::new(Context::new(context)));
    }
}

/// loom's mutex behind `parking_lot`'s signature (`lock` cannot fail).
#[cfg(loom)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(loom::sync::Mutex::new(value))
    }
    pub(crate) fn lock(&self) -> loom::sync::MutexGuard<'_, T> {
        self.0
            .lock()
            .expect("a model thread panicked while holding the cache mutex")
    }
}

/// The context fingerprint, replaced by the writer, read by lock-free lookups.
#[cfg(loom)]
pub(crate) struct ContextCell(loom::sync::RwLock<Context>);

#[cfg(loom)]
impl ContextCell {
    pub(crate) fn new(context: BlockKey) -> Self {
        Self(loom::sync::RwLock::new(Context::new(context)))
    }
    pub(crate) fn load(&self) -> BlockKey {
        self.0
            .read()
            .expect("no writer panics while storing")
            .fingerprint
    }
    pub(crate) fn root(&self, salt: &[u8]) -> BlockKey {
        self.0
            .read()
            .expect("no writer panics while storing")
            .root(salt)
    }
    pub(crate) fn store(&self, context: BlockKey) {
        *self.0.write().expect("no writer panics while storing") = Context::new(context);
    }
}
