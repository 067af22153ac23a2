"""A small pure-Python model of `PrefixCache`, written for clarity, not speed.

The state-machine test drives it side by side with the real cache and demands identical
answers: hit lengths, block tables (the free list and the eviction order are mirrored exactly,
including tie-breaks), refcounts, cached/pinned states and counters. Keys here are the full
token contents, so the model has no hash at all: it is what the verified table must behave like.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOWEST = -(2**31)  # a freshly allocated block's priority, until a request touches it


@dataclass
class Entry:
    id: int
    block: int
    key: tuple


@dataclass
class Meta:
    ref: int = 0
    pins: int = 0
    children: int = 0
    cached: bool = False
    parent: int | None = None
    tick: int = 0
    priority: int = 0
    entry: Entry | None = None
    #: A held private copy of this cached block's content (rust/core/src/pool.rs).
    duplicate_of: int | None = None


@dataclass
class ModelRequest:
    tokens: list[int]
    table: list[int]
    root: tuple
    priority: int
    anchors: list[Entry] = field(default_factory=list)
    cacheable: bool = True
    #: Tokens with KV written: the most any commit said.
    computed: int = 0


class ReferenceCache:
    def __init__(self, num_blocks: int, block_size: int, reuse_last_block: bool = False) -> None:
        self.bs = block_size
        #: The cache's full-hit mode: share every block (else recompute the last one).
        self.reuse_last_block = reuse_last_block
        self.blocks = [Meta() for _ in range(num_blocks)]
        self.free = list(range(num_blocks))[::-1]
        self.table: dict[tuple, Entry] = {}
        self.requests: dict[int, ModelRequest] = {}
        self.pins: dict[int, list[int]] = {}
        self.context = 0
        self.next_request = self.next_pin = self.next_entry = 1
        self.tick = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = self.evictions = 0
        #: Each canonical block's duplicates, in the order they were recorded.
        self.duplicates: dict[int, list[int]] = {}
        #: Spares' children lent to the canonical copy while blocked (pool.rs): child -> spare.
        self.lent: dict[int, int] = {}

    # -- helpers -------------------------------------------------------------------------
    def _key(self, root: tuple, tokens: list[int], n_blocks: int) -> tuple:
        return (root, tuple(tokens[: n_blocks * self.bs]))

    def _match(self, tokens: list[int], root: tuple) -> list[Entry]:
        out = []
        for i in range(len(tokens) // self.bs):
            entry = self.table.get(self._key(root, tokens, i + 1))
            if entry is None:
                break
            out.append(entry)
        return out

    def _result(self, blocks: list[int], n: int) -> tuple[list[int], int, bool]:
        cached = len(blocks) * self.bs
        full = cached == n and n > 0
        if not full:
            return blocks, cached, False
        if self.reuse_last_block:
            return blocks, n - 1, True
        return blocks[:-1], n - self.bs, True

    def _evictable(self, b: int, children: int | None = None) -> bool:
        # A cached leaf nobody holds or pins, or a spare (a released duplicate, pool.rs).
        m = self.blocks[b]
        children = m.children if children is None else children
        return m.ref == 0 and (
            (m.cached and m.pins == 0 and children == 0) or m.duplicate_of is not None
        )

    def _blocked(self, b: int) -> bool:
        # Cached, and out of eviction's reach: referenced, pinned, or above such a block.
        m = self.blocks[b]
        return m.cached and (
            m.ref > 0
            or m.pins > 0
            or any(
                c.cached and c.parent == b and self._blocked(i) for i, c in enumerate(self.blocks)
            )
        )

    def _normalize(self) -> None:
        # A spare's cached child sits under it exactly while not blocked (rust/core/src/pool.rs):
        # a blocked one is lent to the canonical copy, and goes back once unblocked.
        changed = True
        while changed:
            changed = False
            for s, m in enumerate(self.blocks):
                if m.duplicate_of is None or m.ref > 0:
                    continue
                for c, cm in enumerate(self.blocks):
                    if cm.cached and cm.parent == s and self._blocked(c):
                        cm.parent = m.duplicate_of
                        m.children -= 1
                        self.blocks[m.duplicate_of].children += 1
                        self.lent[c] = s
                        changed = True
            for c, s in list(self.lent.items()):
                if not self._blocked(c):
                    canonical = self.blocks[c].parent
                    assert canonical is not None
                    self.blocks[c].parent = s
                    self.blocks[s].children += 1
                    self.blocks[canonical].children -= 1
                    del self.lent[c]
                    changed = True

    def _uncache(self, b: int) -> None:
        self.lent.pop(b, None)
        m = self.blocks[b]
        m.cached = False
        if m.entry is not None:
            del self.table[m.entry.key]
            m.entry = None
        m.pins = 0
        parent, m.parent = m.parent, None
        if m.ref == 0:
            self.free.append(b)
        if parent is not None:
            self.blocks[parent].children = max(0, self.blocks[parent].children - 1)

    def _plan(self) -> list[int]:
        """Every block eviction could take, in order: the smallest (priority, tick, id) evictable
        block each time, a parent joining once its children are planned."""
        plan: list[int] = []
        children = {i: m.children for i, m in enumerate(self.blocks)}
        planned: set[int] = set()
        while True:
            candidates = [
                (m.priority, m.tick, i)
                for i, m in enumerate(self.blocks)
                if i not in planned and self._evictable(i, children[i])
            ]
            if not candidates:
                return plan
            _, _, b = min(candidates)
            plan.append(b)
            planned.add(b)
            if self.blocks[b].parent is not None:
                children[self.blocks[b].parent] -= 1

    def _allocate(self, count: int) -> list[int] | None:
        self._normalize()
        num_listed = len(self.free)
        if len(self.free) + len(self._plan()) < count:
            return None
        # One block at a time, planned afresh: a move into a spare changes which are leaves.
        while len(self.free) < count:
            b = self._plan()[0]
            m = self.blocks[b]
            if m.duplicate_of is not None:
                # A spare: its content is cached elsewhere, in the canonical copy, which takes
                # the spare's cached child for good, lent or not (rust/core/src/pool.rs).
                for c, s in list(self.lent.items()):
                    if s == b:
                        del self.lent[c]
                for child in self.blocks:
                    if child.cached and child.parent == b:
                        child.parent = m.duplicate_of
                        m.children -= 1
                        self.blocks[m.duplicate_of].children += 1
                self._forget_duplicate(m.duplicate_of, b)
                m.duplicate_of = None
                self.free.append(b)
            elif b in self.duplicates:
                self._move_into_duplicate(b, self.duplicates.pop(b))
            else:
                self._uncache(b)
                self.evictions += 1
        # vLLM's free queue order: the free list's top first, then the evicted blocks in order.
        start = len(self.free) - count
        listed = self.free[start:num_listed]
        taken = listed[::-1] + self.free[max(start, num_listed) :]
        del self.free[start:]
        for b in taken:
            self.blocks[b].ref = 1
            self.blocks[b].priority = LOWEST
        return taken

    def _move_into_duplicate(self, b: int, duplicates: list[int]) -> None:
        # Evicting a canonical block with a duplicate moves its entry there: the first one
        # recorded becomes cached under its own parent; the others follow it.
        heir = duplicates.pop(0)  # the earliest copy left, as vLLM returns
        for other in duplicates:
            self.blocks[other].duplicate_of = heir
        if duplicates:
            self.duplicates[heir] = duplicates
        entry = self.blocks[b].entry
        assert entry is not None
        moved = Entry(entry.id, heir, entry.key)
        self.table[entry.key] = moved
        self.blocks[b].entry = None
        evicted_parent = self.blocks[b].parent
        self._uncache(b)
        m = self.blocks[heir]
        if m.ref == 0:
            # A spare takes the evicted block's place (its own child, if any, stays its child).
            m.parent = evicted_parent
        m.cached, m.entry, m.duplicate_of = True, moved, None
        if m.parent is not None:
            self.blocks[m.parent].children += 1

    def _release(self, b: int) -> None:
        m = self.blocks[b]
        assert m.ref > 0
        m.ref -= 1
        if m.ref == 0 and not m.cached:
            if m.duplicate_of is not None:
                # A spare now, in the eviction order; it keeps its cached child, if any.
                m.parent = None
            else:
                self.free.append(b)
        # A release may unblock a lent child, or make a duplicate with a blocked child a spare.
        self._normalize()

    def _forget_duplicate(self, canonical: int, b: int) -> None:
        self.duplicates[canonical].remove(b)
        if not self.duplicates[canonical]:
            del self.duplicates[canonical]

    def _touch(self, b: int, priority: int) -> None:
        # A block keeps the highest priority of any request that used it.
        self.blocks[b].tick = self.tick
        self.blocks[b].priority = max(self.blocks[b].priority, priority)

    def _extend(self, req: ModelRequest, target: int) -> None:
        while req.anchors and self.blocks[req.anchors[-1].block].entry is not req.anchors[-1]:
            req.anchors.pop()
        while len(req.anchors) < target:
            pos = len(req.anchors)
            key = self._key(req.root, req.tokens, pos + 1)
            own = req.table[pos]
            existing = self.table.get(key)
            # Later blocks chain on the request's own copy (a duplicate, if it deduplicated).
            previous = req.table[pos - 1] if pos else None
            if existing is not None and existing.block != own:
                m = self.blocks[own]
                if m.duplicate_of != existing.block:
                    if m.duplicate_of is None:
                        m.parent = previous
                    m.duplicate_of = existing.block
                    self.duplicates.setdefault(existing.block, []).append(own)
                # The request reads its own copy: the canonical one keeps its LRU place.
                req.anchors.append(existing)
                continue
            if existing is not None:
                anchor = existing
            else:
                anchor = Entry(self.next_entry, own, key)
                self.next_entry += 1
                m = self.blocks[own]
                m.cached, m.entry = True, anchor
                m.parent = previous
                if m.parent is not None:
                    self.blocks[m.parent].children += 1
                self.table[key] = anchor
            self._touch(anchor.block, req.priority)
            req.anchors.append(anchor)

    # -- the API -------------------------------------------------------------------------
    def root(self, salt: str | None) -> tuple:
        return (self.context, salt or "")

    def lookup(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], int, bool]:
        return self._result([e.block for e in self._match(tokens, self.root(salt))], len(tokens))

    def begin(self, tokens: list[int], salt: str | None = None, priority: int = 0):
        root = self.root(salt)
        matched = self._match(tokens, root)
        # The hit's shape is what the match found, before allocating (which may evict the
        # block a recompute-last-block full hit leaves out).
        blocks, cached, full = self._result([e.block for e in matched], len(tokens))
        hits = matched[: len(blocks)]
        total = -(-len(tokens) // self.bs)
        for e in hits:
            self.blocks[e.block].ref += 1
        fresh = self._allocate(total - len(hits))
        if fresh is None:
            for e in hits:
                self.blocks[e.block].ref -= 1
            self._normalize()
            return None
        self.tick += 1
        for e in hits:
            self._touch(e.block, priority)
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hit_tokens += cached
        rid = self.next_request
        self.next_request += 1
        self.requests[rid] = ModelRequest(
            list(tokens), blocks + fresh, root, priority, list(hits), computed=cached
        )
        return rid, blocks + fresh, cached, full

    def append(self, rid: int, tokens: list[int]) -> list[int] | None:
        req = self.requests[rid]
        need = max(0, -(-(len(req.tokens) + len(tokens)) // self.bs) - len(req.table))
        fresh = self._allocate(need)
        if fresh is None:
            return None
        req.tokens += tokens
        req.table += fresh
        return fresh

    def commit(self, rid: int, n: int) -> int:
        req = self.requests[rid]
        req.computed = max(req.computed, n)
        if req.cacheable:
            self.tick += 1
            self._extend(req, req.computed // self.bs)
            self._normalize()
        return len(req.anchors)

    def finish(self, rid: int) -> None:
        req = self.requests.pop(rid)
        self.tick += 1
        # Duplicates (spares once released) one tick after the rest (rust/core/src/request/mod.rs).
        spares = False
        for b in req.table:
            m = self.blocks[b]
            if m.cached:
                self._touch(b, req.priority)
            elif m.duplicate_of is not None:
                m.tick, m.priority = self.tick + 1, max(m.priority, req.priority)
                spares = True
        # Duplicates last, after their successors (rust/core/src/request/mod.rs).
        for duplicates in (False, True):
            for b in req.table:
                if (self.blocks[b].duplicate_of is not None) == duplicates:
                    self._release(b)
        if spares:
            self.tick += 1

    def allocate(self, count: int) -> list[int] | None:
        return self._allocate(count)

    def release(self, blocks: list[int]) -> None:
        self.tick += 1
        for b in blocks:
            if self.blocks[b].cached:
                self._touch(b, LOWEST)
            self._release(b)

    def pin(self, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        blocks = [e.block for e in self._match(tokens, self.root(salt))]
        for b in blocks:
            self.blocks[b].pins += 1
        self._normalize()
        pid = self.next_pin
        self.next_pin += 1
        self.pins[pid] = blocks
        return pid, len(blocks)

    def unpin(self, pid: int) -> None:
        for b in self.pins.pop(pid):
            if self.blocks[b].pins > 0:
                self.blocks[b].pins -= 1
        self._normalize()

    def clear(self) -> None:
        for req in self.requests.values():
            req.cacheable = False
            req.anchors.clear()
        self.pins.clear()
        for b, m in enumerate(self.blocks):
            if m.cached:
                self._uncache(b)
        spares = []
        for duplicates in self.duplicates.values():
            for d in duplicates:
                self.blocks[d].duplicate_of = self.blocks[d].parent = None
                if self.blocks[d].ref == 0:
                    spares.append(d)
        self.duplicates.clear()
        self.lent.clear()
        self.free.extend(sorted(spares))

    def set_context(self, context: int) -> None:
        self.context = context
        self.clear()

    # -- observation ---------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        return {
            "blocks_free": len(self.free),
            # Table entries and spares (released duplicates): cached content (core stats.rs).
            "blocks_cached": sum(
                m.cached or (m.duplicate_of is not None and m.ref == 0) for m in self.blocks
            ),
            "blocks_in_use": sum(m.ref > 0 for m in self.blocks),
            "blocks_pinned": sum(m.pins > 0 for m in self.blocks),
            "evictions": self.evictions,
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "requests_live": len(self.requests),
        }
