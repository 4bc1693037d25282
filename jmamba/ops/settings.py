"""Per-op tuning settings: chunk sizes and kernel launch configurations.

Tuning knobs change speed and rounding, never the meaning of a call, so they are settings of the op,
not fields of a model config (a checkpoint does not depend on them). Each op registers a frozen
settings dataclass and its default here; a call uses, in order of priority:

1. the op's `tuning=` keyword (an instance of that op's settings class),
2. the innermost `with jmamba.ops.tuning(op, ...)` block,
3. the op's default (`set_default_tuning` changes it for the process).

Settings are read when a function is traced: a function already traced and cached by `jax.jit`
keeps the settings it was traced with, so build (or re-jit) it inside the block.

Example:
    with jmamba.ops.tuning("mamba3_siso_scan", chunk_size=128):
        step = make_train_step(...)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

_DEFAULTS: dict[str, Any] = {}
_ACTIVE: dict[str, list] = {}


def register_tuning(op: str, default) -> None:
    """Declares `op`'s settings class by its default instance (a frozen dataclass)."""
    if not dataclasses.is_dataclass(default) or isinstance(default, type):
        raise TypeError(f"the default tuning of {op} must be a dataclass instance")
    _DEFAULTS[op] = default


def _settings_class(op: str):
    if op not in _DEFAULTS:
        raise ValueError(f"op must be one of {sorted(_DEFAULTS)}, got {op!r}")
    return type(_DEFAULTS[op])


def current_tuning(op: str, override=None):
    """The settings a call of `op` uses now (`override`, else the innermost block, else the default)."""
    cls = _settings_class(op)
    if override is not None:
        if not isinstance(override, cls):
            raise TypeError(f"tuning for {op} must be a {cls.__name__}, got {type(override).__name__}")
        return override
    stack = _ACTIVE.get(op)
    return stack[-1] if stack else _DEFAULTS[op]


@contextlib.contextmanager
def tuning(op: str, settings=None, **fields):
    """Within the block, calls of `op` use `settings`, or the current settings with `fields` replaced.

    Args:
      op: "selective_scan", "mamba3_siso_scan" or "adamw_update".
      settings: an instance of the op's settings class (`SelectiveScanTuning`, ...), or None.
      **fields: fields to replace in `settings` (or in the current settings).
    """
    cls = _settings_class(op)
    base = current_tuning(op) if settings is None else settings
    if not isinstance(base, cls):
        raise TypeError(f"tuning for {op} must be a {cls.__name__}, got {type(base).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; fields: {sorted(names)}")
    new = dataclasses.replace(base, **fields) if fields else base
    _ACTIVE.setdefault(op, []).append(new)
    try:
        yield new
    finally:
        _ACTIVE[op].pop()


def set_default_tuning(op: str, settings) -> None:
    """Replaces the process-wide default settings of `op`."""
    cls = _settings_class(op)
    if not isinstance(settings, cls):
        raise TypeError(f"tuning for {op} must be a {cls.__name__}, got {type(settings).__name__}")
    _DEFAULTS[op] = settings
