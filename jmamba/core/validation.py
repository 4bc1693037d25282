"""Argument checks shared by every layer: clear `TypeError`/`ValueError`s naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def shape_of(x):
    return tuple(np.shape(x))


def check_float(name, x):
    dt = jnp.result_type(x)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} must be a floating array (float32/bfloat16/float16), got dtype {dt}")


def check_array(name, x, shape, what):
    """`x` must be floating with exactly `shape` (None entries match anything)."""
    if x is None:
        raise TypeError(f"{name} must be an array of shape {what}, got None")
    check_float(name, x)
    s = shape_of(x)
    if len(s) != len(shape) or any(e is not None and e != a for e, a in zip(shape, s)):
        raise ValueError(f"{name} must have shape {what} = {_fmt(shape)}, got {s}")


def check_bool_mask(name, x, shapes, what):
    s = shape_of(x)
    if s not in shapes:
        raise ValueError(f"{name} must have shape {what} ({' or '.join(map(str, shapes))}), got {s}")
    dt = jnp.result_type(x)
    if dt != jnp.bool_:
        raise TypeError(f"{name} must be a bool mask, got dtype {dt}")


def check_bool(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")


def check_positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def normalize_reset(reset, bsz, seqlen, name="reset"):
    """Checks a `[Bt]` or `[Bt, T]` bool reset mask and returns it as `[Bt, T]` (None stays None).

    A row mask `[Bt]` acts at t = 0: True zeroes the state entering the row's first position.
    """
    if reset is None:
        return None
    check_bool_mask(name, reset, [(bsz,), (bsz, seqlen)], "[batch] or [batch, seqlen]")
    reset = jnp.asarray(reset, bool)
    if reset.ndim == 1:
        if seqlen == 0:     # an empty window: nothing to reset
            return jnp.zeros((bsz, 0), bool)
        return jnp.zeros((bsz, seqlen), bool).at[:, 0].set(reset)
    return reset


def _fmt(shape):
    return "(" + ", ".join("?" if e is None else str(e) for e in shape) + ")"


def is_static_number(x) -> bool:
    """True for Python/numpy numbers and concrete 0-d arrays (values known while tracing)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return isinstance(x, (int, float, np.number)) or (hasattr(x, "shape") and np.shape(x) == ())
