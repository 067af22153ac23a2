"""The exception hierarchy: one base class, subclasses that are also the built-in a user catches.

The Rust core raises these through the binding (`prefixkv._core` defines the ones that cross the
boundary and this module re-exports them); the Python modules raise the same classes, so an
engine can write one `except PrefixKVError` around any prefixkv call.
"""

from prefixkv._errors import (
    BlockStateError,
    InvalidBlockError,
    InvalidInputError,
    OutOfBlocksError,
    PrefixKVError,
    UnknownRequestError,
)

__all__ = [
    "BlockStateError",
    "InvalidBlockError",
    "InvalidInputError",
    "OutOfBlocksError",
    "PrefixKVError",
    "UnknownRequestError",
]
