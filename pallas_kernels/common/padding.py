"""Padding one axis of an array up to a static length (T to whole chunks, n / headdim / d_state to
powers of two) before the kernels see it.

The kernels rely on the padded entries being neutral (zero inputs, identity steps), which each call
site states; the helper only appends entries at the end of the axis, so slicing `[:length]` after
the kernels undoes it.
"""

from __future__ import annotations

import jax.numpy as jnp


def pad_axis_to(x, axis: int, length: int, value=0):
    """x with `value` appended along `axis` up to `length` entries.

    Args:
      x: an array of any shape and dtype.
      axis: the axis to pad (negative counts from the end).
      length: the static length wanted, >= x.shape[axis].
      value: the fill (cast to x.dtype by jnp.pad).

    Returns:
      x itself when it already has `length` entries (no pad op is traced), else the padded array.
    """
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}")
    axis = axis % x.ndim
    extra = length - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of shape {x.shape} to the shorter length {length}")
    if extra == 0:
        return x
    return jnp.pad(x, [(0, extra) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=value)
