#!/usr/bin/env bash
# Build the version-specific (non-abi3) wheel for a free-threaded CPython and run the block
# manager's tests under it, checking that importing prefixkv leaves the GIL disabled.
#
#   scripts/free_threaded_check.sh /path/to/python3.13t [VENV]
#
# With VENV, the virtual environment is made there and kept (prefixkv's free-threaded build and
# numpy installed): `PREFIXKV_FREE_THREADED_PYTHON=VENV/bin/python python benches/run.py` then
# runs section 2 (threads) on it too.
#
# abi3 extensions cannot load on a free-threaded interpreter, so this build turns the binding's
# default `abi3` cargo feature off (--no-default-features). PyO3 0.27 supports 3.13t and 3.14t
# (later PyO3 releases drop 3.13t). The tests run without torch, which has no small CPU build
# for these interpreters on PyPI: tests/test_cache.py runs without its torch-tensor cases, plus
# the thread, state-machine and packaging tests. docs/release.md says how the interpreter used
# here was obtained; scripts/build_free_threaded_python.sh builds one (`make free-threaded` runs
# both, as CI does).
set -euo pipefail
cd "$(dirname "$0")/.."

ft="${1:?usage: $0 PATH_TO_FREE_THREADED_PYTHON}"
"$ft" -c 'import sys, sysconfig
sys.exit(0 if sysconfig.get_config_var("Py_GIL_DISABLED") else f"{sys.executable} is not a free-threaded build")'
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

venv="${2:-$work/venv}"
"$ft" -m venv "$venv"
py="$venv/bin/python"
# hypothesis: recent releases build a PyO3 extension that refuses 3.13t; its last pure-Python
# wheel is enough for the tests.
"$py" -m pip install --quiet "maturin>=1.9.2,<2" numpy pytest pytest-timeout
"$py" -m pip install --quiet --only-binary hypothesis hypothesis

CARGO_TARGET_DIR=target/free-threaded "$venv/bin/maturin" build --release \
    --no-default-features -i "$py" --out "$work/dist"
"$py" -m pip install --quiet --force-reinstall --no-deps "$work"/dist/prefixkv-*.whl
"$py" -c 'import sys, prefixkv
assert not sys._is_gil_enabled(), "importing prefixkv turned the GIL on"
print(f"prefixkv {prefixkv.__version__} on {sys.version.split()[0]} free-threaded: GIL stays off")'
"$py" scripts/smoke_no_extras.py

# The block-manager tests, from a copy of what they read: test_cache.py without its
# torch-tensor cases; test_packaging.py reads the version files and the smoke script.
root="$work/root"
mkdir -p "$root/tests" "$root/scripts" "$root/rust/core" "$root/rust/py"
cp Cargo.toml CHANGELOG.md LICENSE pyproject.toml "$root/"
cp rust/core/Cargo.toml "$root/rust/core/"
cp rust/py/Cargo.toml "$root/rust/py/"
cp scripts/smoke_no_extras.py "$root/scripts/"
cp tests/__init__.py tests/core_defaults.py tests/reference_cache.py tests/test_cache_threads.py \
    tests/test_cache_state_machine.py tests/test_packaging.py "$root/tests/"
sed -e '/^import torch$/d' -e '/torch\.tensor/d' tests/test_cache.py > "$root/tests/test_cache.py"
if grep -n torch "$root/tests/test_cache.py"; then
    echo "tests/test_cache.py uses torch in a new way; update the filter above" >&2
    exit 1
fi
# --noconftest: tests/conftest.py imports torch; pyproject.toml's pytest settings still apply.
# Deselected: the old module paths' shims, which import the moved modules, most of them needing
# torch, jinja2 or gguf (extras this interpreter has none of); `make test` runs them.
(cd "$root" && "$py" -m pytest --noconftest -p no:cacheprovider -q tests \
    -k "not test_an_old_module_path_warns_and_is_the_module_at_its_new_path")
