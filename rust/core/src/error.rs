//! The core's one error type. Every fallible call checks its whole input before changing
//! anything, so an `Err` always means "the cache is exactly as it was".

use thiserror::Error;

use crate::request::RequestId;

/// Everything a cache call can refuse.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CacheError {
    /// An argument is malformed: a token id out of range, an empty prompt, a bad size.
    #[error("invalid input: {0}")]
    InvalidInput(String),

    /// The request id is not live: never added, or already finished.
    #[error("unknown request id {0} (never added, or already finished)")]
    UnknownRequest(RequestId),

    /// `add_request` or `begin` with an id that is already live.
    #[error("request id {0} is already live (finish it before reusing its id)")]
    DuplicateRequest(RequestId),

    /// The pin id is not live: never taken, already unpinned, or dropped by `clear()` or
    /// `set_context()`, which release every pin (`reason` says which). The same kind of error as
    /// `UnknownRequest`, an id that is not live, and mapped to the same Python class.
    #[error("unknown pin id {pin_id}: {reason}")]
    UnknownPin {
        /// The offending id.
        pin_id: u64,
        /// Why it is not live.
        reason: &'static str,
    },

    /// A block id outside the pool, or one the caller does not hold.
    #[error("invalid block id {block}: {reason}")]
    InvalidBlock {
        /// The offending id.
        block: u32,
        /// Why it was refused.
        reason: &'static str,
    },

    /// The block exists but is in the wrong state: released twice, or not full when committed.
    #[error("block {block} is in the wrong state: {reason}")]
    BlockState {
        /// The offending id.
        block: u32,
        /// What was wrong.
        reason: &'static str,
    },

    /// Not enough free or evictable blocks; nothing was allocated or evicted.
    #[error("out of KV blocks: needed {needed}, only {available} free or evictable")]
    OutOfBlocks {
        /// Blocks the call needed.
        needed: usize,
        /// Blocks that could have been made free.
        available: usize,
    },

    /// One KV group of a [`KvGroups`](crate::groups::KvGroups) refused a call that every group
    /// must accept (an allocation its pool cannot supply, a truncation it cannot make):
    /// `error` is that group's refusal. Nothing changed in any group. Maps to the Python class
    /// of `error`.
    #[error("KV group {group}: {error}")]
    InKvGroup {
        /// The group's index in the `KvGroups`.
        group: usize,
        /// What the group's cache answered.
        error: Box<CacheError>,
    },
}

/// Result alias for core calls.
pub type Result<T> = std::result::Result<T, CacheError>;
