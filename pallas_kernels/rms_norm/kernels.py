"""The two kernel bodies of the add + RMSNorm (Triton via Pallas; CPU via the interpreter).

Per program: `block_rows` rows, all columns, read as `pieces` column pieces of `width` (config.py).
With D the true feature count (columns past it are zero padding, neutral in every sum):

  forward   h = residual + x                     (float32; h = x without a residual)
            r = 1 / √(Σ_c h_c² / D + eps)         per row
            y = (h·r)·w                           rounded once to y's dtype
  backward  x̂ = h·r,  g = dy·w
            dn = r·(g − x̂·(Σ_c g_c·x̂_c / D))      the norm's cotangent of h
            d  = dh + dn                           (dh: the incoming cotangent of the output h, if any)
            written as float32 (the stream's cotangent) and in x's dtype; dw partial = Σ_rows dy·x̂

Everything is float32, in the reference's order (jmamba/ops/norms/reference.py) up to the order
of the row and column sums. The pieces of h (and of g, x̂ in the backward) stay in registers between
the row sum and the outputs: one HBM read of every operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32


def forward_body(refs, *, pieces, width, n_cols, eps):
    """y, r (and h with a residual) of the program's rows."""
    hs, total = [], None
    for j in range(pieces):
        cols = pl.ds(j * width, width)
        h = refs["x"][:, cols].astype(F32)
        if "residual" in refs:
            h = refs["residual"][:, cols].astype(F32) + h
            refs["h"][:, cols] = h.astype(refs["h"].dtype)
        part = jnp.sum(h * h, axis=1)
        total = part if total is None else total + part
        hs.append(h)
    r = jax.lax.rsqrt(total / n_cols + eps)                              # [rows]
    refs["r"][...] = r
    for j, h in enumerate(hs):
        cols = pl.ds(j * width, width)
        w = refs["w"][cols].astype(F32)
        refs["y"][:, cols] = (h * r[:, None] * w[None, :]).astype(refs["y"].dtype)


def backward_body(refs, *, pieces, width, n_cols):
    """The stream's cotangent (float32 and x's dtype) and the program's dw partial."""
    r = refs["r"][...]                                                   # [rows]
    xhats, gs, dys, total = [], [], [], None
    for j in range(pieces):
        cols = pl.ds(j * width, width)
        xhat = refs["h"][:, cols].astype(F32) * r[:, None]
        dy = refs["dy"][:, cols].astype(F32)
        g = dy * refs["w"][cols].astype(F32)[None, :]
        part = jnp.sum(g * xhat, axis=1)
        total = part if total is None else total + part
        xhats.append(xhat), gs.append(g), dys.append(dy)
    mean = total / n_cols
    for j in range(pieces):
        cols = pl.ds(j * width, width)
        d = r[:, None] * (gs[j] - xhats[j] * mean[:, None])
        if "dh" in refs:
            d = refs["dh"][:, cols].astype(F32) + d
        if "d_stream" in refs:
            refs["d_stream"][:, cols] = d
        refs["dx"][:, cols] = d.astype(refs["dx"].dtype)
        refs["dw"][cols] = jnp.sum(dys[j] * xhats[j], axis=0)
