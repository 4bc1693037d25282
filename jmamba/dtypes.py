"""Deprecated location: the dtype rules moved to `jmamba.core.dtypes` (this module re-exports them)."""

import warnings as _warnings

from jmamba.core.dtypes import *  # noqa: F401,F403
from jmamba.core.dtypes import accum_dtype  # noqa: F401

_warnings.warn("jmamba.dtypes is deprecated; use jmamba.core.dtypes", DeprecationWarning, stacklevel=2)
