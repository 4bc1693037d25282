"""The causal conv + SiLU kernel bodies as a loop over the block's positions (ConvBlockConfig.loop_rows).

Same math, notation and rounding as kernels.py (whose bodies load every row of the block before any
arithmetic: the backward then holds ~40 rows of each operand and compiles to 255 registers at one
warp per program). Here a `fori_loop` walks the positions t0 .. t0 + block_t - 1 carrying only a
window of the last K-1 rows: x̃ rows, dc values and reset distances, plus the dw / db accumulators,
so a program needs few registers and more of them fit on an SM. The next position's rows are loaded
one iteration ahead (carried), so their latency overlaps the current position's arithmetic.

Backward order per position r (t = t0 + r): c_r from the x̃ window, dc_r from both cotangents;
dw[k] += m(r, j)·dc_r·x̃[r - j], db += dc_r; then dx at i = r - (K-1), the first position whose taps
are all known: dx[i] = Σ_k w[k]·m(i + j, j)·dc[i + j] (+ the new state's cotangent first at the last
K-1 positions of the sequence). The K-1 positions after the block (its future halo) finish the last
dx rows outside the loop; the first block's dc[0 .. K-2] give the carried state's cotangent.
Every sum adds its terms in the order of kernels.py, so both variants agree to rounding (the
compiler may contract or schedule the two programs' float32 ops differently: ~1e-7 relative in the
interpreter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.causal_conv import kernels
from pallas_kernels.common.dtypes import F32, I32


def _past_rows(refs, first, k_size, halo):
    """x̃ at positions t0 - (K-1) .. t0 - 1 (oldest first), float32."""
    return [jnp.where(first, refs["state"][halo - (k_size - 1) + q].astype(F32),
                      refs["past"][halo - (k_size - 1) + q].astype(F32)) for q in range(k_size - 1)]


def _conv(window, x_r, w, bias, d_r, k_size, has_reset, km):
    """c at a position from its x̃ window (K-1 older rows, oldest first) and its own row x_r."""
    rows = list(window) + [x_r]
    c = None
    for k in range(k_size):
        j = k_size - 1 - k
        row = rows[k]
        if has_reset and j > 0:
            row = jnp.where(j <= d_r, row, 0.0)
        c = w[k] * row if c is None else km.fma(w[k], row, c)
    return c + bias


def forward_body(refs, *, k_size, halo, block_t, has_reset, km):
    """u rows of the program's block (kernels.forward_body, one position per loop iteration)."""
    w = [refs["w"][k].astype(F32) for k in range(k_size)]
    bias = refs["bias"][...].astype(F32)
    window = tuple(_past_rows(refs, pl.program_id(1) == 0, k_size, halo))

    def step(r, carry):
        window, x_r = carry
        x_next = refs["x"][jnp.minimum(r + 1, block_t - 1)].astype(F32)
        d_r = refs["dist"][r] if has_reset else None
        c = _conv(window, x_r, w, bias, d_r, k_size, has_reset, km)
        refs["u"][r] = (c * km.sigmoid(c)).astype(refs["u"].dtype)
        return (window[1:] + (x_r,) if k_size > 1 else window), x_next

    jax.lax.fori_loop(0, block_t, step, (window, refs["x"][0].astype(F32)))


def backward_body(refs, **kw):
    """kernels.backward_body with the conv part as a loop over positions."""
    kernels.backward_body(refs, conv_backward=_conv_backward, **kw)


def _conv_backward(refs, t, *, k_size, halo, block_t, seqlen, has_reset, km):
    t0 = t * block_t
    km1 = k_size - 1
    w = [refs["w"][k].astype(F32) for k in range(k_size)]
    bias = refs["bias"][...].astype(F32)
    zero = jnp.zeros_like(bias)
    tail_start = seqlen - km1          # the new state's rows: positions tail_start .. seqlen - 1
    d_new = [refs["d_new"][s] for s in range(km1)] if "d_new" in refs else None

    def rows_at(r):
        """(x̃, g = du_a + du_b, dist) at block position r (0 <= r < block_t)."""
        g = refs["du_a"][r].astype(F32) + refs["du_b"][r].astype(F32)
        return refs["x"][r].astype(F32), g, (refs["dist"][r] if has_reset else None)

    def future_at(q):
        """The same at block position block_t + q (the future halo, 0 <= q < K-1)."""
        g = refs["du_a_future"][q].astype(F32) + refs["du_b_future"][q].astype(F32)
        return refs["future"][q].astype(F32), g, (refs["dist_future"][q] if has_reset else None)

    def d_c(window, x_r, g, d_r, pos):
        c = _conv(window, x_r, w, bias, d_r, k_size, has_reset, km)
        s = km.sigmoid(c)
        return jnp.where(pos < seqlen, km.fma(g, s, (c * g) * (s * (1.0 - s))), 0.0)

    def masked(dc, dist, j):
        return dc if (not has_reset or j == 0) else jnp.where(j <= dist, dc, 0.0)

    def dx_row(i_pos, dcs, dists):
        """dx at position i_pos from dc / dist at i_pos .. i_pos + K-1 (lists, oldest first)."""
        acc = None
        if d_new is not None:
            for s in range(km1):
                v = jnp.where(i_pos == tail_start + s, d_new[s], 0.0)
                acc = v if acc is None else acc + v
        for k in range(k_size):
            j = km1 - k
            term = masked(dcs[j], dists[j] if has_reset else None, j)
            acc = w[k] * term if acc is None else km.fma(w[k], term, acc)
        return acc

    first = t == 0
    x_win = tuple(_past_rows(refs, first, k_size, halo))
    dc_win = tuple(zero for _ in range(km1))                   # dc at r-K+1 .. r-1 (before r = 0: unused)
    dist_win = tuple(jnp.zeros((), I32) for _ in range(km1)) if has_reset else ()
    head = tuple(zero for _ in range(km1))                     # dc[0 .. K-2] (the state's cotangent)

    def step(r, carry):
        x_win, dc_win, dist_win, head, dw, db, nxt = carry
        x_r, g, d_r = nxt
        nxt = rows_at(jnp.minimum(r + 1, block_t - 1))
        dc = d_c(x_win, x_r, g, d_r, t0 + r)
        dw = tuple(km.fma(masked(dc, d_r, km1 - k), (list(x_win) + [x_r])[k], dw[k]) for k in range(k_size))
        db = db + dc
        head = tuple(jnp.where(r == q, dc, head[q]) for q in range(km1))
        dcs = list(dc_win) + [dc]
        dists = (list(dist_win) + [d_r]) if has_reset else None

        @pl.when(r >= km1)
        def _():
            refs["dx"][r - km1] = dx_row(t0 + r - km1, dcs, dists).astype(refs["dx"].dtype)

        return (x_win[1:] + (x_r,) if km1 else x_win, tuple(dcs[1:]), tuple(dists[1:]) if has_reset else (),
                head, dw, db, nxt)

    dw0 = tuple(zero for _ in range(k_size))
    x_win, dc_win, dist_win, head, dw, db, _ = jax.lax.fori_loop(
        0, block_t, step, (x_win, dc_win, dist_win, head, dw0, zero, rows_at(0)))
    # The future halo: dc at block_t .. block_t + K-2 finishes dx at block_t - K+1 .. block_t - 1.
    dcs, dists = list(dc_win), list(dist_win)
    for q in range(km1):
        x_r, g, d_r = future_at(q)
        dc = d_c(x_win, x_r, g, d_r, t0 + block_t + q)
        dcs.append(dc)
        if has_reset:
            dists.append(d_r)
        x_win = x_win[1:] + (x_r,)
    for i in range(block_t - km1, block_t):
        o = i - (block_t - km1)
        refs["dx"][i] = dx_row(t0 + i, dcs[o:o + k_size], dists[o:o + k_size] if has_reset else None
                               ).astype(refs["dx"].dtype)
    for k in range(k_size):
        refs["dw"][k] = dw[k]
    refs["db"][...] = db

    @pl.when(first)
    def _():
        kernels.state_cotangent(refs, lambda r, j: masked(head[r], refs["dist"][r] if has_reset else None, j),
                                w, zero, k_size=k_size, halo=halo, km=km)
