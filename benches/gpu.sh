#!/usr/bin/env bash
# CUDA checks and timings for prefixkv, for a machine with one CUDA GPU (about 3-5 minutes).
#
#   bash benches/gpu.sh            # from the repository root, with prefixkv installed
#
# 1. the CUDA-only tests (tests/cuda/, collected only where a GPU is present);
# 2. benches/gpu_check.py: Triton paged prefill and the torch backend against the float64
#    reference on CUDA, the paged model with a cached prefix against full recompute, page
#    copies bit-exact; then Triton vs torch SDPA on gathered K/V (and flash-attn if installed)
#    and page-copy bandwidth vs copy_ of the same bytes. Its tables print last.
# Exits 2 with a message when no CUDA device is visible, 1 if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu.sh: no CUDA device visible to torch (torch.cuda.is_available() is False); nothing to run." >&2
    echo "        Run this on a machine with an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
python -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
python -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "triton: not installed (the Triton checks will fail)"

status=0
echo "== CUDA tests (pytest tests/cuda) =="
if python -c 'import pytest' 2>/dev/null; then
    timeout 300 python -m pytest tests/cuda -q -p no:cacheprovider || status=1
else
    echo "pytest not installed: skipped (pip install -e '.[test]')"
fi

echo "== benches/gpu_check.py =="
timeout 420 python benches/gpu_check.py || status=1
exit $status
