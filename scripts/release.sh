#!/usr/bin/env bash
# Release artifacts for this machine's platform, each checked before it is kept (docs/release.md):
#   1. the abi3 wheel (one file for CPython >= 3.11) for manylinux_2_28, linked by zig against
#      glibc 2.28 (this machine's newer glibc would leak newer symbols), checked by auditwheel;
#   2. the sdist, proven by building a wheel from it alone in an empty folder and running the
#      no-extras smoke test against that wheel in a fresh virtual environment;
#   3. `cargo package` of the pure-Rust crate prefixkv-core (which builds the packaged crate).
# Outputs go to dist/ (wheel, sdist) and target/package/ (the .crate).
# Needs: Python >= 3.11 with pip and venv, cargo. Installs maturin, ziglang (zig as a PyPI
# package) and auditwheel with pip into the running Python. PYTHON=... picks the interpreter;
# PREFIXKV_MANYLINUX=manylinux_2_17 (say) targets an older glibc.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
out=dist
compatibility="${PREFIXKV_MANYLINUX:-manylinux_2_28}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip install --quiet "maturin>=1.9.2,<2" ziglang "auditwheel>=6"
if [ -n "$(git status --porcelain 2>/dev/null)" ]; then
    echo "warning: the work tree has uncommitted changes, and the artifacts will contain them" >&2
fi
version="$("$python" -c 'import re, pathlib
text = pathlib.Path("Cargo.toml").read_text().split("[workspace.package]", 1)[1]
print(re.search(r"^version\s*=\s*\"([^\"]+)\"", text, re.M).group(1))')"
echo "== prefixkv $version"
rm -f "$out"/prefixkv-"$version"[-.]*

echo "== wheel ($compatibility, abi3)"
"$python" -m maturin build --release --zig --compatibility "$compatibility" --out "$out"
wheel="$(ls "$out"/prefixkv-"$version"-cp311-abi3-*.whl)"
"$python" -m auditwheel show "$wheel" | tee "$work/auditwheel.txt"
# auditwheel names the most compatible tag the wheel's symbols allow; fail if it is newer than
# the tag the wheel carries.
"$python" - "$wheel" "$work/auditwheel.txt" <<'EOF'
import re, sys
wheel, report = sys.argv[1], open(sys.argv[2]).read()
carried = re.search(r"manylinux_(\d+)_(\d+)", wheel)
allowed = re.search(r'platform tag:\s*"manylinux_(\d+)_(\d+)', report.replace("\n", " "))
assert carried and allowed, (wheel, report)
carried_v = tuple(map(int, carried.groups()))
allowed_v = tuple(map(int, allowed.groups()))
assert allowed_v <= carried_v, f"symbols need manylinux_{allowed_v}, wheel says {carried_v}"
print(f"wheel tag manylinux_{carried_v[0]}_{carried_v[1]}: ok (symbols allow {allowed_v[0]}_{allowed_v[1]})")
EOF

echo "== sdist"
"$python" -m maturin sdist --out "$out"
sdist="$out/prefixkv-$version.tar.gz"
tar -tzf "$sdist" | sed 's|^[^/]*/||' | sort > "$work/sdist-files.txt"
for required in LICENSE README.md pyproject.toml Cargo.toml Cargo.lock rust/core/Cargo.toml \
        rust/py/Cargo.toml python/prefixkv/__init__.py python/prefixkv/py.typed; do
    grep -qx "$required" "$work/sdist-files.txt" || { echo "sdist lacks $required" >&2; exit 1; }
done
echo "sdist: $(wc -l < "$work/sdist-files.txt") files"

echo "== a wheel from the sdist alone, in an empty folder, installed without extras"
mkdir "$work/from-sdist"
cp "$sdist" "$work/from-sdist/"
(cd "$work/from-sdist" && "$python" -m pip wheel --quiet --no-deps "prefixkv-$version.tar.gz" -w wheels)
"$python" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$work"/from-sdist/wheels/prefixkv-*.whl
"$work/venv/bin/python" scripts/smoke_no_extras.py

echo "== cargo package -p prefixkv-core"
cargo package -p prefixkv-core --allow-dirty
cargo package -p prefixkv-core --allow-dirty --list > "$work/crate-files.txt"
echo "crate: $(wc -l < "$work/crate-files.txt") files, ${CARGO_TARGET_DIR:-target}/package/prefixkv-core-$version.crate"

echo "== done"
ls -l "$wheel" "$sdist" "${CARGO_TARGET_DIR:-target}/package/prefixkv-core-$version.crate"
