"""A plain-Python block manager with the semantics of `prefixkv.PrefixCache`: the baseline.

It is written to be fast within plain Python, the way a careful engine author would write it
(vLLM's v1 block manager is the model), so that "N times faster than Python" measures the
Rust core and not a strawman:

- keys chain: ``key_i = H(key_{i-1} || tokens_i as little-endian u32 bytes)``, one
  ``hashlib`` call per full block (sha256 by default: with SHA extensions it is the fastest
  hashlib digest on current x86 CPUs; ``hash_name="blake2b"`` is available);
- the prompt is converted to bytes once (``array('I', ...)`` for lists, one numpy cast for
  arrays) and each block is a 64-byte slice of it;
- a dict from key to block, per-block refcounts in a list, and an ``OrderedDict`` of evictable
  blocks in LRU order; a finished request releases its blocks tail first, so a chain's last
  blocks are evicted before its first ones (the core evicts leaves only; this is vLLM's
  approximation of that);
- every hit is verified: the block's stored token bytes and parent key must equal the
  request's, as the core verifies tokens, extras and parent;
- matching stops at the first miss, and `commit` resumes hashing from the last matched key,
  so no block is hashed twice (as in the core).

Not modelled, because the benchmark does not use them: salts, adapters, multimodal extras,
priorities, pins, `append`, statistics. The benchmark checks that this baseline and the core
report the same cached-token counts on every request of every workload without eviction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["PyPrefixCache", "PyRequest", "token_bytes"]

_ROOT = bytes(32)


def token_bytes(tokens: Any) -> bytes:
    """Token ids as little-endian u32 bytes: one C-level conversion, no Python loop."""
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype="<u4").tobytes()
    # array('I') is native-endian u32; every platform the benchmark runs on is little-endian.
    return array("I", tokens).tobytes()


class PyRequest:
    __slots__ = (
        "block_table",
        "data",
        "full_hit",
        "id",
        "last_key",
        "num_anchored",
        "num_cached_tokens",
        "num_prompt_tokens",
    )

    def __init__(
        self,
        request_id: int,
        data: bytes,
        block_table: list[int],
        num_anchored: int,
        last_key: bytes,
        num_cached_tokens: int,
        full_hit: bool,
    ) -> None:
        self.id = request_id
        self.data = data
        self.block_table = block_table
        self.num_anchored = num_anchored
        self.last_key = last_key
        self.num_cached_tokens = num_cached_tokens
        self.full_hit = full_hit
        self.num_prompt_tokens = len(data) // 4


class PyPrefixCache:
    """begin / commit / finish with the core's semantics, in plain Python."""

    def __init__(self, num_blocks: int, block_size: int = 16, hash_name: str = "sha256") -> None:
        self.block_size = block_size
        self._block_bytes = 4 * block_size
        if hash_name == "sha256":
            self._hash = lambda data: hashlib.sha256(data).digest()
        elif hash_name == "blake2b":
            self._hash = lambda data: hashlib.blake2b(data, digest_size=32).digest()
        else:
            raise ValueError(f"unknown hash {hash_name!r}")
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_blocks
        # Per cached block: its key, parent key and token bytes (None when not cached).
        self._key: list[bytes | None] = [None] * num_blocks
        self._parent: list[bytes | None] = [None] * num_blocks
        self._tokens: list[bytes | None] = [None] * num_blocks
        self._table: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._requests: dict[int, PyRequest] = {}
        self._next_request = 1
        self.evictions = 0

    def begin(self, tokens: Any) -> PyRequest:
        data = token_bytes(tokens)
        num_tokens = len(data) // 4
        if num_tokens == 0:
            raise ValueError("a request needs at least one token")
        bb = self._block_bytes
        h = self._hash
        table = self._table
        stored_tokens = self._tokens
        stored_parent = self._parent
        hits: list[int] = []
        parent = _ROOT
        for start in range(0, len(data) - bb + 1, bb):
            chunk = data[start : start + bb]
            key = h(parent + chunk)
            block = table.get(key)
            if block is None or stored_tokens[block] != chunk or stored_parent[block] != parent:
                break
            hits.append(block)
            parent = key

        total_blocks = -(-num_tokens // self.block_size)
        needed = total_blocks - len(hits)
        ref = self._ref
        evictable = self._evictable
        for block in hits:
            if ref[block] == 0:
                del evictable[block]
            ref[block] += 1
        if needed > len(self._free) + len(evictable):
            self._release(hits)
            raise MemoryError(f"need {needed} blocks, {len(self._free) + len(evictable)} available")
        fresh = self._allocate(needed)

        cached = len(hits) * self.block_size
        full_hit = cached == num_tokens
        request = PyRequest(
            self._next_request,
            data,
            hits + fresh,
            len(hits),
            parent,
            num_tokens - 1 if full_hit else cached,
            full_hit,
        )
        self._next_request += 1
        self._requests[request.id] = request
        return request

    def commit(self, request: PyRequest, num_computed_tokens: int) -> int:
        target = num_computed_tokens // self.block_size
        first = request.num_anchored
        if first >= target:
            return first
        bb = self._block_bytes
        h = self._hash
        table = self._table
        data = request.data
        own = request.block_table
        parent = request.last_key
        for position in range(first, target):
            chunk = data[position * bb : (position + 1) * bb]
            key = h(parent + chunk)
            existing = table.get(key)
            if existing is None:
                block = own[position]
                table[key] = block
                self._key[block] = key
                self._parent[block] = parent
                self._tokens[block] = chunk
            elif self._tokens[existing] != chunk or self._parent[existing] != parent:
                break  # a hash collision: never publish under another block's key
            # else: an identical block is cached already; ours stays private (deduplicated).
            parent = key
            request.num_anchored = position + 1
        request.last_key = parent
        return request.num_anchored

    def finish(self, request: PyRequest) -> None:
        del self._requests[request.id]
        # Tail first, so the LRU order evicts a chain from its end.
        self._release(reversed(request.block_table))

    def _release(self, blocks: Any) -> None:
        ref = self._ref
        keys = self._key
        evictable = self._evictable
        free = self._free
        for block in blocks:
            ref[block] -= 1
            if ref[block] == 0:
                if keys[block] is not None:
                    evictable[block] = None  # appended: most recently used
                else:
                    free.append(block)

    def _allocate(self, count: int) -> list[int]:
        free = self._free
        ref = self._ref
        out = []
        for _ in range(count):
            if free:
                block = free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._table[self._key[block]]
                self._key[block] = self._parent[block] = self._tokens[block] = None
                self.evictions += 1
            ref[block] = 1
            out.append(block)
        return out

    def block_keys(self, tokens: Any) -> list[bytes]:
        """The chained key of every full block: the plain-Python hash-only floor."""
        data = token_bytes(tokens)
        bb = self._block_bytes
        h = self._hash
        keys = []
        parent = _ROOT
        for start in range(0, len(data) - bb + 1, bb):
            parent = h(parent + data[start : start + bb])
            keys.append(parent)
        return keys
