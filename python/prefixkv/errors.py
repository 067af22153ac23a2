"""Every exception prefixkv raises on purpose, in one place.

One base class, `PrefixKVError`, so an engine can wrap any prefixkv call in a single
`except PrefixKVError`. Each subclass also derives from the built-in a user would catch
without knowing prefixkv (`ValueError`, `KeyError`, `MemoryError`, `ImportError`,
`RuntimeError`).

Why these are Python classes and not defined by the Rust binding: the double bases. A class
created by PyO3's `create_exception!` has one base; `OutOfBlocksError` must be both a
`PrefixKVError` and a `MemoryError`. So the classes live here and the native module imports
them at load time (`pyo3::import_exception!(prefixkv.errors, ...)` in `rust/py`), raising these
exact classes; pure-Python modules raise the same ones.
"""

from __future__ import annotations

__all__ = [
    "EXTRA_FOR_PACKAGE",
    "BackendUnavailableError",
    "BlockStateError",
    "ChatTemplateError",
    "DuplicateRequestError",
    "InvalidBlockError",
    "InvalidInputError",
    "KVAllocationError",
    "KVDeviceError",
    "KVDtypeError",
    "KVIndexError",
    "KVShapeError",
    "MissingDependencyError",
    "ModelTooLargeError",
    "OutOfBlocksError",
    "PagedKVError",
    "PrefixKVError",
    "SubscriberFailedError",
    "UnknownRequestError",
    "UnsupportedEngineVersionError",
    "UnsupportedFeatureError",
    "missing_dependency",
]


class PrefixKVError(Exception):
    """Base class of every error prefixkv raises on purpose."""


class _ReadableKeyError(KeyError):
    # KeyError quotes its message (repr); these messages are sentences, so print them plain.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# -- the block manager (raised by the Rust core through the binding) ---------------------------
class InvalidInputError(PrefixKVError, ValueError):
    """An argument has the wrong type, dtype, shape or value (negative token id, bad size...)."""


class UnknownRequestError(PrefixKVError, _ReadableKeyError):
    """A request or pin id that is not live: never begun, already finished, or dropped by
    `clear()`."""


class DuplicateRequestError(PrefixKVError, ValueError):
    """`add_request` or `begin` with a request id that is already live; nothing was changed."""


class InvalidBlockError(PrefixKVError, _ReadableKeyError):
    """A block id outside the cache, or one the caller holds no reference to."""


class BlockStateError(PrefixKVError, ValueError):
    """A block in the wrong state for the call: releasing twice, committing a block not yet full."""


class OutOfBlocksError(PrefixKVError, MemoryError):
    """Not enough free or evictable blocks for the call; nothing was changed."""


# -- paged KV storage and attention (kv.py, attention.py) --------------------------------------
class PagedKVError(InvalidInputError):
    """Base class for invalid arguments to paged KV storage or paged attention."""


class KVShapeError(PagedKVError):
    """A tensor has the wrong shape, or lengths that disagree with each other."""


class KVDtypeError(PagedKVError):
    """A tensor has the wrong dtype (values that differ from the pages, or non-integer ids)."""


class KVDeviceError(PagedKVError):
    """A tensor lives on a different device than the pages it is used with."""


class KVIndexError(PagedKVError):
    """A block id or slot is out of range, or a destination is repeated in one call."""


class BackendUnavailableError(PrefixKVError, RuntimeError):
    """The requested attention backend cannot run here (triton missing, or no CUDA device)."""


# -- optional dependencies ---------------------------------------------------------------------
class MissingDependencyError(PrefixKVError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names the
    extra to install (for example `pip install 'prefixkv[hf]'`)."""


#: The optional packages prefixkv's torch-based modules import at load time, and the extra that
#: brings each (pyproject.toml's [project.optional-dependencies] is the other half of this).
EXTRA_FOR_PACKAGE = {
    "torch": "torch",
    "safetensors": "torch",
    "tqdm": "demo",
    "zmq": "events",
    "msgspec": "events",
    "prometheus_client": "metrics",
    "redis": "redis",
}


def missing_dependency(
    exc: ModuleNotFoundError, feature: str, extra: str | None = None
) -> MissingDependencyError | None:
    """The `MissingDependencyError` for `feature` when `exc` is a missing optional package, else
    None (then `exc` is a real error, to be shown as it is). `extra` overrides the table when the
    feature needs a larger extra than the package alone (`prefixkv demo` needs `demo`)."""
    package = (exc.name or "").partition(".")[0]
    if package not in EXTRA_FOR_PACKAGE:
        return None
    return MissingDependencyError(
        f"{feature} needs {package}: pip install 'prefixkv[{extra or EXTRA_FOR_PACKAGE[package]}]'"
    )


# -- chat templates (text.py, jinja_sandbox.py) -------------------------------------------------
class ChatTemplateError(InvalidInputError):
    """A chat template could not be found, compiled or rendered: a syntax error, an error the
    template raised, or a render that broke a limit (time, steps, output size). Templates come
    from checkpoints and users, so every failure while rendering one is this class."""


class KVAllocationError(PrefixKVError, MemoryError):
    """The KV pages asked for cannot be allocated on their device (too large for its memory,
    or for torch's size limits); the message names the size."""


class ModelTooLargeError(PrefixKVError, MemoryError):
    """A checkpoint's config describes a model larger than this machine's memory; refused before
    any weight is allocated, the message giving the bytes it needs and the limit."""


# -- KV events (events/subscriber.py) -------------------------------------------------------------
class SubscriberFailedError(PrefixKVError, RuntimeError):
    """The subscriber's thread stopped on its own (its sockets failed): the index no longer
    follows the instances. The message names the cause."""


# -- engine integrations -----------------------------------------------------------------------
class UnsupportedEngineVersionError(PrefixKVError, ImportError):
    """An engine integration (`prefixkv.integrations.vllm`) was imported beside a version of the
    engine it was not written and tested against; the message names the versions supported."""


class UnsupportedFeatureError(PrefixKVError, NotImplementedError):
    """An engine asked an integration for something prefixkv does not do (a hybrid KV layout, a
    Mamba alignment mode, a partial-block hit, ...), or a cache built with ``core="runs"`` for a
    call or setting that core does not serve yet; the message names the setting to change."""
