"""Per-request tenant salt and LoRA adapter through `Engine.generate` (`EngineRequest`).

Two tenants with identical prompts never share a KV block; the same tenant does. A request
naming an adapter is served with that adapter (what an engine with it active gives, checked
against the cache-free oracle), and its blocks are never another adapter's.
"""

from __future__ import annotations

import pytest

from prefixkv import InvalidInputError
from prefixkv.engine.facade import Engine, EngineRequest, RequestResult
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.text.tokenizers import ByteTokenizer
from tests.engine_support import assert_exact, random_prompt

BLOCK = 4
VOCAB = ByteTokenizer().vocab_size
CONFIG = ModelConfig(vocab_size=VOCAB, lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    model = LlamaModel.random(CONFIG, seed=5)
    model.load_adapter("a", LlamaModel.random_adapter(CONFIG, seed=1))
    model.load_adapter("b", LlamaModel.random_adapter(CONFIG, seed=2))
    return model


def _block_tables(engine: Engine, requests: list[EngineRequest]) -> list[set[int]]:
    """The device blocks each request holds right after admission (one step's worth)."""
    tables: list[set[int]] = []
    original = engine.cache.allocate_slots

    def spy(request_id, *args, **kwargs):  # type: ignore[no-untyped-def]
        slots = original(request_id, *args, **kwargs)
        tables.append(set(engine.cache.block_table(request_id)))
        return slots

    engine.cache.allocate_slots = spy  # type: ignore[method-assign]
    try:
        engine.generate(requests, max_new_tokens=1)
    finally:
        del engine.cache.allocate_slots
    return tables


def test_two_tenants_never_share_blocks_and_the_same_tenant_does(model: LlamaModel) -> None:
    model.set_adapter(None)
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    prompt = random_prompt(21, seed=9)
    (first,) = engine.generate([EngineRequest(prompt, salt="tenant-a")], max_new_tokens=2)
    assert first.cached_tokens == 0
    (other,) = engine.generate(
        [EngineRequest(prompt, salt="tenant-b")], max_new_tokens=2, check_exactness=True
    )
    assert other.cached_tokens == 0  # the same prompt, another tenant: nothing shared
    assert_exact(model, other, 2)
    (shared,) = engine.generate([prompt], max_new_tokens=2)
    assert shared.cached_tokens == 0  # nor with requests without a salt
    (again,) = engine.generate(
        [EngineRequest(prompt, salt=b"tenant-a")], max_new_tokens=2, check_exactness=True
    )
    assert again.cached_tokens == 20  # the same tenant (str or bytes alike): a hit
    assert_exact(model, again, 2)
    # In one call too: two tenants' identical prompts admitted side by side hold disjoint
    # blocks, two requests of one tenant share theirs.
    fresh = random_prompt(16, seed=10)
    tables = _block_tables(
        engine,
        [
            EngineRequest(fresh, salt="x"),
            EngineRequest(fresh, salt="y"),
            EngineRequest(fresh, salt="x"),
        ],
    )
    assert not tables[0] & tables[1] and not tables[2] & tables[1]
    (hit,) = engine.generate([EngineRequest(fresh, salt="x")], max_new_tokens=1)
    assert hit.cached_tokens == 12
    assert engine.cache.stats().blocks_in_use == 0


def test_a_request_is_served_with_the_adapter_it_names(model: LlamaModel) -> None:
    model.set_adapter(None)
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    prompt = random_prompt(13, seed=11)
    requests = [
        EngineRequest(prompt, adapter="a"),
        EngineRequest(prompt),
        EngineRequest(prompt, adapter="b"),
    ]
    finished: list[int] = []
    results = engine.generate(
        requests, max_new_tokens=3, check_exactness=False, on_finish=lambda i, _: finished.append(i)
    )
    assert sorted(finished) == [0, 1, 2]
    assert model.active_adapter is None  # the engine put the model back as it found it
    for name, result in zip(["a", None, "b"], results, strict=True):
        assert result.prompt_token_ids == prompt
        assert result.cached_tokens == 0  # no adapter reads another's blocks
        model.set_adapter(name)
        _assert_exact_tokens(model, result, 3)
    model.set_adapter(None)
    outputs = {tuple(result.output_token_ids) for result in results}
    assert len(outputs) > 1  # the adapters do change what is generated
    (again,) = engine.generate(
        [EngineRequest(prompt, adapter="a")], max_new_tokens=3, check_exactness=True
    )
    assert again.cached_tokens == 12 and model.active_adapter is None
    assert again.output_token_ids == results[0].output_token_ids


def _assert_exact_tokens(model: LlamaModel, result: RequestResult, max_new_tokens: int) -> None:
    assert result.output_token_ids == model.generate_greedy_full(
        result.prompt_token_ids, max_new_tokens
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (EngineRequest([1, 2, 3], salt=5), "salt"),  # type: ignore[arg-type]
        (EngineRequest([1, 2, 3], adapter="missing"), "adapter"),
        (EngineRequest([1, 2, 3], adapter=7), "adapter"),  # type: ignore[arg-type]
        (EngineRequest([1.5]), "token ids"),  # type: ignore[list-item]
    ],
)
def test_bad_tenant_or_adapter_is_refused_by_name(
    model: LlamaModel, request_: EngineRequest, field: str
) -> None:
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    with pytest.raises(InvalidInputError, match=field):
        engine.generate([[1, 2], request_], max_new_tokens=1)
    assert engine.cache.stats().requests_live == 0
    assert model.active_adapter is None
