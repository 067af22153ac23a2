//! Probing many prompts in one call (`lookup_many`): the GIL released once for the whole
//! batch, not once per prompt.
//!
//! A router thread that probes one prompt a call holds the GIL for the call's Python side
//! (the wrapper, the result object) and hands it back and forth with the scheduler thread at
//! every probe: each hand-off of a contended GIL wakes the other thread, and a probe of a few
//! microseconds is short beside that (`benches/bench_threads.py`). A batch pays the hand-off
//! once, so the router's work runs beside the scheduler's Python instead of between it.

use prefixkv_core::CacheError;
use pyo3::prelude::*;

use crate::convert::{TokenView, Tokens};
use crate::errors::{invalid, to_py_err, InvalidInputError};

/// Each prompt of a batch read as `Tokens` (a list's ids are converted here, an array's read in
/// place later); a refusal names the prompt's position in the batch.
fn read_prompts<'py>(prompts: &[Bound<'py, PyAny>]) -> PyResult<Vec<Tokens<'py>>> {
    prompts
        .iter()
        .enumerate()
        .map(|(index, prompt)| {
            prompt.extract::<Tokens<'py>>().map_err(|err| {
                if err.is_instance_of::<InvalidInputError>(prompt.py()) {
                    invalid(format!(
                        "prompt {index} of the batch: {}",
                        err.value(prompt.py())
                    ))
                } else {
                    err
                }
            })
        })
        .collect()
}

/// Tokens of a batch's buffer kept between calls, at most (larger batches free theirs).
const KEPT_BATCH_TOKENS: usize = 1 << 22;

thread_local! {
    /// A batch's ids, all its prompts end to end, reused by the next batch on this thread: a
    /// fresh megabyte-sized buffer per call would be returned to the system at its end and
    /// faulted in again at the next (a thread's malloc arena trims eagerly), which in the
    /// threads bench halved a router's probes a second.
    static BATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `lookup` of each prompt, in order, with the GIL released for all of them. Every prompt is
/// read and `check`ed (its ids in range and in the vocabulary) before the first lookup, so a
/// refused prompt refuses the whole call, naming its position in the batch, with nothing
/// changed: not even the probe counters. Both cores' `lookup_many` are this, with their own
/// `check` and `lookup` (their `lookup_checked`: the tokens are not scanned a second time).
pub fn lookup_each<T: Send>(
    py: Python<'_>,
    prompts: &[Bound<'_, PyAny>],
    check: impl Fn(&[u32]) -> Result<(), CacheError> + Sync,
    lookup: impl Fn(&[u32]) -> Result<T, CacheError> + Sync,
) -> PyResult<Vec<T>> {
    let mut prompts = read_prompts(prompts)?;
    let views: Vec<TokenView<'_>> = prompts.iter_mut().map(Tokens::view).collect();
    py.detach(|| {
        BATCH.with_borrow_mut(|ids| {
            ids.clear();
            let answers = read_then_look_up(views, ids, &check, &lookup);
            if ids.capacity() > KEPT_BATCH_TOKENS {
                *ids = Vec::new();
            }
            answers
        })
    })
    .map_err(to_py_err)
}

/// Where a prompt's ids are once read: a range of the batch's buffer (an array's, narrowed
/// there), or the vector they were converted into (a list's, not copied again).
enum Read {
    InBatch(std::ops::Range<usize>),
    Converted(Vec<u32>),
}

impl Read {
    fn tokens<'a>(&'a self, batch: &'a [u32]) -> &'a [u32] {
        match self {
            Read::InBatch(range) => &batch[range.clone()],
            Read::Converted(tokens) => tokens,
        }
    }
}

/// Every prompt read (into `ids`, end to end, or kept as converted) and checked, then each
/// looked up.
fn read_then_look_up<T>(
    views: Vec<TokenView<'_>>,
    ids: &mut Vec<u32>,
    check: impl Fn(&[u32]) -> Result<(), CacheError>,
    lookup: impl Fn(&[u32]) -> Result<T, CacheError>,
) -> Result<Vec<T>, CacheError> {
    let mut read = Vec::with_capacity(views.len());
    for (index, view) in views.into_iter().enumerate() {
        let start = ids.len();
        let prompt = match view.read_into(ids).map_err(|err| in_prompt(index, err))? {
            Some(converted) => Read::Converted(converted),
            None => Read::InBatch(start..ids.len()),
        };
        check(prompt.tokens(ids)).map_err(|err| in_prompt(index, err))?;
        read.push(prompt);
    }
    read.iter()
        .enumerate()
        .map(|(index, prompt)| lookup(prompt.tokens(ids)).map_err(|err| in_prompt(index, err)))
        .collect()
}

/// `err`, its message prefixed with the prompt's position in the batch.
fn in_prompt(index: usize, err: CacheError) -> CacheError {
    match err {
        CacheError::InvalidInput(message) => {
            CacheError::InvalidInput(format!("prompt {index} of the batch: {message}"))
        }
        other => other,
    }
}
