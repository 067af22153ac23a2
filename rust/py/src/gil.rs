//! When a call releases the GIL.
//!
//! Releasing the GIL lets another Python thread run while the core works: a router thread
//! probing (`lookup`, lock-free) while the scheduler thread allocates and commits (under the
//! core's mutex). It is not free: the release wakes a thread waiting for the GIL, and taking it
//! back waits until that thread lets go, which a thread running plain Python does only at its
//! switch interval (5 ms by default). A decode-step call of a few hundred nanoseconds that
//! released the GIL would pay that wait on every step (STYLE.md: stay attached for those).
//!
//! So every call is in one of three groups, by the work it can do:
//! - **always released**: work proportional to a whole prompt or a whole request (hashing and
//!   matching a prompt: `lookup`, `begin`, `block_keys`, `pin`...; releasing every block of a
//!   request: `finish`, `preempt`; `request_block_keys`' SHA-256; bulk pool calls). These run once
//!   per request or per probe, never per decode step. `lookup_many` releases it once for a whole
//!   batch of probes (`probes.rs`): a router thread then hands the GIL over once a batch.
//! - **released when large** ([`detach_if`] with [`many`]): the per-step calls whose cost
//!   follows the tokens they cover: `allocate_slots` and `can_allocate_slots` of a prefill chunk,
//!   or of a waiting request whose first allocation matches a long prompt, against one decode
//!   token; `commit` of a prefill chunk (publishing its blocks) against one decode token
//!   (usually publishing nothing); `append_tokens` and `append` of many tokens against one. The
//!   cut is [`MANY_BLOCKS`] blocks. Where the arguments alone do not tell (how far a request
//!   had computed, whether it waits), the binding asks the core first: one more uncontended
//!   lock, and a guess only (another thread may change the request in between) that decides
//!   where the work runs, never what it does.
//! - **never released**: constant-time observers and small adjustments (`start_position`,
//!   `num_computed_tokens`, `stats`, `ref_count`, `accept_drafts`, `truncate`...), and calls whose
//!   result must be built as Python objects block by block anyway (`block_table`).
//!
//! Released work only reads data the call owns, borrows from immutable Python objects it keeps
//! alive (`bytes` token buffers, frozen `KeyExtras`), or reads from an integer array it holds
//! exported (`convert::Exported`: the memory stays in place; writing to the array during the
//! call is the caller's error, as for `hashlib`); the core synchronises itself (a lock-free
//! table, one mutex around everything else: `prefixkv_core::cache`), so any call may run on any
//! thread at any time. The core never calls back into Python and a released call takes and
//! drops the core's mutex inside its release, so a thread holding that mutex never waits for
//! the GIL, and no lock order between the two can deadlock.
//!
//! `tests/test_threads_gil.py` checks, without timing, which calls let another thread run;
//! `benches/bench_threads.py` measures what it buys.

use pyo3::prelude::*;

/// Blocks of work from which a per-step call releases the GIL: at roughly 0.1–0.2 µs a block
/// (hash, table insert or allocation), 16 blocks are a few microseconds, well above the cost of
/// releasing and retaking an uncontended GIL (about 0.1 µs).
pub const MANY_BLOCKS: usize = 16;

/// Whether `tokens` tokens span at least [`MANY_BLOCKS`] blocks of `block_size` tokens.
pub fn many(tokens: usize, block_size: usize) -> bool {
    tokens >= MANY_BLOCKS.saturating_mul(block_size.max(1))
}

/// Runs `work` with the GIL released when `large`, attached otherwise.
pub fn detach_if<T: Send>(py: Python<'_>, large: bool, work: impl FnOnce() -> T + Send) -> T {
    if large {
        py.detach(work)
    } else {
        work()
    }
}
