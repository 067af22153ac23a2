#!/usr/bin/env bash
# Build a free-threaded CPython 3.13 (`--disable-gil`) into DEST and print its interpreter's path,
# for `scripts/free_threaded_check.sh` (CI's `make free-threaded`) and for section 2 of the
# benchmarks (`PREFIXKV_FREE_THREADED_PYTHON`).
#
#   scripts/build_free_threaded_python.sh DEST
#
# PyPI has no interpreters and Debian ships no free-threaded binary package, so this builds one
# from Debian trixie's `python3.13` source package (`apt-get source`, which checks the archive's
# signature) with a private apt configuration kept in a temporary folder: the machine's own apt
# sources are not changed. The compiler and the headers pip and venv need (OpenSSL, zlib, libffi)
# are installed from Debian packages when missing. Nothing is built when DEST already holds the
# interpreter. About 5 minutes on 2 cores.
set -euo pipefail

dest="${1:?usage: $0 DEST}"
dest="$(mkdir -p "$dest" && cd "$dest" && pwd)"
python="$dest/bin/python3.13t"
if [[ -x "$python" ]]; then
    echo "$python"
    exit 0
fi

sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
missing=()
for package in build-essential libssl-dev zlib1g-dev libffi-dev; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
    $sudo apt-get update -qq >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/parts" "$work/archives/partial" "$work/cache"
echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    >"$work/sources.list"
apt_private=(
    -o "Dir::Etc::SourceList=$work/sources.list"
    -o "Dir::Etc::SourceParts=$work/parts"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::Cache=$work/cache"
    -o "Dir::Cache::Archives=$work/archives"
    -o "APT::Sandbox::User=root"
)
$sudo apt-get "${apt_private[@]}" update -qq >&2
(cd "$work" && $sudo apt-get "${apt_private[@]}" source --download-only -qq python3.13 >&2)
tar -C "$work" -xf "$work"/python3.13_*.orig.tar.xz
source_dir="$(find "$work" -maxdepth 1 -type d -name 'Python-3.13.*' | head -1)"
[[ -n "$source_dir" ]] || { echo "no Python-3.13.* in python3.13's source package" >&2; exit 1; }

(
    cd "$source_dir"
    ./configure --disable-gil --prefix="$dest" --with-ensurepip=install >"$work/configure.log" 2>&1 &&
        make -j"$(nproc)" >"$work/make.log" 2>&1 &&
        make install >"$work/install.log" 2>&1
) || {
    echo "building CPython from $source_dir failed; the end of its logs:" >&2
    tail -n 30 "$work"/configure.log "$work"/make.log "$work"/install.log >&2 2>/dev/null || true
    exit 1
}
"$python" -c 'import sys, sysconfig
sys.exit(0 if sysconfig.get_config_var("Py_GIL_DISABLED") else f"{sys.executable} is not free-threaded")'
echo "$python"
