//! The writer's half of a cache whose unit is a run of blocks (step 2 of the plan in
//! `benches/PROFILE.md`, issue 24): what requests hold, the eviction order, duplicates. Readers
//! see the runs through [`RunTable`]; this module decides what the table holds. It serves the
//! request cycle (begin, commit, finish, each with a retention priority) and the step API's
//! (add, allocate_slots chunk by chunk, append_tokens, commit, preempt, finish), and hands out
//! exactly the blocks [`crate::PrefixCache`] hands out, in its order, which is the step API's
//! contract with vLLM: the tests run both side by side, block table for block table. It
//! serves `PrefixCache(core="runs")` (`by_id.rs`), pins (`pins.rs`), the eviction log and both
//! `FullHit` modes (`hit.rs`), KV events (`events.rs`) and multimodal items included; what it
//! leaves out for now: sliding windows, groups and the low-level block calls.
//!
//! ## Runs
//! A run is a chain of blocks with no branch inside: what a commit publishes under one parent,
//! grown in place by a later commit that continues it, cut where a later prompt branches (the
//! tail becomes a child run, as a radix tree splits a node). A first run is found by its root
//! key and first block, a run's children by the run's id and length and their first block
//! (`RunTable::find`); every token of a hit is verified against the blocks' token rows.
//!
//! A block with multimodal items (equal placeholder tokens, other images) is always a run's
//! first block, hung under a parent that names its items' tag (`RunParent::Tagged`, or a first
//! run's `key::tagged_root`): a prompt's tagged block is looked up only there, and a run is
//! compared only up to the prompt's next tagged block (`RunTable::match_prompt`).
//!
//! ## The eviction order, per run
//! The core evicts in vLLM's order of release: blocks holding no entry first (its free list,
//! top first), then cached blocks nobody holds, lowest priority first, then least recently
//! released, a chain from its tail (a block with a cached child waits for it). On the request
//! path, without duplicates (below), a request holds a *prefix* of every run it matched (all
//! of its ancestors, part of the last), so along a run the reference counts never increase: a
//! run's free blocks are a suffix of it, released tail first, and the order, read block by
//! block, is a sequence of *segments*, a run's blocks `lo..hi`, highest first, one queue per
//! priority (`order.rs`):
//! - finish appends, per run the request held (deepest first), one segment: the blocks whose
//!   count fell to 0;
//! - a hit on a run's first `m` blocks takes `lo..min(hi, m)` out of that run's segments (a
//!   prefix of a segment's range is the end popped last, so a segment only shrinks);
//! - allocation takes the front segment's highest blocks, the run's last ones (its children
//!   went first: their counts fall no later), so eviction truncates a run from its tail in one
//!   step, the block ids handed over in bulk.
//!
//! A split moves the run's segments past the branch to the tail run, and cuts one across it in
//! two. A request's holds are ranges of runs' blocks in its table's order (`Held`); a split
//! leaves the run a `continued` link to the run that took its tail, so a hold made before the
//! split is read through it (`resolve`). A `continued` link may outlive the run it names
//! (recycled); only a hold past the split follows it, and that hold keeps the run alive.
//!
//! ## Duplicates
//! A block another request published first (a full hit's recomputed last block, or blocks two
//! requests in flight computed alike) is recorded at commit as a *duplicate* of the cached
//! (canonical) block; the request keeps its own copy and chains on: its next block is the
//! copy's *successor*, whose parent in the core's pool is the copy, not the canonical block.
//! At finish a duplicate becomes a *spare*, in the order after the request's other blocks,
//! taken like any free block while the canonical copy lives. A block is evictable when it is a
//! leaf of the core's pool: every block hanging right after it is some duplicate's successor.
//! Evicting a canonical block that has duplicates moves its entry into the earliest recorded
//! one: a spare takes its place in the run and its place in the order; a duplicate still held
//! takes the place in the run, held, and its request's finish releases it as the run's block.
//! So a replacement can happen in the middle of a run, and counts can rise along a run; a
//! truncation stays at a run's tail. A segment whose top block is not a leaf waits, *blocked*,
//! and allocation comes back to it; among blocks released by one finish (one tick) the lowest
//! block id goes first (the core's eviction key).
//!
//! The writer keeps no copy of a run's block ids: it reads them from the table's chunks
//! through its own list of each run's chunks (`RunTable::block_at`, `read_ids`).
//!
//! Here: the records, begin and finish. `steps.rs`: the step API (a request added waiting,
//! its slots allocated chunk by chunk, decode tokens appended, preemption); `order.rs`: the
//! eviction order and allocation; `publish.rs`: commit; `pins.rs`: pins, kept out of eviction
//! in their places in the order; `invariants.rs`: what the tests check after their steps.

mod by_id;
mod events;
mod hit;
mod invariants;
mod observe;
mod order;
mod pins;
mod publish;
#[cfg(test)]
mod step_tests;
mod steps;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;

use crate::cache::FullHit;
use crate::events::Events;
use crate::key::BlockKey;
use crate::pool::BlockId;
use crate::run_table::{RunAllocator, RunParent, RunRef, RunTable};

pub use by_id::RunPrefixCache;
pub use events::Origin;
pub use hit::{lookup_in, RunLookup};
pub use observe::RunBlockCounts;
use order::Order;
use publish::RunTag;
pub use steps::RunSlots;

/// "No run, block, segment or record".
const NONE: u32 = u32::MAX;

/// Stores `value` in a slab of records, in a slot freed before if there is one; its index.
fn slab_put<T>(items: &mut Vec<T>, free: &mut Vec<u32>, value: T) -> u32 {
    if let Some(id) = free.pop() {
        items[id as usize] = value;
        id
    } else {
        items.push(value);
        u32::try_from(items.len() - 1).expect("fewer records than blocks")
    }
}

/// A duplicate: a request's own copy of a block another request published first (its
/// canonical copy), recorded at commit. While its request holds it, it waits; at finish it
/// becomes a spare (`segment`). If the canonical copy is evicted first, the earliest recorded
/// duplicate of it takes its place in the run, held or spare, as the core's pool moves the
/// entry (`inherited` then tells the holder's finish to release it as the run's block).
#[derive(Clone, Copy, Debug)]
struct Dup {
    run: u32,
    pos: u32,
    block: BlockId,
    /// Its spare's segment, once its request has finished; `NONE` while held.
    segment: u32,
    /// Its request's retention priority (the copy's own, should it inherit the entry).
    priority: i32,
    inherited: bool,
    /// The block its request published right after it, which hangs after `pos` with this
    /// copy, not the canonical one, as its parent in the core's pool (so the canonical copy
    /// can be evicted, the entry moving here); `NONE` if none, or once that block is gone.
    successor: BlockId,
}

/// The writer's record of a run; the block ids are the table's.
struct Run {
    /// Where the run table holds the run's block ids and rows (`None` while recycled).
    shared: Option<RunRef>,
    /// The parent run, or `NONE` for a first run (hung under a root key, which only the
    /// table keeps: the writer needs it once, when its request publishes the run).
    parent: u32,
    /// Blocks in the run (the table's length, kept here so the writer need not read it).
    len: u32,
    /// Per block: the requests holding it.
    refs: Vec<u32>,
    /// Per block: its retention priority, the highest of any request that held it since it
    /// joined the run (the core's pool keeps it so: a low-priority hit cannot demote a
    /// protected prefix). Blocks released together split into segments where it changes.
    priority: Vec<i32>,
    /// `Some(p)` while every block's priority is `p` (the usual case: one priority in use),
    /// so that a release at `p` or lower neither writes nor reads `priority`.
    one_priority: Option<i32>,
    children: Vec<u32>,
    /// This run's segments in the order (any order: each knows its place).
    segments: Vec<u32>,
    /// Duplicates of this run's blocks (records in `RunCache::dups`), earliest first. A hot
    /// prompt's full hits can leave thousands at its last block, as spares taken oldest first
    /// (`drop_dup`): a deque, so that taking one moves nothing.
    dups: VecDeque<u32>,
    /// Per block: the pins on it (`pins.rs`), or empty while none was taken since the run was
    /// made. Each pin covers a prefix of the run, so the counts never rise along it.
    pins: Vec<u32>,
    /// The run's first `pinned` blocks are pinned: queued (when nobody holds them) but never
    /// given, and not counted obtainable.
    pinned: u32,
    /// Of `dups`, how many have a successor (`Dup::successor`, kept by `set_successor`): with
    /// none, no block hangs under a copy, and eviction asks nothing of the copies (`evictable`,
    /// `forget_as_successor`). So thousands of spares cost nothing per eviction.
    with_successor: u32,
    /// The run a split gave this run's former tail to (what a request holding past the split
    /// point continues into).
    continued: u32,
    /// A first run's origin, what its blocks' SHA-256 keys chain from (`events.rs`), without
    /// multimodal items (they key only the blocks they overlap: `tag`); `None` for a child run.
    origin: Option<Arc<Origin>>,
    /// When its first block has multimodal items: their tag (`key::run_tag`, which its place in
    /// the run table names) and the block's encoded extras (its events' `extras`).
    tag: Option<Box<RunTag>>,
}

/// Blocks `lo..hi` of `run`, free, of one priority: a segment about to be queued.
#[derive(Clone, Copy, Debug)]
struct Stretch {
    run: u32,
    lo: u32,
    hi: u32,
    priority: i32,
}

impl Run {
    /// Sets block `pos`'s priority (an entry moved into a copy takes the copy's).
    fn set_priority(&mut self, pos: u32, priority: i32) {
        self.priority[pos as usize] = priority;
        if self.one_priority != Some(priority) {
            self.one_priority = None;
        }
    }
}

/// What a request holds, in its block table's order.
#[derive(Clone, Copy, Debug)]
enum Held {
    /// Blocks `from..to` of a run (as the run was when taken: `resolve`).
    Blocks { run: u32, from: u32, to: u32 },
    /// Its own copy of a cached block (a duplicate record).
    Copy(u32),
}

/// A request between `begin` and `finish`.
pub struct RunRequest {
    /// The root the run table matches it under (its origin's `run_root`).
    root: BlockKey,
    /// Its blocks with multimodal items, by block index, ascending, and their tags
    /// (`RequestExtras::run_tags`): each is matched and published only as a run's first block.
    /// Computed for its first `tagged_to` blocks, the full ones so far (`extend_tags`).
    tags: Vec<(u32, BlockKey)>,
    tagged_to: usize,
    /// The block size its tags are computed at; 0 without multimodal items (nothing to tag).
    tag_block_size: usize,
    /// What its block keys chain from (events, `block_keys`).
    origin: Arc<Origin>,
    tokens: Vec<u32>,
    priority: i32,
    held: Vec<Held>,
    blocks: Vec<BlockId>,
    cached_blocks: usize,
    /// Every block of the prompt was cached: the last one is recomputed all the same, or with
    /// `FullHit::ReuseLastBlock` held shared too (`last_token_shared`).
    full_hit: bool,
    /// The hit holds the prompt's last block shared: only the last token is computed, reading
    /// its KV from that block (`FullHit::ReuseLastBlock`).
    last_token_shared: bool,
    /// Full blocks committed (the rest of the table is private).
    committed: usize,
    /// Tokens whose KV is written: the hit's, then what `commit` said.
    num_computed: usize,
    /// False while waiting: no blocks held, no prefix matched (`steps.rs`).
    scheduled: bool,
    /// The longest hit its matches may use (`limit_cached_prefix`); kept until changed.
    max_cached_tokens: Option<usize>,
    /// How many of the last `tokens` are unverified drafts (never published).
    num_drafts: usize,
}

impl RunRequest {
    /// The request's block table: its cached blocks, then its own.
    #[must_use]
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Blocks of the table that were cached at `begin`.
    #[must_use]
    pub fn cached_blocks(&self) -> usize {
        self.cached_blocks
    }

    /// The request's tokens: its prompt, then what `append_tokens` added.
    #[must_use]
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens whose KV is written: the cached prefix, then what `commit` recorded.
    #[must_use]
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed
    }

    /// Whether it holds blocks (false while waiting: after `RunCache::add`, or `preempt`).
    #[must_use]
    pub fn is_scheduled(&self) -> bool {
        self.scheduled
    }

    /// Whether every block of the prompt was cached (then the last one is recomputed into a
    /// private block, as the core's default `FullHit::RecomputeLastBlock` does, or held shared
    /// under `FullHit::ReuseLastBlock`).
    #[must_use]
    pub fn full_hit(&self) -> bool {
        self.full_hit
    }

    /// Whether its hit holds the prompt's last block shared (`FullHit::ReuseLastBlock`): the
    /// engine computes the last token's logits reading its KV there and must not write it.
    #[must_use]
    pub fn last_token_shared(&self) -> bool {
        self.last_token_shared
    }
}

/// `RunCache::begin` refused: the fresh blocks the request needed past its hit, and those it
/// could have had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunRefusal {
    pub needed: usize,
    pub obtainable: usize,
}

/// What the cache did, counted (what tests check they exercised, and what benches report).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunCounters {
    pub evictions: u64,
    /// Branches inside a run.
    pub splits: u64,
    /// Entries a duplicate inherited: a spare, or one its request still held.
    pub spare_take_overs: u64,
    pub held_take_overs: u64,
    /// Replacements of a run's last block while children hang under it (they stay found: the
    /// table finds them by the run's id and length, not its last block).
    pub ends_replaced_under_children: u64,
    /// Duplicates recorded, and those with a successor (two requests computing alike).
    pub copies: u64,
    pub copies_with_successor: u64,
    /// Steps `resolve` took across a split (a hold made before it).
    pub steps_across_splits: u64,
}

/// The request cycle on runs; see the module docs.
pub struct RunCache {
    num_blocks: u32,
    block_size: usize,
    /// How a full hit is served (`with_full_hit`).
    full_hit: FullHit,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    /// What a lock-free reader reads: runs' block ids in chunks, the blocks' token rows, the
    /// index of runs by parent and first block. Shared, so that readers on other threads (a router probing while the scheduler
    /// allocates) match prompts while this writer changes it (`shared_table`).
    table: Arc<RunTable>,
    alloc: RunAllocator,
    /// The run recorded for each of the table's slots.
    by_slot: Vec<u32>,
    order: Order,
    dups: Vec<Dup>,
    free_dups: Vec<u32>,
    /// Blocks pinned at least once (`pins.rs`).
    num_pinned: usize,
    /// With the log on, the blocks evicted since the last drain, in eviction order (the core's
    /// `set_eviction_log`: a host tier copies their pages out before they are written again).
    /// An entry moved into a duplicate is not evicted, nor is a spare taken.
    pub(super) eviction_log: Option<Vec<BlockId>>,
    /// The release clock: one tick per finish, one more for its spares.
    tick: u64,
    counters: RunCounters,
    /// KV events, recorded while on (`events.rs`).
    events: Events,
}

impl RunCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens, all free; `None` when the memory
    /// cannot be had, or the sizes are out of range (`RunTable::new`) or would take more than
    /// the cache's bound on memory allocated up front (`cache::MAX_UP_FRONT_BYTES`, with
    /// `cache::MAX_BLOCK_SIZE`). `seed` seeds the index hashes.
    #[must_use]
    pub fn new(num_blocks: u32, block_size: usize, seed: u64) -> Option<Self> {
        // The writer's own records, per block: a slot's chunk list and hash, a free list entry.
        let writer = num_blocks as usize * 48;
        let bytes =
            RunTable::bytes_up_front(num_blocks as usize, block_size)?.checked_add(writer)?;
        if bytes > crate::cache::MAX_UP_FRONT_BYTES || block_size > crate::cache::MAX_BLOCK_SIZE {
            return None;
        }
        let table = Arc::new(RunTable::new(num_blocks as usize, block_size, seed)?);
        let alloc = RunAllocator::new(&table);
        Some(Self {
            num_blocks,
            block_size,
            full_hit: FullHit::default(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            by_slot: vec![NONE; table.num_slots()],
            table,
            alloc,
            order: Order::new(num_blocks),
            dups: Vec::new(),
            free_dups: Vec::new(),
            num_pinned: 0,
            eviction_log: None,
            tick: 0,
            counters: RunCounters::default(),
            events: Events::default(),
        })
    }

    /// This cache, serving full hits as `full_hit` says (the default recomputes the last
    /// block). Set it before the first request: the mode shapes every match.
    #[must_use]
    pub fn with_full_hit(mut self, full_hit: FullHit) -> Self {
        self.full_hit = full_hit;
        self
    }

    /// What the cache did so far.
    #[must_use]
    pub fn counters(&self) -> RunCounters {
        self.counters
    }

    /// The table readers read.
    #[must_use]
    pub fn table(&self) -> &RunTable {
        &self.table
    }

    /// The table, for readers on other threads: `RunTable::match_prompt` there sees what this
    /// cache's `lookup` sees, lock-free, while the cache goes on changing it.
    #[must_use]
    pub fn shared_table(&self) -> Arc<RunTable> {
        Arc::clone(&self.table)
    }

    /// Blocks a request could be given now: free ones and cached ones nobody holds.
    #[must_use]
    pub fn obtainable(&self) -> usize {
        self.order.free_count
    }

    /// The id of the block at `pos` of `run`.
    fn block(&self, run: u32, pos: u32) -> BlockId {
        let shared = self.runs[run as usize]
            .shared
            .expect("a live run is in the table");
        self.table.block_at(&self.alloc, shared, pos as usize)
    }

    /// Where `run`'s blocks hang, as the run table knows it (`root`: a first run's root),
    /// under its first block's tag if it has one.
    fn shared_parent(&self, run: u32, root: BlockKey) -> RunParent {
        let r = &self.runs[run as usize];
        let under = (r.parent != NONE).then(|| {
            let p = &self.runs[r.parent as usize];
            (p.shared.expect("a parent is in the table").id, p.len)
        });
        RunParent::of_block(under, &root, r.tag.as_ref().map(|t| &t.key))
    }

    /// A run record for a new run under `parent` (`NONE`: a first run), empty until published.
    fn new_run(&mut self, parent: u32) -> u32 {
        let Some(index) = self.free_runs.pop() else {
            self.runs.push(Run {
                shared: None,
                parent,
                len: 0,
                refs: Vec::new(),
                priority: Vec::new(),
                one_priority: None,
                children: Vec::new(),
                segments: Vec::new(),
                dups: VecDeque::new(),
                pins: Vec::new(),
                pinned: 0,
                with_successor: 0,
                continued: NONE,
                origin: None,
                tag: None,
            });
            return u32::try_from(self.runs.len() - 1).expect("fewer runs than blocks");
        };
        // Recycled: `unhook` left it out of the table with every vector empty (their capacity
        // kept), so only the rest is set.
        let r = &mut self.runs[index as usize];
        debug_assert!(
            r.shared.is_none()
                && r.len == 0
                && r.refs.is_empty()
                && r.priority.is_empty()
                && r.pins.is_empty()
                && r.pinned == 0
                && r.with_successor == 0
                && r.origin.is_none()
                && r.tag.is_none()
        );
        r.parent = parent;
        r.one_priority = None;
        r.continued = NONE;
        index
    }

    /// The longest cached prefix of `tokens` under `root`, held; then fresh blocks for the
    /// rest: `add` and `allocate_slots` for the whole prompt, in one step. Refused, with
    /// nothing changed, when the blocks are not there.
    ///
    /// # Panics
    /// On an empty prompt (a caller's bug: the cache's API refuses one by name).
    pub fn begin(
        &mut self,
        root: BlockKey,
        tokens: Vec<u32>,
        priority: i32,
    ) -> Result<RunRequest, RunRefusal> {
        assert!(!tokens.is_empty(), "a request needs at least one token");
        let mut request = Self::add(root, tokens, priority);
        match self.schedule(&mut request, None, 0, 0) {
            Ok(_) => Ok(request),
            Err(crate::error::CacheError::OutOfBlocks { needed, available }) => Err(RunRefusal {
                needed,
                obtainable: available,
            }),
            Err(other) => {
                unreachable!("a whole prompt's allocation is refused only for blocks: {other}")
            }
        }
    }

    /// The cached prefix of `tokens` under `root` (a text prompt), without taking references:
    /// what `begin` would hit now (a full hit shaped by the cache's `FullHit` mode). Reads only
    /// the run table, as a reader on another thread could (`lookup_in`).
    #[must_use]
    pub fn lookup(&self, root: &BlockKey, tokens: &[u32]) -> RunLookup {
        lookup_in(&self.table, root, tokens, &[], self.full_hit)
    }

    /// Takes a reference on the run's first `upto` blocks; those that were free leave the
    /// order.
    fn acquire(&mut self, run: u32, upto: u32) {
        let r = &mut self.runs[run as usize];
        for count in &mut r.refs[..upto as usize] {
            *count += 1;
        }
        self.order.take_below(&mut r.segments, upto, r.pinned);
    }

    /// Releases what the request held, as the core's `finish` does: its private blocks to the
    /// free list (in table order); its cached blocks last to first, on one tick, each run's
    /// consecutive blocks whose count falls to 0 as one segment (its duplicates that took their
    /// canonical copy's entry among them, as that block); then its other duplicates as spares,
    /// one tick later.
    pub fn finish(&mut self, request: RunRequest) {
        self.release(&request);
    }

    /// What `finish` releases, leaving the request as it was (`preempt` resets it).
    fn release(&mut self, request: &RunRequest) {
        if !request.scheduled {
            return;
        }
        let private = &request.blocks[request.committed.max(request.cached_blocks)..];
        self.order.free_private(private);
        self.tick += 1;
        let priority = request.priority;
        let mut open: Option<Stretch> = None;
        let mut spares = Vec::new();
        for item in self.resolve(&request.held).into_iter().rev() {
            match item {
                Held::Blocks { run, from, to } => {
                    self.release_blocks(run, from, to, priority, &mut open);
                }
                Held::Copy(dup) => {
                    let Dup {
                        run,
                        pos,
                        inherited,
                        ..
                    } = self.dups[dup as usize];
                    if inherited {
                        self.release_blocks(run, pos, pos + 1, priority, &mut open);
                        self.drop_dup(dup);
                    } else {
                        spares.push(dup);
                    }
                }
            }
        }
        if let Some(stretch) = open {
            self.push_blocks(stretch);
        }
        if !spares.is_empty() {
            self.tick += 1;
            for dup in spares {
                let segment = self.order.push(NONE, 0, 0, dup, priority, self.tick);
                self.dups[dup as usize].segment = segment;
            }
        }
    }

    /// Queues a stretch of a run's blocks, now free, at the back of its priority's queue.
    fn push_blocks(&mut self, stretch: Stretch) {
        let Stretch {
            run,
            lo,
            hi,
            priority,
        } = stretch;
        let segment = self.order.push(run, lo, hi, NONE, priority, self.tick);
        let r = &mut self.runs[run as usize];
        r.segments.push(segment);
        // Pinned blocks are queued in their place but not obtainable (`pins.rs`).
        self.order.free_count -= hi.min(r.pinned).saturating_sub(lo) as usize;
    }

    /// Drops one reference to blocks `from..to` of `run`, raising their priority to at least
    /// `priority`; the blocks that fall free join the open stretch, highest first, each
    /// stretch of them of one priority contiguous with it, else open one (pushing the last).
    /// Counts are decremented in one pass and the free stretches found by scanning, not block
    /// by block: usually the whole range is one stretch.
    fn release_blocks(
        &mut self,
        run: u32,
        from: u32,
        to: u32,
        priority: i32,
        open: &mut Option<Stretch>,
    ) {
        let r = &mut self.runs[run as usize];
        let range = from as usize..to as usize;
        // One priority along the run, no higher than the request's: nothing to raise, and
        // free stretches end only where a block is held.
        let uniform = r.one_priority.filter(|&p| priority <= p);
        if uniform.is_some() {
            for count in &mut r.refs[range] {
                *count -= 1;
            }
        } else {
            r.one_priority = None;
            for (count, level) in r.refs[range.clone()].iter_mut().zip(&mut r.priority[range]) {
                *count -= 1;
                *level = (*level).max(priority);
            }
        }
        let mut hi = to;
        while hi > from {
            let r = &self.runs[run as usize];
            let refs = &r.refs[from as usize..hi as usize];
            let Some(top) = refs.iter().rposition(|&c| c == 0) else {
                break;
            };
            let top = from + top as u32 + 1;
            let (level, lo) = match uniform {
                Some(level) => (
                    level,
                    refs[..(top - from) as usize].iter().rposition(|&c| c != 0),
                ),
                None => {
                    let level = r.priority[top as usize - 1];
                    let stop = (from..top).rev().find(|&pos| {
                        r.refs[pos as usize] != 0 || r.priority[pos as usize] != level
                    });
                    (level, stop.map(|pos| (pos - from) as usize))
                }
            };
            let lo = from + lo.map_or(0, |i| i as u32 + 1);
            match open {
                Some(s) if s.run == run && s.lo == top && s.priority == level => s.lo = lo,
                _ => {
                    if let Some(stretch) = open.take() {
                        self.push_blocks(stretch);
                    }
                    *open = Some(Stretch {
                        run,
                        lo,
                        hi: top,
                        priority: level,
                    });
                }
            }
            hi = lo;
        }
    }

    /// Forgets duplicate record `dup` (taken as a spare, or released after inheriting).
    fn drop_dup(&mut self, dup: u32) {
        let Dup { run, successor, .. } = self.dups[dup as usize];
        let r = &mut self.runs[run as usize];
        // Spares go oldest first: found at the front, removed without moving the others.
        let at = r
            .dups
            .iter()
            .position(|&d| d == dup)
            .expect("a duplicate is listed with its run");
        r.dups.remove(at);
        r.with_successor -= u32::from(successor != NONE);
        self.free_dups.push(dup);
    }

    /// Sets duplicate `dup`'s successor (`NONE`: none), keeping its run's count of them.
    fn set_successor(&mut self, dup: u32, successor: BlockId) {
        let d = &mut self.dups[dup as usize];
        let old = std::mem::replace(&mut d.successor, successor);
        if (old == NONE) != (successor == NONE) {
            let r = &mut self.runs[d.run as usize];
            r.with_successor =
                r.with_successor + u32::from(successor != NONE) - u32::from(old != NONE);
        }
    }

    /// The earliest duplicate of `run`'s block at `pos` not yet in its place.
    fn earliest_dup(&self, run: u32, pos: u32) -> Option<u32> {
        self.runs[run as usize]
            .dups
            .iter()
            .copied()
            .find(|&d| self.dups[d as usize].pos == pos && !self.dups[d as usize].inherited)
    }
}
