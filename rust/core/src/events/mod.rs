//! KV events: what a router must learn about this cache, recorded where it happens.
//!
//! A router that sends each request to the instance already holding its prefix (llm-d, Dynamo,
//! SGLang's router) learns what every instance caches from three kinds of events: blocks
//! *stored* (published into the table), blocks *removed* (evicted), and *all blocks cleared*
//! (`clear`, `set_context`). This module records them in the order the mutex serialises the
//! changes; the Python publisher drains them and puts them on the wire in vLLM's format
//! (`python/prefixkv/events/`, `docs/events.md`).
//!
//! ## Invariants
//! - **Off costs nothing.** Without [`PrefixCache::enable_events`] the recorder is `None`: each
//!   hook is one predictable branch on a field the mutex holder already has in cache.
//! - **Keys are computed once, where the block is published.** The table works on per-process
//!   XXH3 keys, so the SHA-256 block key (`key.rs`) of a stored block is computed by the hook,
//!   chained on its parent's block key, which the recorder remembers per block id while events
//!   are on. Nothing is ever re-hashed from a prompt; a removal reads the remembered key.
//! - **Every recorded change is under the cache mutex**, so the queue's order is the cache's
//!   order, and replaying the queue onto an empty view yields the cache's cached set.
//! - **A slow consumer never stalls or fails the scheduler.** The queue is bounded (in blocks).
//!   When a push would overflow it, the queue is dropped, the loss is counted, and the next drain
//!   *resynchronises*: it yields `AllBlocksCleared` followed by a snapshot of every cached block,
//!   so a consumer's view is correct again after one drain instead of silently diverging.
//!   Enabling events starts with the same snapshot, so blocks cached before are not invisible.
//! - **Token ids can be withheld** ([`TokenIds`]): a salted request's tokens belong to one
//!   tenant, and a subscriber of another tenant should see only opaque keys.
//!
//! `snapshot.rs` rebuilds the cached set as events (resynchronisation, enabling late);
//! `wire.rs` encodes drained events as vLLM's msgpack, for the publisher.

mod snapshot;
mod wire;

pub use wire::{encode_events, hash64, HashForm};

use crate::cache::PrefixCache;
use crate::key::{block_key_with, root_key, BlockKey, RequestExtras};
use crate::pool::BlockId;

/// Which blocks' token ids go into `BlockStored` events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenIds {
    /// Every block's tokens (what vLLM publishes).
    All,
    /// Only blocks of unsalted requests: a salted (tenant) block is published by key alone.
    Unsalted,
    /// No tokens at all: keys only.
    None,
}

/// Settings of the recorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventConfig {
    /// Most blocks (stored or removed) queued between two drains before the queue overflows.
    pub capacity: usize,
    /// Which token ids are recorded.
    pub token_ids: TokenIds,
}

/// One recorded change. Consecutive blocks of one chain are coalesced into one `Stored`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks published, in chain order: `keys[0]` is a child of `parent` (None: a first
    /// block), each further key a child of the one before.
    Stored {
        keys: Vec<BlockKey>,
        parent: Option<BlockKey>,
        /// `block_size` tokens per key, or empty when withheld.
        token_ids: Vec<u32>,
        /// The adapter (LoRA) name, when the blocks were computed with one.
        adapter: Option<Vec<u8>>,
        /// Per key: its encoded extras (`key.rs`), empty for a block without any.
        extras: Vec<Vec<u8>>,
    },
    /// Blocks evicted: no lookup reaches them any more.
    Removed { keys: Vec<BlockKey> },
    /// Every cached block is gone (`clear`, `set_context`, or a resynchronisation).
    Cleared,
}

/// Counters of the recorder, kept for as long as the cache lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EventCounters {
    /// Blocks whose events were recorded (stored plus removed), dropped ones included.
    pub recorded_blocks: u64,
    /// Blocks whose events were dropped by an overflow (then resynchronised).
    pub dropped_blocks: u64,
    /// Overflows, each answered by one resynchronisation.
    pub overflows: u64,
}

/// The recorder: present only while events are on.
pub(crate) struct Recorder {
    config: EventConfig,
    /// The block key of each cached block, by block id.
    keys: Vec<Option<BlockKey>>,
    /// The root of an unsalted request under the current context (salted roots differ).
    unsalted_root: BlockKey,
    queue: Vec<KvEvent>,
    /// Blocks in `queue`.
    queued_blocks: usize,
    /// Set by an overflow: the next drain resynchronises (and counts what it replaces).
    overflowed: bool,
    /// Set when enabled over a non-empty cache: the next drain is a snapshot.
    snapshot_pending: bool,
    counters: EventCounters,
    /// Reused hashing buffer.
    scratch: Vec<u8>,
}

/// The hook point the cache calls: a no-op unless events are on.
#[derive(Default)]
pub(crate) struct Events {
    recorder: Option<Box<Recorder>>,
    /// Survives disable/enable, so counters are monotonic (Prometheus counters must be).
    counters: EventCounters,
    /// Set once events were on: enabling again must resynchronise consumers, whose view may
    /// miss what happened while events were off (or was queued and discarded).
    was_enabled: bool,
}

impl Events {
    /// A block was published under `parent_block` (None: a first block) for a request whose
    /// root key and extras are `origin`.
    #[inline]
    pub(crate) fn stored(
        &mut self,
        block: BlockId,
        parent_block: Option<BlockId>,
        origin: (&BlockKey, &RequestExtras),
        tokens: &[u32],
        extras: &[u8],
    ) {
        if let Some(recorder) = self.recorder.as_deref_mut() {
            let (root, request_extras) = origin;
            let adapter = request_extras.adapter.as_ref();
            recorder.stored(block, parent_block, root, tokens, extras, adapter);
        }
    }

    /// A block was published in a sliding-window cache, whose entries do not chain on their
    /// parent block (it may be released or evicted already): the caller passes the block's
    /// SHA-256 key and its parent's (None: a first block), which it computed to publish it.
    #[inline]
    pub(crate) fn stored_with_keys(
        &mut self,
        block: BlockId,
        (key, parent): (BlockKey, Option<BlockKey>),
        origin: (&BlockKey, &RequestExtras),
        tokens: &[u32],
        extras: &[u8],
    ) {
        if let Some(recorder) = self.recorder.as_deref_mut() {
            let (root, request_extras) = origin;
            let adapter = request_extras.adapter.as_ref();
            recorder.record_stored(block, key, parent, root, tokens, extras, adapter);
        }
    }

    /// A cached block was evicted.
    #[inline]
    pub(crate) fn removed(&mut self, block: BlockId) {
        if let Some(recorder) = self.recorder.as_deref_mut() {
            recorder.removed(block);
        }
    }

    /// A cached block's entry moved into its duplicate (`pool.rs`): the same content stays
    /// cached, so a router has nothing to learn; only the remembered key follows the block.
    #[inline]
    pub(crate) fn moved(&mut self, from: BlockId, to: BlockId) {
        if let Some(recorder) = self.recorder.as_deref_mut() {
            recorder.keys[to as usize] = recorder.keys[from as usize].take();
        }
    }

    /// Every cached block was dropped; `context` is the (possibly new) context fingerprint.
    #[inline]
    pub(crate) fn cleared(&mut self, context: &BlockKey) {
        if let Some(recorder) = self.recorder.as_deref_mut() {
            recorder.cleared(context);
        }
    }
}

impl Recorder {
    /// Whether the queue is replaced by a snapshot at the next drain.
    fn suspended(&self) -> bool {
        self.overflowed || self.snapshot_pending
    }

    fn push(&mut self, event: KvEvent, blocks: usize) {
        self.counters.recorded_blocks += blocks as u64;
        if self.snapshot_pending {
            return;
        }
        if self.overflowed {
            self.counters.dropped_blocks += blocks as u64;
            return;
        }
        if self.queued_blocks + blocks > self.config.capacity {
            self.counters.dropped_blocks += (self.queued_blocks + blocks) as u64;
            self.counters.overflows += 1;
            self.overflowed = true;
            self.queue = Vec::new();
            self.queued_blocks = 0;
            return;
        }
        self.queued_blocks += blocks;
        self.queue.push(event);
    }

    fn stored(
        &mut self,
        block: BlockId,
        parent_block: Option<BlockId>,
        root: &BlockKey,
        tokens: &[u32],
        extras: &[u8],
        adapter: Option<&Vec<u8>>,
    ) {
        let parent = parent_block.map(|b| {
            self.keys[b as usize].expect("a cached parent has its block key while events are on")
        });
        let parent_key = parent.as_ref().unwrap_or(root);
        let key = block_key_with(&mut self.scratch, parent_key, tokens, extras);
        self.record_stored(block, key, parent, root, tokens, extras, adapter);
    }

    /// Queues the `Stored` of `block`, whose block key and parent key are known.
    #[allow(clippy::too_many_arguments)] // one event's fields, assembled by two callers
    fn record_stored(
        &mut self,
        block: BlockId,
        key: BlockKey,
        parent: Option<BlockKey>,
        root: &BlockKey,
        tokens: &[u32],
        extras: &[u8],
        adapter: Option<&Vec<u8>>,
    ) {
        self.keys[block as usize] = Some(key);
        let with_tokens = self.config.token_ids.shows(root, &self.unsalted_root);
        // Extend the last event when this block continues its chain (a commit of n blocks is
        // one event, as in vLLM).
        if !self.suspended() && self.queued_blocks < self.config.capacity {
            if let Some(KvEvent::Stored {
                keys,
                token_ids,
                adapter: last_adapter,
                extras: last_extras,
                ..
            }) = self.queue.last_mut()
            {
                let continues = parent.is_some() && keys.last() == parent.as_ref();
                if continues
                    && last_adapter.as_ref() == adapter
                    && token_ids.is_empty() != with_tokens
                {
                    keys.push(key);
                    if with_tokens {
                        token_ids.extend_from_slice(tokens);
                    }
                    last_extras.push(extras.to_vec());
                    self.queued_blocks += 1;
                    self.counters.recorded_blocks += 1;
                    return;
                }
            }
        }
        let event = stored_event(
            (key, parent),
            tokens,
            (root, &self.unsalted_root),
            extras,
            adapter.cloned(),
            self.config.token_ids,
        );
        self.push(event, 1);
    }

    fn removed(&mut self, block: BlockId) {
        let Some(key) = self.keys[block as usize].take() else {
            return;
        };
        if !self.suspended() && self.queued_blocks < self.config.capacity {
            if let Some(KvEvent::Removed { keys }) = self.queue.last_mut() {
                keys.push(key);
                self.queued_blocks += 1;
                self.counters.recorded_blocks += 1;
                return;
            }
        }
        self.push(KvEvent::Removed { keys: vec![key] }, 1);
    }

    fn cleared(&mut self, context: &BlockKey) {
        self.keys.iter_mut().for_each(|k| *k = None);
        self.unsalted_root = root_key(context, b"");
        if self.suspended() {
            // The resynchronisation starts with a clear anyway; nothing else is owed.
            return;
        }
        // Nothing queued before a clear matters to a consumer that applies the clear.
        self.queue.clear();
        self.queued_blocks = 0;
        self.push(KvEvent::Cleared, 0);
    }
}

/// What a drain hands the publisher.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventDrain {
    /// The events since the last drain, in cache order.
    pub events: Vec<KvEvent>,
    /// True when this drain is a resynchronisation after an overflow (it then starts with
    /// `Cleared` followed by the full cached set).
    pub resynchronised: bool,
    /// The recorder's counters after this drain.
    pub counters: EventCounters,
}

impl Events {
    /// Turns recording on (or changes its settings) over a cache under `context` whose blocks
    /// have the keys `cached` (by block id, one per block of the pool; `None`: not cached). The
    /// first drain then yields a snapshot of them, so a consumer starting now sees them.
    pub(crate) fn enable(
        &mut self,
        config: EventConfig,
        context: &BlockKey,
        cached: Vec<Option<BlockKey>>,
    ) {
        let mut recorder = Box::new(Recorder {
            config,
            keys: cached,
            unsalted_root: root_key(context, b""),
            queue: Vec::new(),
            queued_blocks: 0,
            overflowed: false,
            snapshot_pending: false,
            counters: self.counters,
            scratch: Vec::new(),
        });
        // Announce the blocks already cached as a resynchronisation does; after an earlier
        // recorder, also tell consumers to forget what they learned from it.
        recorder.snapshot_pending = self.was_enabled || recorder.keys.iter().any(Option::is_some);
        if let Some(previous) = self.recorder.take() {
            recorder.counters = previous.counters;
        }
        self.was_enabled = true;
        self.recorder = Some(recorder);
    }

    /// Turns recording off; queued events are discarded. Counters are kept.
    pub(crate) fn disable(&mut self) {
        if let Some(recorder) = self.recorder.take() {
            self.counters = recorder.counters;
        }
    }

    /// Whether events are being recorded.
    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.recorder.is_some()
    }

    /// The recorder's counters now (kept across disable and enable).
    pub(crate) fn counters(&self) -> EventCounters {
        self.recorder.as_ref().map_or(self.counters, |r| r.counters)
    }

    /// Which token ids `Stored` events carry (a snapshot withholds the same ones).
    pub(crate) fn token_policy(&self) -> TokenIds {
        self.recorder
            .as_ref()
            .map_or(TokenIds::All, |r| r.config.token_ids)
    }

    /// The events recorded since the last drain; `None` when this drain must resynchronise
    /// instead (after an overflow, or a late enable): the cache then builds its snapshot and
    /// hands it to [`Events::resynchronised`].
    pub(crate) fn drain(&mut self) -> Option<EventDrain> {
        let Some(recorder) = self.recorder.as_deref_mut() else {
            return Some(EventDrain {
                counters: self.counters,
                ..EventDrain::default()
            });
        };
        if recorder.suspended() {
            return None;
        }
        recorder.queued_blocks = 0;
        Some(EventDrain {
            events: std::mem::take(&mut recorder.queue),
            resynchronised: false,
            counters: recorder.counters,
        })
    }

    /// The drain that replaces what was lost by `snapshot` (`Cleared`, then every cached block).
    pub(crate) fn resynchronised(&mut self, snapshot: Vec<KvEvent>) -> EventDrain {
        let recorder = self
            .recorder
            .as_deref_mut()
            .expect("a resynchronisation while recording");
        recorder.overflowed = false;
        recorder.snapshot_pending = false;
        recorder.queue.clear();
        recorder.queued_blocks = 0;
        EventDrain {
            events: snapshot,
            resynchronised: true,
            counters: recorder.counters,
        }
    }
}

impl TokenIds {
    /// Whether a block of a chain rooted at `root` goes out with its tokens.
    fn shows(self, root: &BlockKey, unsalted_root: &BlockKey) -> bool {
        match self {
            Self::All => true,
            Self::Unsalted => root == unsalted_root,
            Self::None => false,
        }
    }
}

/// The `Stored` of one block (a snapshot's, or the first of a recorded chain), its tokens
/// withheld as `policy` says (`root`: its chain's root key, compared with `unsalted_root`).
pub(crate) fn stored_event(
    (key, parent): (BlockKey, Option<BlockKey>),
    tokens: &[u32],
    (root, unsalted_root): (&BlockKey, &BlockKey),
    extras: &[u8],
    adapter: Option<Vec<u8>>,
    policy: TokenIds,
) -> KvEvent {
    let with_tokens = policy.shows(root, unsalted_root);
    KvEvent::Stored {
        keys: vec![key],
        parent,
        token_ids: if with_tokens {
            tokens.to_vec()
        } else {
            Vec::new()
        },
        adapter,
        extras: vec![extras.to_vec()],
    }
}

impl PrefixCache {
    /// Turns event recording on (or changes its settings). The first drain then yields a
    /// snapshot of every block already cached, so a consumer starting now sees them.
    pub fn enable_events(&self, config: EventConfig) {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        let cached = self.cached_block_keys(inner);
        inner.events.enable(config, &self.context(), cached);
    }

    /// Turns event recording off; queued events are discarded. Counters are kept.
    pub fn disable_events(&self) {
        self.inner.lock().events.disable();
    }

    /// Whether events are being recorded.
    #[must_use]
    pub fn events_enabled(&self) -> bool {
        self.inner.lock().events.enabled()
    }

    /// The recorder's counters now (kept across disable and enable).
    #[must_use]
    pub fn event_counters(&self) -> EventCounters {
        self.inner.lock().events.counters()
    }

    /// The events recorded since the last drain (empty when events are off).
    pub fn drain_events(&self) -> EventDrain {
        let mut guard = self.inner.lock();
        let inner = &mut *guard;
        if let Some(drain) = inner.events.drain() {
            return drain;
        }
        let snapshot = self.snapshot(inner);
        inner.events.resynchronised(snapshot)
    }

    /// The block key of every cached block, in no particular order: the set a consumer's view of
    /// this instance must equal (tests, and resynchronisation).
    pub fn cached_keys(&self) -> Vec<BlockKey> {
        let mut guard = self.inner.lock();
        self.cached_block_keys(&mut guard)
            .into_iter()
            .flatten()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::{cache, no_extras};
    use crate::key::context_fingerprint;

    fn config(capacity: usize, token_ids: TokenIds) -> EventConfig {
        EventConfig {
            capacity,
            token_ids,
        }
    }

    #[test]
    fn a_commit_is_one_stored_event_with_chained_sha256_keys() {
        let c = cache(8, 2);
        c.enable_events(config(64, TokenIds::All));
        let r = c
            .begin(None, vec![1, 2, 3, 4, 5], b"", no_extras(), 0)
            .unwrap();
        c.commit(&r.request_id, 5).unwrap();
        let drain = c.drain_events();
        let expected = c.block_keys(&[1, 2, 3, 4], b"", &no_extras()).unwrap();
        assert_eq!(
            drain.events,
            vec![KvEvent::Stored {
                keys: expected.clone(),
                parent: None,
                token_ids: vec![1, 2, 3, 4],
                adapter: None,
                extras: vec![vec![], vec![]],
            }]
        );
        let mut cached = c.cached_keys();
        cached.sort();
        let mut want = expected;
        want.sort();
        assert_eq!(cached, want);
    }

    #[test]
    fn eviction_and_clear_are_recorded_and_salted_tokens_withheld() {
        let c = cache(2, 2);
        c.enable_events(config(64, TokenIds::Unsalted));
        let r = c
            .begin(None, vec![1, 2, 3, 4], b"tenant", no_extras(), 0)
            .unwrap();
        c.commit(&r.request_id, 4).unwrap();
        c.finish(&r.request_id).unwrap();
        let salted = c
            .block_keys(&[1, 2, 3, 4], b"tenant", &no_extras())
            .unwrap();
        let r = c
            .begin(None, vec![7, 8, 9, 10], b"", no_extras(), 0)
            .unwrap();
        let events = c.drain_events().events;
        assert!(matches!(&events[0], KvEvent::Stored { token_ids, .. } if token_ids.is_empty()));
        let mut removed = match &events[1] {
            KvEvent::Removed { keys } => keys.clone(),
            other => panic!("{other:?}"),
        };
        removed.sort();
        let mut want = salted;
        want.sort();
        assert_eq!(removed, want);
        c.finish(&r.request_id).unwrap();
        c.set_context(context_fingerprint(b"other"));
        assert_eq!(c.drain_events().events, vec![KvEvent::Cleared]);
    }

    #[test]
    fn overflow_is_counted_and_the_next_drain_resynchronises() {
        let c = cache(16, 1);
        c.enable_events(config(2, TokenIds::All));
        for t in 0..4u32 {
            let r = c.begin(None, vec![100 + t], b"", no_extras(), 0).unwrap();
            c.commit(&r.request_id, 1).unwrap();
            c.finish(&r.request_id).unwrap();
        }
        let drain = c.drain_events();
        assert!(drain.resynchronised);
        assert_eq!(drain.counters.overflows, 1);
        assert_eq!(drain.counters.dropped_blocks, 4);
        assert_eq!(drain.events[0], KvEvent::Cleared);
        assert_eq!(drain.events.len(), 5);
        assert!(!c.drain_events().resynchronised);
    }

    #[test]
    fn enabling_again_resynchronises_what_happened_while_off() {
        let c = cache(2, 1);
        c.enable_events(config(64, TokenIds::All));
        let r = c.begin(None, vec![1, 2], b"", no_extras(), 0).unwrap();
        c.commit(&r.request_id, 2).unwrap();
        c.finish(&r.request_id).unwrap();
        assert_eq!(c.drain_events().events.len(), 1);
        c.disable_events();
        // Unseen: both blocks evicted, the cache is empty of them.
        let r = c.begin(None, vec![7, 8], b"", no_extras(), 0).unwrap();
        c.finish(&r.request_id).unwrap();
        c.enable_events(config(64, TokenIds::All));
        let drain = c.drain_events();
        assert!(drain.resynchronised);
        assert_eq!(drain.events, vec![KvEvent::Cleared]);
    }

    #[test]
    fn enabling_late_snapshots_what_is_cached() {
        let c = cache(8, 2);
        let r = c
            .begin(None, vec![1, 2, 3, 4], b"", no_extras(), 0)
            .unwrap();
        c.commit(&r.request_id, 4).unwrap();
        c.enable_events(config(64, TokenIds::None));
        // A child of a block cached before events were on still gets its chained key.
        c.append(&r.request_id, &[5, 6]).unwrap();
        c.commit(&r.request_id, 6).unwrap();
        let drain = c.drain_events();
        assert!(drain.resynchronised);
        assert_eq!(drain.counters.dropped_blocks, 0);
        assert_eq!(drain.events.len(), 4); // Cleared, then the three blocks cached
        let mut cached = c.cached_keys();
        cached.sort();
        let mut want = c
            .block_keys(&[1, 2, 3, 4, 5, 6], b"", &no_extras())
            .unwrap();
        want.sort();
        assert_eq!(cached, want);
    }
}
