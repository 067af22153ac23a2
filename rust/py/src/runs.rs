//! `CoreRunCache`: the request cycle of the cache on runs of blocks (`prefixkv_core::run_cache`,
//! issue 24's plan in `benches/PROFILE.md`), bound so that the benches can time it through the
//! same conversions as `CoreCache` (numpy or list ids in, a `Request` out, the GIL released by
//! the same rule). Experimental and not part of `prefixkv`'s API: it is not the cache yet, and
//! takes only what the run cache serves so far (the request cycle with commits by chunk, a
//! salt, no adapter or multimodal extras); anything else is refused by name.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use prefixkv_core::run_cache::{RunCache, RunRequest};
use prefixkv_core::{root_key, BlockKey, CacheError, RequestId};
use pyo3::prelude::*;

use crate::cache::{fingerprint, U32_RANGE};
use crate::convert::{self, count, int_in, KeyExtras, RequestRef, Tokens};
use crate::errors::{invalid, to_py_err};
use crate::gil::detach_if;
use crate::results::{PrefixMatch, Request};

/// The run cache and its requests in flight, behind one lock.
struct Runs {
    cache: RunCache,
    requests: HashMap<RequestId, RunRequest>,
    next_id: i64,
    context: BlockKey,
    block_size: usize,
}

/// The cache on runs of blocks (experimental; see the module docs).
#[pyclass(frozen, module = "prefixkv._core")]
pub struct CoreRunCache(Mutex<Runs>);

impl CoreRunCache {
    /// The lock, taken inside a call's GIL release when it has one (`gil.rs`: a call that
    /// released the GIL while holding the lock would deadlock with one waiting for the lock
    /// under the GIL). A panic inside the run cache is a bug, raised once as one; the state it
    /// left is not trusted after it, so every later call is refused.
    fn runs(&self) -> Result<MutexGuard<'_, Runs>, CacheError> {
        self.0.lock().map_err(|_| {
            CacheError::InvalidInput(
                "this run cache panicked in an earlier call; its state is not trusted".into(),
            )
        })
    }
}

/// The run cache keys blocks by root (context and salt) and tokens only, so far.
fn no_extras(keys: &KeyExtras) -> PyResult<()> {
    if keys.extras.is_empty() {
        Ok(())
    } else {
        Err(invalid(
            "the run cache takes no adapter or multimodal extras yet".into(),
        ))
    }
}

#[pymethods]
impl CoreRunCache {
    #[new]
    fn new(
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        context_fingerprint: &[u8],
    ) -> PyResult<Self> {
        // As `CoreCache` reads them; `RunCache::new` refuses sizes it cannot hold.
        let positive = |v: i128| v > 0;
        let num_blocks: u32 = int_in(num_blocks, "num_blocks", U32_RANGE, positive)?;
        let block_size = int_in::<u32>(block_size, "block_size", U32_RANGE, positive)? as usize;
        let context = fingerprint(context_fingerprint)?;
        let cache =
            RunCache::new(num_blocks, block_size, 0x7072_6566_6978_6b76).ok_or_else(|| {
                to_py_err(CacheError::InvalidInput(format!(
                    "a run cache of {num_blocks} blocks of {block_size} tokens: its metadata \
                     would take more than the {} bytes allowed up front (or blocks of more \
                     than {} tokens), or the memory is not there",
                    prefixkv_core::cache::MAX_UP_FRONT_BYTES,
                    prefixkv_core::cache::MAX_BLOCK_SIZE
                )))
            })?;
        Ok(Self(Mutex::new(Runs {
            cache,
            requests: HashMap::new(),
            next_id: 0,
            context,
            block_size,
        })))
    }

    /// Matches the cached prefix of `tokens` under `keys`' salt, holds it and allocates the
    /// rest; refused with nothing changed when the blocks are not there.
    #[pyo3(signature = (tokens, keys, priority=None))]
    fn begin(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
        priority: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Request> {
        let priority = convert::priority(priority)?;
        no_extras(keys)?;
        let num_prompt_tokens = tokens.len();
        if num_prompt_tokens == 0 {
            return Err(invalid("a prompt has at least one token".into()));
        }
        let view = tokens.view();
        let salt = &keys.salt;
        let (id, begun) = py
            .detach(|| {
                let tokens = view.into_vec()?;
                let mut runs = self.runs()?;
                let root = root_key(&runs.context, salt);
                let bs = runs.block_size;
                let request = runs
                    .cache
                    .begin(root, tokens, priority)
                    .map_err(|refused| CacheError::OutOfBlocks {
                        needed: refused.needed,
                        available: refused.obtainable,
                    })?;
                let id = RequestId::Int(runs.next_id);
                runs.next_id += 1;
                let begun = (
                    request.blocks().to_vec(),
                    request.cached_blocks() * bs,
                    request.full_hit(),
                );
                runs.requests.insert(id.clone(), request);
                Ok((id, begun))
            })
            .map_err(to_py_err)?;
        let (block_table, num_cached_tokens, full_hit) = begun;
        Ok(Request {
            id,
            block_table,
            num_cached_tokens,
            full_hit,
            last_token_shared: false,
            num_prompt_tokens,
        })
    }

    /// The KV of the request's first `num_computed_tokens` tokens is written: publishes the
    /// full blocks among them (chunk after chunk, as a chunked prefill commits).
    fn commit(
        &self,
        py: Python<'_>,
        request: RequestRef,
        num_computed_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let num = count(num_computed_tokens, "num_computed_tokens")?;
        let id = request.0;
        // Checked and sized under the lock, which is dropped before the GIL is released.
        let large = {
            let runs = self.runs().map_err(to_py_err)?;
            let Some(held) = runs.requests.get(&id) else {
                return Err(to_py_err(CacheError::UnknownRequest(id)));
            };
            if num > held.num_tokens() {
                return Err(invalid(format!(
                    "num_computed_tokens {num} exceeds the request's {} tokens",
                    held.num_tokens()
                )));
            }
            num / runs.block_size >= crate::gil::MANY_BLOCKS
        };
        detach_if(py, large, || {
            let mut runs = self.runs()?;
            let runs = &mut *runs;
            // Another thread may have finished it since.
            let Some(held) = runs.requests.get_mut(&id) else {
                return Err(CacheError::UnknownRequest(id));
            };
            runs.cache.commit(held, num)
        })
        .map_err(to_py_err)
    }

    /// Drops the request's references and forgets it.
    fn finish(&self, py: Python<'_>, request: RequestRef) -> PyResult<()> {
        let id = request.0;
        py.detach(|| {
            let mut runs = self.runs()?;
            let Some(held) = runs.requests.remove(&id) else {
                return Err(CacheError::UnknownRequest(id));
            };
            runs.cache.finish(held);
            Ok(())
        })
        .map_err(to_py_err)
    }

    /// The cached prefix of `tokens` under `keys`' salt, without taking references.
    fn lookup(
        &self,
        py: Python<'_>,
        mut tokens: Tokens<'_>,
        keys: &KeyExtras,
    ) -> PyResult<PrefixMatch> {
        no_extras(keys)?;
        let view = tokens.view();
        let found = py
            .detach(|| {
                let tokens = view.into_vec()?;
                let runs = self.runs()?;
                Ok(runs
                    .cache
                    .lookup(&root_key(&runs.context, &keys.salt), &tokens))
            })
            .map_err(to_py_err)?;
        Ok(PrefixMatch {
            num_cached_tokens: found.num_cached_tokens,
            full_hit: found.full_hit,
            last_token_shared: false,
            block_ids: found.blocks,
        })
    }

    /// Blocks a request could be given now (free, or cached and held by nobody).
    fn obtainable(&self) -> PyResult<usize> {
        Ok(self.runs().map_err(to_py_err)?.cache.obtainable())
    }

    /// Checks every invariant of the run cache (tests); raises on a broken one.
    fn check_invariants(&self) -> PyResult<()> {
        self.runs().map_err(to_py_err)?.cache.check_invariants();
        Ok(())
    }
}
