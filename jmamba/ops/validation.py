"""Deprecated location: the argument checks moved to `jmamba.core.validation` (re-exported here)."""

import warnings as _warnings

from jmamba.core.validation import *  # noqa: F401,F403
from jmamba.core.validation import (FLOAT_DTYPES, check_array, check_bool_mask, check_float,  # noqa: F401
                                    shape_of)

_warnings.warn("jmamba.ops.validation is deprecated; use jmamba.core.validation", DeprecationWarning, stacklevel=2)
