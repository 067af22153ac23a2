#!/usr/bin/env bash
# The remote KV tier's tests (tests/test_tiers_remote.py) start a real redis-server on a loopback
# port; they fail, never skip, without one. `make test` and CI install it from Debian packages
# when neither redis-server nor valkey-server is on PATH.
set -euo pipefail
if command -v redis-server >/dev/null || command -v valkey-server >/dev/null; then
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
