//! KV events on runs: the records of the per-block cache (`crate::events`: blocks stored,
//! removed, all cleared), hooked where the run cache changes what it holds, so that a router
//! reading either core's events learns the same cached set under the same SHA-256 block keys.
//!
//! - *Stored*: `commit` publishes blocks into a run (`publish.rs`), each keyed on its parent in
//!   the chain (the canonical block before it: a duplicate's key is its canonical copy's).
//! - *Removed*: allocation truncates a run's tail (`order.rs`), top first, as the per-block
//!   core evicts a chain from its tail. A spare taken was never published: no event.
//! - *Moved*: an entry that passes to a duplicate (`replace`) keeps its key and content.
//! - *Cleared*: `reset` (`by_id.rs`), under the new context.
//!
//! The writer keeps no per-block SHA-256 keys of its own: the recorder remembers them while
//! events are on. To key what was cached while they were off (a late enable, or the snapshot
//! that follows an overflow), each first run keeps the [`Origin`] its chain was keyed from: the
//! run table knows only the run root, a one-way hash of it.

use std::sync::Arc;

use super::{RunCache, RunRequest, NONE};
use crate::cache::block_extras;
use crate::events::{stored_event, EventConfig, EventCounters, EventDrain, KvEvent};
use crate::key::{block_key_with, root_key, run_root, BlockKey, RequestExtras};
use crate::pool::BlockId;

/// What a request's block keys chain from: the root of its context and salt
/// (`key::root_key`) and its request-wide extras (the adapter).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub root: BlockKey,
    pub extras: RequestExtras,
}

impl Origin {
    /// This origin without its multimodal items: what a first run keeps, the items keying
    /// only the blocks they overlap (tagged runs keep those blocks' extras).
    #[must_use]
    pub fn without_multimodal(self: &Arc<Self>) -> Arc<Self> {
        if self.extras.multimodal.is_empty() {
            return Arc::clone(self);
        }
        Arc::new(Self {
            root: self.root,
            extras: RequestExtras {
                adapter: self.extras.adapter.clone(),
                multimodal: Vec::new(),
            },
        })
    }

    /// The root the run table matches the request under (`key::run_root`: the adapter folded
    /// in, as it parts every block key of the per-block cache).
    #[must_use]
    pub fn run_root(&self) -> BlockKey {
        run_root(&self.root, self.extras.adapter.as_deref())
    }
}

/// A cached block, with what its key and its snapshot event are made of.
struct Chained {
    /// Blocks before it in its chain (its index in every prompt that holds it).
    depth: usize,
    /// Where it is: position `pos` of run `run`.
    run: u32,
    pos: u32,
    block: BlockId,
    parent: Option<BlockId>,
    origin: Arc<Origin>,
}

/// A run whose blocks are still to be keyed: the depth of its first block, the block it hangs
/// after (`None`: a root) and that block's key.
struct Hanging {
    run: u32,
    depth: usize,
    parent: Option<BlockId>,
    parent_key: BlockKey,
    origin: Arc<Origin>,
}

impl RunRequest {
    /// Keys the request under `origin` from now on (`reset` under a new context).
    pub(super) fn rekey(&mut self, origin: Arc<Origin>) {
        self.root = origin.run_root();
        self.origin = origin;
    }
}

impl RunCache {
    /// Records the `Stored` of the request's blocks `from..to`, just published, the first one
    /// a child of `parent` (`None`: a first block).
    pub(super) fn record_stored(
        &mut self,
        request: &RunRequest,
        parent: Option<BlockId>,
        from: usize,
        to: usize,
    ) {
        let bs = self.block_size;
        let origin = &*request.origin;
        let mut parent = parent;
        let mut buffer = Vec::new();
        for (index, &block) in request.blocks.iter().enumerate().take(to).skip(from) {
            let extras = block_extras(&origin.extras, index, bs, &mut buffer);
            self.events.stored(
                block,
                parent,
                (&origin.root, &origin.extras),
                &request.tokens[index * bs..(index + 1) * bs],
                extras,
            );
            parent = Some(block);
        }
    }

    /// Turns event recording on (or changes its settings) under `context`; the first drain
    /// then yields a snapshot of every block already cached.
    pub fn enable_events(&mut self, config: EventConfig, context: &BlockKey) {
        let cached = self.cached_block_keys().1;
        self.events.enable(config, context, cached);
    }

    /// Turns event recording off; queued events are discarded, counters kept.
    pub fn disable_events(&mut self) {
        self.events.disable();
    }

    /// Whether events are being recorded.
    #[must_use]
    pub fn events_enabled(&self) -> bool {
        self.events.enabled()
    }

    /// The recorder's counters (kept across disable and enable).
    #[must_use]
    pub fn event_counters(&self) -> EventCounters {
        self.events.counters()
    }

    /// The events recorded since the last drain (empty when events are off); after an
    /// overflow or a late enable, `Cleared` and every cached block, keyed under `context`.
    pub fn drain_events(&mut self, context: &BlockKey) -> EventDrain {
        if let Some(drain) = self.events.drain() {
            return drain;
        }
        let snapshot = self.snapshot(context);
        self.events.resynchronised(snapshot)
    }

    /// The SHA-256 key of every cached block, in no particular order.
    #[must_use]
    pub fn cached_keys(&self) -> Vec<BlockKey> {
        self.cached_block_keys().1.into_iter().flatten().collect()
    }

    /// `Cleared`, then one `Stored` per cached block, parents first (by depth, then block id:
    /// the per-block core's order, so both snapshot a cached set alike).
    fn snapshot(&self, context: &BlockKey) -> Vec<KvEvent> {
        let (chained, keys) = self.cached_block_keys();
        let unsalted_root = root_key(context, b"");
        let policy = self.events.token_policy();
        let mut buffer = Vec::new();
        let mut events = Vec::with_capacity(chained.len() + 1);
        events.push(KvEvent::Cleared);
        for c in chained {
            let key = keys[c.block as usize].expect("keyed above");
            let parent = c
                .parent
                .map(|p| keys[p as usize].expect("a parent is keyed"));
            let extras = self.extras_of(&c, &mut buffer);
            events.push(stored_event(
                (key, parent),
                &self.table.read_row(c.block),
                (&c.origin.root, &unsalted_root),
                extras,
                c.origin.extras.adapter.clone(),
                policy,
            ));
        }
        events
    }

    /// A cached block's encoded extras: a tagged run's first block keeps its own; every other
    /// one has only its chain's adapter (`Origin::without_multimodal`).
    fn extras_of<'a>(&'a self, c: &Chained, buffer: &'a mut Vec<u8>) -> &'a [u8] {
        match &self.runs[c.run as usize].tag {
            Some(tag) if c.pos == 0 => &tag.extras,
            _ => block_extras(&c.origin.extras, c.depth, self.block_size, buffer),
        }
    }

    /// Every cached block in chain order (by depth, then block id), and the key of each block
    /// of the pool (`None`: not cached), computed from the runs: each first run's chain keyed
    /// from its origin, each child's from the block it hangs after (a run's children hang
    /// after its last block: a commit that branches inside a run splits it first).
    fn cached_block_keys(&self) -> (Vec<Chained>, Vec<Option<BlockKey>>) {
        let mut keys = vec![None; self.num_blocks as usize];
        let mut chained = Vec::new();
        let (mut scratch, mut buffer) = (Vec::new(), Vec::new());
        let mut stack: Vec<Hanging> = self
            .runs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.shared.is_some() && r.parent == NONE)
            .map(|(run, r)| {
                let origin = r.origin.clone().expect("a first run keeps its origin");
                Hanging {
                    run: run as u32,
                    depth: 0,
                    parent: None,
                    parent_key: origin.root,
                    origin,
                }
            })
            .collect();
        while let Some(Hanging {
            run,
            depth,
            mut parent,
            mut parent_key,
            origin,
        }) = stack.pop()
        {
            let r = &self.runs[run as usize];
            for pos in 0..r.len {
                let block = self.block(run, pos);
                let c = Chained {
                    depth: depth + pos as usize,
                    run,
                    pos,
                    block,
                    parent,
                    origin: Arc::clone(&origin),
                };
                let extras = self.extras_of(&c, &mut buffer);
                let key = block_key_with(
                    &mut scratch,
                    &parent_key,
                    &self.table.read_row(block),
                    extras,
                );
                keys[block as usize] = Some(key);
                chained.push(c);
                (parent, parent_key) = (Some(block), key);
            }
            for &child in &r.children {
                stack.push(Hanging {
                    run: child,
                    depth: depth + r.len as usize,
                    parent,
                    parent_key,
                    origin: Arc::clone(&origin),
                });
            }
        }
        chained.sort_unstable_by_key(|c| (c.depth, c.block));
        (chained, keys)
    }
}
