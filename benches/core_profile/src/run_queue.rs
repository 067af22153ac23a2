//! The runs of `run_segments.rs` over a per-block pool: per-block reference counts
//! and vLLM's free queue (a doubly linked list of blocks; a finished request's free blocks
//! appended tail first, a hit taking its blocks out, allocation popping the front and evicting
//! what it pops), so the eviction order, and hence every hit, is the per-block one the step
//! API must keep. Only the table's unit changes: a run of blocks (a radix node) holds its blocks'
//! ids in order, found by its first block's tokens, verified token by token against the rows.
//!
//! What that order asks of runs: the queue can pop a block from the middle of a run (a child
//! still held while its parent was freed, as vLLM allows), so evicting block `k` of a run cuts
//! it there: blocks before `k` stay, block `k` is freed, and the blocks after it (and the runs
//! hanging after them) can no longer be reached, as in vLLM, where a block whose parent was
//! evicted stays in the map unreachable until the queue reaches it. They become an orphan run,
//! evicted block by block as the queue reaches them. So each block records its run and its
//! position (one per-block line with its reference count and queue links), rewritten for the
//! tail when a run is cut or split.
//!
//! An ablation for `benches/PROFILE.md` (round 18), not a model of the core: it follows vLLM's
//! queue literally (blocks holding no entry wait in it too; no spares), so its hits differ from
//! the core's on a few requests of the production trace. One thread, no events, no extras.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::stand_in::{block_key, Index, StandIn, NONE};

/// Per block: one 24-byte record (reference count, queue links, owning run and position).
#[derive(Clone, Copy)]
struct BlockMeta {
    refs: u32,
    prev: u32,
    next: u32,
    /// The run holding this block's cached entry, or `NONE`.
    run: u32,
    /// Its position in that run.
    offset: u32,
    queued: bool,
}

struct Run {
    seq: AtomicU64,
    parent: u32,
    blocks: Vec<u32>,
    children: Vec<u32>,
    root_key: u64,
    /// Reachable from the root (an orphan's parent block was evicted).
    reachable: bool,
}

pub struct QueueRequest {
    tokens: Vec<u32>,
    pub blocks: Vec<u32>,
    pub cached_blocks: usize,
    attach: (u32, u32),
}

pub struct RunQueue {
    block_size: usize,
    runs: Vec<Run>,
    free_runs: Vec<u32>,
    roots: Index,
    /// A run's children by (parent run, first block's tokens); `run_segments.rs` keys them by
    /// the parent's last block instead, which a split leaves with the children.
    branches: Index,
    meta: Vec<BlockMeta>,
    rows: Vec<u32>,
    head: u32,
    tail: u32,
    free_count: usize,
    pub evictions: u64,
}

impl RunQueue {
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        let n = num_blocks as usize;
        let meta = (0..n)
            .map(|i| BlockMeta {
                refs: 0,
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: if i + 1 == n { NONE } else { i as u32 + 1 },
                run: NONE,
                offset: 0,
                queued: true,
            })
            .collect();
        Self {
            block_size,
            runs: Vec::new(),
            free_runs: Vec::new(),
            roots: Index::default(),
            branches: Index::default(),
            meta,
            rows: vec![u32::MAX; n * block_size],
            head: 0,
            tail: num_blocks - 1,
            free_count: n,
            evictions: 0,
        }
    }

    /// Indexes `child`, whose first block is `first`, under `parent` (or drops it: `None`).
    fn index_child(&mut self, parent: u32, child: u32, first: u32, add: bool) {
        let key = block_key(Some(parent), self.row(first));
        if add {
            self.branches.insert(key, child);
        } else if self.branches.get(&key) == Some(&child) {
            self.branches.remove(&key);
        }
    }

    /// Moves `children` from under `from` to under `to` (a split or a cut).
    fn move_children(&mut self, from: u32, to: u32, children: &[u32]) {
        for &c in children {
            let first = self.runs[c as usize].blocks[0];
            self.index_child(from, c, first, false);
            if to != NONE {
                self.index_child(to, c, first, true);
            }
            self.runs[c as usize].parent = to;
        }
    }

    fn row(&self, block: u32) -> &[u32] {
        let bs = self.block_size;
        &self.rows[block as usize * bs..(block as usize + 1) * bs]
    }

    fn new_run(&mut self, parent: u32) -> u32 {
        let index = if let Some(i) = self.free_runs.pop() {
            i
        } else {
            self.runs.push(Run {
                seq: AtomicU64::new(0),
                parent: NONE,
                blocks: Vec::new(),
                children: Vec::new(),
                root_key: 0,
                reachable: true,
            });
            (self.runs.len() - 1) as u32
        };
        let r = &mut self.runs[index as usize];
        r.parent = parent;
        r.reachable = true;
        r.root_key = 0;
        index
    }

    fn write_begin(&self, run: u32) {
        self.runs[run as usize].seq.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    fn write_end(&self, run: u32) {
        self.runs[run as usize].seq.fetch_add(1, Ordering::Release);
    }

    fn unqueue(&mut self, block: u32) {
        let m = self.meta[block as usize];
        if m.prev == NONE {
            self.head = m.next;
        } else {
            self.meta[m.prev as usize].next = m.next;
        }
        if m.next == NONE {
            self.tail = m.prev;
        } else {
            self.meta[m.next as usize].prev = m.prev;
        }
        self.meta[block as usize].queued = false;
        self.free_count -= 1;
    }

    fn enqueue(&mut self, block: u32) {
        let tail = self.tail;
        {
            let m = &mut self.meta[block as usize];
            m.prev = tail;
            m.next = NONE;
            m.queued = true;
        }
        if tail == NONE {
            self.head = block;
        } else {
            self.meta[tail as usize].next = block;
        }
        self.tail = block;
        self.free_count += 1;
    }

    /// The longest cached prefix of `tokens`, held; then fresh blocks for the rest.
    pub fn begin(&mut self, tokens: Vec<u32>) -> QueueRequest {
        let bs = self.block_size;
        let full = tokens.len() / bs;
        let mut blocks: Vec<u32> = Vec::with_capacity(tokens.len().div_ceil(bs));
        let mut attach = (NONE, 0u32);
        // The end of the run matched before `attach`'s.
        let mut before = (NONE, 0u32);
        if full > 0 {
            let mut next = self
                .roots
                .get(&block_key(None, &tokens[..bs]))
                .copied()
                .unwrap_or(NONE);
            while next != NONE {
                let r = &self.runs[next as usize];
                let seq = r.seq.load(Ordering::Acquire);
                let at = blocks.len();
                let take = r.blocks.len().min(full - at);
                let mine = &tokens[at * bs..(at + take) * bs];
                let matched = mine
                    .chunks_exact(bs)
                    .zip(&r.blocks[..take])
                    .take_while(|(a, &b)| *a == self.row(b))
                    .count();
                fence(Ordering::Acquire);
                if matched == 0 || r.seq.load(Ordering::Relaxed) != seq {
                    break;
                }
                blocks.extend_from_slice(&r.blocks[..matched]);
                before = attach;
                attach = (next, matched as u32);
                let at = blocks.len();
                if matched < r.blocks.len() || at == full {
                    break;
                }
                let want = &tokens[at * bs..(at + 1) * bs];
                let here = next;
                next = self
                    .branches
                    .get(&block_key(Some(here), want))
                    .copied()
                    .filter(|&c| self.runs[c as usize].parent == here)
                    .unwrap_or(NONE);
            }
        }
        if blocks.len() == full && full * bs == tokens.len() && full > 0 {
            // Every block cached: the last one is recomputed into a private block, as vLLM's
            // runner does and the core's default (`FullHit::RecomputeLastBlock`).
            blocks.pop();
            attach.1 -= 1;
            if attach.1 == 0 {
                // The recomputed block goes after the run before (or at the root).
                attach = before;
            }
        }
        let cached = blocks.len();
        for &b in &blocks {
            self.meta[b as usize].refs += 1;
            if self.meta[b as usize].queued {
                self.unqueue(b);
            }
        }
        let fresh = tokens.len().div_ceil(bs) - cached;
        assert!(
            fresh <= self.free_count,
            "the cache cannot hold this request"
        );
        for _ in 0..fresh {
            let b = self.head;
            self.unqueue(b);
            if self.meta[b as usize].run != NONE {
                self.evict(b);
            }
            self.meta[b as usize].refs = 1;
            blocks.push(b);
        }
        QueueRequest {
            tokens,
            blocks,
            cached_blocks: cached,
            attach,
        }
    }

    /// Takes cached block `block` out of its run: the run ends before it, and what came after
    /// it (its later blocks, the runs hanging after them) can no longer be reached.
    fn evict(&mut self, block: u32) {
        self.evictions += 1;
        let BlockMeta { run, offset, .. } = self.meta[block as usize];
        self.meta[block as usize].run = NONE;
        let k = offset as usize;
        self.write_begin(run);
        let after: Vec<u32> = self.runs[run as usize].blocks.split_off(k + 1);
        self.runs[run as usize].blocks.pop();
        let children = std::mem::take(&mut self.runs[run as usize].children);
        self.write_end(run);
        if !after.is_empty() {
            let orphan = self.new_run(NONE);
            for (i, &b) in after.iter().enumerate() {
                let m = &mut self.meta[b as usize];
                m.run = orphan;
                m.offset = i as u32;
            }
            let o = &mut self.runs[orphan as usize];
            o.reachable = false;
            o.blocks = after;
            self.move_children(run, orphan, &children);
            self.runs[orphan as usize].children = children;
        } else {
            self.move_children(run, NONE, &children);
            for c in children {
                self.detach(c);
            }
        }
        if k == 0 {
            self.unhook(run, block);
        }
    }

    /// Makes `run` unreachable (the runs under it, reached only through it, are too).
    fn detach(&mut self, run: u32) {
        let r = &mut self.runs[run as usize];
        r.parent = NONE;
        r.reachable = false;
    }

    /// Removes the emptied `run` from its parent (or the root map) and recycles it.
    fn unhook(&mut self, run: u32, first: u32) {
        let (parent, key, reachable) = {
            let r = &self.runs[run as usize];
            (r.parent, r.root_key, r.reachable)
        };
        if parent != NONE {
            self.index_child(parent, run, first, false);
            self.runs[parent as usize].children.retain(|&c| c != run);
        } else if reachable && self.roots.get(&key) == Some(&run) {
            self.roots.remove(&key);
        }
        self.free_runs.push(run);
    }

    /// Publishes the request's fresh full blocks after what it matched.
    pub fn commit(&mut self, request: &mut QueueRequest) {
        let bs = self.block_size;
        let full = request.tokens.len() / bs;
        let at = request.cached_blocks;
        if full == at {
            return;
        }
        let (run, matched) = request.attach;
        // A full hit's recomputed last block, if its canonical copy is still cached right after
        // what the request holds (the run's next block, a child's first, or a first block):
        // it stays private (the core deduplicates it at commit) and goes back at finish.
        let block = &request.tokens[at * bs..full * bs];
        if full - at == 1 {
            let canonical = if run == NONE {
                self.roots.get(&block_key(None, block)).map(|&r| (r, 0))
            } else if (matched as usize) < self.runs[run as usize].blocks.len() {
                Some((run, matched))
            } else {
                self.branches
                    .get(&block_key(Some(run), block))
                    .copied()
                    .filter(|&c| self.runs[c as usize].parent == run)
                    .map(|c| (c, 0))
            };
            if let Some((r, k)) = canonical {
                if self.runs[r as usize]
                    .blocks
                    .get(k as usize)
                    .map(|&b| self.row(b))
                    == Some(block)
                {
                    return;
                }
            }
        }
        // The run matched last may have lost blocks since begin only if they were free; the
        // request holds what it matched, so the run still has at least `matched` blocks.
        let target = if run == NONE {
            let key = block_key(None, &request.tokens[..bs]);
            let new = self.new_run(NONE);
            self.runs[new as usize].root_key = key;
            self.roots.insert(key, new);
            new
        } else {
            if (matched as usize) < self.runs[run as usize].blocks.len() {
                self.split(run, matched as usize);
            }
            if self.runs[run as usize].children.is_empty() {
                run
            } else {
                let new = self.new_run(run);
                self.runs[run as usize].children.push(new);
                new
            }
        };
        if target != run && run != NONE {
            let bs = self.block_size;
            let first = request.blocks[at];
            self.rows[first as usize * bs..(first as usize + 1) * bs]
                .copy_from_slice(&request.tokens[at * bs..(at + 1) * bs]);
            self.index_child(run, target, first, true);
        }
        for (chunk, &b) in request.tokens[at * bs..full * bs]
            .chunks_exact(bs)
            .zip(&request.blocks[at..full])
        {
            self.rows[b as usize * bs..(b as usize + 1) * bs].copy_from_slice(chunk);
        }
        let start = self.runs[target as usize].blocks.len();
        for (i, &b) in request.blocks[at..full].iter().enumerate() {
            let m = &mut self.meta[b as usize];
            m.run = target;
            m.offset = (start + i) as u32;
        }
        self.write_begin(target);
        self.runs[target as usize]
            .blocks
            .extend_from_slice(&request.blocks[at..full]);
        self.write_end(target);
        request.cached_blocks = full;
    }

    /// Cuts `run` after `at` blocks: the tail becomes a child run that takes the children.
    fn split(&mut self, run: u32, at: usize) {
        let tail = self.new_run(run);
        self.write_begin(run);
        let blocks = self.runs[run as usize].blocks.split_off(at);
        let children = std::mem::take(&mut self.runs[run as usize].children);
        self.runs[run as usize].children.push(tail);
        self.write_end(run);
        for (i, &b) in blocks.iter().enumerate() {
            let m = &mut self.meta[b as usize];
            m.run = tail;
            m.offset = i as u32;
        }
        self.move_children(run, tail, &children);
        let first = blocks[0];
        let t = &mut self.runs[tail as usize];
        t.blocks = blocks;
        t.children = children;
        self.index_child(run, tail, first, true);
    }

    /// Releases the request's blocks, tail first, as vLLM's `free` does.
    pub fn finish(&mut self, request: QueueRequest) {
        for &b in request.blocks.iter().rev() {
            self.meta[b as usize].refs -= 1;
            if self.meta[b as usize].refs == 0 {
                self.enqueue(b);
            }
        }
    }
}

impl StandIn for RunQueue {
    type Request = QueueRequest;
    fn begin(&mut self, tokens: Vec<u32>) -> Option<QueueRequest> {
        Some(RunQueue::begin(self, tokens))
    }
    fn commit(&mut self, request: &mut QueueRequest) {
        RunQueue::commit(self, request);
    }
    fn finish(&mut self, request: QueueRequest) {
        RunQueue::finish(self, request);
    }
    fn blocks(request: &QueueRequest) -> &[u32] {
        &request.blocks
    }
    fn cached_blocks(request: &QueueRequest) -> usize {
        request.cached_blocks
    }
}
