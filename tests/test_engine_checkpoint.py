"""Serving a Hugging Face checkpoint as the checkpoint says (issue 8.4): its chat template, in
whichever layout it ships, and its end-of-sequence tokens.

Each test writes a tiny checkpoint directory: a random `LlamaModel`, a byte-level BPE
`tokenizer.json` trained here with the `tokenizers` library, a `tokenizer_config.json`, and the
template laid out one of the ways transformers reads. Where transformers can load the same
directory, the prompt ids are compared with its `apply_chat_template`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer

from prefixkv.engine.facade import Engine
from prefixkv.errors import ChatTemplateError, InvalidInputError
from prefixkv.models.checkpoint import checkpoint_eos_token_ids, find_chat_template
from prefixkv.models.decoder import LlamaModel, ModelConfig
from prefixkv.text.tokenizers import ChatTemplateSet, HFTokenizer, JinjaChatTemplate
from tests.tokenizer_support import byte_level_bpe

DATA = Path(__file__).parent / "data"
CHATML = (DATA / "chatml.jinja").read_text()
#: Another template, so a test can tell which of two was used.
PLAIN = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
TOOL_USE = (
    "{{ bos_token }}[tools] {{ tools | map(attribute='name') | join(',') }}{{ eos_token }}\n"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour of the sea."},
]
TOOLS = [{"name": "lookup", "description": "Look a word up.", "parameters": {}}]
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = [
        "You are terse. Name a colour of the sea. system user assistant tools",
        "Look a word up. lookup the sea is blue, the sky is grey.",
    ] * 20
    tokenizer = byte_level_bpe(corpus, vocab_size=320, special_tokens=SPECIALS)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def model(tokenizer_json: Path) -> LlamaModel:
    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size()
    return LlamaModel.random(ModelConfig(vocab_size=vocab), seed=11)


def _checkpoint(
    directory: Path,
    model: LlamaModel,
    tokenizer_json: Path,
    *,
    config_template: Any = None,
    files: dict[str, str] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> Path:
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
        "pad_token": "</s>",
    }
    if config_template is not None:
        tokenizer_config["chat_template"] = config_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name, text in (files or {}).items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


def _transformers_ids(directory: Path, tools: Any = None) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template(
        MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def _engine(directory: Path, **options: Any) -> Engine:
    return Engine.from_pretrained(directory, num_blocks=64, block_size=BLOCK, **options)


@pytest.mark.parametrize(
    ("layout", "expected_source"),
    [
        ({"files": {"chat_template.jinja": CHATML}}, CHATML),
        ({"config_template": CHATML}, CHATML),
        ({"config_template": [{"name": "default", "template": CHATML}]}, CHATML),
        # The file takes priority over the tokenizer_config entry, as in transformers.
        ({"files": {"chat_template.jinja": CHATML}, "config_template": PLAIN}, CHATML),
    ],
    ids=["jinja_file", "config_string", "config_named_list", "file_over_config"],
)
def test_the_checkpoints_template_is_used_and_matches_transformers(
    tmp_path: Path,
    model: LlamaModel,
    tokenizer_json: Path,
    layout: dict[str, Any],
    expected_source: str,
) -> None:
    directory = _checkpoint(tmp_path, model, tokenizer_json, **layout)
    engine = _engine(directory)
    template = engine.chat_template
    assert isinstance(template, JinjaChatTemplate) and template.source == expected_source
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert engine.encode(MESSAGES) == _transformers_ids(directory)
    assert engine.encode({"messages": MESSAGES, "tools": TOOLS}) == _transformers_ids(
        directory, tools=TOOLS
    )
    (result,) = engine.generate([MESSAGES], max_new_tokens=2, check_exactness=True)
    assert result.tokens_match


@pytest.mark.parametrize(
    "layout",
    [
        {
            "config_template": [
                {"name": "default", "template": PLAIN},
                {"name": "tool_use", "template": TOOL_USE},
            ]
        },
        {
            "files": {
                "chat_template.jinja": PLAIN,
                "additional_chat_templates/tool_use.jinja": TOOL_USE,
            }
        },
    ],
    ids=["config_named_list", "additional_templates_dir"],
)
def test_named_templates_pick_tool_use_when_tools_are_given(
    tmp_path: Path, model: LlamaModel, tokenizer_json: Path, layout: dict[str, Any]
) -> None:
    directory = _checkpoint(tmp_path, model, tokenizer_json, **layout)
    engine = _engine(directory)
    assert isinstance(engine.chat_template, ChatTemplateSet)
    plain = engine.encode(MESSAGES)
    with_tools = engine.encode({"messages": MESSAGES, "tools": TOOLS})
    assert (
        HFTokenizer(directory / "tokenizer.json")
        .decode(with_tools)
        .startswith("<s>[tools] lookup</s>")
    )
    assert plain == _transformers_ids(directory)
    assert with_tools == _transformers_ids(directory, tools=TOOLS)


def test_processor_style_chat_template_json_is_found(
    tmp_path: Path, model: LlamaModel, tokenizer_json: Path
) -> None:
    directory = _checkpoint(
        tmp_path,
        model,
        tokenizer_json,
        files={"chat_template.json": json.dumps({"chat_template": PLAIN})},
    )
    template = find_chat_template(directory)
    assert isinstance(template, JinjaChatTemplate) and template.source == PLAIN


def test_a_checkpoint_without_a_template_refuses_chat_naming_what_was_looked_for(
    tmp_path: Path, model: LlamaModel, tokenizer_json: Path
) -> None:
    directory = _checkpoint(tmp_path, model, tokenizer_json)
    engine = _engine(directory)
    assert engine.chat_template is None
    with pytest.raises(ChatTemplateError) as raised:
        engine.generate([MESSAGES], max_new_tokens=1)
    message = str(raised.value)
    for looked_for in ("chat_template.jinja", "tokenizer_config.json", "'simple'"):
        assert looked_for in message
    assert engine.cache.stats().requests_live == 0
    # Text and token requests need no template.
    (text,) = engine.generate(["the sea is blue"], max_new_tokens=1)
    assert text.prompt_tokens > 0
    # Asking for the built-in template explicitly is allowed.
    builtin = _engine(directory, chat_template="simple")
    assert builtin.encode(MESSAGES)
    assert builtin.context.chat_template_version != engine.context.chat_template_version


def test_an_engine_with_a_foreign_tokenizer_and_no_template_refuses_chat(
    model: LlamaModel, tokenizer_json: Path
) -> None:
    engine = Engine(model, tokenizer=HFTokenizer(tokenizer_json), num_blocks=16, block_size=4)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        engine.encode(MESSAGES)
    # The built-in tokenizer keeps its built-in template.
    assert Engine(num_blocks=16, block_size=4).encode(MESSAGES)


def _first_tokens(model: LlamaModel, engine: Engine, count: int) -> tuple[list[int], list[int]]:
    prompt = engine.encode("the sea is blue")
    return prompt, model.generate_greedy_full(prompt, count)


@pytest.mark.parametrize("as_list", [False, True], ids=["int", "list"])
def test_generation_config_eos_tokens_stop_by_default(
    tmp_path: Path, model: LlamaModel, tokenizer_json: Path, as_list: bool
) -> None:
    probe = _engine(_checkpoint(tmp_path / "probe", model, tokenizer_json))
    prompt, greedy = _first_tokens(model, probe, 8)
    eos = greedy[2]
    unused = next(token for token in range(300) if token not in greedy)
    value: Any = [unused, eos] if as_list else eos
    directory = _checkpoint(
        tmp_path / "ckpt",
        model,
        tokenizer_json,
        generation_config={"eos_token_id": value},
    )
    engine = _engine(directory)
    assert eos in engine.stop_token_ids
    (stopped,) = engine.generate([prompt], max_new_tokens=8)
    assert stopped.output_token_ids == greedy[: greedy.index(eos) + 1]
    # An explicit argument wins, an empty one included.
    (unstopped,) = engine.generate([prompt], max_new_tokens=8, stop_token_ids=())
    assert unstopped.output_token_ids == greedy
    explicit = _engine(directory, stop_token_ids=[greedy[4]])
    assert explicit.stop_token_ids == (greedy[4],)


def test_eos_falls_back_to_config_json_and_bad_values_are_refused(
    tmp_path: Path, model: LlamaModel, tokenizer_json: Path
) -> None:
    directory = _checkpoint(tmp_path, model, tokenizer_json)
    assert checkpoint_eos_token_ids(directory) == ()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    assert checkpoint_eos_token_ids(directory) == (2,)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    assert checkpoint_eos_token_ids(directory) == (1, 3)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(InvalidInputError, match="eos_token_id"):
        checkpoint_eos_token_ids(directory)
