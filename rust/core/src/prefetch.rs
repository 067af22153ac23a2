//! A cache-line prefetch hint: one of the core's two uses of `unsafe` (with `hugepages.rs`).
//!
//! The tables and the pool's metadata are tens of MiB on production traffic, and the lines a
//! request touches are mostly cold. Starting their reads a few blocks ahead lets the misses
//! overlap. A plain load whose value is thrown away does start the read, but it must complete
//! before the instruction retires: a burst of missing loads fills the reorder buffer and the
//! core stalls on the oldest of them (`benches/PROFILE.md`, round 11). A prefetch instruction
//! retires at once and only asks the memory system for the line.

/// Asks the CPU to bring the cache line holding `item` into its caches, without waiting for it.
/// A hint only: it changes no value and can never fault. On targets without a stable prefetch
/// instruction it does nothing.
#[inline(always)]
pub fn prefetch<T>(item: &T) {
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    // Safety: `_mm_prefetch` is `unsafe` only for its `#[target_feature(enable = "sse")]`, and
    // SSE is part of every x86-64 target. The instruction reads nothing into the program and
    // cannot fault on any address (here a live reference's).
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            std::ptr::from_ref(item).cast::<i8>(),
        );
    }
    #[cfg(not(all(target_arch = "x86_64", not(loom), not(miri))))]
    let _ = item;
}
