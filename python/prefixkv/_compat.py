"""Old module paths (before the package was split into layer folders) as deprecated aliases.

Until release 0.2, ``import prefixkv.model`` still works: it warns (`DeprecationWarning`, naming
the new path) and returns the module at its new path, the same object, so isinstance checks and
monkeypatches see one module. Names importable from ``prefixkv`` itself never moved. The map is
the one place that lists where each module went (docs/design.md, "Map of the code", explains the
layers).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "prefixkv.attention": "prefixkv.kv.prefill",
    "prefixkv.decode_attention": "prefixkv.kv.decode",
    "prefixkv.grouped_kv": "prefixkv.kv.grouped",
    "prefixkv.batch": "prefixkv.models.batch",
    "prefixkv.model": "prefixkv.models.decoder",
    "prefixkv.model_config": "prefixkv.models.config",
    "prefixkv.rope": "prefixkv.models.rope",
    "prefixkv.lora": "prefixkv.models.lora",
    "prefixkv.checkpoint": "prefixkv.models.checkpoint",
    "prefixkv.gguf": "prefixkv.models.gguf",
    "prefixkv.chat": "prefixkv.text.chat",
    "prefixkv.jinja_sandbox": "prefixkv.text.sandbox",
    "prefixkv.segments": "prefixkv.text.segments",
    "prefixkv.engine_inputs": "prefixkv.engine.inputs",
    "prefixkv.scheduler": "prefixkv.engine.scheduler",
    "prefixkv.threads": "prefixkv.engine.threads",
    "prefixkv.cli": "prefixkv.apps.cli",
    "prefixkv.demo": "prefixkv.apps.demo",
    "prefixkv.route_demo": "prefixkv.apps.route_demo",
    "prefixkv.tiers.demo": "prefixkv.apps.tiers_demo",
}


class _AliasLoader(importlib.abc.Loader):
    """Executes an old path by putting the new module in its place in `sys.modules`: the
    import system then returns (and binds on the parent package) the new module itself."""

    def __init__(self, new: str) -> None:
        self._new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self._new}; the old path will be removed in prefixkv 0.2",
            DeprecationWarning,
            stacklevel=2,
        )
        sys.modules[module.__name__] = importlib.import_module(self._new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    """Add the finder once (importing prefixkv twice, or reloading it, adds no second one)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
