"""Launches of the add + RMSNorm kernels: rows flattened and padded, column pieces, dw partial sums.

Shapes: x [N, D] (any float dtype), residual [N, D] float32 or None, weight [D]; the caller
(jmamba/ops/norms/pallas.py) flattens the leading axes into N. N is padded to whole blocks of
`block_rows` rows and D to a multiple of 16 when its largest power-of-two divisor is smaller (zero
rows and columns: neutral in every sum, sliced away after; the benchmark shapes need neither).

Numerics: float32 throughout (kernels.py); y and dx are rounded once to their dtypes; the dw partials
([N / block_rows, D] float32) are summed by XLA in a fixed order (deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.common.sizes import largest_power_of_2_dividing, round_up
from pallas_kernels.rms_norm import kernels
from pallas_kernels.rms_norm.config import DEFAULT_NORM_CONFIG, NormBlockConfig


class _Tiling:
    """Block sizes and block specs of one call on [N, D] operands."""

    def __init__(self, n_rows, n_cols, config: NormBlockConfig | None):
        cfg = (config or DEFAULT_NORM_CONFIG).validate()
        self.n_rows, self.n_cols = n_rows, n_cols
        self.block_rows, self.num_warps = cfg.block_rows, cfg.num_warps
        self.rows_pad = round_up(max(n_rows, 1), self.block_rows)
        self.cols_pad = n_cols if largest_power_of_2_dividing(n_cols) >= 16 else round_up(n_cols, 16)
        self.width = min(cfg.max_width, largest_power_of_2_dividing(self.cols_pad))
        self.pieces = self.cols_pad // self.width
        self.grid = (self.rows_pad // self.block_rows,)

    def pad(self, a):
        """[N, D] -> [N_pad, D_pad] (zeros), or a [D] vector -> [D_pad]."""
        if a.ndim == 1:
            return pad_axis_to(a, 0, self.cols_pad)
        return pad_axis_to(pad_axis_to(a, 0, self.rows_pad), 1, self.cols_pad)

    def rows(self):
        return pl.BlockSpec((self.block_rows, self.cols_pad), lambda i: (i, 0))

    def row_vector(self):
        return pl.BlockSpec((self.block_rows,), lambda i: (i,))

    def columns(self):
        return pl.BlockSpec((self.cols_pad,), lambda i: (0,))

    def partial(self):
        return pl.BlockSpec((None, self.cols_pad), lambda i: (i, 0))

    def unpad(self, a):
        return a[:self.n_rows, :self.n_cols]


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "config", "interpret"))
def add_rms_norm_forward(x, residual, weight, *, eps, out_dtype, config=None, interpret=False):
    """(y [N, D] out_dtype, h [N, D] float32 or None without a residual, r [N] float32).

    h = residual + x in float32, y = (h·r)·weight with r = 1/√(mean(h²) + eps) per row (kernels.py).
    """
    t = _Tiling(*x.shape, config)
    has_residual = residual is not None
    inputs = [("x", t.pad(x), t.rows()), ("residual", t.pad(residual) if has_residual else None, t.rows()),
              ("w", t.pad(weight.astype(F32)), t.columns())]
    outputs = [("y", jax.ShapeDtypeStruct((t.rows_pad, t.cols_pad), jnp.dtype(out_dtype)), t.rows()),
               ("r", jax.ShapeDtypeStruct((t.rows_pad,), F32), t.row_vector())]
    if has_residual:
        outputs.append(("h", jax.ShapeDtypeStruct((t.rows_pad, t.cols_pad), F32), t.rows()))
    out = run_kernel(
        functools.partial(kernels.forward_body, pieces=t.pieces, width=t.width, n_cols=t.n_cols, eps=eps),
        grid=t.grid, inputs=inputs, outputs=outputs, name="add_rms_norm_forward", num_warps=t.num_warps,
        num_stages=1, interpret=interpret)
    h = t.unpad(out["h"]) if has_residual else None
    return t.unpad(out["y"]), h, out["r"][:t.n_rows]


@functools.partial(jax.jit, static_argnames=("x_dtype", "with_stream", "config", "interpret"))
def add_rms_norm_backward(h, r, weight, dy, dh, *, x_dtype, with_stream, config=None, interpret=False):
    """Cotangents of `add_rms_norm_forward` from dy [N, D] (y's cotangent) and dh [N, D] float32
    (the cotangent of the output h) or None.

    h: [N, D] the normalized input (the forward's h, or x without a residual); r: [N] float32.
    with_stream: also return the cotangent in float32 (the residual's; x's is the same values).

    Returns:
      (dx [N, D] x_dtype, d_residual [N, D] float32 or None, dweight [D] float32).
    """
    t = _Tiling(*h.shape, config)
    inputs = [("h", t.pad(h), t.rows()), ("r", pad_axis_to(r, 0, t.rows_pad, 1.0), t.row_vector()),
              ("w", t.pad(weight.astype(F32)), t.columns()), ("dy", t.pad(dy), t.rows()),
              ("dh", None if dh is None else t.pad(dh), t.rows())]
    outputs = [("dx", jax.ShapeDtypeStruct((t.rows_pad, t.cols_pad), jnp.dtype(x_dtype)), t.rows()),
               ("dw", jax.ShapeDtypeStruct((t.grid[0], t.cols_pad), F32), t.partial())]
    if with_stream:
        outputs.append(("d_stream", jax.ShapeDtypeStruct((t.rows_pad, t.cols_pad), F32), t.rows()))
    out = run_kernel(functools.partial(kernels.backward_body, pieces=t.pieces, width=t.width, n_cols=t.n_cols),
                     grid=t.grid, inputs=inputs, outputs=outputs, name="add_rms_norm_backward",
                     num_warps=t.num_warps, num_stages=1, interpret=interpret)
    d_stream = t.unpad(out["d_stream"]) if with_stream else None
    return t.unpad(out["dx"]), d_stream, jnp.sum(out["dw"], axis=0)[:t.n_cols]
