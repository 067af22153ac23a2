"""A fixture for test modules written against `PrefixCache`'s default core: each test runs on
the default as it ships and on the block core. A module uses it with
``pytestmark = pytest.mark.usefixtures("each_default_core")`` after importing it; it needs no
torch (the free-threaded check runs such modules without the conftest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefixkv import PrefixCache


@pytest.fixture(scope="module", params=["auto", "blocks"])
def each_default_core(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a module written against `PrefixCache`'s default core twice: with the default as it
    ships ("auto": the run core where it serves the settings) and with the block core, so both
    cores answer its tests. Module-scoped (set once for every example of a hypothesis test);
    a test that names its core keeps it."""
    init = PrefixCache.__init__
    defaults = init.__kwdefaults__
    init.__kwdefaults__ = {**defaults, "core": request.param}
    try:
        yield request.param
    finally:
        init.__kwdefaults__ = defaults
