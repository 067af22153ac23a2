//! The real cache and a tiny reference model, side by side, through random operation sequences:
//! the Rust twin of `tests/test_cache_state_machine.py` (whose model, `tests/reference_cache.py`,
//! this one follows), extended to the whole API (`match_and_acquire`, `commit_blocks`, every
//! error) and to tiny table keys.
//!
//! The model indexes its table by a block's full content (root and every token up to the block's
//! end), so it has no hash and nothing to verify: it is what the verified table must behave like.
//! Collisions are the one thing it cannot know by itself, because they depend on the hash. With
//! `key_bits` of 1 to 4 they are constant, so the model asks the real `TableHasher` (same seed)
//! which *key* a content would take, and only that: a content whose key is held by another
//! content is not published, exactly as `request/publish.rs` says. Everything else (matching, refcounts,
//! the free list and the eviction order with its tie-breaks, epochs, ownership, ids, counters,
//! and which error each refused call returns) the model computes on its own.
//!
//! After every step: equal results (or equal errors), equal stats, equal refcount and cached
//! state of every block, equal block tables of every live request, and the core's own
//! `check_invariants`. At the end every request finishes and every external reference is
//! released: nothing may stay referenced, and no block may leak.

use std::collections::{BTreeMap, HashMap};

use prefixkv_core::key::{TableHasher, TableKey};
use prefixkv_core::{
    context_fingerprint, root_key, BlockId, BlockKey, CacheConfig, CacheError, CacheStats, FullHit,
    PrefixCache, RequestExtras, RequestId,
};
use proptest::collection::vec;
use proptest::prelude::*;

/// A freshly allocated block's priority, until a request touches it.
const LOWEST: i32 = i32::MIN;
/// A request id no `begin` returns in these runs.
const NEVER_BEGUN: u64 = 1 << 40;
const SALT: &[u8] = b"tenant";

/// (context index, salted): what the root of a request is made of.
type Root = (usize, bool);
/// A block's full identity in the model: its root and every token up to its end.
type Content = (Root, Vec<u32>);

#[derive(Clone, Debug, PartialEq)]
struct ModelEntry {
    id: u64,
    block: BlockId,
    content: Content,
}

#[derive(Clone, Debug, Default)]
struct Meta {
    refs: u32,
    pins: u32,
    children: u32,
    cached: bool,
    parent: Option<BlockId>,
    tick: u64,
    priority: i32,
    entry: Option<ModelEntry>,
    /// A held private copy of this cached block's content (`pool.rs`, duplicates).
    duplicate_of: Option<BlockId>,
}

#[derive(Clone, Debug)]
struct ModelRequest {
    tokens: Vec<u32>,
    table: Vec<BlockId>,
    root: Root,
    priority: i32,
    anchors: Vec<ModelEntry>,
    cacheable: bool,
    /// Tokens with KV written: the most any commit said (a commit never takes KV back).
    computed: usize,
    /// Later blocks chain on its own copies (a request; not `commit_blocks`).
    own_chain: bool,
}

/// Which table key a content takes in the real cache: the one fact the model borrows.
struct KeyOracle {
    hasher: TableHasher,
    contexts: [BlockKey; 2],
    block_size: usize,
}

impl KeyOracle {
    fn root_key(&self, root: Root) -> BlockKey {
        root_key(&self.contexts[root.0], if root.1 { SALT } else { b"" })
    }

    fn key(&self, content: &Content) -> TableKey {
        let mut key = self.hasher.root(&self.root_key(content.0));
        let mut buffer = Vec::new();
        for chunk in content.1.chunks_exact(self.block_size) {
            key = self.hasher.block(&mut buffer, key, chunk, b"");
        }
        key
    }
}

struct Model {
    bs: usize,
    /// The cache's `FullHit` mode is `ReuseLastBlock` (else `RecomputeLastBlock`).
    reuse_last_block: bool,
    blocks: Vec<Meta>,
    free: Vec<BlockId>,
    table: HashMap<Content, ModelEntry>,
    /// Which content holds each table key.
    keys: HashMap<TableKey, Content>,
    oracle: KeyOracle,
    requests: BTreeMap<u64, ModelRequest>,
    pins: BTreeMap<u64, Vec<BlockId>>,
    pins_gone: HashMap<u64, &'static str>,
    context: usize,
    next_request: u64,
    next_pin: u64,
    next_entry: u64,
    tick: u64,
    epoch: u64,
    block_epoch: Vec<u64>,
    external: Vec<u32>,
    stats: CacheStats,
    /// Each canonical block's duplicates, in the order they were recorded.
    duplicates: HashMap<BlockId, Vec<BlockId>>,
    /// Entries eviction moved into a duplicate (for the tests that must reach it).
    moves: u64,
    /// Spares' children lent to the canonical copy while blocked (`pool.rs`): child → spare.
    lent: HashMap<BlockId, BlockId>,
}

type Matched = (Vec<BlockId>, usize, bool);

impl Model {
    fn new(num_blocks: u32, bs: usize, reuse_last_block: bool, oracle: KeyOracle) -> Self {
        let n = num_blocks as usize;
        Self {
            bs,
            reuse_last_block,
            blocks: vec![Meta::default(); n],
            free: (0..num_blocks).rev().collect(),
            table: HashMap::new(),
            keys: HashMap::new(),
            oracle,
            requests: BTreeMap::new(),
            pins: BTreeMap::new(),
            pins_gone: HashMap::new(),
            context: 0,
            next_request: 1,
            next_pin: 1,
            next_entry: 1,
            tick: 0,
            epoch: 0,
            block_epoch: vec![0; n],
            external: vec![0; n],
            stats: CacheStats {
                blocks_total: n,
                ..CacheStats::default()
            },
            duplicates: HashMap::new(),
            moves: 0,
            lent: HashMap::new(),
        }
    }

    // -- helpers, after reference_cache.py ------------------------------------------------

    fn content(&self, root: Root, tokens: &[u32], n_blocks: usize) -> Content {
        (root, tokens[..n_blocks * self.bs].to_vec())
    }

    fn matched(&self, tokens: &[u32], root: Root) -> Vec<ModelEntry> {
        let mut out = Vec::new();
        for i in 0..tokens.len() / self.bs {
            match self.table.get(&self.content(root, tokens, i + 1)) {
                Some(entry) => out.push(entry.clone()),
                None => break,
            }
        }
        out
    }

    /// What a match of `blocks` leading cached blocks gives a prompt of `n` tokens: a full hit
    /// shares every block and recomputes the last token (`ReuseLastBlock`), or recomputes the
    /// last block (`RecomputeLastBlock`).
    fn result(&self, mut blocks: Vec<BlockId>, n: usize) -> Matched {
        let cached = blocks.len() * self.bs;
        let full = cached == n && n > 0;
        if !full {
            return (blocks, cached, false);
        }
        if self.reuse_last_block {
            return (blocks, n - 1, true);
        }
        blocks.pop();
        (blocks, n - self.bs, true)
    }

    /// The matched entries a request or `match_and_acquire` references (see `result`).
    fn used_hits(&self, mut hits: Vec<ModelEntry>, n: usize) -> Vec<ModelEntry> {
        let used = self.result(vec![0; hits.len()], n).0.len();
        hits.truncate(used);
        hits
    }

    /// A cached leaf nobody holds or pins, or a spare (a released duplicate, `pool.rs`), with
    /// or without the cached child its holder chained on it.
    fn evictable(&self, b: usize, children: &[u32]) -> bool {
        let m = &self.blocks[b];
        m.refs == 0 && (m.cached && m.pins == 0 && children[b] == 0 || m.duplicate_of.is_some())
    }

    fn uncache(&mut self, b: BlockId) {
        self.lent.remove(&b);
        let m = &mut self.blocks[b as usize];
        m.cached = false;
        if let Some(entry) = m.entry.take() {
            self.table.remove(&entry.content);
            let key = self.oracle.key(&entry.content);
            self.keys.remove(&key);
        }
        m.pins = 0;
        let parent = m.parent.take();
        if m.refs == 0 {
            self.free.push(b);
        }
        if let Some(p) = parent {
            self.drop_child(p);
        }
    }

    fn drop_child(&mut self, p: BlockId) {
        let pm = &mut self.blocks[p as usize];
        pm.children = pm.children.saturating_sub(1);
    }

    /// Every block eviction could take, in order: the smallest (priority, tick, id) evictable
    /// leaf each time, a parent becoming a leaf once its children are planned.
    fn plan(&self) -> Vec<BlockId> {
        let mut children: Vec<u32> = self.blocks.iter().map(|m| m.children).collect();
        let mut planned = vec![false; self.blocks.len()];
        let mut plan = Vec::new();
        loop {
            let next = (0..self.blocks.len())
                .filter(|&b| !planned[b] && self.evictable(b, &children))
                .min_by_key(|&b| (self.blocks[b].priority, self.blocks[b].tick, b));
            let Some(b) = next else { break };
            plan.push(b as BlockId);
            planned[b] = true;
            if let Some(p) = self.blocks[b].parent {
                children[p as usize] -= 1;
            }
        }
        plan
    }

    /// Cached, and out of eviction's reach: referenced, pinned, or above such a block.
    fn blocked(&self, b: usize) -> bool {
        let m = &self.blocks[b];
        m.cached
            && (m.refs > 0
                || m.pins > 0
                || (0..self.blocks.len()).any(|c| {
                    self.blocks[c].cached
                        && self.blocks[c].parent == Some(b as BlockId)
                        && self.blocked(c)
                }))
    }

    /// A spare's cached child sits under it exactly while not blocked (`pool.rs`): a blocked
    /// one is lent to the spare's canonical copy (which may in turn be a spare's child), and
    /// goes back once unblocked.
    fn normalize(&mut self) {
        let mut changed = true;
        while changed {
            changed = false;
            for s in 0..self.blocks.len() {
                let m = &self.blocks[s];
                let Some(canonical) = m.duplicate_of else {
                    continue;
                };
                if m.refs > 0 {
                    continue;
                }
                let child = (0..self.blocks.len()).find(|&c| {
                    self.blocks[c].cached && self.blocks[c].parent == Some(s as BlockId)
                });
                if let Some(c) = child.filter(|&c| self.blocked(c)) {
                    self.blocks[c].parent = Some(canonical);
                    self.blocks[s].children -= 1;
                    self.blocks[canonical as usize].children += 1;
                    self.lent.insert(c as BlockId, s as BlockId);
                    changed = true;
                }
            }
            let lent: Vec<(BlockId, BlockId)> = self.lent.iter().map(|(&c, &s)| (c, s)).collect();
            for (c, s) in lent {
                if !self.blocked(c as usize) {
                    let canonical = self.blocks[c as usize].parent.expect("lent under it");
                    self.blocks[c as usize].parent = Some(s);
                    self.blocks[s as usize].children += 1;
                    self.blocks[canonical as usize].children -= 1;
                    self.lent.remove(&c);
                    changed = true;
                }
            }
        }
    }

    fn allocate_blocks(&mut self, count: usize) -> Result<Vec<BlockId>, CacheError> {
        self.normalize();
        let num_listed = self.free.len();
        if num_listed < count {
            let plan = self.plan();
            if self.free.len() + plan.len() < count {
                return Err(CacheError::OutOfBlocks {
                    needed: count,
                    available: self.free.len() + plan.len(),
                });
            }
            // One block at a time, the order planned afresh: a move into a spare changes
            // which blocks are leaves (the heir takes the evicted block's place).
            while self.free.len() < count {
                let b = self.plan()[0];
                if let Some(canonical) = self.blocks[b as usize].duplicate_of.take() {
                    // A spare: its content is cached elsewhere, in the canonical copy, which
                    // takes the spare's cached child if it has one.
                    let lent = self.lent.iter().find(|&(_, &s)| s == b).map(|(&c, _)| c);
                    if let Some(c) = lent {
                        // Lent to the canonical copy already: it stays there.
                        self.lent.remove(&c);
                    }
                    let child = (0..self.blocks.len())
                        .find(|&c| self.blocks[c].cached && self.blocks[c].parent == Some(b));
                    if let Some(c) = child {
                        self.blocks[c].parent = Some(canonical);
                        self.blocks[b as usize].children -= 1;
                        self.blocks[canonical as usize].children += 1;
                    }
                    self.forget_duplicate(canonical, b);
                    self.free.push(b);
                    continue;
                }
                match self.duplicates.remove(&b) {
                    Some(list) => self.move_into_duplicate(b, list),
                    None => {
                        self.uncache(b);
                        self.stats.evictions += 1;
                    }
                }
            }
        }
        let start = self.free.len() - count;
        // vLLM's free queue: the free list's top first, then the evicted blocks in order.
        let mut taken: Vec<BlockId> = self.free.drain(start..).collect();
        taken[..num_listed - start].reverse();
        for &b in &taken {
            self.blocks[b as usize].refs = 1;
            self.blocks[b as usize].priority = LOWEST;
            self.block_epoch[b as usize] = self.epoch;
        }
        Ok(taken)
    }

    /// Evicts canonical `b` by moving its entry into its first recorded duplicate, which
    /// becomes cached under the parent it has (`pool.rs`); the other duplicates follow it.
    fn move_into_duplicate(&mut self, b: BlockId, mut list: Vec<BlockId>) {
        let heir = list.remove(0); // the earliest copy left
        self.moves += 1;
        for &other in &list {
            self.blocks[other as usize].duplicate_of = Some(heir);
        }
        if !list.is_empty() {
            self.duplicates.insert(heir, list);
        }
        let mut entry = self.blocks[b as usize].entry.take().expect("cached");
        entry.block = heir;
        self.table.insert(entry.content.clone(), entry.clone());
        let evicted_parent = self.blocks[b as usize].parent;
        self.uncache(b);
        let m = &mut self.blocks[heir as usize];
        if m.refs == 0 {
            // A spare takes the evicted block's place (its own child, if any, stays its child).
            m.parent = evicted_parent;
        }
        m.cached = true;
        m.duplicate_of = None;
        m.entry = Some(entry);
        if let Some(p) = m.parent {
            self.blocks[p as usize].children += 1;
        }
    }

    fn release_one(&mut self, b: BlockId) {
        let m = &mut self.blocks[b as usize];
        assert!(m.refs > 0, "model: release of an unreferenced block");
        m.refs -= 1;
        if m.refs == 0 && !m.cached {
            if m.duplicate_of.is_some() {
                // A spare now, in the eviction order; it keeps its cached child, if any, unless
                // blocked (`pool.rs`).
                m.parent = None;
            } else {
                self.free.push(b);
            }
        }
        // A release may unblock a lent child, or make a duplicate with a blocked child a spare.
        self.normalize();
    }

    fn forget_duplicate(&mut self, canonical: BlockId, b: BlockId) {
        let list = self.duplicates.get_mut(&canonical).unwrap();
        list.retain(|&d| d != b);
        if list.is_empty() {
            self.duplicates.remove(&canonical);
        }
    }

    fn touch(&mut self, b: BlockId, priority: i32) {
        let m = &mut self.blocks[b as usize];
        m.tick = self.tick;
        m.priority = m.priority.max(priority);
    }

    /// Publishes positions `anchors.len() .. target` (the rules of `request/publish.rs`).
    fn extend(&mut self, req: &mut ModelRequest, target: usize) {
        while let Some(last) = req.anchors.last() {
            if self.blocks[last.block as usize].entry.as_ref() == Some(last) {
                break;
            }
            req.anchors.pop();
        }
        while req.anchors.len() < target {
            let pos = req.anchors.len();
            let content = self.content(req.root, &req.tokens, pos + 1);
            let own = req.table[pos];
            if self.blocks[own as usize].cached {
                match self.table.get(&content) {
                    Some(e) if e.block == own => {
                        let anchor = e.clone();
                        self.touch(own, req.priority);
                        req.anchors.push(anchor);
                        continue;
                    }
                    _ => {
                        req.cacheable = false;
                        return;
                    }
                }
            }
            let key = self.oracle.key(&content);
            let anchor = match self.keys.get(&key) {
                None => {
                    let entry = ModelEntry {
                        id: self.next_entry,
                        block: own,
                        content: content.clone(),
                    };
                    self.next_entry += 1;
                    let parent = match pos.checked_sub(1) {
                        Some(previous) if req.own_chain => Some(req.table[previous]),
                        _ => req.anchors.last().map(|a| a.block),
                    };
                    let m = &mut self.blocks[own as usize];
                    m.cached = true;
                    m.entry = Some(entry.clone());
                    m.parent = parent;
                    if let Some(p) = parent {
                        self.blocks[p as usize].children += 1;
                    }
                    self.table.insert(content.clone(), entry.clone());
                    self.keys.insert(key, content);
                    self.stats.committed_blocks += 1;
                    entry
                }
                Some(holder) if *holder == content => {
                    let canonical = self.table[&content].block;
                    let m = &mut self.blocks[own as usize];
                    if !req.own_chain {
                        self.stats.deduplicated_blocks += 1;
                    } else if m.duplicate_of != Some(canonical) {
                        if m.duplicate_of.is_none() {
                            m.parent = pos.checked_sub(1).map(|previous| req.table[previous]);
                        }
                        m.duplicate_of = Some(canonical);
                        self.duplicates.entry(canonical).or_default().push(own);
                        self.stats.deduplicated_blocks += 1;
                    }
                    if req.own_chain {
                        // It reads its own copy: the canonical one keeps its LRU place.
                        req.anchors.push(self.table[&content].clone());
                        continue;
                    }
                    self.table[&content].clone()
                }
                Some(_) => {
                    self.stats.collisions += 1;
                    req.cacheable = false;
                    return;
                }
            };
            self.touch(anchor.block, req.priority);
            req.anchors.push(anchor);
        }
    }

    fn count_lookup(&mut self, n: usize, cached: usize) {
        self.stats.lookups += 1;
        self.stats.lookup_tokens += n as u64;
        self.stats.hit_tokens += cached as u64;
    }

    fn check_block(&self, b: BlockId) -> Result<(), CacheError> {
        if (b as usize) < self.blocks.len() {
            Ok(())
        } else {
            Err(CacheError::InvalidBlock {
                block: b,
                reason: "outside the pool",
            })
        }
    }

    // -- the API ----------------------------------------------------------------------------

    fn lookup(&mut self, tokens: &[u32], root: Root) -> Matched {
        self.stats.probes += 1;
        let blocks = self.matched(tokens, root).iter().map(|e| e.block).collect();
        self.result(blocks, tokens.len())
    }

    fn begin(
        &mut self,
        tokens: &[u32],
        root: Root,
        priority: i32,
    ) -> Result<(u64, Vec<BlockId>, usize, bool), CacheError> {
        if tokens.is_empty() {
            return Err(CacheError::InvalidInput(String::new()));
        }
        let matched = self.matched(tokens, root);
        // The hit's shape is what the match found, before allocating (which may evict the
        // block a `RecomputeLastBlock` full hit does not use).
        let (_, cached, full) =
            self.result(matched.iter().map(|e| e.block).collect(), tokens.len());
        let hits = self.used_hits(matched, tokens.len());
        for e in &hits {
            self.blocks[e.block as usize].refs += 1;
        }
        self.normalize();
        let fresh = match self.allocate_blocks(tokens.len().div_ceil(self.bs) - hits.len()) {
            Ok(fresh) => fresh,
            Err(err) => {
                for e in &hits {
                    self.blocks[e.block as usize].refs -= 1;
                }
                return Err(err);
            }
        };
        self.tick += 1;
        for e in &hits {
            self.touch(e.block, priority);
        }
        let mut table: Vec<BlockId> = hits.iter().map(|e| e.block).collect();
        self.count_lookup(tokens.len(), cached);
        table.extend(fresh);
        let id = self.next_request;
        self.next_request += 1;
        self.requests.insert(
            id,
            ModelRequest {
                tokens: tokens.to_vec(),
                table: table.clone(),
                root,
                priority,
                anchors: hits,
                cacheable: true,
                computed: cached,
                own_chain: true,
            },
        );
        Ok((id, table, cached, full))
    }

    fn append(&mut self, id: u64, tokens: &[u32]) -> Result<Vec<BlockId>, CacheError> {
        let req = self
            .requests
            .get(&id)
            .ok_or(CacheError::UnknownRequest(rid(id)))?;
        let need = (req.tokens.len() + tokens.len())
            .div_ceil(self.bs)
            .saturating_sub(req.table.len());
        let fresh = self.allocate_blocks(need)?;
        let req = self.requests.get_mut(&id).unwrap();
        req.tokens.extend_from_slice(tokens);
        req.table.extend_from_slice(&fresh);
        Ok(fresh)
    }

    fn commit(&mut self, id: u64, n: usize) -> Result<usize, CacheError> {
        let mut req = self
            .requests
            .remove(&id)
            .ok_or(CacheError::UnknownRequest(rid(id)))?;
        if n > req.tokens.len() {
            self.requests.insert(id, req);
            return Err(CacheError::InvalidInput(String::new()));
        }
        req.computed = req.computed.max(n);
        if req.cacheable {
            self.tick += 1;
            let target = req.computed / self.bs;
            self.extend(&mut req, target);
            self.normalize();
        }
        let committed = req.anchors.len();
        self.requests.insert(id, req);
        Ok(committed)
    }

    fn finish(&mut self, id: u64) -> Result<(), CacheError> {
        let req = self
            .requests
            .remove(&id)
            .ok_or(CacheError::UnknownRequest(rid(id)))?;
        self.tick += 1;
        // Duplicates (spares once released) one tick after the rest, and released after them,
        // so a duplicate's successor is no longer held by the request (`request/mod.rs`).
        let mut spares = false;
        for &b in &req.table {
            let m = &mut self.blocks[b as usize];
            if m.cached {
                self.touch(b, req.priority);
            } else if m.duplicate_of.is_some() {
                m.tick = self.tick + 1;
                m.priority = m.priority.max(req.priority);
                spares = true;
            }
        }
        for duplicates in [false, true] {
            for &b in &req.table {
                if self.blocks[b as usize].duplicate_of.is_some() == duplicates {
                    self.release_one(b);
                }
            }
        }
        if spares {
            self.tick += 1;
        }
        Ok(())
    }

    fn match_and_acquire(&mut self, tokens: &[u32], root: Root, priority: i32) -> Matched {
        let blocks: Vec<BlockId> = self.matched(tokens, root).iter().map(|e| e.block).collect();
        let result = self.result(blocks, tokens.len());
        self.tick += 1;
        for &b in &result.0 {
            self.blocks[b as usize].refs += 1;
            self.external[b as usize] += 1;
            self.touch(b, priority);
        }
        self.normalize();
        self.count_lookup(tokens.len(), result.1);
        result
    }

    fn allocate(&mut self, count: usize) -> Result<Vec<BlockId>, CacheError> {
        if count > self.blocks.len() {
            let available = self.free.len() + self.plan().len();
            return Err(CacheError::OutOfBlocks {
                needed: count,
                available,
            });
        }
        let blocks = self.allocate_blocks(count)?;
        for &b in &blocks {
            self.external[b as usize] += 1;
        }
        Ok(blocks)
    }

    fn commit_blocks(
        &mut self,
        tokens: &[u32],
        blocks: &[BlockId],
        root: Root,
        priority: i32,
    ) -> Result<Vec<BlockId>, CacheError> {
        for (pos, &b) in blocks.iter().enumerate() {
            self.check_block(b)?;
            if self.external[b as usize] == 0 {
                return Err(CacheError::InvalidBlock {
                    block: b,
                    reason: "not held by the caller (take it with allocate or match_and_acquire)",
                });
            }
            if self.block_epoch[b as usize] != self.epoch {
                return Err(CacheError::BlockState {
                    block: b,
                    reason: "its KV was computed before clear() or set_context(): never published",
                });
            }
            if (pos + 1) * self.bs > tokens.len() {
                return Err(CacheError::BlockState {
                    block: b,
                    reason: "not full: too few tokens to commit it",
                });
            }
        }
        let mut req = ModelRequest {
            tokens: tokens[..blocks.len() * self.bs].to_vec(),
            table: blocks.to_vec(),
            root,
            priority,
            anchors: Vec::new(),
            cacheable: true,
            computed: blocks.len() * self.bs,
            own_chain: false,
        };
        self.tick += 1;
        self.extend(&mut req, blocks.len());
        self.normalize();
        Ok(req.anchors.iter().map(|a| a.block).collect())
    }

    fn release(&mut self, blocks: &[BlockId]) -> Result<(), CacheError> {
        let mut counts: HashMap<BlockId, u32> = HashMap::new();
        for &b in blocks {
            self.check_block(b)?;
            let count = counts.entry(b).or_default();
            *count += 1;
            if *count > self.external[b as usize] {
                return Err(CacheError::BlockState {
                    block: b,
                    reason: "released more often than it was acquired with allocate or \
                             match_and_acquire (a double release, or a block a request owns)",
                });
            }
        }
        self.tick += 1;
        for &b in blocks {
            if self.blocks[b as usize].cached {
                self.touch(b, LOWEST);
            }
            self.external[b as usize] -= 1;
            self.release_one(b);
        }
        Ok(())
    }

    fn pin(&mut self, tokens: &[u32], root: Root) -> (u64, usize) {
        let blocks: Vec<BlockId> = self.matched(tokens, root).iter().map(|e| e.block).collect();
        for &b in &blocks {
            self.blocks[b as usize].pins += 1;
        }
        self.normalize();
        let id = self.next_pin;
        self.next_pin += 1;
        let count = blocks.len();
        self.pins.insert(id, blocks);
        (id, count)
    }

    fn unpin(&mut self, id: u64) -> Result<(), CacheError> {
        let Some(blocks) = self.pins.remove(&id) else {
            let reason = match self.pins_gone.get(&id) {
                Some(reason) => *reason,
                None => "never taken",
            };
            return Err(CacheError::UnknownPin { pin_id: id, reason });
        };
        self.pins_gone.insert(id, "already unpinned");
        for b in blocks {
            let m = &mut self.blocks[b as usize];
            m.pins = m.pins.saturating_sub(1);
        }
        self.normalize();
        Ok(())
    }

    fn clear(&mut self, reason: &'static str) {
        self.epoch += 1;
        for req in self.requests.values_mut() {
            req.cacheable = false;
            req.anchors.clear();
        }
        for id in std::mem::take(&mut self.pins).into_keys() {
            self.pins_gone.insert(id, reason);
        }
        for b in 0..self.blocks.len() {
            if self.blocks[b].cached {
                self.uncache(b as BlockId);
            }
        }
        let mut spares = Vec::new();
        for (_, list) in self.duplicates.drain() {
            for d in list {
                self.blocks[d as usize].duplicate_of = None;
                self.blocks[d as usize].parent = None;
                if self.blocks[d as usize].refs == 0 {
                    spares.push(d);
                }
            }
        }
        spares.sort_unstable();
        self.free.extend(spares);
    }

    fn set_context(&mut self, context: usize) {
        self.context = context;
        self.clear("dropped by set_context(), which releases every pin");
    }

    fn expected_stats(&self) -> CacheStats {
        let children: Vec<u32> = self.blocks.iter().map(|m| m.children).collect();
        CacheStats {
            blocks_free: self.free.len(),
            blocks_cached: self
                .blocks
                .iter()
                .filter(|m| m.cached || m.duplicate_of.is_some() && m.refs == 0)
                .count(),
            blocks_in_use: self.blocks.iter().filter(|m| m.refs > 0).count(),
            blocks_pinned: self.blocks.iter().filter(|m| m.pins > 0).count(),
            blocks_evictable: (0..self.blocks.len())
                .filter(|&b| self.evictable(b, &children))
                .count(),
            blocks_obtainable: self.free.len() + self.reachable_by_eviction(),
            requests_live: self.requests.len(),
            ..self.stats.clone()
        }
    }

    /// Cached blocks that evicting leaves over and over would free: peel evictable leaves off
    /// a copy of the child counts until none is left (the slow, obvious way).
    fn reachable_by_eviction(&self) -> usize {
        let mut children: Vec<u32> = self.blocks.iter().map(|m| m.children).collect();
        let mut gone = vec![false; self.blocks.len()];
        let mut count = 0;
        loop {
            let peel: Vec<usize> = (0..self.blocks.len())
                .filter(|&b| !gone[b] && self.evictable(b, &children))
                .collect();
            if peel.is_empty() {
                return count;
            }
            for b in peel {
                gone[b] = true;
                count += 1;
                if let Some(parent) = self.blocks[b].parent {
                    children[parent as usize] -= 1;
                }
            }
        }
    }
}

// -- the operations -----------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    Begin {
        tokens: Vec<u32>,
        salt: bool,
        priority: i32,
    },
    /// The same prompt begun twice in a row, as in a batch, and the first one's prefill
    /// committed: both missed, so the second one's commit, whenever it comes, deduplicates.
    BeginTwins {
        tokens: Vec<u32>,
        salt: bool,
        priority: i32,
    },
    /// A whole request life in one step: the common case, and what fills the cache.
    Serve {
        tokens: Vec<u32>,
        salt: bool,
        priority: i32,
        generated: Vec<u32>,
    },
    /// `percent` of the request's tokens, past 100 to ask for more than it has.
    Commit {
        request: usize,
        percent: u8,
    },
    Append {
        request: usize,
        tokens: Vec<u32>,
    },
    Finish {
        request: usize,
    },
    Lookup {
        tokens: Vec<u32>,
        salt: bool,
    },
    MatchAndAcquire {
        tokens: Vec<u32>,
        salt: bool,
        priority: i32,
    },
    Allocate {
        count: usize,
    },
    /// Commits a held set (an allocation or a match) under `tokens`, or a prefix of it.
    CommitBlocks {
        held: usize,
        keep: usize,
        tokens: Vec<u32>,
        salt: bool,
        priority: i32,
    },
    /// Releases a held set, consuming it.
    Release {
        held: usize,
    },
    /// Releases arbitrary ids: unheld, a request's, out of the pool, twice.
    ReleaseAny {
        blocks: Vec<BlockId>,
    },
    Pin {
        tokens: Vec<u32>,
        salt: bool,
    },
    /// Unpins one of the ids ever returned (live or not), or one never returned.
    Unpin {
        pin: usize,
    },
    Clear,
    SetContext {
        which: usize,
    },
}

/// A few shared stems make prefixes meet often, as in real traffic (the Python test's stems).
const STEMS: [&[u32]; 4] = [
    &[1, 2, 3, 4, 5, 6, 7, 8],
    &[1, 2, 3, 4, 9, 9, 9, 9],
    &[5, 5, 5, 5, 5, 5],
    &[],
];

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    (0..STEMS.len(), 0..=8usize, vec(0u32..4, 0..10)).prop_map(|(stem, cut, tail)| {
        let stem = STEMS[stem];
        let mut tokens = stem[..cut.min(stem.len())].to_vec();
        tokens.extend(tail);
        tokens
    })
}

fn priority() -> impl Strategy<Value = i32> {
    prop_oneof![Just(0), Just(0), Just(1), Just(-1)]
}

fn op() -> impl Strategy<Value = Op> {
    let index = 0..64usize;
    prop_oneof![
        4 => (tokens(), any::<bool>(), priority())
            .prop_map(|(tokens, salt, priority)| Op::Begin { tokens, salt, priority }),
        2 => (tokens(), any::<bool>(), priority())
            .prop_map(|(tokens, salt, priority)| Op::BeginTwins { tokens, salt, priority }),
        4 => (tokens(), any::<bool>(), priority(), vec(0u32..4, 0..6)).prop_map(
            |(tokens, salt, priority, generated)| Op::Serve { tokens, salt, priority, generated }
        ),
        5 => (index.clone(), 0..=110u8)
            .prop_map(|(request, percent)| Op::Commit { request, percent }),
        2 => (index.clone(), vec(0u32..4, 1..5))
            .prop_map(|(request, tokens)| Op::Append { request, tokens }),
        4 => index.clone().prop_map(|request| Op::Finish { request }),
        3 => (tokens(), any::<bool>()).prop_map(|(tokens, salt)| Op::Lookup { tokens, salt }),
        2 => (tokens(), any::<bool>(), priority())
            .prop_map(|(tokens, salt, priority)| Op::MatchAndAcquire { tokens, salt, priority }),
        2 => (0..=4usize).prop_map(|count| Op::Allocate { count }),
        2 => (index.clone(), 0..4usize, tokens(), any::<bool>(), priority()).prop_map(
            |(held, keep, tokens, salt, priority)| Op::CommitBlocks {
                held,
                keep,
                tokens,
                salt,
                priority
            }
        ),
        2 => index.clone().prop_map(|held| Op::Release { held }),
        1 => vec(0u32..20, 1..3).prop_map(|blocks| Op::ReleaseAny { blocks }),
        2 => (tokens(), any::<bool>()).prop_map(|(tokens, salt)| Op::Pin { tokens, salt }),
        2 => index.prop_map(|pin| Op::Unpin { pin }),
        1 => Just(Op::Clear),
        1 => (0..2usize).prop_map(|which| Op::SetContext { which }),
    ]
}

// -- the machine ----------------------------------------------------------------------------

struct Machine {
    real: PrefixCache,
    model: Model,
    contexts: [BlockKey; 2],
    /// Every request id begun, live or not, in order.
    requests: Vec<u64>,
    /// Sets of blocks taken through the low-level API and not yet released as a set.
    held: Vec<Vec<BlockId>>,
    /// Every pin id returned, live or not.
    pins: Vec<u64>,
}

/// Same outcome: equal values, or errors of the same kind (`InvalidInput` messages are the
/// real cache's to word; every other error must be equal field by field).
/// The core's name for the model's request id.
fn rid(id: u64) -> RequestId {
    RequestId::Int(i64::try_from(id).expect("small ids"))
}

fn same<T: PartialEq + std::fmt::Debug>(
    op: &Op,
    real: &Result<T, CacheError>,
    model: &Result<T, CacheError>,
) {
    match (real, model) {
        (Err(CacheError::InvalidInput(_)), Err(CacheError::InvalidInput(_))) => {}
        _ => assert_eq!(real, model, "after {op:?}"),
    }
}

impl Machine {
    fn new(
        num_blocks: u32,
        block_size: usize,
        key_bits: u32,
        seed: u64,
        reuse_last_block: bool,
    ) -> Self {
        let contexts = [
            context_fingerprint(b"model a"),
            context_fingerprint(b"model b"),
        ];
        let config = CacheConfig {
            key_bits,
            full_hit: if reuse_last_block {
                FullHit::ReuseLastBlock
            } else {
                FullHit::RecomputeLastBlock
            },
            ..CacheConfig::new(num_blocks, block_size)
        };
        let real = PrefixCache::with_table_seed(config, contexts[0], seed).unwrap();
        let oracle = KeyOracle {
            hasher: TableHasher::with_seed(key_bits, seed),
            contexts,
            block_size,
        };
        Self {
            real,
            model: Model::new(num_blocks, block_size, reuse_last_block, oracle),
            contexts,
            requests: Vec::new(),
            held: Vec::new(),
            pins: Vec::new(),
        }
    }

    fn root(&self, salt: bool) -> Root {
        (self.model.context, salt)
    }

    /// Mostly a live request (so one request's life goes on across many steps); otherwise any
    /// id begun so far, finished or not, or (one slot past them) an id never begun.
    fn request_id(&self, index: usize) -> u64 {
        let live = &self.model.requests;
        if !index.is_multiple_of(4) && !live.is_empty() {
            return *live.keys().nth(index / 4 % live.len()).unwrap();
        }
        self.requests
            .get(index % (self.requests.len() + 1))
            .copied()
            .unwrap_or(NEVER_BEGUN)
    }

    fn begin(&mut self, op: &Op, tokens: &[u32], salt: bool, priority: i32) -> Option<u64> {
        let salt_bytes: &[u8] = if salt { SALT } else { b"" };
        let real = self
            .real
            .begin(
                None,
                tokens.to_vec(),
                salt_bytes,
                RequestExtras::default(),
                priority,
            )
            .map(|r| (r.request_id, r.block_table, r.num_cached_tokens, r.full_hit));
        let model = self
            .model
            .begin(tokens, self.root(salt), priority)
            .map(|(id, table, cached, full)| (rid(id), table, cached, full));
        same(op, &real, &model);
        let (RequestId::Int(id), _, cached, _) = real.ok()? else {
            unreachable!("begin without an id picks an int")
        };
        let id = u64::try_from(id).expect("positive ids");
        assert!(
            cached < tokens.len(),
            "at least one token is left to compute"
        );
        self.requests.push(id);
        Some(id)
    }

    fn commit(&mut self, op: &Op, id: u64, n: usize) {
        same(
            op,
            &self.real.commit(&rid(id), n),
            &self.model.commit(id, n),
        );
    }

    fn append(&mut self, op: &Op, id: u64, tokens: &[u32]) {
        same(
            op,
            &self.real.append(&rid(id), tokens),
            &self.model.append(id, tokens),
        );
    }

    fn finish(&mut self, op: &Op, id: u64) {
        same(op, &self.real.finish(&rid(id)), &self.model.finish(id));
    }

    fn apply(&mut self, op: &Op) {
        self.apply_op(op);
        // Every change that may block a spare's child has normalized already; in case.
        self.model.normalize();
    }

    fn apply_op(&mut self, op: &Op) {
        let extras = RequestExtras::default();
        let salt_of = |salt: bool| -> &'static [u8] {
            if salt {
                SALT
            } else {
                b""
            }
        };
        match op {
            Op::Begin {
                tokens,
                salt,
                priority,
            } => {
                self.begin(op, tokens, *salt, *priority);
            }
            Op::BeginTwins {
                tokens,
                salt,
                priority,
            } => {
                let first = self.begin(op, tokens, *salt, *priority);
                self.begin(op, tokens, *salt, *priority);
                if let Some(first) = first {
                    self.commit(op, first, tokens.len());
                }
            }
            Op::Serve {
                tokens,
                salt,
                priority,
                generated,
            } => {
                if let Some(id) = self.begin(op, tokens, *salt, *priority) {
                    self.commit(op, id, tokens.len());
                    if !generated.is_empty() {
                        self.append(op, id, generated);
                        let n = self.model.requests[&id].tokens.len();
                        self.commit(op, id, n);
                    }
                    self.finish(op, id);
                }
            }
            Op::Commit { request, percent } => {
                let id = self.request_id(*request);
                let len = self.model.requests.get(&id).map_or(3, |r| r.tokens.len());
                self.commit(op, id, len * usize::from(*percent) / 100);
            }
            Op::Append { request, tokens } => self.append(op, self.request_id(*request), tokens),
            Op::Finish { request } => self.finish(op, self.request_id(*request)),
            Op::Lookup { tokens, salt } => {
                let real = self
                    .real
                    .lookup(tokens, salt_of(*salt), &extras)
                    .map(|m| (m.blocks, m.num_cached_tokens, m.full_hit));
                let model = self.model.lookup(tokens, self.root(*salt));
                same(op, &real, &Ok(model));
            }
            Op::MatchAndAcquire {
                tokens,
                salt,
                priority,
            } => {
                let real = self
                    .real
                    .match_and_acquire(tokens, salt_of(*salt), &extras, *priority)
                    .map(|m| (m.blocks, m.num_cached_tokens, m.full_hit));
                let model = self
                    .model
                    .match_and_acquire(tokens, self.root(*salt), *priority);
                same(op, &real, &Ok(model.clone()));
                if !model.0.is_empty() {
                    self.held.push(model.0);
                }
            }
            Op::Allocate { count } => {
                let real = self.real.allocate(*count);
                same(op, &real, &self.model.allocate(*count));
                if let Ok(blocks) = real {
                    if !blocks.is_empty() {
                        self.held.push(blocks);
                    }
                }
            }
            Op::CommitBlocks {
                held,
                keep,
                tokens,
                salt,
                priority,
            } => {
                if self.held.is_empty() {
                    return;
                }
                let set = &self.held[held % self.held.len()];
                let blocks = &set[..(*keep).clamp(1, set.len())];
                let real =
                    self.real
                        .commit_blocks(tokens, blocks, salt_of(*salt), &extras, *priority);
                let model = self
                    .model
                    .commit_blocks(tokens, blocks, self.root(*salt), *priority);
                same(op, &real, &model);
            }
            Op::Release { held } => {
                if self.held.is_empty() {
                    return;
                }
                let blocks = self.held.remove(held % self.held.len());
                same(
                    op,
                    &self.real.release(&blocks),
                    &self.model.release(&blocks),
                );
            }
            Op::ReleaseAny { blocks } => {
                same(op, &self.real.release(blocks), &self.model.release(blocks));
            }
            Op::Pin { tokens, salt } => {
                let real = self.real.pin(tokens, salt_of(*salt), &extras);
                let model = self.model.pin(tokens, self.root(*salt));
                same(op, &real, &Ok(model));
                self.pins.push(model.0);
            }
            Op::Unpin { pin } => {
                let id = self
                    .pins
                    .get(pin % (self.pins.len() + 1))
                    .copied()
                    .unwrap_or(NEVER_BEGUN);
                same(op, &self.real.unpin(id), &self.model.unpin(id));
            }
            Op::Clear => {
                self.real.clear();
                self.model
                    .clear("dropped by clear(), which releases every pin");
            }
            Op::SetContext { which } => {
                self.real.set_context(self.contexts[*which]);
                self.model.set_context(*which);
            }
        }
    }

    fn check(&self, op: &Op) {
        self.real.check_invariants();
        assert_eq!(
            self.real.stats(),
            self.model.expected_stats(),
            "after {op:?}"
        );
        for (block, meta) in self.model.blocks.iter().enumerate() {
            let id = block as BlockId;
            assert_eq!(
                self.real.ref_count(id),
                Ok(meta.refs),
                "refcount of {block} after {op:?}"
            );
            assert_eq!(
                self.real.is_cached(id),
                Ok(meta.cached),
                "cached {block} after {op:?}"
            );
        }
        for (&id, request) in &self.model.requests {
            assert_eq!(
                self.real.block_table(&rid(id)).as_ref(),
                Ok(&request.table),
                "after {op:?}"
            );
        }
    }

    /// Every request finishes and every external reference is released: nothing may stay.
    fn teardown(mut self) {
        for id in self.model.requests.keys().copied().collect::<Vec<_>>() {
            self.real.finish(&rid(id)).unwrap();
            self.model.finish(id).unwrap();
        }
        let held: Vec<BlockId> = (0..self.model.external.len() as BlockId)
            .flat_map(|b| std::iter::repeat_n(b, self.model.external[b as usize] as usize))
            .collect();
        self.real.release(&held).unwrap();
        self.model.release(&held).unwrap();
        self.check(&Op::Clear);
        let stats = self.real.stats();
        assert_eq!(stats.blocks_in_use, 0, "a block is still referenced");
        // Spares (released duplicates, `pool.rs`) are neither free nor cached; a clear frees
        // them: then every block is free or cached.
        self.real.clear();
        self.model
            .clear("dropped by clear(), which releases every pin");
        self.check(&Op::Clear);
        let stats = self.real.stats();
        assert_eq!(
            stats.blocks_free + stats.blocks_cached,
            stats.blocks_total,
            "a block leaked"
        );
    }
}

fn run(
    num_blocks: u32,
    block_size: usize,
    key_bits: u32,
    seed: u64,
    reuse_last_block: bool,
    ops: &[Op],
) {
    let mut machine = Machine::new(num_blocks, block_size, key_bits, seed, reuse_last_block);
    for op in ops {
        machine.apply(op);
        machine.check(op);
    }
    machine.teardown();
}

fn key_bits() -> impl Strategy<Value = u32> {
    // Half tiny, so collisions are constant; half full width, where none stops a request from
    // publishing and deduplication and eviction get their turn.
    prop_oneof![Just(1), Just(2), Just(4), Just(128), Just(128), Just(128)]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn real_cache_matches_the_reference_model(
        num_blocks in 3..=16u32,
        block_size in 1..=4usize,
        key_bits in key_bits(),
        seed in any::<u64>(),
        reuse_last_block in any::<bool>(),
        ops in vec(op(), 1..50),
    ) {
        run(num_blocks, block_size, key_bits, seed, reuse_last_block, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    /// The same, longer and many more times: `make rust-stress`.
    #[test]
    #[ignore = "long: make rust-stress"]
    fn real_cache_matches_the_reference_model_long(
        num_blocks in 3..=24u32,
        block_size in 1..=4usize,
        key_bits in key_bits(),
        seed in any::<u64>(),
        reuse_last_block in any::<bool>(),
        ops in vec(op(), 1..200),
    ) {
        run(num_blocks, block_size, key_bits, seed, reuse_last_block, &ops);
    }
}

/// The generator reaches the interesting states: collisions, deduplication, eviction, pins.
#[test]
fn tiny_keys_collide_and_shared_stems_deduplicate() {
    let mut machine = Machine::new(6, 2, 1, 3, false);
    let prompt = STEMS[0].to_vec();
    let ops = [
        Op::Begin {
            tokens: prompt.clone(),
            salt: false,
            priority: 0,
        },
        Op::Begin {
            tokens: prompt.clone(),
            salt: false,
            priority: 0,
        },
        Op::Commit {
            request: 0,
            percent: 100,
        },
        Op::Commit {
            request: 1,
            percent: 100,
        },
        Op::Finish { request: 0 },
        Op::Finish { request: 1 },
        Op::Serve {
            tokens: STEMS[2].to_vec(),
            salt: true,
            priority: 1,
            generated: vec![],
        },
    ];
    for op in &ops {
        machine.apply(op);
        machine.check(op);
    }
    let stats = machine.real.stats();
    assert!(
        stats.collisions + stats.deduplicated_blocks > 0,
        "{stats:?}"
    );
    machine.teardown();
}

/// Issue 22: a full hit's recomputed last block is a duplicate of the cached one, and the
/// request's next block chains on it; so once nobody references the original it is evictable
/// (as vLLM counts it), and evicting it moves its entry into the duplicate: the whole chain
/// stays reachable.
#[test]
fn an_evicted_original_moves_into_the_full_hits_duplicate() {
    let mut machine = Machine::new(6, 2, 128, 3, false);
    let prompt = vec![1, 2, 3, 4];
    // Request index 1: the one live request (`Machine::request_id`).
    let ops = [
        Op::Serve {
            tokens: prompt.clone(),
            salt: false,
            priority: 0,
            generated: vec![],
        },
        // A full hit: the first block shared, the second recomputed into a duplicate.
        Op::Begin {
            tokens: prompt.clone(),
            salt: false,
            priority: 0,
        },
        Op::Commit {
            request: 1,
            percent: 100,
        },
        Op::Append {
            request: 1,
            tokens: vec![5, 6],
        },
        Op::Commit {
            request: 1,
            percent: 100,
        },
        // Two free blocks, the original second block obtainable: three can be had.
        Op::Allocate { count: 3 },
        Op::Lookup {
            tokens: vec![1, 2, 3, 4, 5, 6, 7],
            salt: false,
        },
        Op::Finish { request: 1 },
        Op::Lookup {
            tokens: vec![1, 2, 3, 4, 5, 6, 7],
            salt: false,
        },
    ];
    for op in &ops {
        machine.apply(op);
        machine.check(op);
    }
    assert_eq!(machine.model.moves, 1);
    // The whole chain is still reachable, through the duplicate.
    let found = machine
        .real
        .lookup(&[1, 2, 3, 4, 5, 6, 7], b"", &RequestExtras::default());
    assert_eq!(found.unwrap().num_cached_tokens, 6);
    machine.model.lookup(&[1, 2, 3, 4, 5, 6, 7], (0, false));
    machine.teardown();
}

// ----- sliding-window runs --------------------------------------------------------------------
//
// A sliding-window cache releases blocks as requests advance and serves hits that skip blocks,
// so the exact model above does not apply. These runs check what matters instead, against a
// model of what each block's KV holds: the engine's writes, recorded as the token prefix the
// block was computed under. After every step, every position the window of a scheduled
// request's settled count reads is a block the request holds, never the null block, whose
// recorded content is the request's own tokens ("a released block is never read"); every block
// an allocation hands out is a real one; and `check_invariants` holds.

#[derive(Clone, Debug)]
enum SlidingOp {
    /// A request whose prompt is `prefix` tokens of a shared stem and then `tail`.
    Add {
        prefix: usize,
        tail: Vec<u32>,
    },
    /// Allocate and compute (commit) up to `chunk` tokens of request `index % live`.
    Step {
        index: usize,
        chunk: usize,
    },
    /// Append one sampled token to a fully computed request.
    Decode {
        index: usize,
        token: u32,
    },
    Preempt {
        index: usize,
    },
    Finish {
        index: usize,
    },
}

fn sliding_op() -> impl Strategy<Value = SlidingOp> {
    prop_oneof![
        2 => (0..24usize, vec(1..4u32, 0..6)).prop_map(|(prefix, tail)| SlidingOp::Add { prefix, tail }),
        5 => (any::<usize>(), 1..12usize).prop_map(|(index, chunk)| SlidingOp::Step { index, chunk }),
        2 => (any::<usize>(), 1..4u32).prop_map(|(index, token)| SlidingOp::Decode { index, token }),
        1 => any::<usize>().prop_map(|index| SlidingOp::Preempt { index }),
        1 => any::<usize>().prop_map(|index| SlidingOp::Finish { index }),
    ]
}

struct SlidingMachine {
    cache: PrefixCache,
    window: usize,
    block_size: usize,
    null: BlockId,
    /// The token prefix each block's KV was computed under, up to its last written token.
    content: HashMap<BlockId, Vec<u32>>,
    /// Live requests, in order of arrival, with their tokens.
    live: Vec<(u64, Vec<u32>)>,
    next_id: u64,
}

impl SlidingMachine {
    fn pick(&self, index: usize) -> Option<(u64, Vec<u32>)> {
        (!self.live.is_empty()).then(|| self.live[index % self.live.len()].clone())
    }

    /// The window of a query at `settled` reads positions `first..last`: each must be held,
    /// real, and hold the request's own tokens up to `settled`.
    fn check_window(&self, id: u64, tokens: &[u32], settled: usize) {
        let bs = self.block_size;
        let table = self.cache.block_table(&rid(id)).unwrap();
        let first = (settled + 1).saturating_sub(self.window) / bs;
        for (position, &block) in table
            .iter()
            .enumerate()
            .take(settled.div_ceil(bs))
            .skip(first)
        {
            assert_ne!(
                block, self.null,
                "request {id} reads position {position}: released"
            );
            assert!(
                self.cache.ref_count(block).unwrap() > 0,
                "request {id} reads a block it does not hold"
            );
            let end = ((position + 1) * bs).min(settled);
            let written = self.content.get(&block).map_or(&[][..], Vec::as_slice);
            assert!(
                written.len() >= end && written[..end] == tokens[..end],
                "request {id} position {position}: block {block} holds {written:?}, not {:?}",
                &tokens[..end]
            );
        }
    }

    fn apply(&mut self, op: &SlidingOp) {
        let bs = self.block_size;
        match op {
            SlidingOp::Add { prefix, tail } => {
                let tokens: Vec<u32> = (100..100 + *prefix as u32)
                    .chain(tail.iter().copied())
                    .collect();
                if tokens.is_empty() {
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                self.cache
                    .add_request(rid(id), tokens.clone(), b"", RequestExtras::default(), 0)
                    .unwrap();
                self.live.push((id, tokens));
            }
            SlidingOp::Step { index, chunk } => {
                let Some((id, tokens)) = self.pick(*index) else {
                    return;
                };
                let start = self.cache.start_position(&rid(id)).unwrap();
                let n = (*chunk).min(tokens.len() - start);
                if n == 0 {
                    return;
                }
                let waiting = self.cache.block_table(&rid(id)).unwrap().is_empty();
                let slots = match self.cache.allocate_slots(&rid(id), n, 0, 0) {
                    Ok(slots) => slots,
                    Err(CacheError::OutOfBlocks { .. }) => return,
                    Err(e) => panic!("{e}"),
                };
                assert_eq!(
                    slots.num_computed_tokens, start,
                    "start_position foretold it"
                );
                let hit_blocks = if waiting {
                    slots.num_cached_tokens.div_ceil(bs)
                } else {
                    0
                };
                for &block in &slots.block_ids[hit_blocks..] {
                    assert!(block < self.null, "a fresh block is a real one");
                    self.content.insert(block, Vec::new());
                }
                // The queries of the chunk read their windows: check what is there, then write.
                self.check_window(id, &tokens, start);
                let table = self.cache.block_table(&rid(id)).unwrap();
                let end = start + n;
                for position in start / bs..end.div_ceil(bs) {
                    let block = table[position];
                    assert_ne!(block, self.null, "the chunk writes into the null block");
                    let written = tokens[..((position + 1) * bs).min(end)].to_vec();
                    let kept = self.content.entry(block).or_default();
                    // A shared block (a reuse-last-block hit) is read, not written.
                    if !(kept.len() >= written.len() && kept[..written.len()] == written[..]) {
                        *kept = written;
                    }
                }
                self.cache.commit(&rid(id), end).unwrap();
            }
            SlidingOp::Decode { index, token } => {
                let Some((id, mut tokens)) = self.pick(*index) else {
                    return;
                };
                if self.cache.num_computed_tokens(&rid(id)).unwrap() < tokens.len() {
                    return;
                }
                self.cache
                    .append_tokens(&rid(id), &[*token], false)
                    .unwrap();
                tokens.push(*token);
                let slot = self.live.iter_mut().find(|(i, _)| *i == id).unwrap();
                slot.1 = tokens;
            }
            SlidingOp::Preempt { index } => {
                let Some((id, _)) = self.pick(*index) else {
                    return;
                };
                self.cache.preempt(&rid(id)).unwrap();
            }
            SlidingOp::Finish { index } => {
                let Some((id, _)) = self.pick(*index) else {
                    return;
                };
                self.cache.finish(&rid(id)).unwrap();
                self.live.retain(|(i, _)| *i != id);
            }
        }
    }

    fn check(&self) {
        self.cache.check_invariants();
        for (id, tokens) in &self.live {
            let table = self.cache.block_table(&rid(*id)).unwrap();
            if table.is_empty() {
                continue;
            }
            let settled = self.cache.num_computed_tokens(&rid(*id)).unwrap();
            self.check_window(*id, tokens, settled);
        }
    }
}

fn run_sliding(
    num_blocks: u32,
    block_size: usize,
    window: usize,
    reuse_last_block: bool,
    ops: &[SlidingOp],
) {
    let config = CacheConfig {
        sliding_window: Some(window),
        full_hit: if reuse_last_block {
            FullHit::ReuseLastBlock
        } else {
            FullHit::RecomputeLastBlock
        },
        ..CacheConfig::new(num_blocks, block_size)
    };
    let cache = PrefixCache::with_table_seed(config, context_fingerprint(b"sliding"), 3).unwrap();
    let mut machine = SlidingMachine {
        null: cache
            .null_block()
            .expect("sliding caches have a null block"),
        cache,
        window,
        block_size,
        content: HashMap::new(),
        live: Vec::new(),
        next_id: 1,
    };
    for op in ops {
        machine.apply(op);
        machine.check();
    }
    for (id, _) in std::mem::take(&mut machine.live) {
        machine.cache.finish(&rid(id)).unwrap();
    }
    let stats = machine.cache.stats();
    assert_eq!(stats.blocks_in_use, 0, "a request's reference outlived it");
    assert_eq!(
        stats.blocks_free + stats.blocks_cached,
        stats.blocks_total,
        "a block leaked"
    );
    machine.cache.check_invariants();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn sliding_window_requests_never_read_a_released_block(
        num_blocks in 4..=24u32,
        block_size in 1..=4usize,
        window in 1..=20usize,
        reuse_last_block in any::<bool>(),
        ops in vec(sliding_op(), 1..60),
    ) {
        run_sliding(num_blocks, block_size, window, reuse_last_block, &ops);
    }
}

/// Found by `make rust-stress` at 60000 cases on the change that lets a spare keep its cached
/// child (`pool.rs`).
#[test]
fn a_spare_keeps_its_child_through_low_level_commits() {
    let ops = [
        Op::Begin {
            tokens: vec![0],
            salt: false,
            priority: 0,
        },
        Op::Begin {
            tokens: vec![1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0],
            salt: false,
            priority: 0,
        },
        Op::Begin {
            tokens: vec![1, 2, 3, 0, 0],
            salt: false,
            priority: 0,
        },
        Op::Finish { request: 12 },
        Op::Commit {
            request: 21,
            percent: 40,
        },
        Op::Allocate { count: 3 },
        Op::BeginTwins {
            tokens: vec![1, 2, 3],
            salt: true,
            priority: 0,
        },
        Op::Commit {
            request: 61,
            percent: 37,
        },
        Op::CommitBlocks {
            held: 0,
            keep: 3,
            tokens: vec![1, 2, 3, 4, 5, 1],
            salt: false,
            priority: 0,
        },
        Op::Finish { request: 1 },
        Op::Finish { request: 5 },
        Op::Finish { request: 1 },
    ];
    run(15, 2, 4, 12_597_561_123_941_762_363, false, &ops);
}
