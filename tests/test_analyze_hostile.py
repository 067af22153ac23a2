"""The analyzer against hostile and awkward traces: bytes that are not lines of UTF-8 JSON,
lines too large to hold, tool definitions reordered inside prompt text, options that are not
numbers. Each class of input is a hypothesis strategy, so the suite explores it rather than
checking one crafted case."""

from __future__ import annotations

import codecs
import json
import math
import string
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixkv.analyze import AnalysisReport, analyze_trace, format_report
from prefixkv.analyze import match as match_module
from prefixkv.analyze.diagnose import LAYOUT_CAUSES
from prefixkv.apps.cli import analyze_main as main
from prefixkv.errors import InvalidInputError
from prefixkv.text.tokenizers import ByteTokenizer

STABLE = (
    "You are Harbor, the support assistant for Acme Shipping. Answer in at most three "
    "sentences and cite the policy section you relied on. Never invent tracking numbers. "
)


@contextmanager
def trace_file(data: bytes) -> Iterator[Path]:
    """A trace on disk (hypothesis examples cannot share pytest's function-scoped tmp_path)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.jsonl"
        path.write_bytes(data)
        yield path


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN and Infinity, as strict parsers (and other languages) do."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


# -- Lines: separators, encodings, line ends ------------------------------------------------

# str.splitlines() breaks on these; inside a JSON string they are legal raw characters, and
# json.dumps(..., ensure_ascii=False) writes them raw.
UNICODE_BREAKS = ["\u2028", "\u2029", "\u0085"]
INVALID_UTF8 = [
    b"\xff",  # never valid
    b"\xc3\x28",  # a lead byte followed by a non-continuation byte
    b"\xa0\xa1",  # continuation bytes with no lead byte
    b"\xe2\x28\xa1",
    b"\xf0\x28\x8c\xbc",
    b"\xed\xa0\x80",  # a UTF-16 surrogate encoded as UTF-8 (CESU-8)
    b"\xc0\xaf",  # an overlong encoding of "/"
    b"\xf8\xa1\xa1\xa1\xa1",  # a five-byte sequence
]


@st.composite
def valid_line(draw: st.DrawFn, index: int) -> bytes:
    words = draw(
        st.lists(
            st.text(alphabet=string.ascii_letters + "é中" + "".join(UNICODE_BREAKS), min_size=1),
            min_size=1,
            max_size=6,
        )
    )
    text = STABLE + draw(st.sampled_from(UNICODE_BREAKS)).join(words)
    return json.dumps({"id": f"v{index}", "text": text}, ensure_ascii=False).encode()


@st.composite
def hostile_lines(draw: st.DrawFn) -> tuple[bytes, dict[str, list[int]]]:
    """A trace as bytes, and the 1-based numbers of its valid, malformed and non-UTF-8 lines."""
    kinds = draw(
        st.lists(st.sampled_from(["valid", "valid", "utf8", "json", "blank"]), max_size=10)
    )
    expected: dict[str, list[int]] = {"valid": [], "utf8": [], "json": []}
    out = []
    for number, kind in enumerate(kinds, 1):
        if kind == "valid":
            line = draw(valid_line(number))
        elif kind == "utf8":
            line = b'{"text": "' + STABLE.encode() + draw(st.sampled_from(INVALID_UTF8)) + b'"}'
        elif kind == "json":
            line = draw(st.sampled_from([b'{"text": 5}', b'{"text": "open', b"[1, 2]", b"\x00"]))
        else:
            line = draw(st.sampled_from([b"", b"  ", b"\t"]))
        if kind != "blank":
            expected[kind].append(number)
        out.append(line + draw(st.sampled_from([b"\n", b"\r\n"])))
    data = b"".join(out)
    if draw(st.booleans()) and out:
        data = data.rstrip(b"\r\n")  # no newline after the last line
    if draw(st.booleans()):
        data = codecs.BOM_UTF8 + data
    return data, expected


@given(hostile_lines())
def test_lines_are_split_on_newlines_only_and_bad_bytes_are_reported(
    trace: tuple[bytes, dict[str, list[int]]],
) -> None:
    data, expected = trace
    with trace_file(data) as path:
        report = analyze_trace(path)
        status = main([str(path), "--json"])
    assert report.requests == len(expected["valid"])
    skipped = {s.line: s.error for s in report.skipped_lines}
    assert sorted(skipped) == sorted(expected["utf8"] + expected["json"])
    for number in expected["utf8"]:
        assert "UTF-8" in skipped[number]
    assert status == (2 if not expected["valid"] else 1 if skipped else 0)


def test_a_line_separator_inside_a_string_keeps_the_line_whole(tmp_path: Path) -> None:
    # The shape of issue 8, item 2, as one fixed case next to the property.
    lines = [
        json.dumps({"id": "a", "text": STABLE + "one\u2028two"}, ensure_ascii=False),
        json.dumps({"id": "b", "text": STABLE + "three\u2029four\u0085five"}, ensure_ascii=False),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = analyze_trace(path)
    assert report.requests == 2 and not report.skipped_lines
    assert main([str(path)]) == 0


def test_invalid_utf8_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "also fine"}\n')
    report = analyze_trace(path)
    assert report.requests == 2
    assert [(s.line, "UTF-8" in s.error) for s in report.skipped_lines] == [(2, True)]


# -- Size: a line too large to hold, and work that stays linear -----------------------------


def test_an_oversized_line_is_reported_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("wb") as handle:
        handle.write(json.dumps({"id": "first", "text": STABLE + "a"}).encode() + b"\n")
        handle.write(b'{"text": "' + b"x" * 5000 + b'"}\n')
        handle.write(json.dumps({"id": "third", "text": STABLE + "b"}).encode() + b"\n")
    report = analyze_trace(path, max_line_bytes=1000)
    assert report.requests == 2
    assert [s.line for s in report.skipped_lines] == [2]
    assert "5012 bytes" in report.skipped_lines[0].error
    assert "--max-line-bytes" in report.skipped_lines[0].error
    assert main([str(path), "--max-line-bytes", "1000"]) == 1


def test_reading_a_huge_line_holds_at_most_the_cap(tmp_path: Path) -> None:
    import tracemalloc

    from prefixkv.analyze.read import read_trace

    path = tmp_path / "huge.jsonl"
    with path.open("wb") as handle:
        handle.write(b'{"text": "')
        chunk = b"y" * 2**20
        for _ in range(48):  # 48 MiB on one line
            handle.write(chunk)
        handle.write(b'"}\n{"text": "after"}\n')
    tracemalloc.start()
    try:
        result = read_trace(path, max_line_bytes=2**20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [r.request_id for r in result.requests] == ["line 2"]
    assert [s.line for s in result.skipped_lines] == [1]
    assert peak < 16 * 2**20, f"reading held {peak / 2**20:.0f} MiB"


def test_the_trace_size_limit_truncates_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"text": STABLE + str(i)}) + "\n" for i in range(20)), encoding="utf-8"
    )
    line_bytes = len(json.dumps({"text": STABLE + "0"})) + 1
    report = analyze_trace(path, max_trace_bytes=5 * line_bytes + 3)
    assert report.requests == 5 and report.truncated_at_line == 6
    assert "truncated at line 6" in format_report(report)
    assert main([str(path), "--max-trace-bytes", str(5 * line_bytes + 3)]) == 1
    assert analyze_trace(path).truncated_at_line is None


@st.composite
def periodic_pairs(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """Two token sequences made of one short period repeated (the worst case for finding where
    two prompts meet again: every position matches somewhere), with different heads."""
    period = draw(st.lists(st.integers(0, 5), min_size=1, max_size=7))
    repeats = draw(st.integers(200, 2000))
    head = draw(st.lists(st.integers(100, 105), min_size=1, max_size=20))
    this = head + period * repeats
    other = period * draw(st.integers(repeats // 2, repeats))
    return this, other, draw(st.sampled_from([4, 8, 16]))


@settings(max_examples=20)
@given(periodic_pairs())
def test_resync_work_is_linear_on_repetitive_content(
    pair: tuple[list[int], list[int], int],
) -> None:
    this, other, anchor = pair
    read = 0
    original = match_module.common_length

    def counting(*args: Any, **kwargs: Any) -> int:
        nonlocal read
        length = original(*args, **kwargs)
        read += length
        return length

    # Counting the tokens the forward extensions read (not pytest's monkeypatch: hypothesis
    # runs many examples in one test call).
    match_module.common_length = counting  # type: ignore[assignment]
    try:
        match_module.resync(this, other, 0, anchor, 2 * anchor)
        assert read <= 8 * (len(this) + len(other)) + 4096
        # The reordering detector's worst case: the same periodic content, shifted by one, so
        # every run matches almost everywhere.
        shifted = this[len(this) - len(other) + 1 :] + this[: len(this) - len(other) + 1]
        for a, b in ((this, other), (other, shifted)):
            read = 0
            start = original(a, 0, b, 0, min(len(a), len(b)))
            match_module.permuted_region(a, b, start, 2 * anchor)
            assert read <= 16 * (len(a) + len(b)) + 4096
    finally:
        match_module.common_length = original  # type: ignore[assignment]


def test_a_long_system_prompt_pair_is_diagnosed_in_linear_time() -> None:
    # Two 600k-character system prompts that differ in one word near the start: the old
    # similarity check (difflib) was quadratic in the prompt's length.
    import time

    body = " ".join(f"rule {i}: be exact." for i in range(30_000))
    trace = [
        json.dumps({"messages": [{"role": "system", "content": f"Agent {name}. {body}"}]})
        for name in ("Ada", "Brook", "Cyrus")
    ]
    start = time.perf_counter()
    report = analyze_trace(trace)
    assert time.perf_counter() - start < 30
    assert report.requests == 3


# -- Tool definitions rendered as text, in varying order -------------------------------------


def _tool(name: str, rich: bool) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": {"order_id": {"type": "string"}}}
    if rich:
        parameters["properties"]["note"] = {"type": "string", "description": f"why {name}"}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the current customer",
            "parameters": parameters,
        },
    }


def _render_tools(tools: list[dict[str, Any]], style: str) -> str:
    if style == "json_lines":
        return "\n".join(json.dumps(t) for t in tools) + "\n"
    if style == "json_indented":
        return "\n".join(json.dumps(t, indent=2) for t in tools) + "\n"
    return "".join(  # markdown sections
        f"## {t['function']['name']}\n{t['function']['description']}.\n"
        f"Arguments: {', '.join(t['function']['parameters']['properties'])}.\n\n"
        for t in tools
    )


@dataclass(frozen=True)
class ToolCase:
    """A trace that lists the same tools in varying order inside the prompt: `where` (the
    system message, a text or prompt string, or token ids), in `style` (JSON lines, indented
    JSON, markdown sections), one order per request."""

    names: tuple[str, ...]
    rich: bool
    style: str
    where: str
    orders: tuple[tuple[int, ...], ...]

    def lines(self, canonical: bool = False) -> list[str]:
        """The trace; `canonical`: every request in the first request's order."""
        tools = [_tool(name, self.rich) for name in self.names]
        out = []
        for i, order in enumerate(self.orders):
            listed = _render_tools(
                [tools[j] for j in (self.orders[0] if canonical else order)], self.style
            )
            system = f"{STABLE}\nYou can call these tools:\n{listed}Be polite.\n"
            query = f"Question {i}: where is parcel {1000 + 37 * i}?"
            if self.where == "system":
                body: dict[str, Any] = {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": query},
                    ]
                }
            elif self.where == "tokens":
                body = {"tokens": ByteTokenizer().encode(system + "User: " + query)}
            else:
                body = {self.where: system + "User: " + query}
            out.append(json.dumps({"id": f"r{i}", **body}))
        return out


@st.composite
def tool_order_traces(draw: st.DrawFn) -> ToolCase:
    names = draw(
        st.lists(
            st.text(alphabet=string.ascii_lowercase + "_", min_size=5, max_size=14),
            min_size=3,
            max_size=6,
            unique=True,
        )
    )
    orders = draw(
        st.lists(st.permutations(range(len(names))), min_size=4, max_size=8).filter(
            lambda o: len({tuple(x) for x in o}) > 1
        )
    )
    return ToolCase(
        names=tuple(names),
        rich=draw(st.booleans()),
        style=draw(st.sampled_from(["json_lines", "json_indented", "markdown"])),
        where=draw(st.sampled_from(["system", "text", "prompt", "tokens"])),
        orders=tuple(tuple(order) for order in orders),
    )


@settings(max_examples=25)
@given(tool_order_traces())
def test_tools_reordered_inside_the_prompt_are_named_and_fixed(case: ToolCase) -> None:
    report = analyze_trace(case.lines())
    best = analyze_trace(case.lines(canonical=True))
    causes = [f.cause for f in report.findings]
    assert "tool_order" in causes, [(f.cause, f.detail) for f in report.findings]
    assert not set(causes) & set(LAYOUT_CAUSES), causes
    f = next(f for f in report.findings if f.cause == "tool_order")
    assert "order" in f.fix
    assert f.what_if is not None
    assert f.what_if.hit_rate > report.hit_rate
    # The rewrite lists every request's tools in one order: it reuses what a trace written
    # that way does.
    assert f.what_if.hit_rate == pytest.approx(best.hit_rate, abs=1e-9)


def test_tools_in_a_system_prompt_in_varying_order_is_not_system_prompt_drift() -> None:
    # Issue 8, item 3, as reported: the old analyzer called this system prompt drift, and its
    # own what-if predicted no gain or a loss.
    tools = [_tool(name, True) for name in ("lookup_order", "refund_order", "track_parcel")]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 2, 1), (2, 1, 0), (0, 1, 2)]
    trace = [
        json.dumps(
            {
                "messages": [
                    {
                        "role": "system",
                        "content": STABLE
                        + "Tools:\n"
                        + _render_tools([tools[j] for j in order], "json_lines"),
                    },
                    {"role": "user", "content": f"query number {i}"},
                ]
            }
        )
        for i, order in enumerate(orders)
    ]
    report = analyze_trace(trace)
    assert [f.cause for f in report.findings if f.cause != "different_prompt"] == ["tool_order"]
    f = report.findings[0]
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.2
    assert "canonical order" in f.fix


# -- The report never advises a fix its own replay does not confirm --------------------------


@st.composite
def any_hostile_trace(draw: st.DrawFn) -> list[str]:
    choice = draw(st.sampled_from(["tools", "passages", "mixed"]))
    if choice == "tools":
        return draw(tool_order_traces()).lines()
    # Retrieved passages in varying order and varying number before the query: a layout
    # rewrite may not help, and then must not be advised.
    passages = [f"Passage {k}: " + "lorem ipsum dolor " * draw(st.integers(2, 6)) for k in range(6)]
    lines = []
    for i in range(draw(st.integers(3, 7))):
        chosen = draw(st.lists(st.sampled_from(passages), min_size=1, max_size=4, unique=True))
        head = f"Time: 2024-05-01T09:{i:02d}:00Z\n" if choice == "mixed" else ""
        text = head + "\n".join(chosen) + "\n" + STABLE + f"Q{i}: why?"
        lines.append(json.dumps({"id": i, "text": text}))
    return lines


def _assert_no_unconfirmed_fix(report: AnalysisReport) -> None:
    text = format_report(report)
    for f in report.findings:
        if f.what_if is None or f.what_if.hit_rate > report.hit_rate:
            continue
        assert f.fix.startswith("No fix confirmed"), f.fix
        assert f"fix: {f.fix}" in text
    if report.what_if_all is not None and report.what_if_all.hit_rate <= report.hit_rate:
        assert "All fixes together" not in text


@settings(max_examples=25)
@given(any_hostile_trace())
def test_a_what_if_without_gain_is_never_printed_as_the_fix(trace: list[str]) -> None:
    _assert_no_unconfirmed_fix(analyze_trace(trace))


def test_the_no_gain_rule_on_a_crafted_report() -> None:
    # A report whose what-if loses: built from a real run, then the what-if is made to lose.
    tools = [_tool(n, False) for n in ("alpha_tool", "beta_tool", "gamma_tool")]
    trace = [
        json.dumps({"text": STABLE + _render_tools([tools[j] for j in order], "json_lines") + q})
        for order, q in (((0, 1, 2), "a"), ((1, 2, 0), "b"), ((2, 0, 1), "c"))
    ]
    from prefixkv.analyze.report import confirm_fix

    report = analyze_trace(trace)
    f = report.findings[0]
    assert f.what_if is not None
    losing = type(f.what_if)(f.what_if.description, 0.0, 0, f.what_if.prompt_tokens, -0.5)
    fix = confirm_fix(f.cause, f.detail, losing)
    assert fix.startswith("No fix confirmed") and "List the tools" not in fix


# -- Options and JSON -------------------------------------------------------------------------


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_prefill_rate_is_finite_and_positive_or_refused(rate: float) -> None:
    if math.isfinite(rate) and rate > 0:
        report = analyze_trace([json.dumps({"text": STABLE})], prefill_tokens_per_second=rate)
        strict_json(report.to_json())
    else:
        with pytest.raises(InvalidInputError):
            analyze_trace([json.dumps({"text": STABLE})], prefill_tokens_per_second=rate)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--prefill-tokens-per-second", "nan"),
        ("--prefill-tokens-per-second", "inf"),
        ("--prefill-tokens-per-second", "-inf"),
        ("--prefill-tokens-per-second", "0"),
        ("--prefill-tokens-per-second", "-5"),
        ("--prefill-tokens-per-second", "fast"),
        ("--block-size", "99999999999999999999"),
        ("--capacity-blocks", "99999999999999999999"),
        ("--dtype-bytes", "9" * 400),
        ("--model-shape", "1,1," + "9" * 400),
        ("--max-line-bytes", "0"),
        ("--max-trace-bytes", "-1"),
    ],
)
def test_bad_numeric_options_exit_2_with_a_message(
    option: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": STABLE}) + "\n")
    with pytest.raises(SystemExit) as info:
        main([str(path), option, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


def test_json_output_is_strict_even_for_a_report_holding_non_finite_numbers() -> None:
    report = analyze_trace([json.dumps({"text": STABLE}), json.dumps({"text": STABLE})])
    report.prefill_seconds_estimate = math.inf
    report.hit_rate = math.nan
    data = strict_json(report.to_json())
    assert data["prefill_seconds_estimate"] is None and data["hit_rate"] is None


# -- Hostile content the tokenizer or template would choke on ---------------------------------

LONE_SURROGATES = ['"\\ud800"', '"x\\udfff"', '"\\udc00\\ud800"']


@given(st.sampled_from(LONE_SURROGATES), st.sampled_from(["text", "system", "tool"]))
def test_lone_surrogates_are_malformed_lines(escaped: str, where: str) -> None:
    if where == "text":
        line = '{"text": ' + escaped + "}"
    elif where == "system":
        line = '{"messages": [{"role": "system", "content": ' + escaped + "}]}"
    else:
        line = (
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": '
            + escaped
            + "}]}"
        )
    report = analyze_trace([json.dumps({"text": STABLE}), line])
    assert report.requests == 1
    assert [s.line for s in report.skipped_lines] == [2]
    assert "surrogate" in report.skipped_lines[0].error


def test_a_template_that_refuses_one_request_skips_that_line(tmp_path: Path) -> None:
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}"
        "<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    )
    trace = [
        json.dumps({"messages": [{"role": "system", "content": STABLE}]}),
        json.dumps({"messages": [{"role": "wizard", "content": "abracadabra"}]}),
        json.dumps({"messages": [{"role": "system", "content": STABLE + "more"}]}),
    ]
    report = analyze_trace(trace, chat_template=str(template))
    assert report.requests == 2
    assert [s.line for s in report.skipped_lines] == [2]
    assert "unknown role wizard" in report.skipped_lines[0].error


@st.composite
def hostile_json_lines(draw: st.DrawFn) -> list[str]:
    """Lines that parse as JSON but fight the analyzer: odd types, deep nesting, huge numbers,
    NaN, lone surrogates, control characters, empty and enormous ids."""
    atoms = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.sampled_from(["\ud800", "\x00", "\u2028", "<|user|>", "{{ 7 * 7 }}"]),
    )
    values = st.recursive(
        atoms,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    )
    keys = st.sampled_from(
        ["text", "tokens", "messages", "tools", "prompt", "id", "tenant", "salt", "body"]
    )
    lines = [json.dumps({"text": STABLE})]
    for _ in range(draw(st.integers(1, 5))):
        obj = draw(st.dictionaries(keys, values, max_size=4))
        if draw(st.booleans()):
            obj["messages"] = draw(
                st.lists(
                    st.fixed_dictionaries({"role": values, "content": values}),
                    min_size=1,
                    max_size=3,
                )
            )
        lines.append(json.dumps(obj, ensure_ascii=draw(st.booleans())))
    return lines


@settings(max_examples=50)
@given(hostile_json_lines(), st.booleans())
def test_hostile_lines_never_escape_as_tracebacks(lines: list[str], as_json: bool) -> None:
    with trace_file(("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")) as path:
        args = [str(path), *(["--json"] if as_json else [])]
        status = main(args)
    assert status in (0, 1, 2)
    report = analyze_trace(lines)
    strict_json(report.to_json())
    format_report(report)


def test_hostile_input_through_the_console_shows_no_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "\\ud800"}\n{"text": "caf\xe9"}\n' + b"[" * 200_000 + b"\n{}\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixkv.apps.cli",
            "analyze",
            str(path),
            "--max-line-bytes",
            "100000",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "line 3" in result.stdout and "--max-line-bytes" in result.stdout


# -- The shipped samples ----------------------------------------------------------------------

DATA = Path(__file__).parent / "data"


def test_shipped_tools_in_system_prompt_sample(capsys: pytest.CaptureFixture[str]) -> None:
    # tests/data/tools_in_system_prompt.jsonl: eight support requests whose system prompt lists
    # the same four tool schemas (one JSON object a line) in shuffled order.
    assert main([str(DATA / "tools_in_system_prompt.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "Same tools listed in a different order" in out
    assert "tool definitions reordered in message 0 (system)" in out
    assert "one canonical order" in out and "Variable content" not in out
    report = analyze_trace(DATA / "tools_in_system_prompt.jsonl")
    f = report.findings[0]
    assert f.what_if is not None and f.what_if.hit_rate > 0.8 > 0.5 > report.hit_rate


def test_shipped_hostile_lines_sample() -> None:
    # tests/data/hostile_lines.jsonl: a BOM, CRLF, raw U+2028/U+2029/U+0085 inside strings,
    # a line of Latin-1 and a lone surrogate escape.
    report = analyze_trace(DATA / "hostile_lines.jsonl")
    assert report.requests == 3
    assert [s.line for s in report.skipped_lines] == [3, 4]
    assert "UTF-8" in report.skipped_lines[0].error
    assert "surrogate" in report.skipped_lines[1].error
    assert main([str(DATA / "hostile_lines.jsonl"), "--json"]) == 1


# -- Nesting (issue 20, item 14): JSON nested deeper than the renderer's encoders survive ---------


@st.composite
def nested_lines(draw: st.DrawFn) -> tuple[str, int]:
    """A valid request line with a message's content or a tool nested `depth` levels (lists or
    objects), around where Python's recursive JSON encoder and decoder give up, and the level
    of its deepest container (the message or tool is level 1)."""
    depth = draw(st.one_of(st.integers(1, 150), st.integers(900, 1000)))
    as_dict = draw(st.booleans())
    value = ('{"k": ' * depth + "1" + "}" * depth) if as_dict else "[" * depth + "]" * depth
    if draw(st.booleans()):
        line = '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"p": ' + value + "}]}"
        return line, depth + 1
    line = '{"messages": [{"role": "user", "content": [{"type": "image", "x": ' + value + "}]}]}"
    return line, depth + 3  # the message, its content list, the part


NESTING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
)


@settings(max_examples=40)
@given(nested_lines(), st.booleans())
def test_nested_lines_are_one_line_errors(case: tuple[str, int], jinja: bool) -> None:
    from prefixkv.text.chat import MAX_NESTING

    line, level = case
    with tempfile.TemporaryDirectory() as directory:
        template = Path(directory) / "t.jinja"
        template.write_text(NESTING_TEMPLATE)
        options = ["--chat-template", str(template)] if jinja else []
        trace = Path(directory) / "t.jsonl"
        trace.write_text(json.dumps({"text": STABLE}) + "\n" + line + "\n")
        status = main([str(trace), *options])
        report = analyze_trace(trace, chat_template=str(template) if jinja else None)
    if level <= MAX_NESTING:
        assert status == 0 and report.requests == 2
    else:
        assert status == 1 and report.requests == 1
        (skipped,) = report.skipped_lines
        assert skipped.line == 2
        assert "nested" in skipped.error


def test_tools_nested_980_deep_through_a_jinja_template_is_one_line_error(tmp_path: Path) -> None:
    # The shape of the report: a RecursionError traceback from the template's size check.
    import subprocess
    import sys

    template = tmp_path / "t.jinja"
    template.write_text(NESTING_TEMPLATE)
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"text": STABLE})]
    for depth in range(960, 990, 2):
        lines.append(
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"p": '
            + "[" * depth
            + "]" * depth
            + "}]}"
        )
    trace.write_text("\n".join(lines) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixkv.apps.cli",
            "analyze",
            str(trace),
            "--chat-template",
            str(template),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1
    assert "tools[0] is nested deeper than" in result.stdout


def test_a_line_of_many_short_messages_costs_a_small_multiple_of_its_size(tmp_path: Path) -> None:
    # Issue 20, item 16: one 7.8 MB line of 600,000 messages took 950 MB (about 120 bytes per
    # byte of the line): a (start, end) tuple per token from the tokenizer, and three segments
    # per message held before merging. The same shape, smaller.
    import tracemalloc

    path = tmp_path / "many.jsonl"
    line = '{"messages": [' + ",".join(['{"role":"u"}'] * 30_000) + "]}"
    path.write_text(line + "\n")
    tracemalloc.start()
    try:
        report = analyze_trace(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.requests == 1 and report.prompt_tokens == 8 * 30_000 + 2
    assert peak < 40 * len(line), f"{peak / len(line):.0f} bytes per byte of the line"


# -- Memory: what the analysis holds, per byte of the trace (issue 20, item 16) -----------------

# Peak RSS, not tracemalloc: it counts the Rust core's allocations (the replay cache's block
# metadata) too. On Linux, VmHWM: ru_maxrss would also hold the RSS of the process that spawned
# this one (pytest's, hundreds of MB with torch), which Linux carries across exec. Elsewhere
# ru_maxrss (bytes on macOS, KiB on other systems).
_PEAK_GROWTH = """
import os, resource, sys
from prefixkv.analyze import analyze_trace

def peak_rss():
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

before = peak_rss()
capacity = None if sys.argv[2] == "-" else int(sys.argv[2])
report = analyze_trace(sys.argv[1], capacity_blocks=capacity)
print(report.requests, report.prompt_tokens, peak_rss() - before)
"""


def peak_growth(path: Path, capacity_blocks: int | None = None) -> tuple[int, int, int]:
    """(requests, prompt tokens, bytes the peak RSS grew by) of `analyze_trace(path)` run in a
    fresh interpreter, after its imports."""
    import subprocess
    import sys

    capacity = "-" if capacity_blocks is None else str(capacity_blocks)
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_GROWTH, str(path), capacity],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    requests, tokens, growth = map(int, result.stdout.split())
    return requests, tokens, growth


@pytest.mark.parametrize(
    ("message", "tokens_each", "bytes_per_byte"),
    [
        # Issue 20, item 16, in full: RSS, Rust included. 13 bytes a message render to 8 tokens,
        # 0.6 a byte, so the replay cache's block metadata alone, a few hundred bytes a block
        # of 16 tokens in the core, is ~15 bytes per byte of the line; the analysis holds ~6
        # more (4 bytes a token for the ids, 4 for their character positions, the rendered
        # text, the messages' compact JSON). Messages as dicts and ids in a list took ~41.
        ('{"role":"u"}', 8, 32),
        # With content, two segments a message: as objects they took ~32 bytes per byte.
        ('{"role":"user","content":"hi"}', 6, 24),
    ],
)
def test_a_line_of_many_short_messages_peaks_at_a_small_multiple_of_its_size(
    tmp_path: Path, message: str, tokens_each: int, bytes_per_byte: int
) -> None:
    count = 2_600_000 // len(message)
    path = tmp_path / "many.jsonl"
    line = '{"messages": [' + ",".join([message] * count) + "]}"
    path.write_text(line + "\n")
    requests, tokens, growth = peak_growth(path)
    assert (requests, tokens) == (1, tokens_each * count + 2)
    assert growth < bytes_per_byte * len(line), f"{growth / len(line):.1f} bytes per byte"


def test_a_cache_larger_than_the_trace_needs_is_not_allocated(tmp_path: Path) -> None:
    # The core allocates each block's metadata up front: a --capacity-blocks far above what the
    # trace holds cost ~300 bytes a block for nothing (10**7 blocks: 3 GB for five requests),
    # or was refused outright. A replay allocates what the trace can occupy at once; every
    # figure is that of the cache asked for, which never fills.
    lines = [json.dumps({"text": f"2026-12-01 10:{i:02d} {STABLE}"}) for i in range(5)]
    lines += [json.dumps({"text": STABLE + str(i)}) for i in range(5)]
    expected = analyze_trace(lines).to_dict()
    report = analyze_trace(lines, capacity_blocks=2**32 - 1)
    assert report.settings["capacity_blocks"] == 2**32 - 1
    got = report.to_dict()
    for settings_ in (expected["settings"], got["settings"]):
        del settings_["capacity_blocks"], settings_["capacity_given"]
    assert got == expected
    assert any(f.what_if is not None for f in report.findings)

    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(lines) + "\n")
    _, _, growth = peak_growth(path, capacity_blocks=10**6)
    assert growth < 32 * 2**20, f"grew {growth / 2**20:.0f} MiB"


def test_a_replay_whose_cache_bound_falls_short_is_run_again_at_full_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bound on the blocks a replay occupies is only an allocation size: were it ever short,
    # the replay would evict or refuse, and is then run again with the whole capacity.
    from prefixkv.analyze import replay as replay_module

    lines = [json.dumps({"text": f"2026-12-01 10:{i:02d} {STABLE}"}) for i in range(8)]
    expected = analyze_trace(lines).to_dict()
    bounded = analyze_trace(lines, capacity_blocks=40).to_dict()
    monkeypatch.setattr(replay_module, "blocks_occupied_at_most", lambda prepared, size: 1)
    assert analyze_trace(lines).to_dict() == expected
    assert analyze_trace(lines, capacity_blocks=40).to_dict() == bounded


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, "a", "b"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
        ),
        min_size=1,
        max_size=10,
    ),
    st.integers(1, 4),
)
def test_the_replay_cache_bound_is_never_short(
    trace: list[tuple[str | None, list[int]]], block_size: int
) -> None:
    # A cache of exactly `blocks_occupied_at_most` blocks never evicts nor refuses, and gives
    # what the whole-trace cache gives. Tokens from {0, 1, 2} share prefixes often.
    from array import array

    from prefixkv.analyze.read import TraceRequest
    from prefixkv.analyze.replay import (
        Prepared,
        blocks_needed,
        blocks_occupied_at_most,
        replay,
    )
    from prefixkv.context import CacheContext

    requests = [
        TraceRequest(i, str(i), "tokens", tokens=array("I", tokens), tenant=tenant)
        for i, (tenant, tokens) in enumerate(trace)
    ]
    prepared = [Prepared(r, r.tokens) for r in requests if r.tokens is not None]
    context = CacheContext(block_size=block_size)
    bound = blocks_occupied_at_most(prepared, block_size)
    full = replay(prepared, capacity_blocks=blocks_needed(prepared, block_size), context=context)
    tight = replay(prepared, capacity_blocks=bound, context=context)
    assert tight.evictions == 0 and tight.out_of_blocks == []
    assert (tight.cached, tight.peak_blocks) == (full.cached, full.peak_blocks)
    assert full.peak_blocks <= bound
