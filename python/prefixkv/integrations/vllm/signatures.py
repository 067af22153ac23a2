"""The installed vLLM's `KVCacheManager` interface, compared with prefixkv's, at import.

A version check (`_versions.py`) names releases; this checks the interface itself, so a patch
release that adds an argument or a member fails at import with the difference named, instead
of a call being answered wrongly. Every public method and property of vLLM's class must exist
on `PrefixKVCacheManager` with the same parameters (names, kinds, defaults; prefixkv may add
keyword-only parameters with defaults), and every attribute vLLM's constructor sets must be set
by prefixkv's (`missing_attributes`, checked on the first instance).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from prefixkv.errors import UnsupportedEngineVersionError

_ASSIGNED = re.compile(r"^\s+self\.([A-Za-z]\w*)\s*(?::[^=]+)?=", re.MULTILINE)


def _public_members(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") or name == "__init__"
    }


def _compatible(stock: inspect.Signature, ours: inspect.Signature) -> str | None:
    """Why `ours` cannot stand in for `stock`, or None."""
    stock_params = list(stock.parameters.values())
    our_params = list(ours.parameters.values())
    for i, param in enumerate(stock_params):
        if i >= len(our_params):
            return f"missing parameter {param.name!r}"
        mine = our_params[i]
        if (mine.name, mine.kind) != (param.name, param.kind):
            return f"parameter {i} is {param.name!r} ({param.kind.description}) in vLLM"
        if mine.default != param.default:
            return f"parameter {param.name!r} defaults to {param.default!r} in vLLM"
    for extra in our_params[len(stock_params) :]:
        if extra.kind is not inspect.Parameter.KEYWORD_ONLY or extra.default is inspect._empty:
            return f"extra parameter {extra.name!r} must be keyword-only with a default"
    return None


def interface_differences(stock_cls: type, our_cls: type) -> list[str]:
    """What of `stock_cls`'s public interface `our_cls` lacks or answers differently."""
    problems = []
    ours = dict(inspect.getmembers(our_cls))
    for name, member in _public_members(stock_cls).items():
        if name not in ours:
            problems.append(f"{name}: not implemented")
            continue
        if isinstance(member, property) != isinstance(ours[name], property):
            problems.append(f"{name}: a property in one, not in the other")
            continue
        if callable(member) and not isinstance(member, type):
            reason = _compatible(inspect.signature(member), inspect.signature(ours[name]))
            if reason is not None:
                problems.append(f"{name}: {reason}")
    return problems


def constructor_attributes(cls: type) -> set[str]:
    """Attribute names `cls.__init__` assigns (read from its source)."""
    # The class's own constructor (vLLM's KVCacheManager defines one), not an inherited one.
    return set(_ASSIGNED.findall(inspect.getsource(vars(cls)["__init__"])))


def check_interface(stock_cls: type, our_cls: type) -> None:
    problems = interface_differences(stock_cls, our_cls)
    if problems:
        raise UnsupportedEngineVersionError(
            f"vLLM's {stock_cls.__name__} differs from the interface prefixkv implements: "
            + "; ".join(problems)
        )


def missing_attributes(stock_cls: type, instance: object) -> list[str]:
    return sorted(name for name in constructor_attributes(stock_cls) if not hasattr(instance, name))
