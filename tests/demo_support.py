"""`prefixkv demo --model PATH --json`, run in-process the way the model tests check it: three
requests of three new tokens on one thread, with the layout effect every served model must show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixkv.apps import cli


def run_demo_model(model: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> Any:
    """The demo's JSON report for `model`, after checking what holds for every model: it exits
    0, the stable-first layout hits the cache where the query-first one does not, and greedy
    tokens equal a full recompute's in both layouts."""
    argv = ["demo", "--model", str(model), "--json", "--quiet", "-n", "3", *extra]
    threads = torch.get_num_threads()
    try:
        status = cli.main([*argv, "--max-new-tokens", "3", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the CLI sets it for the process
    out = capsys.readouterr()
    assert status == 0, out.err
    data = json.loads(out.out)
    stable, query = data["layouts"]["stable_first"], data["layouts"]["query_first"]
    assert stable["hit_rate"] > 0.5 > query["hit_rate"]
    assert stable["tokens_match"] and query["tokens_match"]
    assert data["max_logit_diff"] < 1e-3
    return data
