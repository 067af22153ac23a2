"""config.json read as transformers reads it (issue 20, items 3, 4, 5 and 14).

The reference is transformers itself (a test-only dependency): configs its `save_pretrained`
writes for each supported architecture, models it loads from the checkpoints we write, and its
config classes' defaults. Hostile fields (wrong types, huge or non-finite numbers) must give an
`InvalidInputError` naming the field, never another exception.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import example, given
from hypothesis import strategies as st

from prefixkv.apps.cli import main
from prefixkv.errors import InvalidInputError
from prefixkv.models import config as model_config
from prefixkv.models.decoder import LlamaModel, ModelConfig, RopeScaling

TOKENS = torch.tensor([(29 * i + 3) % 256 for i in range(40)])
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
}


def transformers_logits(directory: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(TOKENS[None]).logits[0]


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


# -- item 3: every field read as transformers reads it -----------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"sliding_window": 4},
        {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2},
    ],
    ids=["sliding_window", "layer_types_all_sliding"],
)
def test_a_llama_config_with_a_window_is_read_as_transformers_llama_reads_it(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    """transformers' Llama ignores `sliding_window` and `layer_types`; so must we (before:
    prefixkv windowed it, logits off by 7)."""
    LlamaModel.random(ModelConfig(), seed=4).save_pretrained(tmp_path)
    edit_config(tmp_path, **changes)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    ours = LlamaModel.from_pretrained(tmp_path)
    assert ours.config.layer_sliding_windows == (None, None)
    expected = transformers_logits(tmp_path)
    torch.testing.assert_close(ours.forward_full(TOKENS), expected, rtol=0, atol=1e-4)


def test_a_mistral_config_without_a_window_gets_transformers_default() -> None:
    raw = {**TINY, "model_type": "mistral"}
    expected = transformers.MistralConfig(**TINY).sliding_window
    assert expected is not None  # 4096 in transformers 5.24
    assert ModelConfig.from_hf_config(raw).sliding_window == expected
    # An explicit null is full attention, there as here.
    assert ModelConfig.from_hf_config({**raw, "sliding_window": None}).sliding_window is None


def test_a_window_is_written_as_a_type_transformers_windows(tmp_path: Path) -> None:
    """`to_hf_config` wrote `model_type: llama` with a window, loaded by transformers as full
    attention (logits off by 9.7)."""
    ours = LlamaModel.random(ModelConfig(sliding_window=5), seed=4)
    ours.save_pretrained(tmp_path)
    assert ours.config.to_hf_config()["model_type"] == "mistral"
    torch.testing.assert_close(
        ours.forward_full(TOKENS), transformers_logits(tmp_path), rtol=0, atol=1e-4
    )
    with pytest.raises(InvalidInputError, match="Mistral"):
        ModelConfig(
            sliding_window=5, attention_qkv_bias=True, attention_output_bias=True
        ).to_hf_config()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sliding_window", True),
        ("num_hidden_layers", 2.9),
        ("rope_theta", "1e400"),  # JSON's 1e400 parses as inf
        ("rope_theta", "NaN"),
        ("vocab_size", 256.0),
        ("tie_word_embeddings", 1),
        ("attention_bias", "yes"),
    ],
)
def test_values_are_not_coerced(tmp_path: Path, field: str, value: Any) -> None:
    raw = {**TINY, "model_type": "mistral" if field == "sliding_window" else "llama"}
    text = (
        json.dumps(raw)[:-1]
        + f', "{field}": '
        + (value if isinstance(value, str) and field == "rope_theta" else json.dumps(value))
        + "}"
    )
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(InvalidInputError, match=repr(field)):
        ModelConfig.from_hf_config(tmp_path)


def test_the_constructors_refuse_what_the_reader_refuses() -> None:
    for changes in ({"rope_theta": math.inf}, {"rms_norm_eps": math.nan}, {"rope_theta": True}):
        with pytest.raises(InvalidInputError, match=next(iter(changes))):
            ModelConfig(**changes)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="factor"):
        RopeScaling("linear", True)


# -- item 4: configs transformers writes load -------------------------------------------------


def _transformers_config(model_type: str) -> Any:
    extra: dict[str, Any] = {}
    if model_type == "qwen2":
        extra = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    return CONFIG_CLASSES[model_type](**TINY, tie_word_embeddings=True, **extra)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_configs_transformers_saves_load_and_read_as_it_reads_them(
    tmp_path: Path, model_type: str
) -> None:
    theirs = _transformers_config(model_type)
    theirs.save_pretrained(tmp_path)
    # What published configs carry besides (SmolLM2 converted from GGUF, transformers.js).
    edit_config(
        tmp_path,
        torch_dtype="float32",
        **{
            "transformers.js_config": {"dtype": "q4"},
            "_model_name_or_path": "x",
            "unk_token_id": 0,
        },
    )
    ours = ModelConfig.from_hf_config(tmp_path)
    assert ours.num_layers == theirs.num_hidden_layers
    assert (ours.num_heads, ours.num_kv_heads) == (
        theirs.num_attention_heads,
        theirs.num_key_value_heads,
    )
    assert ours.head_dim == getattr(theirs, "head_dim", 64 // 4)
    assert ours.vocab_size == theirs.vocab_size and ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings is True
    if model_type == "qwen2":
        assert [w is not None for w in ours.layer_sliding_windows] == [
            kind == "sliding_attention" for kind in theirs.layer_types
        ]
    else:
        assert set(ours.layer_sliding_windows) == {getattr(theirs, "sliding_window", None)}


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_the_type_tables_are_transformers_config_classes(model_type: str) -> None:
    """`hf_config`'s data (transformers is not a runtime dependency) against the installed
    transformers: every declared field is known for the type, with transformers' default."""
    from prefixkv.models import hf_config

    declared = {field.name: field for field in dataclasses.fields(CONFIG_CLASSES[model_type])}
    defaults = hf_config.TYPE_DEFAULTS[model_type]
    for name, field in declared.items():
        assert name in defaults or name in hf_config.KNOWN_HF_CONFIG_FIELDS, name
        if name in defaults and field.default is not dataclasses.MISSING:
            default = field.default
            assert defaults[name] == default, (name, defaults[name], default)


def test_a_config_transformers_converted_from_gguf_loads(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    del gguf
    from tests.gguf_files import byte_level_bpe, tiny_model, write_gguf

    tokenizer = byte_level_bpe(["the sky is grey, the sea is blue"] * 20)
    path = write_gguf(tmp_path / "m.gguf", tiny_model(tokenizer), tokenizer)
    converted = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    converted.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    config = ModelConfig.from_hf_config(tmp_path / "hf")
    assert (config.num_layers, config.hidden_size) == (2, 64), raw


# -- item 5: sized before built ----------------------------------------------------------------


def test_a_config_larger_than_memory_is_refused_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    LlamaModel.random(ModelConfig(), seed=4).save_pretrained(tmp_path)
    edit_config(tmp_path, hidden_size=65536, num_hidden_layers=100_000, head_dim=16)
    with pytest.raises(MemoryError, match=r"needs [\d,]+ bytes"):
        LlamaModel.from_pretrained(tmp_path)
    # A test machine's limit, lowered: the tiny model itself no longer fits.
    LlamaModel.random(ModelConfig(), seed=4).save_pretrained(tmp_path)
    needed = ModelConfig.from_hf_config(tmp_path).weight_bytes()
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: needed - 1)
    with pytest.raises(MemoryError, match=f"{needed:,} bytes"):
        LlamaModel.from_pretrained(tmp_path)
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: needed)
    LlamaModel.from_pretrained(tmp_path)


def test_parameter_count_is_the_model_s() -> None:
    for config in (
        ModelConfig(),
        ModelConfig(tie_word_embeddings=True, attention_qkv_bias=True),
        ModelConfig(attention_qkv_bias=True, attention_output_bias=True, mlp_bias=True),
    ):
        model = LlamaModel.random(config, seed=1)
        tensors = {t.data_ptr(): t.numel() for t in model.state_dict().values()}  # tied: once
        assert config.parameter_count == sum(tensors.values())


# -- item 14: malformed fields are typed errors naming the field --------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"num_hidden_layers": "abc"}, "num_hidden_layers"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"layer_types": 5}, "layer_types"),
        ({"model_type": "qwen2", "max_window_layers": "x"}, "max_window_layers"),
        ({"rope_scaling": {"rope_type": ["linear"], "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": ["linear"]}, "rope_scaling"),
        ({"torch_dtype": ["float32"]}, "torch_dtype"),
        ({"model_type": ["llama"]}, "model_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ],
)
def test_malformed_fields_are_refused_by_name(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInputError, match=field):
        ModelConfig.from_hf_config({**TINY, **changes})


def test_demo_model_prints_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "num_attention_heads": 0}))
    assert main(["demo", "--model", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_attention_heads" in err, err


#: Fields `read_hf_config` reads, and those where null means "the default / derived" for
#: transformers too (so null loads).
READ_FIELDS = [
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "pretraining_tp", "torch_dtype",
    "dtype", "model_type", "partial_rotary_factor", "prefixkv_position_offset",
    "prefixkv_lora_rank", "prefixkv_lora_alpha",
]  # fmt: skip
NULLABLE = {
    "num_key_value_heads", "head_dim", "rope_scaling", "rope_parameters", "sliding_window",
    "layer_types", "torch_dtype", "dtype", "pretraining_tp", "prefixkv_lora_rank",
    "prefixkv_lora_alpha",
}  # fmt: skip
WRONG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.integers(min_value=2**31, max_value=2**80),
    st.integers(max_value=-1),
)


@example(model_type="llama", field="tie_word_embeddings", value=False)
@given(
    model_type=st.sampled_from(sorted(CONFIG_CLASSES)),
    field=st.sampled_from(READ_FIELDS),
    value=WRONG_VALUES,
)
def test_any_wrong_value_is_a_typed_error_naming_the_field(
    model_type: str, field: str, value: Any
) -> None:
    raw = {**TINY, "model_type": model_type, field: value}
    try:
        ModelConfig.from_hf_config(raw)
    except InvalidInputError as exc:
        # Named by its config.json spelling (or, for RoPE parameters, the object holding them).
        names = {field, "rope parameters"} if field.startswith("rope") else {field}
        if field in ("rope_theta", "partial_rotary_factor"):
            names |= {"rope_scaling", "rope_parameters"}
        if field == "model_type":
            names |= {"model_type"}
        assert any(name in str(exc) for name in names), (field, value, str(exc))
    else:
        # Loaded: only a value transformers reads the same way may do that.
        acceptable = value is None and field in NULLABLE
        assert acceptable or _harmless(model_type, field, value), (field, value)


def _harmless(model_type: str, field: str, value: Any) -> bool:
    """Values transformers reads as this decoder does: ignored fields of a type, a float RoPE
    theta/rms epsilon/LoRA alpha, one of the supported dtypes."""
    if model_type == "llama" and field in ("sliding_window",):
        return True
    if field in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
        # A boolean field given a boolean is not a wrong value (a fresh CI draw found
        # tie_word_embeddings=False, which WRONG_VALUES' booleans can produce).
        return isinstance(value, bool)
    if field in ("model_type", "hidden_act", "torch_dtype", "dtype"):
        return value in (*CONFIG_CLASSES, "silu", "float32", "float16", "bfloat16", "float64")
    if field in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
        # A positive number (an int is a float there too); partial_rotary_factor only 1.
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and math.isfinite(value) and (field != "partial_rotary_factor" or value == 1)
    if field in ("rope_scaling", "rope_parameters"):
        return value == {}
    return bool(field == "layer_types" and value == [])
