"""End-to-end tests of the `prefixkv` command, run as a subprocess like a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixkv.apps.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One small demo run (JSON and plot together, to keep the suite fast)."""
    plot = tmp_path_factory.mktemp("demo") / "ttft.png"
    result = _run(
        "demo", "--json", "--quiet", "--requests", "3", "--max-new-tokens", "2",
        "--model-size", "tiny", "--check", "all", "--threads", "1", "--plot", str(plot),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), plot


def test_demo_json_reports_the_layout_effect(demo_run: tuple[dict, Path]) -> None:
    data, _ = demo_run
    assert set(data) >= {"workload", "model", "layouts", "speedup", "max_logit_diff"}
    stable, query = data["layouts"]["stable_first"], data["layouts"]["query_first"]
    for layout in (stable, query):
        assert set(layout) >= {
            "hit_rate", "prefill_tokens_computed", "prefill_tokens_total", "ttft_median_s",
            "ttft_s", "max_logit_diff", "tokens_match", "wall_s",
        }  # fmt: skip
        assert len(layout["ttft_s"]) == 3
        assert layout["tokens_match"] is True
        assert layout["prefill_tokens_computed"] <= layout["prefill_tokens_total"]
    # The same content in another order (query-first adds a one-line pointer to the query).
    assert 1.0 <= query["prefill_tokens_total"] / stable["prefill_tokens_total"] < 1.05
    # 3 requests: the first computes everything, the other two reuse the shared prefix.
    assert stable["hit_rate"] > 0.5 > 0.05 > query["hit_rate"]
    assert stable["prefill_tokens_computed"] < query["prefill_tokens_computed"] / 2
    assert data["max_logit_diff"] < 1e-3
    assert data["workload"]["checked_requests"] == [0, 1, 2]
    wrong = data["wrong_context"]
    assert wrong["fingerprints_differ"] and wrong["max_logit_diff"] > 100 * data["max_logit_diff"]


def test_demo_plot_is_a_png(demo_run: tuple[dict, Path]) -> None:
    _, plot = demo_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_selfcheck_and_version() -> None:
    result = _run("selfcheck")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "selfcheck passed" in result.stdout and "FAIL" not in result.stdout
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.startswith("prefixkv ")


def test_analyze_names_the_cause() -> None:
    result = _run("analyze", str(DATA / "agent_timestamp_first.jsonl"))
    assert result.returncode == 0, result.stderr
    assert "timestamp" in result.stdout and "Variable content placed before" in result.stdout


def test_analyze_runs_as_a_module_too() -> None:
    # `python -m prefixkv.analyze` is the same command as `prefixkv analyze`.
    result = subprocess.run(
        [sys.executable, "-m", "prefixkv.analyze", str(DATA / "hostile_lines.jsonl"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["requests"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("demo", "--requests", "zero"), "expected a positive integer"),
        (("demo", "--check", "some"), "expected a count or 'all'"),
        (("demo", "--model-size", "huge"), "invalid choice"),
        (("demo", "--plot", "/no/such/dir/x.png"), "is not a directory"),
        (("analyze", "/no/such/trace.jsonl"), "cannot read"),
        (
            ("analyze", str(DATA / "malformed.jsonl"), "--prefill-tokens-per-second", "nan"),
            "expected a finite positive number",
        ),
        (("analyze", str(DATA / "malformed.jsonl"), "--block-size", "9" * 30), "at most"),
        (("frobnicate",), "invalid choice"),
        ((), "usage: prefixkv"),
    ],
)
def test_bad_input_exits_nonzero_with_a_message(args: tuple[str, ...], message: str) -> None:
    result = _run(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_console_script_is_installed() -> None:
    # The script sits beside the interpreter running the tests (a venv's bin/, or the
    # interpreter's own scripts directory): a missing script is a packaging bug, not a skip.
    beside = Path(sys.executable).with_name("prefixkv")
    script = str(beside) if beside.exists() else shutil.which("prefixkv")
    assert script is not None, "the prefixkv console script is not installed"
    result = subprocess.run(
        [script, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and "prefixkv" in result.stdout


def test_demo_model_sizes_listed_by_the_parser_match_the_demo() -> None:
    from prefixkv.apps import cli, demo

    assert set(cli.DEMO_MODEL_SIZES) == set(demo.MODEL_SIZES)
