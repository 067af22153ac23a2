"""The engine-facing prefix cache: `PrefixCache`.

A thin typed layer over the Rust block manager (`prefixkv._core`): it turns the token ids an
engine holds (lists, numpy arrays, CPU tensors) into what the core reads, and the core's
answers into small typed objects. All state lives in the core, behind its own lock, so one
`PrefixCache` may be shared by threads: lookups never block, even while another thread begins,
commits and finishes requests.

size: one class, the engine-facing API of the core: each method is a thin typed wrapper with
its argument checks and docstring, and splitting them would scatter one object's surface.

A request's life, the simple way (the whole prompt at once)::

    request = cache.begin(prompt_ids)           # cached prefix referenced, rest allocated
    # compute positions request.num_cached_tokens .. len(prompt)-1 into request.block_table
    cache.commit(request, len(prompt_ids))      # publish the blocks that are now full
    new_blocks = cache.append(request, [next_token])   # decode: room for generated tokens
    cache.commit(request, num_tokens_with_kv)
    cache.finish(request)                       # blocks stay cached, evictable (LRU)

and the way a scheduler drives it, step by step under its own request ids (chunked prefill,
speculative decoding, preemption; the README has a whole loop)::

    cache.add_request("req-7", prompt_ids)                  # nothing taken yet
    slots = cache.allocate_slots("req-7", 512)              # prefix hit + room for a chunk
    # compute positions slots.num_computed_tokens .. +512 into the blocks (slots.block_ids)
    cache.commit("req-7", slots.num_computed_tokens + 512)
    cache.append_tokens("req-7", [sampled])                 # decode
    cache.allocate_slots("req-7", 1, num_lookahead_tokens=4)  # + room for 4 drafts
    cache.append_tokens("req-7", drafts, draft=True)        # never published while drafts
    cache.accept_drafts("req-7", num_accepted)              # the rest dropped, blocks freed
    cache.preempt("req-7")                                   # refs dropped, blocks stay cached
    cache.finish("req-7")
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from prefixkv import _core
from prefixkv._core import CacheStats, KeyExtras, Pin, PrefixMatch, Request, Slots
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError, UnsupportedFeatureError

__all__ = [
    "CacheStats",
    "KeyExtras",
    "Pin",
    "PrefixCache",
    "PrefixMatch",
    "Request",
    "RequestRef",
    "Slots",
    "as_token_ids",
]

#: What callers may pass as token ids.
TokenIds = Any  # Sequence[int] | np.ndarray | torch.Tensor (kept Any: torch is optional here)
#: A request for every request-keyed call: the `Request` that `begin` returned, or the
#: engine's own id for it (an int or a str).
RequestRef = Request | int | str
#: How a prompt whose every block is cached is served (see `PrefixCache`).
FULL_HIT_MODES = ("recompute_last_block", "reuse_last_block")
CORES = ("auto", "blocks", "runs")
#: When a sliding-window cache releases what a request's window passed (`PrefixCache`).
WINDOW_RELEASE_MODES = ("on_commit", "explicit")
#: A multimodal item: (first placeholder position, number of placeholders, content hash).
MultimodalItem = tuple[int, int, "bytes | str"]

#: The extras of a request that has none: parsed once, shared by every such call.
_NO_EXTRAS = KeyExtras()

# The result types are the native module's frozen classes (`rust/py/src/results.rs`):
# `PrefixMatch` (num_cached_tokens, full_hit, block_ids, num_cached_blocks), `Request` (id,
# block_table, num_cached_tokens, full_hit, num_prompt_tokens, num_tokens_to_compute) and
# `Pin` (id, num_blocks).


def key_extras(
    salt: str | bytes | None = None,
    adapter: str | bytes | None = None,
    multimodal: Sequence[MultimodalItem] | None = None,
) -> KeyExtras:
    """Everything besides the token ids that goes into a request's block keys, parsed once."""
    if salt is None and adapter is None and not multimodal:
        return _NO_EXTRAS
    return KeyExtras(salt, adapter, multimodal)


def as_token_ids(
    tokens: TokenIds,
) -> list[int] | tuple[int, ...] | tuple[np.ndarray, int, bool]:
    """Token ids in a form the core reads (treat it as opaque).

    Lists and tuples go to the core as they are: it reads each exact int with one C-API call
    (~3 ns a token, against ~6 for packing them with `array('I')` first) and refuses anything
    else (a bool, a negative id, one above 2**32 - 1) by position. Numpy arrays of any integer
    dtype and CPU torch tensors are read by the core in place (the buffer protocol; a strided
    view is gathered first), checked and narrowed with the GIL released, so the array must not
    be written while the call that takes it runs. The result refers to the array, not a copy
    of it: make it again after writing to the array. Nothing is converted element by element
    in Python.
    """
    if type(tokens) is _NDARRAY:  # the common case first, inlined: it runs on every request
        dtype = tokens.dtype
        if tokens.ndim == 1:
            if dtype is _INT64:  # numpy's default integer: one identity check
                return (tokens, 8, True)
            kind = dtype.kind
            if (kind == "i" or kind == "u") and dtype.byteorder in _LITTLE_ENDIAN_ORDERS:
                return (tokens, dtype.itemsize, kind == "i")
        return _array_tokens(tokens)
    if isinstance(tokens, (list, tuple)):
        if type(tokens) is tuple and len(tokens) == 3 and isinstance(tokens[2], bool):
            # The core would read it as an `(array, width, signed)` of this function's own:
            # no tuple of ids holds a bool, so this one is refused here, by position.
            raise InvalidInputError("token id at position 2 must be an int, not bool")
        return tokens
    if isinstance(tokens, np.ndarray):
        return _array_tokens(tokens)
    if type(tokens).__module__.startswith("torch"):
        if tokens.is_floating_point() or tokens.is_complex() or str(tokens.dtype) == "torch.bool":
            raise InvalidInputError(f"token ids must have an integer dtype, got {tokens.dtype}")
        if tokens.device.type != "cpu":
            raise InvalidInputError(
                f"token ids must be on the CPU, got a tensor on {tokens.device}; call .cpu() first"
            )
        return _array_tokens(tokens.detach().numpy())
    if isinstance(tokens, range):
        return list(tokens)
    raise InvalidInputError(
        f"token ids must be a list, tuple, numpy array or CPU tensor of ints, not {type(tokens).__name__}"
    )


def _owned(ids: Any) -> Any:
    """`as_token_ids`' result made independent of the caller's object: a list copied, an array
    (or a tensor's view) copied; tuples, bytes and ranges cannot change."""
    if isinstance(ids, list):
        return list(ids)
    if type(ids) is tuple and len(ids) == 3 and isinstance(ids[0], np.ndarray):
        return (ids[0].copy(), ids[1], ids[2])
    return ids


_NDARRAY = np.ndarray
#: The byte orders numpy gives an integer dtype the core reads as it is: little-endian
#: (`<`, or `=` on a little-endian machine) or one byte (`|`). Checked from the dtype's own
#: attributes, never by looking the dtype up in a shared dict: on a free-threaded interpreter
#: a dict keyed by objects other than str takes a lock on every lookup, and two threads
#: converting prompts then queue on it (`benches/PROFILE.md`, issue 24, round 26).
_LITTLE_ENDIAN_ORDERS = ("<", "|", "=") if sys.byteorder == "little" else ("<", "|")
#: Little-endian int64 (numpy's builtin dtypes are singletons, so `is` finds it).
_INT64 = np.dtype("<i8")


def _array_tokens(values: np.ndarray) -> tuple[np.ndarray, int, bool]:
    # Only metadata is checked here; the core reads the array in place through the buffer
    # protocol (gathering a strided view), checks every value (negative, above 2**32 - 1)
    # and narrows to u32 with the GIL released.
    if values.ndim != 1:
        raise InvalidInputError(f"token ids must be one-dimensional, got shape {values.shape}")
    if values.dtype.kind not in "iu":  # bool is kind "b": refused here too
        raise InvalidInputError(f"token ids must have an integer dtype, got {values.dtype}")
    if values.dtype.byteorder == ">" or (values.dtype.byteorder == "=" and sys.byteorder == "big"):
        values = values.astype(values.dtype.newbyteorder("<"))
    return values, values.dtype.itemsize, values.dtype.kind == "i"


class PrefixCache:
    """Prefix-cache block manager: which KV blocks a request may reuse, and for how long.

    Args:
        num_blocks: blocks in the pool (the engine's KV pages).
        context: the execution context; defaults to `CacheContext()`. Changing it later with
            `set_context` (or calling `clear`) makes every cached block unreachable.
        block_size: tokens per block; defaults to `context.block_size` and must equal it.
        vocab_size: when given, token ids at or above it are refused.
        full_hit: how a prompt whose every block is cached is served. Some token must still be
            computed for its logits. ``"recompute_last_block"`` (the default): every block but
            the last is shared and the last block is recomputed into a private block
            (``num_cached_tokens`` is ``n - block_size``), as vLLM's runner does; a runner
            that writes the KV of every token it computes is always right. ``"reuse_last_block"``:
            every block is shared and only the last token is computed, reading its KV from the
            shared block; the runner must then *not* write KV for it (``last_token_shared``).
        sliding_window: ``None`` (the default) for full attention. A positive int ``W`` makes
            this the cache of a sliding-window KV group (one `PrefixCache` per group of layers
            of one attention kind): the query at position ``i`` reads keys ``i - W < j <= i``
            only. Blocks that leave a request's window are released as it advances (cached ones
            stay cached, evictable), and their block-table positions hold `null_block`; a hit
            needs only the blocks of the window before the hit point, the earlier positions of
            `PrefixMatch.block_ids` / `Slots.block_ids` being `null_block` too. The low-level
            `commit_blocks` and `pin` are refused in this mode (use the request API);
            `match_and_acquire` references only the non-null blocks. ``docs/design.md``,
            "Sliding-window groups", has the rules.
        window_release: when a sliding-window cache releases those blocks. ``"on_commit"``
            (the default): as the request advances (`commit`, `allocate_slots`,
            `accept_drafts`). ``"explicit"``: only at `release_out_of_window`, for an engine
            that publishes a step's blocks before the step writes them and releases on its own
            schedule, as vLLM does (``docs/vllm.md``, "Hybrid and sliding-window layouts");
            released positions, and a finished request's table, then leave last first.
            Refused without a `sliding_window`.
        core: which structure holds the cache; `core` names the one in use. ``"auto"`` (the
            default) picks the run core where it serves the settings (no `sliding_window`)
            and the block core otherwise. An "auto" cache on the run core moves to the block
            core at its first low-level block call (`match_and_acquire`, `allocate`,
            `commit_blocks`, `release`), provided it holds no request and every block is
            still free: both cores give the same hits and blocks, so the move changes only
            speed. Past that point such a call is an `UnsupportedFeatureError` naming
            ``core="blocks"``. ``"blocks"`` serves every call
            here. ``"runs"`` (issue 24; the vLLM integration's default for full attention)
            keeps one table entry per run of blocks, as a radix tree keeps a node, and serves
            the request cycle and the step API
            (`begin`, `add_request`, `allocate_slots`, `append_tokens` with drafts,
            `accept_drafts`, `truncate`, `commit`, `preempt`, `finish`, `lookup`, ...) faster
            on long prompts (1.85× on the production-shaped replay), handing out the same
            blocks in the same order; `pin`, `unpin`, the eviction log, both `full_hit` modes,
            KV events (`EventRecorder`: the same events as the block core's) and `multimodal`
            items (a block they overlap starts a run of its own, found only under its items'
            tag) too. It refuses by name, changing nothing, what it does not serve yet:
            `sliding_window`, the low-level block calls (`match_and_acquire`, `allocate`,
            `commit_blocks`, `release`) and KV groups (`UnsupportedFeatureError`), and `clear`
            / `set_context` while a request is scheduled (`InvalidInputError`; waiting and
            preempted ones stay, keyed anew). Its `lookup` does not take the writer's lock.

    Every request-keyed call takes the `Request` that `begin` returned, or the request's id:
    the engine's own (an int or a str, given to `add_request` or `begin`), or the int `begin`
    picked. An int follows `operator.index` (a float, bool or None is an `InvalidInputError`,
    never rounded to some other request). A live id given twice is a `DuplicateRequestError`. `salt`, `adapter` and `multimodal` may be given as keywords
    or, parsed once for several calls, as one `extras=key_extras(...)`.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        context: CacheContext | None = None,
        block_size: int | None = None,
        vocab_size: int | None = None,
        full_hit: str = "recompute_last_block",
        sliding_window: int | None = None,
        window_release: str = "on_commit",
        core: str = "auto",
        _key_bits: int = 128,
    ) -> None:
        if full_hit not in FULL_HIT_MODES:
            raise InvalidInputError(f"full_hit must be one of {FULL_HIT_MODES}, got {full_hit!r}")
        if window_release not in WINDOW_RELEASE_MODES:
            raise InvalidInputError(
                f"window_release must be one of {WINDOW_RELEASE_MODES}, got {window_release!r}"
            )
        if sliding_window is not None and (
            isinstance(sliding_window, bool)
            or not isinstance(sliding_window, int)
            or sliding_window < 1
        ):
            raise InvalidInputError(
                f"sliding_window must be None or a positive int (tokens), got {sliding_window!r}"
            )
        if block_size is not None and (
            isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
        ):
            raise InvalidInputError(f"block_size must be a positive int, got {block_size!r}")
        if context is None:
            context = CacheContext(block_size=16 if block_size is None else block_size)
        elif not isinstance(context, CacheContext):
            raise InvalidInputError(f"context must be a CacheContext, not {type(context).__name__}")
        if block_size is not None and block_size != context.block_size:
            raise InvalidInputError(
                f"block_size {block_size} differs from context.block_size {context.block_size}"
            )
        _check_reuse_safe(context)
        self._context = context
        # Guards the pair (core context, self._context) so that `context` never names a
        # context other than the one the core keys blocks under.
        self._context_lock = threading.Lock()
        self.full_hit = full_hit
        # "auto": the run core unless a setting needs the block core; it may still move to the
        # block core once, while empty (`_block_core`).
        self._auto = core == "auto"
        if self._auto:
            runs_serve = sliding_window is None and window_release == "on_commit"
            core = "runs" if runs_serve and _key_bits == 128 else "blocks"
        self.core = core
        # What the block core would be built with, kept for an "auto" cache's move to it.
        self._block_core_arguments = (
            num_blocks,
            vocab_size,
            _key_bits,
            full_hit == "reuse_last_block",
            sliding_window,
            window_release,
        )
        #: Set by `set_eviction_log` and by an `EventRecorder` (capacity, token_ids), so that an
        #: "auto" cache's move to the block core carries them over.
        self._eviction_log = False
        self._event_settings: tuple[int, str] | None = None
        #: Lookup counters an "auto" cache's run core gathered before its move.
        self._earlier_stats: CacheStats | None = None
        self._core: _core.CoreCache | _core.CoreRunCache
        if core == "runs":
            _check_runs_serve(sliding_window, window_release, _key_bits)
            self._core = _core.CoreRunCache(
                num_blocks,
                context.block_size,
                context.fingerprint(),
                vocab_size,
                full_hit == "reuse_last_block",
            )
        elif core == "blocks":
            self._core = self._new_block_core(context)
        else:
            raise InvalidInputError(f"core must be one of {CORES}, got {core!r}")

    # -- properties ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def sliding_window(self) -> int | None:
        """The window in tokens of a sliding-window cache; None for full attention."""
        return self._core.sliding_window

    @property
    def window_release(self) -> str:
        """``"on_commit"`` or ``"explicit"`` (see the class docs)."""
        return self._core.window_release

    @property
    def null_block(self) -> int | None:
        """The block id standing at every block-table position a sliding-window request no
        longer reads (``num_blocks``: one past the pool, never allocated, cached or referenced;
        keep one spare KV page for it). None for full attention."""
        return self._core.null_block

    @property
    def context(self) -> CacheContext:
        with self._context_lock:
            return self._context

    # -- lookups -------------------------------------------------------------------------
    def lookup(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> PrefixMatch:
        """The cached prefix of `tokens`, without taking references (lock-free probe)."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.lookup(as_token_ids(tokens), keys)

    def lookup_many(
        self,
        prompts: Iterable[TokenIds],
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
    ) -> list[PrefixMatch]:
        """`lookup` of each prompt, under the same `salt` and `adapter`, in one call.

        The answers are those of `lookup` prompt by prompt (no references taken; each probe
        counted in `stats`). The GIL is released once for the whole batch rather than once a
        prompt, so a router thread probing a batch leaves the interpreter to the scheduler
        thread meanwhile (`benches/bench_threads.py`). A prompt that is refused (a token id out
        of range or outside the vocabulary) refuses the whole call, naming its position in the
        batch; the cache is unchanged either way. `prompts` may be any iterable (a list, a 2-D
        array's rows, a generator); a generator may hand out one buffer refilled for each
        prompt, since each is copied as it comes. The batch's ids are held together while it
        runs (4 bytes a token). For prompts with multimodal items, use `lookup`.
        """
        keys = _extras(salt, adapter, None, None)
        # A container's items stay as they are while the call runs; an iterator's need not (one
        # list or array refilled for each prompt), so each of those is copied as it comes: the
        # core reads every prompt only once the iterator is done.
        held = isinstance(prompts, (list, tuple, np.ndarray))
        try:
            items = enumerate(prompts)
        except TypeError:
            raise InvalidInputError(
                f"prompts must be an iterable of token id sequences, not {type(prompts).__name__}"
            ) from None
        batch: list[Any] = []
        for index, tokens in items:
            try:
                ids = as_token_ids(tokens)
            except InvalidInputError as error:
                raise InvalidInputError(f"prompt {index} of the batch: {error}") from None
            if not held:
                ids = _owned(ids)
            batch.append(ids)
        return self._core.lookup_many(batch, keys)

    def lookup_in_window(
        self,
        tokens: TokenIds,
        window: int,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> PrefixMatch:
        """`lookup` under a sliding window of `window` tokens in place of the cache's: what a
        request given that window (`set_request_window`) would hit. Sliding-window caches
        only (`InvalidInputError` otherwise, and for a window of 0)."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.lookup_in_window(as_token_ids(tokens), keys, window)

    def block_keys(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> list[bytes]:
        """The 32-byte key of every full block of `tokens` (stable across processes)."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.block_keys(as_token_ids(tokens), keys)

    # -- a request's life ----------------------------------------------------------------
    def begin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
        request_id: int | str | None = None,
    ) -> Request:
        """Match the cached prefix, reference it and allocate blocks for the whole prompt.

        `salt` isolates tenants; `adapter` and `multimodal` become per-block extra keys;
        `priority` is the retention priority of the request's blocks (lower goes first);
        `request_id` is the engine's id for it (default: an unused int, `Request.id`).
        Raises `OutOfBlocksError` (nothing changed) when the pool cannot hold the prompt.
        """
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.begin(as_token_ids(tokens), keys, priority, request_id)

    def add_request(
        self,
        request_id: int | str,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> None:
        """Register a request under the engine's id, taking no blocks (it *waits*).

        Its first `allocate_slots` matches and references its cached prefix. Raises
        `DuplicateRequestError` if the id is live.
        """
        keys = _extras(salt, adapter, multimodal, extras)
        self._core.add_request(request_id, as_token_ids(tokens), keys, priority)

    def allocate_slots(
        self,
        request: RequestRef,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> Slots:
        """Make room to compute the next `num_new_tokens` known tokens of a request, plus
        `num_lookahead_tokens` slots past them (for draft tokens not proposed yet).

        On a waiting request (just added, or preempted) it first matches and references the
        cached prefix: `Slots.num_computed_tokens` says where computing starts and
        `Slots.block_ids` lists the blocks added to the request's table (the cached ones
        first). The hit is the longest one that leaves room for the `num_new_tokens` before
        the request's end, so if it grew since `start_position` it is cut back rather than
        refused (docs/scheduling.md). `watermark_blocks` more blocks must stay obtainable afterwards (admit new
        requests with one, so running ones keep room to decode). Raises `OutOfBlocksError`
        with nothing changed when the pool cannot supply them: wait, or preempt someone.
        """
        return self._core.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens, watermark_blocks
        )

    def can_allocate_slots(
        self,
        request: RequestRef,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        watermark_blocks: int = 0,
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now; changes nothing."""
        return self._core.can_allocate_slots(
            request, num_new_tokens, num_lookahead_tokens, watermark_blocks
        )

    def blocks_needed(
        self, request: RequestRef, num_new_tokens: int, *, num_lookahead_tokens: int = 0
    ) -> int:
        """Blocks `allocate_slots` would take from the pool now (not counting cached prefix
        blocks it would reference); changes nothing."""
        return self._core.blocks_needed(request, num_new_tokens, num_lookahead_tokens)

    def start_position(self, request: RequestRef) -> int:
        """Where the next `allocate_slots` would start computing, changing nothing: for a
        waiting request, its cached prefix (matched from the keys it kept, so asking every
        step rehashes nothing); for a scheduled one, its computed tokens."""
        return self._core.start_position(request)

    def limit_cached_prefix(self, request: RequestRef, max_cached_tokens: int | None) -> None:
        """Cap the cached prefix the request's matches may use (None lifts the cap).

        Its next `allocate_slots` while waiting (and `start_position`, `can_allocate_slots`,
        `blocks_needed` before it) then considers only hits of at most `max_cached_tokens`
        tokens; a full hit only if the cap allows its ``num_cached_tokens``. The cap stays until
        changed (a re-match after `preempt` honours it too). A coordinator running one cache
        per KV group uses it to make every group serve the same hit length.
        """
        self._core.limit_cached_prefix(request, max_cached_tokens)

    def append_tokens(self, request: RequestRef, tokens: TokenIds, *, draft: bool = False) -> None:
        """Add sampled tokens (or, with `draft`, speculative draft tokens) without allocating.

        Draft tokens are never published: blocks holding one stay private until
        `accept_drafts` verifies them. Verified tokens cannot follow pending drafts.
        """
        self._core.append_tokens(request, as_token_ids(tokens), bool(draft))

    def append(self, request: RequestRef, tokens: TokenIds) -> list[int]:
        """Add generated tokens and allocate slots for them; returns the new blocks."""
        return self._core.append(request, as_token_ids(tokens))

    def commit(self, request: RequestRef, num_computed_tokens: int) -> int:
        """KV of the first `num_computed_tokens` tokens is written: publish the full blocks
        of verified tokens among them (never a block holding a draft).

        Returns how many leading blocks of the request are now cached.
        """
        return self._core.commit(request, num_computed_tokens)

    def set_request_window(self, request: RequestRef, window: int) -> None:
        """With ``window_release="explicit"``: give a request not yet scheduled its own sliding
        window in place of the cache's, so that one cache (one pool, one eviction order, one
        free count) serves every KV group of a hybrid model, one request per group with its
        own salt; a window longer than any request is a full-attention group (docs/vllm.md,
        "Hybrid and sliding-window layouts"). Refused (`InvalidInputError`, nothing changed):
        another kind of cache, a window of 0, a request already scheduled."""
        self._core.set_request_window(request, window)

    def release_out_of_window(self, request: RequestRef, processed_tokens: int) -> int:
        """With ``window_release="explicit"``: release the request's leading blocks that lie
        wholly before ``processed_tokens + 1 - sliding_window`` (last first; `null_block` takes
        their place) and return how many this call released. vLLM's ``remove_skipped_blocks``,
        called before each allocation for the request. A waiting request holds none; a
        full-attention cache releases nothing before `finish`. Refused (`InvalidInputError`,
        nothing changed): a sliding cache releasing on commit, and `processed_tokens` above
        the request's verified tokens (it may pass its commits: a position released before it
        was published is never published)."""
        return self._core.release_out_of_window(request, processed_tokens)

    def accept_drafts(self, request: RequestRef, num_accepted: int) -> int:
        """Keep the first `num_accepted` draft tokens as verified, drop the rest (their KV
        and every block left without tokens goes back). Publishes what became full and
        verified; returns how many leading blocks are now cached."""
        return self._core.accept_drafts(request, num_accepted)

    def truncate(self, request: RequestRef, num_tokens: int) -> list[int]:
        """Drop the request's tokens from position `num_tokens` on, with their KV; returns the
        blocks freed (those left without tokens). Cutting into a published block is refused:
        published KV is never rewritten. In a sliding-window cache, so is a length whose next
        query would read a block the request already released."""
        return self._core.truncate(request, num_tokens)

    def preempt(self, request: RequestRef) -> None:
        """Drop every reference the request holds and its KV (and pending drafts); it waits.

        Its committed blocks stay cached (evictable), so its next `allocate_slots` matches
        them again, usually as a hit, from the block keys it kept (nothing is rehashed).
        """
        self._core.preempt(request)

    def finish(self, request: RequestRef) -> None:
        """Drop the request's references and forget it; its cached blocks stay (evictable)."""
        self._core.finish(request)

    def block_table(self, request: RequestRef) -> list[int]:
        """The request's current block table (empty while it waits)."""
        return self._core.block_table(request)

    def num_tokens(self, request: RequestRef) -> int:
        """The request's tokens, drafts included."""
        return self._core.num_tokens(request)

    def num_computed_tokens(self, request: RequestRef) -> int:
        """The request's tokens whose KV is written (`commit`)."""
        return self._core.num_computed_tokens(request)

    def request_block_keys(self, request: RequestRef) -> list[bytes]:
        """The 32-byte key of every full block of the request's verified tokens (what
        `block_keys` gives for them), each computed once for the life of the request."""
        return self._core.request_block_keys(request)

    # -- low-level calls -----------------------------------------------------------------
    def match_and_acquire(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> PrefixMatch:
        """Match the cached prefix and take one reference per matched block, atomically."""
        keys = _extras(salt, adapter, multimodal, extras)
        core = self._block_core("match_and_acquire")
        return core.match_and_acquire(as_token_ids(tokens), keys, priority)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each, evicting cached blocks if needed."""
        return self._block_core("allocate").allocate(count)

    def blocks_obtainable(self, up_to: int | None = None) -> int:
        """How many blocks `allocate` could hand out right now, capped at `up_to` (default: the
        pool size), without changing anything: the free blocks plus every cached block that
        eviction can reach (unreferenced, unpinned, no held descendant). Cheap when the free
        list covers `up_to`; otherwise it plans the eviction, so ask for what you need.
        `stats().blocks_evictable` counts only the leaves evictable at once: a lower bound."""
        return self._core.blocks_obtainable(self.num_blocks if up_to is None else up_to)

    def commit_blocks(
        self,
        tokens: TokenIds,
        block_ids: Sequence[int],
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        priority: int = 0,
        extras: KeyExtras | None = None,
    ) -> list[int]:
        """Publish blocks the caller filled: `block_ids[i]` holds tokens of block i.

        Returns the canonical block per cached position (an existing identical block where
        one was cached first; the caller's copy is then freed at its release).
        """
        keys = _extras(salt, adapter, multimodal, extras)
        core = self._block_core("commit_blocks")
        return core.commit_blocks(as_token_ids(tokens), block_ids, keys, priority)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per listed block."""
        self._block_core("release").release(block_ids)

    # -- retention -----------------------------------------------------------------------
    def pin(
        self,
        tokens: TokenIds,
        *,
        salt: str | bytes | None = None,
        adapter: str | bytes | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
        extras: KeyExtras | None = None,
    ) -> Pin:
        """Keep the cached prefix of `tokens` (e.g. a system prompt) safe from eviction."""
        keys = _extras(salt, adapter, multimodal, extras)
        return self._core.pin(as_token_ids(tokens), keys)

    def unpin(self, pin: Pin | int) -> None:
        """Release a pin. An unknown id (never taken, already unpinned, or dropped by `clear` /
        `set_context`, which release every pin) is an `UnknownRequestError` saying which."""
        self._core.unpin(pin)

    # -- reset and observation -----------------------------------------------------------
    def clear(self) -> None:
        """Forget every cached block (e.g. after a weights update). On the block core, live
        requests keep their blocks, but nothing they compute from now on is published; the
        run core refuses while a request is scheduled (`InvalidInputError`: preempt or finish
        it first), and keys waiting and preempted ones anew."""
        self._core.clear()

    def set_context(self, context: CacheContext) -> None:
        """Switch to a new execution context; clears the cache as `clear` does."""
        if not isinstance(context, CacheContext):
            raise InvalidInputError(f"context must be a CacheContext, not {type(context).__name__}")
        if context.block_size != self.block_size:
            raise InvalidInputError(
                f"context.block_size {context.block_size} differs from the cache's {self.block_size}"
            )
        _check_reuse_safe(context)
        fingerprint = context.fingerprint()
        with self._context_lock:
            self._core.set_context(fingerprint)
            self._context = context

    def stats(self) -> CacheStats:
        """Counters and block states. Every block is exactly one of free (`blocks_free`),
        cached (`blocks_cached`: a table entry, or a spare copy of one) or private (held and
        not an entry), so `blocks_free + blocks_cached == blocks_total` once no request holds
        a private block (docs/design.md, "Block counts")."""
        stats = self._core.stats()
        earlier = self._earlier_stats
        return stats if earlier is None else stats._after(earlier)

    def set_eviction_log(self, enabled: bool) -> None:
        """Log the cached blocks allocations evict, for `drain_evicted` (a host tier saves
        their KV). Off by default; while on, drain after every allocation."""
        with self._context_lock:
            self._core.set_eviction_log(bool(enabled))
            self._eviction_log = bool(enabled)

    def drain_evicted(self) -> list[int]:
        """Block ids evicted since the last drain, oldest first. Their pages still hold the
        evicted KV until the blocks the evicting allocation returned are written."""
        return self._core.drain_evicted()

    def ref_count(self, block_id: int) -> int:
        return self._core.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self._core.is_cached(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant is broken (for tests)."""
        self._core.check_invariants()

    def _block_core(self, what: str) -> _core.CoreCache:
        """The per-block core, for `what` (the low-level block calls, KV groups), which only it
        serves. An "auto" cache on the run core moves to it here, if nothing depends on the
        run core yet: no request live, every block free (nothing cached, pinned or held),
        nothing committed, no KV event recorded. The block core starts from its first free
        order, as a cache built with ``core="blocks"`` does."""
        core = self._core
        if isinstance(core, _core.CoreCache):
            return core
        if not self._auto:
            raise UnsupportedFeatureError(
                f'{what} is not served by the run core yet (core="runs"); use '
                'core="blocks" (or "auto", which moves to it while the cache is empty) for it'
            )
        with self._context_lock:
            core = self._core
            if isinstance(core, _core.CoreCache):  # another thread moved it meanwhile
                return core
            stats = core.stats()
            untouched = (
                stats.requests_live == 0
                and stats.blocks_free == stats.blocks_total
                and stats.committed_blocks == 0
                and _core.event_counters(core).recorded_blocks == 0
            )
            if not untouched:
                raise UnsupportedFeatureError(
                    f'{what} is not served by the run core, which this cache (core="auto") '
                    "chose at its first request call and has used since; create the cache "
                    'with core="blocks" to use the low-level block calls or KV groups beside '
                    "requests"
                )
            blocks = self._new_block_core(self._context)
            if self._eviction_log:
                blocks.set_eviction_log(True)
            if self._event_settings is not None and _core.events_enabled(core):
                _core.enable_events(blocks, *self._event_settings)
            # The run core's counters are lookups that found nothing (nothing was cached):
            # `stats` adds them to the block core's.
            self._earlier_stats = stats
            self._core = blocks
            self.core = "blocks"
            return blocks

    def _new_block_core(self, context: CacheContext) -> _core.CoreCache:
        num_blocks, vocab_size, key_bits, reuse_last_block, window, release = (
            self._block_core_arguments
        )
        return _core.CoreCache(
            num_blocks,
            context.block_size,
            context.fingerprint(),
            vocab_size,
            key_bits,
            reuse_last_block,
            window,
            release,
        )

    def __repr__(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        core = "" if self.core == "blocks" else f", core={self.core!r}"
        return (
            f"PrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size}{window}{core})"
        )


def _extras(
    salt: str | bytes | None,
    adapter: str | bytes | None,
    multimodal: Sequence[MultimodalItem] | None,
    extras: KeyExtras | None,
) -> KeyExtras:
    if extras is None:
        # `key_extras`, inlined: this runs on every request.
        if salt is None and adapter is None and not multimodal:
            return _NO_EXTRAS
        return KeyExtras(salt, adapter, multimodal)
    if salt is not None or adapter is not None or multimodal is not None:
        raise InvalidInputError("pass either extras= or salt/adapter/multimodal, not both")
    if not isinstance(extras, KeyExtras):
        raise InvalidInputError(f"extras must be a KeyExtras, not {type(extras).__name__}")
    return extras


def _check_runs_serve(sliding_window: int | None, window_release: str, key_bits: int) -> None:
    """Refuses, by name, a setting the run core does not serve yet."""
    unserved = [
        name
        for name, asked in (
            ("sliding_window", sliding_window is not None),
            ('window_release="explicit"', window_release != "on_commit"),
            ("_key_bits", key_bits != 128),
        )
        if asked
    ]
    if unserved:
        raise UnsupportedFeatureError(
            f'{", ".join(unserved)} is not served by the run core yet (core="runs"); '
            'use core="blocks" (or "auto", the default, which picks it) for it'
        )


def _check_reuse_safe(context: CacheContext) -> None:
    if not context.reuse_is_safe:
        raise InvalidInputError(
            f"position encoding {context.position_encoding.rope_scaling!r} depends on the total "
            "sequence length: a prefix's KV differs from a full recompute, so prefix reuse is unsafe"
        )
