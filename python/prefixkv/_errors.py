"""Exception classes, defined in Python so both the Rust binding and pure-Python code raise them.

The native module imports this module at load time and raises these exact classes, so
`except prefixkv.OutOfBlocksError` works whichever layer raised it.
"""


class PrefixKVError(Exception):
    """Base class of every error prefixkv raises on purpose."""


class InvalidInputError(PrefixKVError, ValueError):
    """An argument has the wrong type, dtype, shape or value (negative token id, bad size...)."""


class UnknownRequestError(PrefixKVError, KeyError):
    """A request id that is not live: never begun, or already finished."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable.
        return str(self.args[0]) if self.args else ""


class InvalidBlockError(PrefixKVError, KeyError):
    """A block id outside the cache, or one the caller holds no reference to."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BlockStateError(PrefixKVError, ValueError):
    """A block in the wrong state for the call: releasing twice, committing a block not yet full."""


class OutOfBlocksError(PrefixKVError, MemoryError):
    """Not enough free or evictable blocks for the call; nothing was changed."""
