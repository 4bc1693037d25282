"""Old spellings keep working for a while, with a `DeprecationWarning` that names the new one."""

from __future__ import annotations

import warnings

_MISSING = object()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel)


def take_renamed(kwargs: dict, old: str, new: str, value, *, where: str, default=None, stacklevel: int = 4):
    """Resolves a renamed keyword: returns `value` (the new keyword's) or the deprecated `kwargs[old]`.

    Args:
      kwargs: the caller's leftover keyword arguments; `old` is popped from it.
      old, new: the deprecated and the current keyword name.
      value: what the caller passed for `new` (`default` when not passed).
      where: the function's name, for the messages.
    Raises:
      TypeError when both spellings were given.
    """
    if old not in kwargs:
        return value
    old_value = kwargs.pop(old)
    if value is not default and value is not _MISSING:
        raise TypeError(f"{where}: got both {new}= and its deprecated spelling {old}=")
    warn_renamed(f"{where}({old}=...)", f"{new}=", stacklevel=stacklevel)
    return old_value


def reject_unknown(kwargs: dict, where: str) -> None:
    if kwargs:
        raise TypeError(f"{where}() got unexpected keyword argument(s) {sorted(kwargs)}")
