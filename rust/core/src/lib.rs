//! prefixkv-core: the block manager of a prefix cache for LLM inference, in pure Rust.
//!
//! KV blocks computed for a prompt prefix are kept and handed to later requests that start
//! with the same tokens under the same execution context. This crate decides *which* blocks a
//! request may reuse; it never touches KV tensors.
//!
//! - [`key`]: what identifies a block, and the exact bytes hashed.
//! - [`table`]: the lock-free lookup table and the verification that makes collisions harmless.
//! - [`pool`]: refcounts, pin counts, the free list and the eviction order.
//! - [`cache`]: [`PrefixCache`] built from the three: its shared state, who may change a
//!   refcount, lookups, the low-level API and reset.
//! - [`request`]: a request's life (`begin` to `finish`) and how blocks are published.
//! - [`run_table`]: runs of blocks readable without locks, the unit of the table that is to
//!   replace the per-block one (`benches/PROFILE.md`, issue 24); not yet used by the cache.
//! - [`run_cache`]: the writer's half on runs (holds, the eviction order by segments,
//!   duplicates), giving the cache's blocks in the cache's order; not yet used by the cache.
//! - [`sliding`]: sliding-window KV groups: releasing blocks that left the window, and hits
//!   that need only the window's blocks.
//! - [`groups`]: [`KvGroups`], the caches of a hybrid model's KV groups driven as one (one hit
//!   length, all-or-nothing allocation).
//! - [`pins`]: keeping a prefix from eviction.
//! - [`events`]: KV events (stored, removed, cleared) recorded for routers.
//! - [`index`]: a prefix index over many instances' events, for routers.
//! - [`hugepages`]: huge pages for the large per-block arrays (`PREFIXKV_HUGE_PAGES`).
//!
//! The Python binding (`rust/py`) is a thin layer over [`PrefixCache`] and [`KvGroups`].

// Safe Rust: the workspace denies `unsafe`; the core's two exceptions are hints that change no
// byte of memory: the prefetch (`prefetch.rs`) and the huge-page advice (`hugepages.rs`). The
// binding's is `rust/py/src/convert.rs`.
#![deny(unsafe_code)]

pub mod cache;
pub mod error;
pub mod events;
pub mod groups;
pub mod hugepages;
#[cfg(not(loom))]
pub mod index;
pub mod key;
pub mod pins;
pub mod pool;
pub mod prefetch;
pub mod request;
pub mod run_cache;
pub mod run_table;
pub mod sliding;
mod slot_index;
pub mod stats;
mod sync;
pub mod table;

pub use cache::{
    BeginResult, CacheConfig, FullHit, PrefixCache, PrefixMatch, RequestId, Slots, WindowRelease,
};
pub use error::{CacheError, Result};
pub use events::{
    encode_events, EventConfig, EventCounters, EventDrain, HashForm, KvEvent, TokenIds,
};
pub use groups::{GroupSlots, KvGroups};
pub use key::{block_key, context_fingerprint, root_key, BlockKey, MultimodalItem, RequestExtras};
pub use pool::BlockId;
pub use stats::CacheStats;
