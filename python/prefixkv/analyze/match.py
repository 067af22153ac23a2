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
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "MIN_RUN_CHARS",
    "MIN_RUN_TOKENS",
    "RadixTrie",
    "common_length",
    "common_suffix_length",
    "permuted_region",
    "resync",
]


_FIRST_STEP = 64
_MAX_STEP = 2**16


def common_length(
    a: Sequence[Any], a_start: int, b: Sequence[Any], b_start: int, limit: int
) -> int:
    """Length of the common run a[a_start:] / b[b_start:], at most `limit`.

    Galloping: slices twice as long after each equal one, so a long run costs a few dozen
    slice comparisons (C loops) rather than one Python step per element; the mismatch is then
    found at fine grain. Linear in the run's length either way."""
    matched = 0
    step = _FIRST_STEP
    while matched < limit:
        size = min(step, limit - matched)
        i, j = a_start + matched, b_start + matched
        if a[i : i + size] == b[j : j + size]:
            matched += size
            step = min(2 * step, _MAX_STEP)
        elif size > _FIRST_STEP:
            step = _FIRST_STEP  # the mismatch is in this slice: look again, finer
        else:
            while a[i] == b[j]:
                i += 1
                j += 1
                matched += 1
            return matched
    return matched


def common_suffix_length(
    a: Sequence[Any], a_end: int, b: Sequence[Any], b_end: int, limit: int
) -> int:
    """Length of the common run ending just before a[a_end] / b[b_end], at most `limit`."""
    matched = 0
    step = _FIRST_STEP
    while matched < limit:
        size = min(step, limit - matched)
        i, j = a_end - matched, b_end - matched
        if a[i - size : i] == b[j - size : j]:
            matched += size
            step = min(2 * step, _MAX_STEP)
        elif size > _FIRST_STEP:
            step = _FIRST_STEP
        else:
            while a[i - 1] == b[j - 1]:
                i -= 1
                j -= 1
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
    if isinstance(tokens, array) and tokens.typecode == "I":  # how the analysis holds them
        return tokens.tobytes()
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
    longest stretch wins.

    Linear in the tokens read, whatever the content: repetitive content (every position
    matches somewhere) could otherwise make each of those tries, or the tries before any long
    stretch is found, read the whole prompt. Extension reads are capped at a few times the
    prompts' length; past the cap the best stretch so far stands."""
    if len(this) - start < min_length or len(other) - start < min_length:
        return None
    budget = 4 * (len(this) + len(other) - 2 * start) + 64 * anchor
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
            back = common_suffix_length(this, p, other, hit, min(p, hit) - start)
            p0, q0 = p - back, hit - back
            length = common_length(this, p0, other, q0, min(len(this) - p0, len(other) - q0))
            budget -= length
            if budget < 0:
                return best
            covered[p - hit] = p0 + length
            if length >= min_length:
                if best is None:
                    deadline = min(deadline, p0 + anchor)
                if best is None or length > best[2]:
                    best = (p0, q0, length)
        if attempts > 256 and best is None:  # repetitive content: give up, do not go quadratic
            return None
    return best


# The shortest run that counts as one reordered piece: a tool definition is rarely shorter.
MIN_RUN_CHARS = 32
MIN_RUN_TOKENS = 16


def permuted_region(
    a: Sequence[Any], b: Sequence[Any], start: int, min_run: int
) -> tuple[int, int] | None:
    """Where `a` and `b`, equal before `start`, hold the same runs in another order: (s, e)
    with s <= start < e such that a[s:e] is made of runs of at least `min_run` elements found
    in b[s:e], not all in place, and holds exactly the elements of b[s:e]; None if the
    divergence at `start` is not that.

    This is how reordered tool definitions look once rendered into a prompt (as JSON objects,
    markdown sections or their tokens), whatever their syntax: the same pieces, shuffled. `a`
    is tiled from `start` by the longest runs `b` also has. Pieces that begin alike
    ({"name": "...) part ways inside a piece, after a shared header, and a run may overshoot a
    piece's end into the next one's header; so runs may overlap in `b`, and the region is
    closed by counting: when the runs lie within [s, e) of `b` (give or take a header) and the
    two spans hold the same elements. A run of `a` found in `b` before `start` reveals the shared header, and the
    tiling restarts there. A run found in place ends the region if the counts are even there;
    otherwise it is a piece that kept its place between moved ones (T0 T2 T1 / T1 T2 T0).

    The sequences are str or lists of ints. The work is linear in their length (extensions and
    counts are capped), and a divergence that is not a reordering fails on its first run."""
    if not _occurs(a[start : start + min_run], b, max(0, start - _MAX_HEADER * min_run)):
        return None  # the usual case, settled without an index: no run begins at the divergence
    width = max(1, (min_run + 1) // 2)  # a run of min_run holds an indexed width-gram of b
    slack = _MAX_HEADER * min_run  # how far a shared header may reach around a piece
    lo = max(0, start - slack)
    key_a, key_b = _gram_keys(a, width), _gram_keys(b, width)
    index: dict[Any, list[int]] = defaultdict(list)
    for q in range(lo, len(b) - width + 1, width):
        positions = index[key_b(q)]
        if len(positions) < 8:
            positions.append(q)
    budget = 8 * (len(a) + len(b) - 2 * lo) + 64 * min_run
    s = cursor = start
    highest = -1  # the end of the span of `b` the runs reach so far
    balance = _Balance()  # elements of a[s:cursor] minus those of b[s:cursor]
    shuffled = False  # some run of `a` sits elsewhere in `b`
    restarts = 0
    closed_at = -1
    while budget >= 0 and cursor < len(a):
        best_q, best_length = -1, 0
        for delta in range(min(width, len(a) - cursor - width + 1)):
            for hit in index.get(key_a(cursor + delta), ()):
                q = hit - delta
                if q < lo or budget < 0:
                    continue
                length = common_length(a, cursor, b, q, min(len(a) - cursor, len(b) - q))
                budget -= length
                if length > best_length:
                    best_q, best_length = q, length
        if best_length < min_run or budget < 0:
            break
        if best_q < s:
            if restarts == 3:
                break
            # The run starts in the shared header: restart the tiling there.
            restarts += 1
            s = cursor = best_q
            highest, balance = -1, _Balance()
            shuffled, closed_at = False, -1
            continue
        if best_q == cursor and shuffled and balance.even() and highest <= cursor + slack:
            closed_at = cursor  # back in place, and even: the region ends here
            break
        shuffled = shuffled or best_q != cursor
        highest = max(highest, best_q + best_length)
        balance.add(a[cursor : cursor + best_length], 1)
        balance.add(b[cursor : cursor + best_length], -1)
        cursor += best_length
        if shuffled and balance.even() and highest <= cursor + slack:
            closed_at = cursor
            if cursor >= min(len(a), len(b)) or a[cursor] == b[cursor]:
                break
    return (s, closed_at) if closed_at > start else None


class _Balance:
    """A running multiset difference: `even()` when both sides hold the same elements."""

    def __init__(self) -> None:
        self._diff: dict[Any, int] = defaultdict(int)
        self._uneven = 0  # keys whose count is not zero

    def add(self, items: Iterable[Any], sign: int) -> None:
        diff = self._diff
        for item in items:
            before = diff[item]
            diff[item] = before + sign
            if before == 0:
                self._uneven += 1
            elif before + sign == 0:
                self._uneven -= 1

    def even(self) -> bool:
        return self._uneven == 0


_MAX_HEADER = 8  # how far before the divergence, in min_runs, a shared header may begin


def _occurs(probe: Sequence[Any], seq: Sequence[Any], lo: int) -> bool:
    """Does `probe` occur in seq[lo:]? (C-speed search: str.find, or bytes.find on packed ids
    at a 4-byte boundary.)"""
    if isinstance(seq, str):
        return isinstance(probe, str) and seq.find(probe, lo) >= 0
    packed, needle = _to_bytes(seq), _to_bytes(probe)
    pos = packed.find(needle, 4 * lo)
    while pos >= 0 and pos % 4:
        pos = packed.find(needle, pos + 1)
    return pos >= 0


def _gram_keys(seq: Sequence[Any], width: int) -> Any:
    """A function giving the hashable `width`-gram at a position: str slices for text, byte
    slices of the packed ids for tokens."""
    if isinstance(seq, str):
        return lambda pos: seq[pos : pos + width]
    packed = _to_bytes(seq)
    return lambda pos: packed[4 * pos : 4 * (pos + width)]
