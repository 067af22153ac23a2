"""The distribution an engine installs: what `pip install prefixkv` pulls, and what works then.

The block manager must not cost an engine a torch install: numpy is the only unconditional
dependency, and the torch-based names fail with an error naming the extra. The no-extras
behaviour itself is checked by scripts/smoke_no_extras.py, which .ci/run also runs against the
built wheel in an environment where the extras are really absent; here it runs with the
optional packages blocked from import.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import prefixkv
from prefixkv import _compat

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "scripts" / "smoke_no_extras.py"

#: Packages an engine must not get from a plain `pip install prefixkv`.
HEAVY = {"torch", "safetensors", "tqdm", "matplotlib", "transformers", "tokenizers", "jinja2"}


def _requirements() -> list[tuple[str, str | None]]:
    """(name, extra or None) for every Requires-Dist of the installed distribution."""
    parsed = []
    for requirement in metadata.requires("prefixkv") or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)
        assert name is not None, requirement
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", requirement)
        parsed.append((name.group(0).lower(), extra.group(1) if extra else None))
    return parsed


def test_plain_install_pulls_only_numpy() -> None:
    unconditional = {name for name, extra in _requirements() if extra is None}
    assert unconditional == {"numpy"}, (
        "a plain `pip install prefixkv` must pull only numpy (reinstall if pyproject.toml "
        f"changed since the last `pip install -e`): {sorted(unconditional)}"
    )


def test_every_heavy_package_comes_from_a_named_extra() -> None:
    by_extra: dict[str, set[str]] = {}
    for name, extra in _requirements():
        if extra is not None:
            by_extra.setdefault(extra, set()).add(name)
    assert {"torch", "hf", "demo", "plot", "bench", "test", "dev"} <= set(by_extra)
    assert by_extra["torch"] >= {"torch", "safetensors"}
    assert by_extra["demo"] >= {"prefixkv", "tqdm"}  # prefixkv[torch] and the progress bar
    assert by_extra["hf"] >= {"tokenizers", "jinja2"}
    assert by_extra["plot"] >= {"matplotlib"}
    # [test] pulls every feature the suite exercises (through prefixkv[demo,hf,plot]).
    assert "prefixkv" in by_extra["test"] and "transformers" in by_extra["test"]
    requires = metadata.requires("prefixkv") or []
    test_features = [r for r in requires if r.startswith("prefixkv[") and "'test'" in r]
    assert test_features and all(
        feature in test_features[0] for feature in ("demo", "hf", "plot")
    ), test_features


def test_license_metadata_is_pep_639() -> None:
    meta = metadata.metadata("prefixkv")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def _cargo_workspace_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', section, re.MULTILINE)
    assert found is not None, "Cargo.toml [workspace.package] has no version"
    return found.group(1)


def test_one_version_for_the_wheel_and_the_crates() -> None:
    version = _cargo_workspace_version()
    assert prefixkv.__version__ == metadata.version("prefixkv") == version
    for crate in ("rust/core/Cargo.toml", "rust/py/Cargo.toml"):
        assert re.search(r"^version\.workspace\s*=\s*true", (ROOT / crate).read_text(), re.M), (
            f"{crate} must take the workspace version"
        )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{version}]" in changelog, f"CHANGELOG.md has no entry for {version}"


def _without_optional(code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter where the optional packages cannot be imported."""
    prelude = (
        "import sys\n"
        f"sys.path.insert(0, {str(SMOKE.parent)!r})\n"
        "import smoke_no_extras\n"
        "sys.meta_path.insert(0, smoke_no_extras._BlockOptional())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_block_manager_and_analyze_work_without_the_extras() -> None:
    result = subprocess.run(
        [sys.executable, str(SMOKE), "--block-optional"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "work without the extras" in result.stdout


def test_torch_names_raise_missing_dependency_error_naming_the_extra() -> None:
    result = _without_optional(
        "import prefixkv\n"
        "try:\n"
        "    prefixkv.Engine\n"
        "except prefixkv.MissingDependencyError as exc:\n"
        "    assert isinstance(exc, ImportError) and isinstance(exc, prefixkv.PrefixKVError)\n"
        "    print(exc)\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "prefixkv.Engine needs torch: pip install 'prefixkv[torch]'"


def test_blocker_really_blocks() -> None:
    """The check above means something only if the blocked packages are really unimportable."""
    result = _without_optional("import torch\n")
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_unrelated_import_errors_are_not_disguised() -> None:
    """Only a missing optional package becomes MissingDependencyError; other import failures
    (a bug in prefixkv itself) surface as they are."""
    result = _without_optional(
        "import prefixkv\n"
        "prefixkv._LAZY['Engine'] = 'prefixkv.no_such_module'\n"
        "try:\n"
        "    prefixkv.Engine\n"
        "except prefixkv.MissingDependencyError:\n"
        "    raise SystemExit('disguised')\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "prefixkv.no_such_module"


def test_cli_without_torch_names_the_extra() -> None:
    result = _without_optional(
        "from prefixkv.apps.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "status = main(['demo', '--quiet'])\n"
        "print('status', status)\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert "pip install 'prefixkv[demo]'" in result.stderr, result.stderr
    assert "status 2" in result.stdout


@pytest.mark.parametrize("old", sorted(_compat.MOVED))
def test_an_old_module_path_warns_and_is_the_module_at_its_new_path(old: str) -> None:
    """The layer folders moved modules (issue 21); old paths stay for one release as aliases:
    the same module object (so a monkeypatch through either path is seen by both), with a
    DeprecationWarning that names the new path."""
    new = _compat.MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new


def test_analyze_main_is_a_deprecated_alias_of_the_cli_entry_point() -> None:
    import prefixkv.analyze
    from prefixkv.apps.cli import analyze_main

    with pytest.warns(DeprecationWarning, match="apps.cli.analyze_main"):
        assert prefixkv.analyze.main is analyze_main


#: The layers, base first (docs/design.md, "Map of the code"): a module imports its own layer
#: and the layers before it, never one after. Top-level modules are the block manager, except
#: metrics, which reads the event publisher's counters.
LAYERS = (
    "block manager",
    "events",
    "metrics",
    "text",
    "analyze",
    "kv",
    "tiers",
    "models",
    "engine",
    "integrations",
    "apps",
)
PACKAGE_DIR = Path(prefixkv.__file__).parent


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE_DIR / parts[1]).is_dir():
        return parts[1]
    return "metrics" if parts[1:2] == ["metrics"] else "block manager"


def _imports(path: Path) -> set[str]:
    """Every prefixkv module a file names in an import, at any depth (type-only and
    function-local imports count: they are dependencies a reader follows too)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "prefixkv":
                names.update(f"prefixkv.{a.name}" for a in node.names)
            else:
                names.add(node.module)
    return {n for n in names if n == "prefixkv" or n.startswith("prefixkv.")}


def test_every_module_imports_only_its_own_layer_and_the_layers_below() -> None:
    """The package's folders are its architecture: no module imports a layer above its own. The
    curated `prefixkv/__init__.py` (which re-exports every layer, lazily) and `__main__`
    entry points are the two exceptions."""
    upward = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "__main__.py" or path == PACKAGE_DIR / "__init__.py":
            continue
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        rank = LAYERS.index(_layer_of(module))
        for target in _imports(path):
            if target in ("prefixkv", "prefixkv._core"):
                continue
            if LAYERS.index(_layer_of(target)) > rank:
                upward.append(f"{module} ({_layer_of(module)}) imports {target}")
    assert not upward, "\n".join(upward)
