"""`prefixkv.integrations.vllm` names what it needs when vLLM is missing (the main suite's
case); where vLLM is installed, it imports and says which version it found."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.util import find_spec

import pytest

from prefixkv.errors import UnsupportedEngineVersionError


def test_vllm_integration_import_names_the_supported_versions() -> None:
    sys.modules.pop("prefixkv.integrations.vllm", None)
    if find_spec("vllm") is None:
        with pytest.raises(UnsupportedEngineVersionError, match=r"needs vLLM installed.*0\.32\.x"):
            importlib.import_module("prefixkv.integrations.vllm")
    else:
        module = importlib.import_module("prefixkv.integrations.vllm")
        assert module.VLLM_VERSION.startswith("0.32.")


def test_integrations_package_imports_no_engine() -> None:
    code = "import sys, prefixkv.integrations; print(sorted(m for m in sys.modules if m.startswith('vllm')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
