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

use crate::key::BlockKey;

#[cfg(not(loom))]
pub(crate) use parking_lot::Mutex;

/// The context fingerprint, replaced by the writer, read by lock-free lookups.
#[cfg(not(loom))]
pub(crate) struct ContextCell(arc_swap::ArcSwap<BlockKey>);

#[cfg(not(loom))]
impl ContextCell {
    pub(crate) fn new(context: BlockKey) -> Self {
        Self(arc_swap::ArcSwap::from_pointee(context))
    }
    #[inline]
    pub(crate) fn load(&self) -> BlockKey {
        **self.0.load()
    }
    pub(crate) fn store(&self, context: BlockKey) {
        self.0.store(std::sync::Arc::new(context));
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
pub(crate) struct ContextCell(loom::sync::RwLock<BlockKey>);

#[cfg(loom)]
impl ContextCell {
    pub(crate) fn new(context: BlockKey) -> Self {
        Self(loom::sync::RwLock::new(context))
    }
    pub(crate) fn load(&self) -> BlockKey {
        *self.0.read().expect("no writer panics while storing")
    }
    pub(crate) fn store(&self, context: BlockKey) {
        *self.0.write().expect("no writer panics while storing") = context;
    }
}
