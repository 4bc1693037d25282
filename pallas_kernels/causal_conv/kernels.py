"""The two kernel bodies of the causal conv + SiLU (Triton via Pallas; CPU via the interpreter).

Notation (per program: batch row b, positions [t0, t0 + block_t), channels [e0, e0 + block_e)):
K = d_conv taps, j = K-1-k the look-back of tap k, H the halo (power of two >= K-1) and
  c_t = Σ_k w[k]·m(t, j)·x̃[t - j] + bias,   u_t = silu(c_t) = c_t·σ(c_t)
where x̃[p] is x[p] for p >= 0 and the carried conv state for p < 0, and m(t, j) = (j <= dist_t)
is the reset mask (dist_t = positions since the latest reset at or before t; no mask without
resets). The backward, with g_t = du_a[t] + du_b[t] (the two cotangents of u, summed in float32):
  dc_t = g_t·σ_t + (c_t·g_t)·(σ_t·(1 - σ_t))        (0 at padding positions t >= T)
  dx[t] = Σ_k w[k]·m(t + j, j)·dc[t + j]             (needs dc of the next K-1 positions: the halo)
  dw[k] = Σ_t m(t, j)·dc_t·x̃[t - j],   db = Σ_t dc_t  (per program; the caller sums the partials)
  dstate[s] = Σ_k w[k]·m(p + j, j)·dc[p + j] for the state position p = s - (K-1) (program t0 = 0),
and with `d_new` (the cotangent of the new conv state, x's last K-1 rows) added to dx at positions
T-(K-1) .. T-1 before the taps (the reference's order).
Everything is float32; rows are loaded one by one at static indices (no value slicing, which the
Triton lowering does not support), so a program's loads are all issued before its arithmetic.
`km` (a `KernelMath`) gives the sigmoid and the multiply-adds: exact forms by default, the hardware
ex2 / rcp and one-rounding fma with ConvBlockConfig.fast_math / fused_multiply_add on the GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32


def _x_rows(refs, first, *, halo, block_t, future):
    """x̃ rows at positions t0 - halo .. t0 + block_t (+ halo with `future`) - 1, float32 (`first`:
    this is the sequence's first block, whose past rows are the carried state)."""
    rows = [jnp.where(first, refs["state"][i].astype(F32), refs["past"][i].astype(F32)) for i in range(halo)]
    rows += [refs["x"][i].astype(F32) for i in range(block_t)]
    if future:
        rows += [refs["future"][i].astype(F32) for i in range(halo)]
    return rows


def _dist(refs, r, block_t):
    """dist at the program's position t0 + r (r may reach into the next block's halo)."""
    return refs["dist"][r] if r < block_t else refs["dist_future"][r - block_t]


def _conv_at(rows, w, bias, refs, r, *, k_size, halo, block_t, has_reset, km):
    """c at position t0 + r from the x̃ rows (k = 0 first, then the bias: the reference's order)."""
    c = None
    d = _dist(refs, r, block_t) if has_reset else None
    for k in range(k_size):
        j = k_size - 1 - k
        row = rows[halo + r - j]
        if has_reset and j > 0:
            row = jnp.where(j <= d, row, 0.0)     # w·0 = 0: the same as masking the product
        c = w[k] * row if c is None else km.fma(w[k], row, c)
    return c + bias


def forward_body(refs, *, k_size, halo, block_t, has_reset, km):
    """u rows of the program's block (module docstring)."""
    w = [refs["w"][k].astype(F32) for k in range(k_size)]
    bias = refs["bias"][...].astype(F32)
    rows = _x_rows(refs, pl.program_id(1) == 0, halo=halo, block_t=block_t, future=False)
    for i in range(block_t):
        c = _conv_at(rows, w, bias, refs, i, k_size=k_size, halo=halo, block_t=block_t, has_reset=has_reset,
                     km=km)
        refs["u"][i] = (c * km.sigmoid(c)).astype(refs["u"].dtype)


def backward_body(refs, *, k_size, halo, block_t, seqlen, has_reset, conv_blocks, km, conv_backward=None):
    """dx, the dw / db partials and (first block) dstate of the program's block; programs whose
    channel block index is >= `conv_blocks` copy their block of dz into the packed cotangent.
    `conv_backward` does the conv part (default: this module's; rows_loop.py passes its loop)."""
    t, e = pl.program_id(1), pl.program_id(2)     # (read here: program_id inside pl.when does not interpret)
    conv_backward = conv_backward or _conv_backward

    if "dz" in refs:
        @pl.when(e >= conv_blocks)
        def _():
            refs["dx"][...] = refs["dz"][...].astype(refs["dx"].dtype)

    @pl.when(e < conv_blocks)
    def _():
        conv_backward(refs, t, k_size=k_size, halo=halo, block_t=block_t, seqlen=seqlen, has_reset=has_reset,
                      km=km)


def state_cotangent(refs, masked_at, w, zero, *, k_size, halo, km):
    """The carried state's cotangent rows (first block only): state row s sits at position
    p = s - (K-1) < 0, and tap k reads it from position p + j >= 0; `masked_at(r, j)` = m(r, j)·dc[r]."""
    for row in range(halo):
        s_idx = row - (halo - (k_size - 1))      # state row held in this (front-padded) row
        acc = zero
        if s_idx >= 0:
            p = s_idx - (k_size - 1)            # its position (< 0)
            for k in range(k_size):
                j = k_size - 1 - k
                if p + j >= 0:                  # p + j <= K-2 < block_t always
                    acc = km.fma(w[k], masked_at(p + j, j), acc)
        refs["d_state"][row] = acc


def _conv_backward(refs, t, *, k_size, halo, block_t, seqlen, has_reset, km):
    t0 = t * block_t
    w = [refs["w"][k].astype(F32) for k in range(k_size)]
    bias = refs["bias"][...].astype(F32)
    rows = _x_rows(refs, t == 0, halo=halo, block_t=block_t, future=True)

    def g_at(r):
        if r < block_t:
            return refs["du_a"][r].astype(F32) + refs["du_b"][r].astype(F32)
        return refs["du_a_future"][r - block_t].astype(F32) + refs["du_b_future"][r - block_t].astype(F32)

    dc = []
    for r in range(block_t + k_size - 1):       # this block and the first K-1 positions after it
        c = _conv_at(rows, w, bias, refs, r, k_size=k_size, halo=halo, block_t=block_t, has_reset=has_reset,
                     km=km)
        g = g_at(r)
        s = km.sigmoid(c)
        d = km.fma(g, s, (c * g) * (s * (1.0 - s)))
        dc.append(jnp.where(t0 + r < seqlen, d, 0.0))

    def masked(r, j):
        """m(t0 + r, j)·dc[r]."""
        if not has_reset or j == 0:
            return dc[r]
        return jnp.where(j <= _dist(refs, r, block_t), dc[r], 0.0)

    def dx_row(i, tail_row=None):
        acc = None if tail_row is None else refs["d_new"][tail_row]   # the new state's cotangent first
        for k in range(k_size):
            j = k_size - 1 - k
            acc = w[k] * masked(i + j, j) if acc is None else km.fma(w[k], masked(i + j, j), acc)
        return acc.astype(refs["dx"].dtype)

    # The new conv state is x's last K-1 rows: their cotangent (d_new, [halo, block_e] with row s for
    # position T-(K-1)+s) adds to dx there. Those rows lie in at most two blocks, known statically.
    tail_start = seqlen - (k_size - 1)
    tail = {}
    if "d_new" in refs:
        for s_row in range(k_size - 1):
            blk, i = divmod(tail_start + s_row, block_t)
            tail.setdefault(blk, {})[i] = s_row
    plain = None
    for blk in tail:
        plain = (t != blk) if plain is None else jnp.logical_and(plain, t != blk)

    def store_rows(rows_with_tail):
        for i in range(block_t):
            refs["dx"][i] = dx_row(i, rows_with_tail.get(i))

    if plain is None:
        store_rows({})
    else:
        pl.when(plain)(lambda: store_rows({}))
        for blk, rows_with_tail in tail.items():
            pl.when(t == blk)(lambda r=rows_with_tail: store_rows(r))

    for k in range(k_size):
        j = k_size - 1 - k
        acc = None
        for i in range(block_t):
            acc = masked(i, j) * rows[halo + i - j] if acc is None else km.fma(masked(i, j), rows[halo + i - j], acc)
        refs["dw"][k] = acc
    db = dc[0]
    for i in range(1, block_t):
        db = db + dc[i]
    refs["db"][...] = db

    @pl.when(t == 0)
    def _():
        state_cotangent(refs, masked, w, jnp.zeros_like(bias), k_size=k_size, halo=halo, km=km)
