"""Deprecated location: the AdamW step scalars are part of the `jmamba.ops.adamw_update` op now
(`jmamba.ops.step_scalars`, `jmamba.ops.bias_correction`); the per-leaf update is in
`jmamba/ops/adamw/reference.py`."""

import warnings as _warnings

from jmamba.core.validation import is_static_number  # noqa: F401
from jmamba.ops import bias_correction, step_scalars  # noqa: F401

_warnings.warn("jmamba.optim.adamw_numerics is deprecated; use jmamba.ops.step_scalars / jmamba.ops.bias_correction",
               DeprecationWarning, stacklevel=2)
