"""Hostile chat templates (issue 8.7): rendering is bounded in time and size, and every failure
is a `ChatTemplateError`.

Templates come from checkpoints and users. Before the bounded environment, ``{{ 1/0 }}``, a
recursive macro, ``range(2**62)`` and a bad ``strftime_now`` argument escaped as raw Python
exceptions, ``{{ 'a'*2000000000 }}`` exhausted memory and two nested ``range(100000)`` loops
hung. The named cases run under the default limits; the hypothesis strategy composes hostile
pieces under small limits so that each example fails fast.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.errors import ChatTemplateError, InvalidInputError, PrefixKVError
from prefixkv.text.tokenizers import JinjaChatTemplate

MESSAGES = [{"role": "user", "content": "hello"}]
#: Seconds a hostile render may take under the default limits on a slow shared CPU.
DEFAULT_BOUND_S = 20.0


def _render(source: str, **limits: object) -> str:
    return JinjaChatTemplate(source, **limits).render(MESSAGES)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 1/0 }}",
        "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
        "{% for i in range(2**62) %}{% endfor %}",
        "{{ range(2**64) | length }}",
        "{{ strftime_now(123) }}",
        "{{ strftime_now('%Y' * 1000000) }}",
        "{{ 'a' * 2000000000 }}",
        "{{ 7 ** 100000000 }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ messages[5].content }}",
        "{{ ''.__class__.__mro__ }}",
        "{{ raise_exception('no tools here') }}",
        "{{ '%0999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ 'x'.center(10**9) }}",
        "{{ ('ab' * 500000) | replace('', 'yyyy') }}",
        "{% set ns = namespace(s='xy') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        "{% set ns = namespace(s='xy') %}{% for i in range(64) %}"
        "{% set block %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = block %}{% endfor %}",
        "{{ (['abcdefgh'] * 90000) | join(',' * 1000) }}",
        "{{ ([range(100000) | list] * 100) | sum(start=[]) | length }}",
    ],
    ids=[
        "zero_division",
        "recursive_macro",
        "huge_range",
        "range_over_maxsize",
        "strftime_non_string",
        "strftime_huge_format",
        "huge_string",
        "huge_power",
        "nested_loops",
        "index_error",
        "dunder_access",
        "raise_exception",
        "percent_width",
        "format_width",
        "center_width",
        "replace_amplifies",
        "concat_doubling",
        "block_set_doubling",
        "join_amplifies",
        "sum_of_lists",
    ],
)
def test_hostile_templates_fail_typed_and_bounded(source: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as raised:
        _render(source)
    assert time.monotonic() - start < DEFAULT_BOUND_S
    # Typed, and catchable as what a caller would catch without knowing prefixkv.
    assert isinstance(raised.value, (PrefixKVError, InvalidInputError, ValueError))
    assert "chat template" in str(raised.value)


def test_a_syntax_error_is_typed() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        JinjaChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):
        JinjaChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")


def test_the_output_limit_counts_the_streamed_prompt() -> None:
    # Many small outputs, none over the limit alone: the total is what is refused.
    source = "{% for i in range(5000) %}{{ 'abcdefghij' }}{% endfor %}"
    assert len(_render(source)) == 50_000
    with pytest.raises(ChatTemplateError, match="rendered prompt"):
        _render(source, max_output_chars=10_000)


def test_the_step_budget_stops_a_loop_with_an_empty_body() -> None:
    source = "{% for i in range(100000) %}{% endfor %}done"
    assert _render(source) == "done"
    with pytest.raises(ChatTemplateError, match="steps"):
        _render(source, max_steps=1_000)


def test_the_limits_scale_with_the_input() -> None:
    """A long conversation is not hostile: its prompt may be far over the base limits."""
    template = JinjaChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}",
        max_output_chars=1_000,
        max_steps=100,
    )
    messages = [{"role": "user", "content": "x" * 5_000} for _ in range(300)]
    assert len(template.render(messages)) > 1_500_000


def test_legitimate_template_features_still_work() -> None:
    source = (
        "{% set sep = '-' * 3 %}{{ sep }}{{ 2 ** 10 }}{{ '%05d' % 42 }}{{ '{:>6}'.format('r') }}"
        "{{ 'ab'.center(6, '*') }}{{ [1, 2] + [3] }}{{ range(3) | map('string') | join(',') }}"
        "{{ [[1], [2]] | sum(start=[]) }}{{ messages | map(attribute='content') | join }}"
        "{% for m in messages %}{{ loop.index }}:{{ m.content | upper ~ '!' }}{% endfor %}"
        "{{ {'a': 1} | tojson }}{{ 'a b c' | replace(' ', '_') }}{{ 'x' | indent(2, true) }}"
        # jinja2's own `sum` of lists is quadratic: 100000 one-element lists took minutes.
        "{{ (range(100000) | batch(1) | list) | sum(start=[]) | length }}"
    )
    assert _render(source) == (
        '---102400042     r**ab**[1, 2, 3]0,1,2[1, 2]hello1:HELLO!{"a": 1}a_b_c  x100000'
    )


# -- hypothesis: compositions of hostile pieces --------------------------------------------

_SIZES = st.sampled_from([0, 1, 7, 10**3, 10**5, 10**6, 10**9, 2**62, -(10**9)])

_EXPRESSIONS = st.one_of(
    st.builds(lambda n: f"'ab' * {n}", _SIZES),
    st.builds(lambda n: f"[1, 2] * {n}", _SIZES),
    st.builds(lambda n, m: f"{n} ** {m}", _SIZES, _SIZES),
    st.builds(lambda n: f"range({n}) | list", _SIZES),
    st.builds(lambda n: f"'x'.ljust({n})", _SIZES),
    st.builds(lambda n: f"'%0{n}d' % 7", _SIZES),
    st.builds(lambda n: f"'q' | center({n})", _SIZES),
    st.builds(lambda n: f"('ab' * 1000) | indent({n})", _SIZES),
    st.builds(lambda n: f"'\\t'.expandtabs({n})", _SIZES),
    st.builds(lambda n: f"messages[{n}]", _SIZES),
    st.builds(lambda n: f"strftime_now({n})", _SIZES),
    st.sampled_from(
        [
            "1 / 0",
            "1 // 0",
            "''.__class__",
            "messages.append(1)",
            "raise_exception('x')",
            "undefined_name.attribute.deeper",
            "strftime_now('%')",
            "(range(1000) | list) * 1000",
            "'a' ~ 'b'",
        ]
    ),
)


@st.composite
def hostile_templates(draw: st.DrawFn) -> str:
    """An expression, possibly doubled in a loop, inside up to three nested loops."""
    expression = draw(_EXPRESSIONS)
    body = f"{{{{ {expression} }}}}"
    if draw(st.booleans()):
        body = (
            f"{{% set ns = namespace(v={expression}) %}}"
            "{% for i in range(40) %}{% set ns.v = ns.v ~ ns.v %}{% endfor %}{{ ns.v }}"
        )
    for depth in range(draw(st.integers(0, 3))):
        count = draw(st.sampled_from([1, 10, 1000, 100000]))
        body = f"{{% for i{depth} in range({count}) %}}{body}{{% endfor %}}"
    if draw(st.booleans()):
        body = f"{{% macro m(x) %}}{{{{ m(x) }}}}{body}{{% endmacro %}}{{{{ m(1) }}}}"
    return body


@given(hostile_templates())
def test_any_hostile_template_renders_within_limits_or_fails_typed(source: str) -> None:
    limits = {"max_output_chars": 200_000, "max_steps": 20_000, "max_seconds": 5.0}
    start = time.monotonic()
    try:
        text = _render(source, **limits)
    except ChatTemplateError:
        pass
    else:
        assert len(text) <= 200_000
    assert time.monotonic() - start < 10.0


# -- real-world template constructs render exactly as transformers renders them ----------------

LLAMA31_STYLE = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content | tojson if message.content is mapping or message.content is iterable and message.content is not string else message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

MISTRAL_STYLE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(count=0) %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content']|trim + eos_token}}
    {%- endif %}
{%- endfor %}
{{- '%d turns' % ns.count }}{{ loop_messages | map(attribute='role') | unique | list | join(',') }}
"""

REAL_MESSAGES = [
    {"role": "system", "content": "  You are helpful.  "},
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": " Let me check. "},
    {"role": "user", "content": "In Paris, please."},
]
REAL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("tools", [None, REAL_TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize(
    "source", [LLAMA31_STYLE, MISTRAL_STYLE, None], ids=["llama31", "mistral", "chatml"]
)
def test_real_templates_render_as_transformers_renders_them(
    source: str | None, tools: list[dict[str, object]] | None
) -> None:
    from pathlib import Path

    from transformers.utils.chat_template_utils import render_jinja_template

    if source is None:
        source = (Path(__file__).parent / "data" / "chatml.jinja").read_text()
    ours = JinjaChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        REAL_MESSAGES, add_generation_prompt=True, tools=tools
    )
    rendered, _ = render_jinja_template(
        conversations=[REAL_MESSAGES],
        tools=tools,
        chat_template=source,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    assert ours == rendered[0]


# -- Hostile input (issue 20, item 14): messages and tools of the wrong shape or nested past
# -- what Python's recursive encoders survive are refused by field name, by every template.

INPUT_TEMPLATES = [
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}",
    None,  # the built-in SimpleChatTemplate
]


def _template(source: str | None):  # type: ignore[no-untyped-def]
    from prefixkv.text.chat import SimpleChatTemplate

    return SimpleChatTemplate() if source is None else JinjaChatTemplate(source)


def nested(depth: int, leaf: object = "x", as_dict: bool = False) -> object:
    """A value `depth` levels deep, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_dict else [value]
    return value


@pytest.mark.parametrize("source", INPUT_TEMPLATES, ids=["jinja", "simple"])
@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((5,), "messages must be a list"),
        ((["hi"],), r"messages\[0\] must be a mapping, got str"),
        (({"role": "user"},), "messages must be a list of mappings, got dict"),
        (([{"role": "user", "content": nested(5000)}],), r"messages\[0\] is nested deeper"),
        ((MESSAGES, True, [{"a": nested(5000, as_dict=True)}]), r"tools\[0\] is nested deeper"),
        ((MESSAGES, True, 5), "tools must be a list of mappings, got int"),
        ((MESSAGES, True, [MESSAGES[0], "tool"]), r"tools\[1\] must be a mapping"),
    ],
)
def test_input_of_the_wrong_shape_is_refused_by_field(
    source: str | None, args: tuple[object, ...], field: str
) -> None:
    with pytest.raises(InvalidInputError, match=field):
        _template(source).render(*args)


@st.composite
def nested_input(draw: st.DrawFn) -> tuple[list[object], list[object] | None, int]:
    """Messages and tools holding JSON nested up to 6,000 levels (lists and objects), and the
    deepest level drawn (a message or tool is level 1)."""
    depth = draw(st.one_of(st.integers(1, 120), st.integers(1, 6000)))
    value = nested(depth - 1, draw(st.sampled_from(["x", 1, None])), draw(st.booleans()))
    where = draw(st.sampled_from(["content", "part", "tool"]))
    messages: list[object] = [{"role": "user", "content": "hello"}]
    tools: list[object] | None = None
    if where == "content":
        messages = [{"role": "user", "content": value}]
    elif where == "part":
        messages = [{"role": "user", "content": [{"type": "image", "data": value}]}]
        depth += 2  # the content list and the part around it
    else:
        tools = [{"type": "function", "parameters": value}]
    return messages, tools, depth


@settings(max_examples=30)
@given(nested_input(), st.sampled_from(INPUT_TEMPLATES))
def test_nested_input_renders_or_is_refused_by_field(
    case: tuple[list[object], list[object] | None, int], source: str | None
) -> None:
    from prefixkv.text.chat import MAX_NESTING

    messages, tools, depth = case
    template = _template(source)
    if depth > MAX_NESTING:
        field = "tools[0]" if tools else "messages[0]"
        with pytest.raises(InvalidInputError, match=field.replace("[", r"\[")):
            template.render(messages, True, tools)  # type: ignore[arg-type]
    else:
        assert template.render(messages, True, tools)  # type: ignore[arg-type]
