"""The SGLang peer tests run only where SGLang is installed (the venv of benches/peer_sglang.py's
docstring); elsewhere they are not collected, so the main suite runs without SGLang. Where
SGLang *is* installed they always run."""

from __future__ import annotations

import warnings
from importlib.util import find_spec

HAVE_SGLANG = find_spec("sglang") is not None
collect_ignore_glob = [] if HAVE_SGLANG else ["test_*.py"]

if HAVE_SGLANG:
    # SGLang's and torch's modules warn on import (quantization backends without CUDA and the
    # like); warnings are errors in this suite, meant for ours, so import them once here with
    # their import-time warnings silenced.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import peer_sglang  # noqa: F401
