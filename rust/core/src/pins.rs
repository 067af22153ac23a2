//! Pins: keeping a cached prefix from eviction, without holding it.
//!
//! `pin` matches the cached prefix of a prompt (under the mutex, so it pins exactly what it
//! matched) and pins each of its blocks once; `unpin` takes those pins off again. A pin is not a
//! reference: the engine reads no KV through it, and a pinned block may be referenced by any
//! number of requests besides. The pool keeps a pin count per block, and a block with a pin is
//! never evicted (`pool.rs`); since a cached parent is never evicted before its child, pinning a
//! prefix keeps all of it. Only `unpin`, `clear` and `set_context` change pin counts, and the pin
//! counts are always exactly the live pins' (`check_invariants`).
//!
//! `clear` and `set_context` drop every pin with the blocks they pinned. A pin id is live from
//! `pin` until its `unpin` or the next reset; ids are never reused. Unpinning an id that is not
//! live changes nothing and says why: never taken, already unpinned, or dropped by which reset.
//! To say so, the registry remembers the ids each reset dropped (8 bytes per dropped pin for the
//! life of the cache: resets are rare and pins few).

use std::collections::HashMap;

use crate::cache::{PrefixCache, Reset};
use crate::error::{CacheError, Result};
use crate::key::RequestExtras;
use crate::pool::BlockId;

/// The live pins by id (each with what it pins: `T`, the block ids here, the runs' ranges in
/// the run cache), and what became of the others.
pub(crate) struct Pins<T = Vec<BlockId>> {
    live: HashMap<u64, T>,
    next_id: u64,
    /// Ids dropped by each reset, in order: ascending, since a reset drops every live pin.
    dropped: Vec<(u64, Reset)>,
}

impl<T> Default for Pins<T> {
    fn default() -> Self {
        Self {
            live: HashMap::new(),
            next_id: 1,
            dropped: Vec::new(),
        }
    }
}

impl Pins {
    /// Every block pin the live pins hold, one item per pin.
    pub(crate) fn pinned_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.live.values().flatten().copied()
    }
}

impl<T> Pins<T> {
    /// Records a new pin of `pinned`; its id (never reused).
    pub(crate) fn add(&mut self, pinned: T) -> u64 {
        let pin_id = self.next_id;
        self.next_id += 1;
        self.live.insert(pin_id, pinned);
        pin_id
    }

    /// Takes pin `pin_id` out; `UnknownPin`, saying why, if it is not live.
    pub(crate) fn take(&mut self, pin_id: u64) -> Result<T> {
        self.live
            .remove(&pin_id)
            .ok_or_else(|| self.not_live(pin_id))
    }

    /// At a reset: every live pin is gone (the pool forgets its pin counts as it uncaches).
    pub(crate) fn drop_all(&mut self, reset: Reset) {
        let mut ids: Vec<u64> = self.live.drain().map(|(id, _)| id).collect();
        ids.sort_unstable();
        self.dropped.extend(ids.into_iter().map(|id| (id, reset)));
    }

    /// Why `pin_id` is not live.
    fn not_live(&self, pin_id: u64) -> CacheError {
        let reason = match self.dropped.binary_search_by_key(&pin_id, |&(id, _)| id) {
            Ok(index) => match self.dropped[index].1 {
                Reset::Clear => "dropped by clear(), which releases every pin",
                Reset::SetContext => "dropped by set_context(), which releases every pin",
            },
            Err(_) if pin_id == 0 || pin_id >= self.next_id => "never taken",
            Err(_) => "already unpinned",
        };
        CacheError::UnknownPin { pin_id, reason }
    }
}

impl PrefixCache {
    /// Pins the cached prefix of `tokens` so eviction never takes it. Returns a pin id for
    /// `unpin` and the number of blocks pinned.
    pub fn pin(&self, tokens: &[u32], salt: &[u8], extras: &RequestExtras) -> Result<(u64, usize)> {
        self.check_tokens(tokens)?;
        self.refuse_in_sliding_mode("pin")?;
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = self.matched_blocks(&mut inner.scratch, tokens, salt, extras);
        for &block in &blocks {
            inner.pool.pin(block);
        }
        let count = blocks.len();
        Ok((inner.pins.add(blocks), count))
    }

    /// Releases a pin taken by `pin`; `UnknownPin`, saying why, if the id is not live.
    pub fn unpin(&self, pin_id: u64) -> Result<()> {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let blocks = inner.pins.take(pin_id)?;
        for block in blocks {
            inner.pool.unpin(block);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::tests::{cache, no_extras};
    use crate::error::CacheError;
    use crate::key::context_fingerprint;
    use crate::PrefixCache;

    fn serve(c: &PrefixCache, tokens: &[u32]) {
        let r = c.begin(None, tokens.to_vec(), b"", no_extras(), 0).unwrap();
        c.commit(&r.request_id, tokens.len()).unwrap();
        c.finish(&r.request_id).unwrap();
    }

    fn message(result: Result<(), CacheError>) -> String {
        result.unwrap_err().to_string()
    }

    #[test]
    fn a_pinned_prefix_survives_pressure_and_goes_at_unpin() {
        let c = cache(4, 1);
        serve(&c, &[1, 2]);
        let (pin, count) = c.pin(&[1, 2, 3], b"", &no_extras()).unwrap();
        assert_eq!(count, 2, "only the cached prefix is pinned");
        assert_eq!(c.stats().blocks_pinned, 2);
        // Every unpinned block can go; the pinned two cannot.
        assert!(matches!(
            c.allocate(3),
            Err(CacheError::OutOfBlocks {
                needed: 3,
                available: 2
            })
        ));
        let held = c.allocate(2).unwrap();
        assert_eq!(
            c.lookup(&[1, 2, 3], b"", &no_extras())
                .unwrap()
                .blocks
                .len(),
            2
        );
        c.unpin(pin).unwrap();
        c.release(&held).unwrap();
        let all = c.allocate(4).unwrap();
        assert_eq!(
            c.stats().evictions,
            2,
            "unpinned, the prefix is evictable again"
        );
        c.release(&all).unwrap();
        c.check_invariants();
    }

    #[test]
    fn pins_count_per_pin_and_are_not_references() {
        let c = cache(4, 1);
        serve(&c, &[1, 2]);
        let (first, _) = c.pin(&[1, 2], b"", &no_extras()).unwrap();
        let (second, _) = c.pin(&[1], b"", &no_extras()).unwrap();
        assert_ne!(first, second);
        assert_eq!(c.ref_count(0), Ok(0));
        c.unpin(first).unwrap();
        // Block 0 is still pinned by the second pin, so its chain's head stays.
        assert_eq!(c.stats().blocks_pinned, 1);
        let held = c.allocate(4).unwrap_err();
        assert!(matches!(held, CacheError::OutOfBlocks { available: 3, .. }));
        c.unpin(second).unwrap();
        assert_eq!(c.stats().blocks_pinned, 0);
        c.check_invariants();
    }

    #[test]
    fn unpin_says_why_an_id_is_not_live() {
        let c = cache(4, 1);
        serve(&c, &[1, 2]);
        let (unpinned, _) = c.pin(&[1], b"", &no_extras()).unwrap();
        c.unpin(unpinned).unwrap();
        let (cleared, _) = c.pin(&[1], b"", &no_extras()).unwrap();
        c.clear();
        serve(&c, &[1, 2]);
        let (switched, _) = c.pin(&[1], b"", &no_extras()).unwrap();
        c.set_context(context_fingerprint(b"other"));
        let before = c.stats();
        assert_eq!(
            c.unpin(cleared),
            Err(CacheError::UnknownPin {
                pin_id: cleared,
                reason: "dropped by clear(), which releases every pin"
            })
        );
        assert!(message(c.unpin(unpinned)).ends_with("already unpinned"));
        assert!(message(c.unpin(cleared)).contains("dropped by clear()"));
        assert!(message(c.unpin(switched)).contains("dropped by set_context()"));
        assert!(message(c.unpin(0)).ends_with("never taken"));
        assert!(message(c.unpin(99)).ends_with("never taken"));
        // Asking twice gets the same answer; nothing changed.
        assert!(message(c.unpin(cleared)).contains("dropped by clear()"));
        assert_eq!(c.stats(), before);
        // A pin taken after the reset is live as usual.
        let (fresh, count) = c.pin(&[1], b"", &no_extras()).unwrap();
        assert_eq!(count, 0, "the new context has nothing cached");
        c.unpin(fresh).unwrap();
        c.check_invariants();
    }
}
