//! `SlotIndex`: 32-bit hashes to slot numbers, in an open-addressing array of atomic words that
//! readers probe without locks while one writer inserts and removes.
//!
//! The per-block table (`table/`: a slot per block) and the run table (`run_table/`: a slot per
//! run) find their entries through it; neither trusts it. A word packs 32 bits of the key's
//! hash (which also give the home position) and the slot number, so a probe names *candidate*
//! slots and the caller verifies each one in full (its key, its parent, its tokens) under that
//! slot's own sequence lock.
//!
//! ## Invariants
//! - Built once, at least twice the number of slots it can hold and a power of two, never
//!   resized: at most half the words are in use, so an empty word ends every probe run.
//! - One writer at a time (the caller's mutex). A removal shifts the rest of its probe run back
//!   (no tombstones), so probe runs stay short however many entries come and go.
//! - A reader may read a word just before the writer moves it back, which can make a probe run
//!   look shorter than it is: that can only hide an entry, never show a wrong one (the caller
//!   verifies every candidate). A probe that ends without finding checks the shift counter and
//!   probes again if a shift ran meanwhile (a few times at most, then the miss stands: a
//!   shorter cached prefix is always a correct answer for a lock-free probe).

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crossbeam_utils::CachePadded;

use crate::prefetch::prefetch;

const EMPTY: u64 = 0;

/// Probe rounds a reader makes when shifts keep racing it, before it reports a miss.
const PROBE_ROUNDS: usize = 4;

fn word(hash: u32, slot: u32) -> u64 {
    (u64::from(hash) << 32) | (u64::from(slot) + 1)
}

fn word_hash(word: u64) -> u32 {
    (word >> 32) as u32
}

fn word_slot(word: u64) -> u32 {
    (word as u32).wrapping_sub(1)
}

/// What a probe's caller made of one candidate slot.
pub(crate) enum Candidate<T> {
    /// The entry looked for: the probe returns it.
    Found(T),
    /// The key's own entry, but not what was looked for (a collision of full keys): the probe
    /// stops with a miss.
    Stop,
    /// Another key with the same 32 bits, or a slot rewritten meanwhile: probe on.
    Next,
}

/// Where `SlotIndex::find` stopped.
pub(crate) enum Found {
    /// A word whose slot the caller's test accepted.
    Slot(u32),
    /// The empty word where the key would go (`SlotIndex::put`).
    Free(usize),
}

/// The index; see the module docs.
pub(crate) struct SlotIndex {
    words: Box<[AtomicU64]>,
    mask: usize,
    /// Bumped before and after every backward shift (odd while one runs). Every probe reads it
    /// and every removal writes it, so it has a cache line of its own: beside `words` and
    /// `mask`, each write would take their line from a reader thread's cache too.
    shifts: CachePadded<AtomicU64>,
}

impl SlotIndex {
    /// Words for `slots` slots: a power of two at least twice as many.
    #[must_use]
    pub(crate) fn capacity(slots: usize) -> Option<usize> {
        Some(
            slots
                .checked_mul(2)?
                .checked_next_power_of_two()?
                .min(1 << 32),
        )
    }

    /// An empty index for up to `slots` slots; `None` when the memory cannot be had.
    pub(crate) fn new(slots: usize) -> Option<Self> {
        let capacity = Self::capacity(slots)?;
        let mut words = crate::hugepages::reserve(capacity)?;
        words.extend(std::iter::repeat_with(|| AtomicU64::new(EMPTY)).take(capacity));
        Some(Self {
            words: words.into_boxed_slice(),
            mask: capacity - 1,
            shifts: CachePadded::new(AtomicU64::new(0)),
        })
    }

    /// Asks for the line of `hash`'s home word (a hint, no effect on any answer).
    #[inline(always)]
    pub(crate) fn prefetch_home(&self, hash: u32) {
        prefetch(&self.words[hash as usize & self.mask]);
    }

    /// The slot named by `hash`'s home word if that word carries `hash`: the first candidate a
    /// probe would visit, for read-ahead hints only.
    #[inline]
    pub(crate) fn home_slot(&self, hash: u32) -> Option<u32> {
        let word = self.words[hash as usize & self.mask].load(Ordering::Relaxed);
        (word != EMPTY && word_hash(word) == hash).then(|| word_slot(word))
    }

    /// Lock-free: offers each slot whose word carries `hash` to `visit`, in probe order, until
    /// it finds or stops (see `Candidate`).
    #[inline]
    pub(crate) fn probe<T>(
        &self,
        hash: u32,
        mut visit: impl FnMut(u32) -> Candidate<T>,
    ) -> Option<T> {
        for _ in 0..PROBE_ROUNDS {
            let shifts = self.shifts.load(Ordering::Acquire);
            let mut i = hash as usize & self.mask;
            // At most half the index is ever in use, so an empty word ends every run; the bound
            // only makes termination evident.
            for _ in 0..=self.mask {
                let word = self.words[i].load(Ordering::Acquire);
                if word == EMPTY {
                    break;
                }
                if word_hash(word) == hash {
                    match visit(word_slot(word)) {
                        Candidate::Found(found) => return Some(found),
                        Candidate::Stop => return None,
                        Candidate::Next => {}
                    }
                }
                i = (i + 1) & self.mask;
            }
            fence(Ordering::Acquire);
            if shifts.is_multiple_of(2) && self.shifts.load(Ordering::Relaxed) == shifts {
                return None;
            }
        }
        None
    }

    /// Writer only: the first slot under `hash` that `is_key` accepts, else the free word where
    /// the key goes.
    #[inline]
    pub(crate) fn find(&self, hash: u32, mut is_key: impl FnMut(u32) -> bool) -> Found {
        let mut i = hash as usize & self.mask;
        loop {
            let word = self.words[i].load(Ordering::Relaxed);
            if word == EMPTY {
                return Found::Free(i);
            }
            if word_hash(word) == hash && is_key(word_slot(word)) {
                return Found::Slot(word_slot(word));
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Words in use: a scan of the whole index (tests, to check that nothing leaked).
    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.words
            .iter()
            .filter(|word| word.load(Ordering::Relaxed) != EMPTY)
            .count()
    }

    /// Writer only: publishes `slot` under `hash` at `position`, the free word `find` returned
    /// (with nothing inserted since). `Release`: a reader that sees the word sees the slot the
    /// writer filled before.
    #[inline]
    pub(crate) fn put(&self, position: usize, hash: u32, slot: u32) {
        debug_assert_eq!(self.words[position].load(Ordering::Relaxed), EMPTY);
        self.words[position].store(word(hash, slot), Ordering::Release);
    }

    /// Writer only: `find` then `put`, for a key the caller knows is absent.
    pub(crate) fn insert(&self, hash: u32, slot: u32) {
        match self.find(hash, |_| false) {
            Found::Free(position) => self.put(position, hash, slot),
            Found::Slot(_) => unreachable!("the test accepts nothing"),
        }
    }

    /// Writer only: where `hash`'s word for `slot` is, if it is there.
    fn position_of(&self, hash: u32, slot: u32) -> Option<usize> {
        let mut i = hash as usize & self.mask;
        loop {
            let found = self.words[i].load(Ordering::Relaxed);
            if found == EMPTY {
                return None;
            }
            if found == word(hash, slot) {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Writer only: points `hash`'s word for slot `from` at slot `to` (an entry that moved).
    /// Returns false if there is no such word.
    pub(crate) fn repoint(&self, hash: u32, from: u32, to: u32) -> bool {
        let Some(position) = self.position_of(hash, from) else {
            return false;
        };
        self.words[position].store(word(hash, to), Ordering::Release);
        true
    }

    /// Writer only: removes `hash`'s word for `slot`, calling `before_shift` once it is found
    /// and before any word moves (the per-block table empties the slot there, so a reader
    /// holding the old word finds no entry). Returns false if there is no such word.
    pub(crate) fn remove(&self, hash: u32, slot: u32, before_shift: impl FnOnce()) -> bool {
        let Some(mut hole) = self.position_of(hash, slot) else {
            return false;
        };
        before_shift();
        // Backward shift: move later words of the probe run into the hole when their home
        // allows, so no tombstone is left. Readers racing it re-probe (`shifts`).
        let shifts = self.shifts.load(Ordering::Relaxed);
        self.shifts.store(shifts + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        let mut next = hole;
        loop {
            next = (next + 1) & self.mask;
            let moving = self.words[next].load(Ordering::Relaxed);
            if moving == EMPTY {
                break;
            }
            let home = word_hash(moving) as usize & self.mask;
            // The word stays when its home lies cyclically in (hole, next].
            let stays = if hole <= next {
                hole < home && home <= next
            } else {
                hole < home || home <= next
            };
            if !stays {
                self.words[hole].store(moving, Ordering::Relaxed);
                hole = next;
            }
        }
        self.words[hole].store(EMPTY, Ordering::Relaxed);
        self.shifts.store(shifts + 2, Ordering::Release);
        true
    }
}
