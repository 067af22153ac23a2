"""The trace analyzer: replay through the real cache, divergence positions, named causes, and
what-if replays that show the fix pays off."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from prefixkv.analyze import (
    AnalysisReport,
    Finding,
    analyze_trace,
    format_report,
    parse_trace,
)
from prefixkv.analyze.match import RadixTrie, resync
from prefixkv.apps.cli import analyze_main as main
from prefixkv.text.tokenizers import ByteTokenizer, SimpleChatTemplate, load_tokenizer
from tests.tokenizer_support import byte_level_bpe

DATA = Path(__file__).parent / "data"

# -- Crafted traces: an agent with a long system prompt, four tools, two few-shot examples ----

SYSTEM = (
    "You are Harbor, the support assistant for Acme Shipping.\n"
    "Answer in at most three sentences and cite the policy section you relied on.\n"
    "Never invent tracking numbers; look them up with the tools.\n"
    "Escalate to a human agent when the customer is upset or asks for a refund above the limit.\n"
    "Policy 4.2: parcels lost for more than ten working days are refunded in full.\n"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the current customer",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
    for name in ("lookup_order", "refund_order", "track_parcel", "escalate_to_human")
]
EXAMPLES = [
    {"role": "user", "content": "Can I change the delivery address?"},
    {"role": "assistant", "content": "Yes, until the parcel ships (policy 2.1)."},
]
QUERIES = [
    "Where is my parcel? It was due on Monday.",
    "The box arrived damaged, what now?",
    "Can you refund order A-77?",
    "How long does express delivery take?",
    "I want to talk to a person.",
    "Do you ship to Norway?",
    "My tracking page shows nothing at all.",
    "Why was I charged twice for one order?",
    "Is Saturday delivery possible?",
    "Can I return an opened item?",
    "What does 'held at depot' mean?",
    "How do I print a return label?",
]

Trace = list[dict[str, Any]]


def stable_first() -> Trace:
    return [
        {
            "id": f"q{i}",
            "messages": [
                {"role": "system", "content": SYSTEM},
                *EXAMPLES,
                {"role": "user", "content": query},
            ],
            "tools": TOOLS,
        }
        for i, query in enumerate(QUERIES)
    ]


def query_first() -> Trace:
    return [
        {
            "id": f"q{i}",
            "messages": [
                {"role": "user", "content": query},
                {"role": "system", "content": SYSTEM},
                *EXAMPLES,
            ],
        }
        for i, query in enumerate(QUERIES)
    ]


def timestamp_first() -> Trace:
    def now(i: int) -> str:
        return f"Current time: 2024-05-01T09:{i:02d}:{17 * i % 60:02d}Z\n"

    return [
        {
            "id": f"t{i}",
            "messages": [
                {"role": "system", "content": now(i) + SYSTEM},
                *EXAMPLES,
                {"role": "user", "content": query},
            ],
            "tools": TOOLS,
        }
        for i, query in enumerate(QUERIES)
    ]


def system_word_change() -> Trace:
    # One word of the system prompt changes per request (the customer's name).
    names = [
        "Ada",
        "Brook",
        "Cyrus",
        "Dana",
        "Elio",
        "Fern",
        "Gus",
        "Hana",
        "Ivo",
        "Jun",
        "Kit",
        "Lior",
    ]
    return [
        {
            "id": f"s{i}",
            "messages": [
                {
                    "role": "system",
                    "content": SYSTEM.replace("Acme Shipping.", f"Acme Shipping, serving {name}."),
                },
                *EXAMPLES,
                {"role": "user", "content": query},
            ],
            "tools": TOOLS,
        }
        for i, (name, query) in enumerate(zip(names, QUERIES, strict=True))
    ]


def shuffled_tools() -> Trace:
    rng = random.Random(7)
    trace = stable_first()
    for request in trace:
        tools = list(TOOLS)
        while tools == TOOLS:
            rng.shuffle(tools)
        request["tools"] = tools
    trace[0]["tools"] = TOOLS
    return trace


def whitespace_variant() -> Trace:
    # Per request, a doubled space after a different word, and some trailing spaces: the kind
    # of drift string formatting produces.
    trace = stable_first()
    words = SYSTEM.split(" ")
    for i, request in enumerate(trace[1:], 1):
        system = " ".join(words[: i + 1]) + "  " + " ".join(words[i + 1 :])
        request["messages"][0]["content"] = system.replace("\n", " " * (i % 3) + "\n")
    return trace


def write(tmp_path: Path, trace: Trace, name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    return path


def lines(trace: Trace) -> list[str]:
    return [json.dumps(r) for r in trace]


def finding(report: AnalysisReport, cause: str) -> Finding:
    matches = [f for f in report.findings if f.cause == cause]
    causes = [(f.cause, f.detail) for f in report.findings]
    assert matches, f"no {cause!r} finding; found {causes}"
    return matches[0]


def divergence_token(tokens_a: list[int], tokens_b: list[int]) -> int:
    """Independent check: the first index where two token lists differ."""
    n = 0
    while n < min(len(tokens_a), len(tokens_b)) and tokens_a[n] == tokens_b[n]:
        n += 1
    return n


def rendered_tokens(request: dict[str, Any]) -> list[int]:
    text = SimpleChatTemplate().render(request["messages"], tools=request.get("tools"))
    return ByteTokenizer().encode(text)


# -- Layouts ------------------------------------------------------------------------------


def test_stable_first_trace_reuses_almost_everything() -> None:
    report = analyze_trace(lines(stable_first()))
    assert report.requests == len(QUERIES)
    assert report.hit_rate > 0.85
    assert report.first_requests == 1
    assert not [f for f in report.findings if f.cause != "different_prompt"]
    assert report.prefill_seconds_saved_estimate == pytest.approx(report.hit_tokens / 10_000)
    assert report.cost["evictions"] == 0 and report.cost["peak_blocks"] > 0


def test_query_first_is_diagnosed_and_the_what_if_recovers_the_reuse() -> None:
    trace = query_first()
    report = analyze_trace(lines(trace))
    good = analyze_trace(lines(stable_first()))
    assert report.hit_rate < 0.1
    f = finding(report, "variable_before_stable")
    assert f.detail == "user query"
    assert f.requests == len(QUERIES) - 1
    assert f.divergence is not None
    assert f.divergence.this_segment == "message 0 (user)"
    this_id = f.divergence.request_id
    other_id = f.divergence.other_request_id
    by_id = {r["id"]: r for r in trace}
    assert f.divergence.token == divergence_token(
        rendered_tokens(by_id[this_id]), rendered_tokens(by_id[other_id])
    )
    assert f.what_if is not None
    assert f.what_if.hit_rate > report.hit_rate + 0.5
    assert f.what_if.hit_rate == pytest.approx(good.hit_rate, abs=0.1)
    assert "query last" in f.fix


def test_timestamp_first_points_at_the_timestamp() -> None:
    trace = timestamp_first()
    report = analyze_trace(lines(trace))
    assert report.hit_rate < 0.05
    f = finding(report, "variable_before_stable")
    assert f.detail == "timestamp"
    assert f.requests == len(QUERIES) - 1
    d = f.divergence
    assert d is not None and d.request_id == "t1" and d.other_request_id == "t0"
    expected = divergence_token(rendered_tokens(trace[1]), rendered_tokens(trace[0]))
    # "<|system|>" is one token, then "\nCurrent time: 2024-05-01T09:0" -> "1:17Z" vs "0:00Z".
    assert expected == 1 + len("\nCurrent time: 2024-05-01T09:0")
    assert d.token == expected and d.block == expected // 16
    assert d.this_segment == "message 0 (system)"
    assert d.this_text is not None and d.this_text.startswith("1:17Z")
    assert d.other_text is not None and d.other_text.startswith("0:00Z")
    assert f.what_if is not None and f.what_if.hit_rate > 0.8
    assert "timestamp" in f.fix


def test_timestamp_first_text_trace_moves_spans() -> None:
    stable = SYSTEM * 2
    trace = [
        {"id": i, "text": f"[2024-05-01 10:{i:02d}:00] request {i}\n{stable}Q: {q}"}
        for i, q in enumerate(QUERIES)
    ]
    report = analyze_trace(lines(trace))
    f = finding(report, "variable_before_stable")
    assert f.detail == "timestamp"
    assert f.divergence is not None and f.divergence.token == len("[2024-05-01 10:0")
    assert f.divergence.this_segment == "text"
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.5


def test_volatile_tokens_first_in_a_token_trace() -> None:
    stable = list(range(1000, 1200))
    trace = [{"id": f"k{i}", "tokens": [7, 7, 50_000 + i, *stable, 9, i]} for i in range(10)]
    report = analyze_trace(lines(trace), block_size=8)
    f = finding(report, "variable_before_stable")
    assert f.detail == "varying tokens"
    assert f.divergence is not None and f.divergence.token == 2
    assert f.divergence.this_tokens is not None and f.divergence.this_tokens[2] == 50_001
    assert f.what_if is not None and f.what_if.hit_rate > 0.8 > report.hit_rate


def test_system_prompt_with_a_one_word_change() -> None:
    trace = system_word_change()
    report = analyze_trace(lines(trace))
    f = finding(report, "system_prompt")
    assert f.requests == len(QUERIES) - 1
    d = f.divergence
    assert d is not None and d.this_segment == "message 0 (system)"
    assert d.token == divergence_token(rendered_tokens(trace[1]), rendered_tokens(trace[0]))
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.4
    assert "byte-identical" in f.fix


def test_shuffled_tools() -> None:
    trace = shuffled_tools()
    report = analyze_trace(lines(trace))
    f = finding(report, "tool_order")
    assert f.divergence is not None and f.divergence.this_segment is not None
    assert f.divergence.this_segment.startswith("tool ")
    d = f.divergence
    by_id = {r["id"]: r for r in trace}
    assert d.token == divergence_token(
        rendered_tokens(by_id[d.request_id]), rendered_tokens(by_id[d.other_request_id])
    )
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.3
    assert "Sort the tool list" in f.fix


def test_whitespace_variant() -> None:
    report = analyze_trace(lines(whitespace_variant()))
    f = finding(report, "whitespace")
    assert f.divergence is not None and f.divergence.this_segment == "message 0 (system)"
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.2


def test_template_that_renders_identical_messages_differently(tmp_path: Path) -> None:
    # A template that prints the conversation length before the system prompt.
    template = tmp_path / "counting.jinja"
    template.write_text(
        "[{{ messages | length }} messages]\n"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    )
    conversation = [{"role": "system", "content": SYSTEM}]
    trace = []
    for i, query in enumerate(QUERIES[:6]):
        conversation = [*conversation, {"role": "user", "content": query}]
        trace.append({"id": i, "messages": conversation})
        conversation = [*conversation, {"role": "assistant", "content": f"Answer {i}."}]
    report = analyze_trace(lines(trace), chat_template=str(template))
    f = finding(report, "template")
    assert f.divergence is not None and f.divergence.this_segment == "template"
    assert f.divergence.token == 1  # "[1 messages]" vs "[3 messages]"
    assert "template" in f.fix


def test_genuinely_different_prompts_are_not_a_problem() -> None:
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "zeta", "rho", "tau"]
    trace = [
        {"text": " ".join(rng.choice(words) + str(rng.randrange(10**6)) for _ in range(40))}
        for _ in range(8)
    ]
    report = analyze_trace(lines(trace))
    assert [f.cause for f in report.findings] == ["different_prompt"]
    assert report.findings[0].what_if is None
    assert "Nothing to fix" in report.findings[0].fix


# -- Isolation, capacity --------------------------------------------------------------------


def test_tenants_and_salts_never_share() -> None:
    base = stable_first()[:4]
    tenants = [{**r, "tenant": tenant} for tenant in ("acme", "globex") for r in base]
    report = analyze_trace(lines(tenants))
    single = analyze_trace(lines(base + base))
    assert report.isolation_groups == 2 and report.first_requests == 2
    assert report.hit_tokens < single.hit_tokens
    # Two tenants' hits are exactly twice one tenant's: nothing crossed the boundary.
    alone = analyze_trace(lines(base))
    assert report.hit_tokens == 2 * alone.hit_tokens
    salted = [{**r, "tenant": "acme", "salt": f"s{i}"} for i, r in enumerate(base)]
    assert analyze_trace(lines(salted)).hit_tokens == 0


def test_small_cache_reports_evictions_and_the_unbounded_what_if() -> None:
    # Alternating unrelated prompts in a cache too small for two of them.
    a = {"text": "A" * 300 + " first family"}
    b = {"text": "B" * 300 + " second family"}
    trace = [a, b] * 5
    report = analyze_trace(lines(trace), capacity_blocks=25)
    assert report.cost["evictions"] > 0
    f = finding(report, "evicted")
    assert f.requests == 8
    assert f.what_if is not None and f.what_if.hit_rate > 0.7 > report.hit_rate
    assert "more blocks" in f.fix


def test_request_larger_than_the_cache_is_counted_as_a_miss() -> None:
    trace = [{"text": "x" * 100}, {"text": "y" * 10}, {"text": "y" * 10}]
    report = analyze_trace(lines(trace), capacity_blocks=3)
    assert report.cost["out_of_blocks_requests"] == 1
    assert report.prompt_tokens == 120


# -- Malformed input, CLI, JSON -----------------------------------------------------------


def test_malformed_lines_are_reported_and_the_rest_is_analysed() -> None:
    report = analyze_trace(DATA / "malformed.jsonl")
    assert report.requests == 4  # line 5 has an extra field ("model"): ignored, not an error
    errors = {s.line: s.error for s in report.skipped_lines}
    assert sorted(errors) == [2, 3, 4, 6, 7, 8, 11, 12]
    assert "invalid JSON" in errors[2]
    assert "exactly one of" in errors[3] and "found: none" in errors[3]
    assert "found: tokens, text" in errors[4]
    assert "tokens[2] is negative" in errors[6]
    assert 'tokens[1] is "2", not an integer' in errors[7]
    assert "expected a JSON object" in errors[8]
    assert "messages[0].role" in errors[11]
    assert "'tools' is only allowed with 'messages'" in errors[12]
    assert report.hit_tokens > 0  # ok-2 reuses ok-1's prefix


def test_real_log_shapes_are_read_and_hostile_lines_reported(tmp_path: Path) -> None:
    system = "You are a careful assistant. " * 20
    trace = [
        # An OpenAI batch-API line: the request is in "body", the id in "custom_id".
        {
            "custom_id": "b1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "hi"},
                ],
            },
        },
        {
            "custom_id": "b2",
            "body": {
                "model": "m",
                "temperature": 0.2,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "yo"},
                ],
            },
        },
        {"id": "c1", "prompt": system + "completion one", "max_tokens": 5},
        {"id": "c2", "prompt": [1, 2, 3, 4]},
    ]
    raw = [json.dumps(line) for line in trace]
    raw.append("[" * 100_000)  # nested too deeply for the parser
    raw.append('{"tokens": [' + "9" * 5000 + "]}")  # an integer beyond the digit limit
    path = tmp_path / "log.jsonl"
    path.write_text("\ufeff" + "\n".join(raw) + "\n", encoding="utf-8")  # with a BOM
    report = analyze_trace(path)
    assert report.requests == 4
    assert {s.line for s in report.skipped_lines} == {5, 6}
    assert all("invalid JSON" in s.error for s in report.skipped_lines)
    assert report.hit_tokens > 0  # b2 reuses b1's system prompt


def test_main_exit_codes_and_terminal_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(DATA / "malformed.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "line 2: invalid JSON" in out and "8 malformed lines skipped" in out

    assert main([str(write(tmp_path, query_first()))]) == 0
    out = capsys.readouterr().out
    for expected in (
        "hit rate",
        "ESTIMATE",
        "Variable content placed before stable content",
        "diverges from",
        "what-if",
        "fix:",
    ):
        assert expected in out

    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n{}\n")
    assert main([str(junk)]) == 2
    assert "no usable requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main([str(junk), "--capacity-blocks", "0"])
    assert info.value.code == 2


def test_json_output_has_every_documented_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, timestamp_first() + shuffled_tools()[1:3])
    assert main([str(path), "--json", "--capacity-bytes", str(64 * 2**20)]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in (
        "trace",
        "settings",
        "requests",
        "isolation_groups",
        "prompt_tokens",
        "hit_tokens",
        "hit_rate",
        "prefill_seconds_estimate",
        "prefill_seconds_saved_estimate",
        "cost",
        "first_requests",
        "causes",
        "findings",
        "what_if_all",
        "skipped_lines",
    ):
        assert key in data
    assert data["settings"]["bytes_per_block"] == 2 * 32 * 8 * 128 * 2 * 16
    assert data["settings"]["capacity_blocks"] == 64 * 2**20 // (2 * 32 * 8 * 128 * 2 * 16)
    assert set(data["cost"]) == {"peak_blocks", "peak_bytes", "evictions", "out_of_blocks_requests"}
    f = data["findings"][0]
    for key in (
        "cause",
        "title",
        "detail",
        "requests",
        "recoverable_tokens",
        "example_ids",
        "example_lines",
        "fix",
        "divergence",
        "what_if",
    ):
        assert key in f
    for key in (
        "request_id",
        "line",
        "other_request_id",
        "other_line",
        "token",
        "block",
        "this_segment",
        "other_segment",
        "context_before",
        "this_text",
        "other_text",
    ):
        assert key in f["divergence"]
    assert set(f["what_if"]) == {
        "description",
        "hit_rate",
        "hit_tokens",
        "prompt_tokens",
        "hit_rate_gain",
    }
    assert data["causes"]["variable_before_stable"] >= 11


def train_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE tokenizer.json, trained here rather than downloaded."""
    corpus = [SYSTEM, *QUERIES, json.dumps(TOOLS)]
    specials = ["<|im_start|>", "<|im_end|>"]
    byte_level_bpe(corpus, vocab_size=500, special_tokens=specials).save(str(path))
    return path


def test_hf_tokenizer_and_jinja_template_end_to_end(tmp_path: Path) -> None:
    tokenizer_json = train_tokenizer(tmp_path / "tokenizer.json")
    trace = timestamp_first()
    report = analyze_trace(
        lines(trace), tokenizer=str(tokenizer_json), chat_template=str(DATA / "chatml.jinja")
    )
    f = finding(report, "variable_before_stable")
    assert f.detail == "timestamp"
    assert f.divergence is not None and f.divergence.this_segment == "message 0 (system)"
    tokenizer = load_tokenizer(tokenizer_json)
    from prefixkv.text.tokenizers import JinjaChatTemplate

    template = JinjaChatTemplate.from_file(DATA / "chatml.jinja")

    def encode(request: dict[str, Any]) -> list[int]:
        return tokenizer.encode(template.render(request["messages"], tools=request["tools"]))

    assert f.divergence.token == divergence_token(encode(trace[1]), encode(trace[0]))
    assert report.settings["tokenizer_digest"] == tokenizer.digest()
    assert f.what_if is not None and f.what_if.hit_rate > report.hit_rate + 0.5


def test_format_report_on_an_empty_report() -> None:
    report = analyze_trace(["", "   "])
    assert report.requests == 0
    assert "no usable requests" in format_report(report)


def test_parse_trace_keeps_ids_and_isolation() -> None:
    requests, skipped = parse_trace(
        [
            json.dumps({"id": 5, "tokens": [1, 2], "tenant": "a", "salt": "x", "timestamp": 1.5}),
            json.dumps({"tokens": [1, 2]}),
            json.dumps({"tokens": [True]}),
            json.dumps({"tokens": [2**32]}),
        ]
    )
    assert [r.request_id for r in requests] == ["5", "line 2"]
    assert requests[0].isolation != requests[1].isolation and requests[1].isolation is None
    assert [s.line for s in skipped] == [3, 4]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(st.dictionaries(st.text(), json_values, max_size=4), max_size=5))
def test_json_objects_give_back_what_they_were_given(items: list[dict[str, Any]]) -> None:
    from prefixkv.analyze.read import JsonObjects

    objects = JsonObjects(items)
    assert len(objects) == len(items)
    assert objects.decode() == items and list(objects) == items
    assert [objects[i] for i in range(-len(items), len(items))] == items + items
    assert objects[1:] == items[1:]
    with pytest.raises(IndexError):
        objects[len(items)]
    if items:  # every read decodes afresh: what a caller changes is not the request
        objects.decode()[0]["changed"] = True
        objects[0]["changed"] = True
        assert objects.decode() == items
    assert objects == JsonObjects(list(objects)) and hash(objects) == hash(JsonObjects(items))
    assert objects != JsonObjects([*items, {}])


def test_trace_requests_are_held_compactly() -> None:
    from array import array

    from prefixkv.analyze.read import JsonObjects, TraceRequest
    from prefixkv.errors import InvalidInputError

    (request,) = parse_trace(
        [json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "t"}]})]
    )[0]
    assert isinstance(request.messages, JsonObjects) and isinstance(request.tools, JsonObjects)
    assert list(request.messages) == [{"role": "user", "content": "hi"}]
    (request,) = parse_trace([json.dumps({"tokens": [5, 2**32 - 1]})])[0]
    assert request.tokens == array("I", [5, 2**32 - 1])
    # Rewrites hand in plain sequences: held the same way.
    rewritten = TraceRequest(1, "a", "tokens", tokens=(1, 0, 3))  # type: ignore[arg-type]
    assert rewritten.tokens == array("I", [1, 0, 3])
    chat = TraceRequest(1, "a", "messages", messages=({"role": "user"},))  # type: ignore[arg-type]
    assert chat.messages == JsonObjects([{"role": "user"}])
    for bad in ((True,), (-1,), (2**32,), ("1",)):
        with pytest.raises(InvalidInputError, match="tokens"):
            TraceRequest(1, "a", "tokens", tokens=bad)  # type: ignore[arg-type]


# -- Matching structures ------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=12)


@given(st.lists(token_lists, min_size=1, max_size=12), token_lists)
def test_radix_trie_matches_brute_force(stored: list[list[int]], query: list[int]) -> None:
    trie = RadixTrie()
    for i, seq in enumerate(stored):
        trie.insert(seq, i)
    length, owner = trie.longest_match(query)
    best = max(divergence_token(query, seq) for seq in stored)
    assert length == best
    if best:
        assert divergence_token(query, stored[owner]) == best
        # Ties go to the latest request.
        assert owner == max(i for i, s in enumerate(stored) if divergence_token(query, s) == best)


@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=20),
    st.lists(st.integers(100, 150), min_size=0, max_size=20),
    st.lists(st.integers(100, 150), min_size=0, max_size=20),
    st.lists(st.integers(200, 260), min_size=8, max_size=40),
)
def test_resync_finds_the_shared_stretch(
    prefix: list[int], head_a: list[int], head_b: list[int], shared: list[int]
) -> None:
    assume(head_a[:1] != head_b[:1])  # the two must actually part ways before `shared`
    a = prefix + head_a + shared + [1000]
    b = prefix + head_b + shared + [2000]
    start = divergence_token(a, b)
    found = resync(a, b, start, anchor=4, min_length=8)
    assert found is not None
    p, q, length = found
    assert a[p : p + length] == b[q : q + length] and length >= len(shared)
    assert p <= len(prefix) + len(head_a)


Builder = Callable[[], Trace]


@pytest.mark.parametrize(
    "bad", [query_first, timestamp_first, system_word_change, shuffled_tools, whitespace_variant]
)
def test_every_bad_layout_what_if_beats_the_original(bad: Builder) -> None:
    report = analyze_trace(lines(bad()))
    fixable = [f for f in report.findings if f.what_if is not None]
    assert fixable
    assert max(f.what_if.hit_rate for f in fixable if f.what_if) > report.hit_rate + 0.2


def test_shipped_sample_trace_is_diagnosed(capsys: pytest.CaptureFixture[str]) -> None:
    # tests/data/agent_timestamp_first.jsonl is the first 8 requests of timestamp_first(), kept
    # as a file so the CLI can be tried on it.
    sample = DATA / "agent_timestamp_first.jsonl"
    assert sample.read_text().splitlines() == lines(timestamp_first()[:8])
    assert main([str(sample), "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "[timestamp]" in out and "at token 31 (block 1), in message 0 (system)" in out


def test_a_message_that_ends_early_is_not_blamed_on_the_template() -> None:
    # Every other request drops the system prompt's last sentence: in the shorter prompt the
    # divergence falls on the template's "<|end|>", in the longer one inside the message.
    trace = stable_first()
    for i, request in enumerate(trace):
        if i % 2:
            request["messages"][0]["content"] = SYSTEM + f"Today's focus is ticket {i}."
    report = analyze_trace(lines(trace))
    assert "template" not in report.causes
    f = report.findings[0]
    assert f.divergence is not None
    assert "message 0 (system)" in (f.divergence.this_segment, f.divergence.other_segment)
