"""Sequence matching for the diagnosis: where two prompts part ways, and where they meet again.

A request's best earlier match is found in a radix trie of the earlier requests of its isolation
group (`RadixTrie`): the longest common token prefix is the divergence. `resync` then looks for
a long stretch the two share after the divergence, which is the sign that stable content sits
behind variable content. Both are linear in the tokens they read; `resync` gives up on
repetitive content rather than go quadratic.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Sequence

__all__ = ["RadixTrie", "common_length", "resync"]


def common_length(
    a: Sequence[int], a_start: int, b: Sequence[int], b_start: int, limit: int
) -> int:
    """Length of the common run a[a_start:] / b[b_start:], at most `limit`."""
    matched = 0
    chunk = 64
    while matched < limit:
        step = min(chunk, limit - matched)
        i, j = a_start + matched, b_start + matched
        if a[i : i + step] == b[j : j + step]:
            matched += step
            continue
        while a[i] == b[j]:
            i += 1
            j += 1
            matched += 1
        return matched
    return matched


class _Node:
    __slots__ = ("children", "end", "owner", "seq", "start")

    def __init__(self, seq: int, start: int, end: int, owner: int) -> None:
        self.seq = seq  # the edge into this node is RadixTrie._seqs[seq][start:end]
        self.start = start
        self.end = end
        self.owner = owner  # the latest request whose tokens pass through this node
        self.children: dict[int, _Node] = {}


class RadixTrie:
    """Token sequences of earlier requests; an edge is a slice of one stored sequence, so the
    trie costs O(requests) nodes rather than O(tokens)."""

    def __init__(self) -> None:
        self._seqs: list[Sequence[int]] = []
        self._root = _Node(-1, 0, 0, -1)

    def longest_match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(length of the longest common prefix with any stored sequence, the latest request
        sharing that prefix); (0, -1) when the trie is empty or nothing matches."""
        node, pos, owner = self._root, 0, -1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            label = self._seqs[child.seq]
            edge = child.end - child.start
            matched = common_length(tokens, pos, label, child.start, min(edge, len(tokens) - pos))
            pos += matched
            owner = child.owner
            if matched < edge:
                break
            node = child
        return pos, owner

    def insert(self, tokens: Sequence[int], owner: int) -> None:
        self._seqs.append(tokens)
        seq = len(self._seqs) - 1
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                node.children[tokens[pos]] = _Node(seq, pos, len(tokens), owner)
                return
            label = self._seqs[child.seq]
            edge = child.end - child.start
            matched = common_length(tokens, pos, label, child.start, min(edge, len(tokens) - pos))
            if matched < edge:  # split the edge: `middle` takes the shared part
                middle = _Node(child.seq, child.start, child.start + matched, owner)
                child.start += matched
                middle.children[label[child.start]] = child
                node.children[tokens[pos]] = middle
                child = middle
            child.owner = owner
            pos += matched
            node = child


def _to_bytes(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


def resync(
    this: Sequence[int], other: Sequence[int], start: int, anchor: int, min_length: int
) -> tuple[int, int, int] | None:
    """The first long stretch (at least `min_length` tokens) that `this[start:]` and
    `other[start:]` share, at possibly different positions: (position in this, position in
    other, length).

    `other` is indexed only at every `anchor`-th position; any shared stretch of at least
    2*anchor-1 tokens contains one indexed `anchor`-gram, and extending the hit backwards and
    forwards recovers the whole stretch. Repeated content can align a stretch with the wrong
    copy, so once a long stretch is found the next `anchor` positions are tried too and the
    longest stretch wins."""
    if len(this) - start < min_length or len(other) - start < min_length:
        return None
    this_bytes, other_bytes = _to_bytes(this), _to_bytes(other)
    width = 4 * anchor
    index: dict[bytes, list[int]] = defaultdict(list)
    for q in range(start, len(other) - anchor + 1, anchor):
        positions = index[other_bytes[4 * q : 4 * q + width]]
        if len(positions) < 4:
            positions.append(q)
    best: tuple[int, int, int] | None = None
    deadline = len(this) - anchor + 1
    covered: dict[int, int] = {}  # diagonal (p - q) -> end of the stretch already measured
    attempts = 0
    for p in range(start, len(this) - anchor + 1):
        if p >= deadline:
            break
        for hit in index.get(this_bytes[4 * p : 4 * p + width], ()):
            if covered.get(p - hit, -1) > p:
                continue
            attempts += 1
            p0, q0 = p, hit
            while p0 > start and q0 > start and this[p0 - 1] == other[q0 - 1]:
                p0 -= 1
                q0 -= 1
            length = common_length(this, p0, other, q0, min(len(this) - p0, len(other) - q0))
            covered[p - hit] = p0 + length
            if length >= min_length:
                if best is None:
                    deadline = min(deadline, p0 + anchor)
                if best is None or length > best[2]:
                    best = (p0, q0, length)
        if attempts > 256 and best is None:  # repetitive content: give up, do not go quadratic
            return None
    return best
