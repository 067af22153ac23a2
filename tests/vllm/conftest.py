"""The vLLM integration tests run only where vLLM is installed (`make vllm-test` builds such a
venv with scripts/install_vllm.sh); elsewhere they are not collected, so the main suite runs
without vLLM. Where vLLM *is* installed they always run: an unsupported vLLM then fails them
with the integration's own error, as it should."""

from __future__ import annotations

import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest

HAVE_VLLM = find_spec("vllm") is not None
collect_ignore_glob = [] if HAVE_VLLM else ["test_*.py"]

if HAVE_VLLM:
    # vLLM's and torch's own modules warn on import (torch.jit deprecations and the like);
    # warnings are errors in this suite, meant for ours. Importing them once here, with their
    # import-time warnings silenced, leaves every warning raised while a test runs an error.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tests.vllm.harness  # noqa: F401


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama config.json vLLM's ModelConfig can read (no weights, no tokenizer)."""
    from tests.vllm.harness import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("models"))
