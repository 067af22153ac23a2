"""Paged KV storage against a dict-of-tokens model, plus every error path.

The state machine drives a `PagedKVCache` and a pure-Python model (a dict from (layer, block,
offset) to the K and V rows stored there) with the same writes, block copies, moves to a second
"host" cache and back, and checks after every step that gathering any block table gives what the
model says. Copies are bit-exact, so comparisons are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from prefixkv.errors import InvalidInputError, PrefixKVError
from prefixkv.kv.pages import (
    KVDeviceError,
    KVDtypeError,
    KVIndexError,
    KVShapeError,
    PagedKVCache,
    PagedKVError,
)

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
TokenKey = tuple[int, int, int]  # (layer, block, offset)


@dataclass(frozen=True)
class Geometry:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def cache(self, num_blocks: int | None = None) -> PagedKVCache:
        return PagedKVCache(
            self.num_layers,
            num_blocks or self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=self.dtype,
        )


geometries = st.builds(
    Geometry,
    num_layers=st.integers(1, 3),
    num_blocks=st.integers(1, 8),
    block_size=st.integers(1, 5),
    num_kv_heads=st.integers(1, 3),
    head_dim=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
)


def random_rows(geometry: Geometry, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (count, geometry.num_kv_heads, geometry.head_dim)
    return torch.randn(shape, generator=generator).to(geometry.dtype)


class TokenModel:
    """What every slot of a cache should hold: K and V rows by (layer, block, offset)."""

    def __init__(self, geometry: Geometry, num_blocks: int) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        zero = torch.zeros(geometry.num_kv_heads, geometry.head_dim, dtype=geometry.dtype)
        self.zero = zero
        self.rows: dict[TokenKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, key: TokenKey) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.get(key, (self.zero, self.zero))

    def block(self, block: int) -> dict[TokenKey, tuple[torch.Tensor, torch.Tensor]]:
        geometry = self.geometry
        return {
            (layer, block, offset): self.get((layer, block, offset))
            for layer in range(geometry.num_layers)
            for offset in range(geometry.block_size)
        }

    def expected_gather(
        self, layer: int, table: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.geometry.block_size
        pairs = [self.get((layer, table[t // size], t % size)) for t in range(num_tokens)]
        empty = self.zero.new_empty((0, *self.zero.shape))
        keys = torch.stack([k for k, _ in pairs]) if pairs else empty
        values = torch.stack([v for _, v in pairs]) if pairs else empty
        return keys, values


def assert_matches_model(cache: PagedKVCache, model: TokenModel) -> None:
    """Every slot of every layer holds what the model says."""
    size = cache.block_size
    for layer in range(cache.num_layers):
        table = list(range(cache.num_blocks))
        keys, values = cache.gather(layer, table, cache.num_blocks * size)
        expected_keys, expected_values = model.expected_gather(layer, table, len(keys))
        assert torch.equal(keys, expected_keys)
        assert torch.equal(values, expected_values)


class PagedKVMachine(RuleBasedStateMachine):
    """A device cache and a host cache, each mirrored by a TokenModel."""

    def __init__(self) -> None:
        super().__init__()
        self.geometry: Geometry
        self.cache: PagedKVCache
        self.host: PagedKVCache
        self.model: TokenModel
        self.host_model: TokenModel

    @initialize(geometry=geometries, host_blocks=st.integers(1, 6))
    def setup(self, geometry: Geometry, host_blocks: int) -> None:
        self.geometry = geometry
        self.cache = geometry.cache()
        self.host = geometry.cache(host_blocks)
        self.model = TokenModel(geometry, geometry.num_blocks)
        self.host_model = TokenModel(geometry, host_blocks)

    @rule(data=st.data(), seed=st.integers(0, 2**31), as_tensor=st.booleans())
    def write(self, data: st.DataObject, seed: int, as_tensor: bool) -> None:
        geometry = self.geometry
        num_slots = self.cache.num_slots
        slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
        layer = data.draw(st.integers(0, geometry.num_layers - 1))
        keys = random_rows(geometry, len(slots), seed)
        values = random_rows(geometry, len(slots), seed + 1)
        mapping: list[int] | torch.Tensor = slots
        if as_tensor:
            mapping = torch.tensor(
                slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))
            )
        self.cache.write(layer, keys, values, mapping)
        size = geometry.block_size
        for i, slot in enumerate(slots):
            self.model.rows[(layer, slot // size, slot % size)] = (keys[i], values[i])

    @rule(data=st.data())
    def copy_blocks(self, data: st.DataObject) -> None:
        num_blocks = self.cache.num_blocks
        dst = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=num_blocks))
        src = data.draw(
            st.lists(st.integers(0, num_blocks - 1), min_size=len(dst), max_size=len(dst))
        )
        self.cache.copy_blocks(src, dst)
        apply_block_copy(self.model, self.model, src, dst)

    @rule(data=st.data(), to_host=st.booleans())
    def move_between_tiers(self, data: st.DataObject, to_host: bool) -> None:
        source, target = (self.cache, self.host) if to_host else (self.host, self.cache)
        source_model, target_model = (
            (self.model, self.host_model) if to_host else (self.host_model, self.model)
        )
        count = data.draw(st.integers(0, min(source.num_blocks, target.num_blocks)))
        src = data.draw(
            st.lists(st.integers(0, source.num_blocks - 1), min_size=count, max_size=count)
        )
        dst = data.draw(
            st.lists(
                st.integers(0, target.num_blocks - 1), unique=True, min_size=count, max_size=count
            )
        )
        if to_host:
            self.cache.swap_out(src, self.host, dst)
        else:
            self.cache.swap_in(self.host, src, dst)
        apply_block_copy(source_model, target_model, src, dst)

    @rule(data=st.data())
    def gather_a_request(self, data: st.DataObject) -> None:
        """A request's tokens through a random (repeating, padded) block table."""
        num_blocks, size = self.cache.num_blocks, self.cache.block_size
        table = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=6))
        num_tokens = data.draw(st.integers(0, len(table) * size))
        layer = data.draw(st.integers(0, self.cache.num_layers - 1))
        padded = table + data.draw(st.lists(st.sampled_from([-1, num_blocks, 10**6]), max_size=2))
        keys, values = self.cache.gather(layer, torch.tensor(padded), num_tokens)
        expected_keys, expected_values = self.model.expected_gather(layer, table, num_tokens)
        assert keys.is_contiguous() and values.is_contiguous()
        assert torch.equal(keys, expected_keys)
        assert torch.equal(values, expected_values)

    @invariant()
    def pages_match_models(self) -> None:
        assert_matches_model(self.cache, self.model)
        assert_matches_model(self.host, self.host_model)


def apply_block_copy(
    source: TokenModel, target: TokenModel, src: list[int], dst: list[int]
) -> None:
    """Model of a block copy: read every source block, then write every destination."""
    snapshots = [source.block(block) for block in src]
    for snapshot, block in zip(snapshots, dst, strict=True):
        for (layer, _, offset), rows in snapshot.items():
            target.rows[(layer, block, offset)] = rows


TestPagedKVMachine = PagedKVMachine.TestCase
TestPagedKVMachine.settings = settings(stateful_step_count=20)


# -- layout and sizing ---------------------------------------------------------------------


@given(geometry=geometries)
def test_layout_pages_are_contiguous_slabs(geometry: Geometry) -> None:
    cache = geometry.cache()
    shape = (geometry.num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
    for layer in range(geometry.num_layers):
        for pages in (cache.key_pages[layer], cache.value_pages[layer]):
            assert tuple(pages.shape) == shape
            assert pages.is_contiguous()
            assert pages.dtype == geometry.dtype and pages.device == torch.device("cpu")
    slab = geometry.block_size * geometry.num_kv_heads * geometry.head_dim
    assert cache.key_pages[0].stride(0) == slab
    assert cache.bytes_per_block * geometry.num_blocks == cache.storage.nbytes
    for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype"):
        assert getattr(cache, name) == getattr(geometry, name)


@given(geometry=geometries, slack=st.integers(0, 10_000))
def test_from_memory_budget_fits_the_budget(geometry: Geometry, slack: int) -> None:
    per_block = geometry.cache(1).bytes_per_block
    budget = geometry.num_blocks * per_block + slack % per_block
    cache = PagedKVCache.from_memory_budget(
        budget,
        geometry.num_layers,
        geometry.block_size,
        geometry.num_kv_heads,
        geometry.head_dim,
        dtype=geometry.dtype,
        device="cpu",
    )
    assert cache.num_blocks == geometry.num_blocks
    assert cache.storage.nbytes <= budget


def test_write_puts_a_token_at_its_slot() -> None:
    cache = PagedKVCache(2, 4, 3, 2, 5)
    key, value = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    cache.write(1, key, value, [2 * 3 + 1])  # block 2, offset 1
    assert torch.equal(cache.key_pages[1][2, 1], key[0])
    assert torch.equal(cache.value_pages[1][2, 1], value[0])
    assert cache.key_pages[0].abs().sum() == 0  # other layers untouched


def test_writes_do_not_attach_autograd_history_to_the_cache() -> None:
    cache = PagedKVCache(1, 2, 2, 1, 3)
    source = torch.randn(1, 1, 3, requires_grad=True)
    cache.write(0, source * 2, source * 3, [1])
    cache.copy_blocks([0], [1])
    assert not cache.storage.requires_grad and cache.storage.grad_fn is None
    assert torch.equal(cache.key_pages[0][0, 1], (source * 2)[0].detach())


# -- errors: right class, nothing changed -------------------------------------------------


def filled_cache() -> PagedKVCache:
    cache = PagedKVCache(2, 4, 3, 2, 5)
    cache.storage.copy_(torch.randn(cache.storage.shape))
    return cache


def tokens(count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(count, 2, 5).to(dtype)


ERROR_CASES: list[tuple[str, type[PagedKVError], Callable[[PagedKVCache], object]]] = [
    ("key shape", KVShapeError, lambda c: c.write(0, torch.randn(2, 2, 4), tokens(2), [0, 1])),
    ("key rank", KVShapeError, lambda c: c.write(0, torch.randn(2, 10), tokens(2), [0, 1])),
    ("value shape", KVShapeError, lambda c: c.write(0, tokens(2), torch.randn(2, 3, 5), [0, 1])),
    ("token counts", KVShapeError, lambda c: c.write(0, tokens(2), tokens(3), [0, 1])),
    ("slot count", KVShapeError, lambda c: c.write(0, tokens(2), tokens(2), [0, 1, 2])),
    ("key dtype", KVDtypeError, lambda c: c.write(0, tokens(1, torch.float16), tokens(1), [0])),
    ("value dtype", KVDtypeError, lambda c: c.write(0, tokens(1), tokens(1, torch.float64), [0])),
    ("not a tensor", KVDtypeError, lambda c: c.write(0, [[0.0]], tokens(1), [0])),  # type: ignore[arg-type]
    (
        "key device",
        KVDeviceError,
        lambda c: c.write(0, torch.empty(1, 2, 5, device="meta"), tokens(1), [0]),
    ),
    (
        "float slots",
        KVDtypeError,
        lambda c: c.write(0, tokens(1), tokens(1), torch.tensor([0.0])),
    ),
    ("bool slots", KVDtypeError, lambda c: c.write(0, tokens(1), tokens(1), [True])),
    (
        "2-D slots",
        KVShapeError,
        lambda c: c.write(0, tokens(1), tokens(1), torch.zeros(1, 1).long()),
    ),
    ("slot too high", KVIndexError, lambda c: c.write(0, tokens(2), tokens(2), [0, 12])),
    ("negative slot", KVIndexError, lambda c: c.write(0, tokens(2), tokens(2), [-1, 0])),
    (
        "slot too high, tensor",
        KVIndexError,
        lambda c: c.write(0, tokens(2), tokens(2), torch.tensor([3, 12])),
    ),
    ("repeated slot", KVIndexError, lambda c: c.write(0, tokens(2), tokens(2), [5, 5])),
    ("layer too high", KVIndexError, lambda c: c.write(2, tokens(1), tokens(1), [0])),
    ("negative layer", KVIndexError, lambda c: c.write(-1, tokens(1), tokens(1), [0])),
    ("copy src range", KVIndexError, lambda c: c.copy_blocks([0, 4], [1, 2])),
    ("copy dst range", KVIndexError, lambda c: c.copy_blocks([0], [-1])),
    ("copy dst repeated", KVIndexError, lambda c: c.copy_blocks([0, 1], [2, 2])),
    ("copy lengths", KVShapeError, lambda c: c.copy_blocks([0, 1], [2])),
    (
        "move geometry",
        KVShapeError,
        lambda c: c.copy_blocks_to(PagedKVCache(2, 4, 2, 2, 5), [0], [0]),
    ),
    (
        "move dtype",
        KVDtypeError,
        lambda c: c.copy_blocks_to(PagedKVCache(2, 4, 3, 2, 5, dtype=torch.float16), [0], [0]),
    ),
    ("move dst range", KVIndexError, lambda c: c.swap_out([0], PagedKVCache(2, 1, 3, 2, 5), [1])),
    ("swap-in src range", KVIndexError, lambda c: c.swap_in(PagedKVCache(2, 1, 3, 2, 5), [1], [0])),
    ("gather table short", KVShapeError, lambda c: c.gather(0, [0], 4)),
    ("gather table range", KVIndexError, lambda c: c.gather(0, [0, 9], 4)),
    ("gather negative", KVShapeError, lambda c: c.gather(0, [0], -1)),
    ("gather layer", KVIndexError, lambda c: c.gather(5, [0], 1)),
]


@pytest.mark.parametrize(
    ("call", "error"),
    [(case[2], case[1]) for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_bad_calls_raise_and_change_nothing(
    call: Callable[[PagedKVCache], object], error: type[PagedKVError]
) -> None:
    cache = filled_cache()
    before = cache.storage.clone()
    with pytest.raises(error) as raised:
        call(cache)
    assert isinstance(raised.value, PrefixKVError)
    assert isinstance(raised.value, ValueError)
    assert isinstance(raised.value, InvalidInputError)
    assert torch.equal(cache.storage, before)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_layers": 0}, KVShapeError),
        ({"num_blocks": -1}, KVShapeError),
        ({"block_size": 2.0}, KVShapeError),
        ({"head_dim": True}, KVShapeError),
        ({"dtype": torch.int32}, KVDtypeError),
        ({"device": "meta", "pin_memory": True}, KVDeviceError),
    ],
)
def test_bad_construction(kwargs: dict[str, object], error: type[PagedKVError]) -> None:
    arguments: dict[str, object] = {
        "num_layers": 1,
        "num_blocks": 2,
        "block_size": 3,
        "num_kv_heads": 1,
        "head_dim": 4,
    }
    arguments.update(kwargs)
    with pytest.raises(error):
        PagedKVCache(**arguments)  # type: ignore[arg-type]


def test_budget_below_one_block() -> None:
    with pytest.raises(KVShapeError, match="holds no block"):
        PagedKVCache.from_memory_budget(100, 2, 16, 8, 128, dtype=torch.float16, device="cpu")
