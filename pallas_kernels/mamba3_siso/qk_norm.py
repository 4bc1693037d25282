"""The Mamba-3 B/C RMSNorms fused with the permutation into the kernel layout: one kernel each way.

    Q̂ = RMSNorm(Q)·w_Q,  K̂ = RMSNorm(K)·w_K       over d_state, rounded once to Q's dtype
    (Qk, Kk) = kernel layout of (Q̂, K̂)              [Bt, Tp, G, Np]: even | odd | rest pieces (config.py)

`normalized_kernel_layout(geo, Q, K, Q_weight, K_weight, eps)` replaces, in the scan's Pallas path,
the model's two RMSNorms (a row reduction and an elementwise pass each), `to_kernel_layout`'s slices
and concatenates of both, and backward `from_kernel_layout`'s splits, pads and adds, the norms' row
sums and the weights' column sums, by one read of Q, K and one write of Qk, Kk forward, and one read
of Q, K, dQk, dKk and one write of dQ, dK (plus a [programs, N] float32 partial of each weight's
gradient, summed by XLA in a fixed order) backward.

Per row (float32, the reference's formulas, jmamba/ops/norms/reference.py):
  forward   r = 1/√(Σ_n x_n²/N + eps),   y = (x·r)·w
  backward  x̂ = x·r, g = dy·w,  dx = r·(g − x̂·(Σ_n g_n·x̂_n / N)),  dw partial = Σ_rows dy·x̂
Only the order of the row sums differs from the reference (over the kernel-layout pieces); r is
recomputed backward, not saved.

The kernel reads a row's d_state dims in the kernel layout's order directly: the even and odd pieces
are stride-2 loads (and stores, backward) of the raw row, the rest pieces contiguous ones (past N they
read the zero padding of `raw_width`). `fuses_num_angles(S)` says which geometries it handles.

Grid: programs (b, c, g) over batch rows, chunks of the padded time axis and groups (common/grid.py);
each normalizes the chunk's [L, N] rows of Q and of K. The time padding rows are zeros (normalized to
zeros: x = 0 gives y = 0, dw = 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.mamba3_siso.config import ScanGeometry

# Triton warps per program. Backward holds x̂, g and dy of a [chunk, d_state] block in registers:
# with 4 warps that is 255 registers a thread at the benchmark shape (Triton 3.6 for sm_90a, no spill);
# 8 warps halve it.
NUM_WARPS_FORWARD = 4
NUM_WARPS_BACKWARD = 8


def fuses_num_angles(S: int) -> bool:
    """Whether the kernels handle S rotated pairs: the even / odd pieces must have no padding columns
    (S = 0, or S a power of two >= 8, so that Sp = S; the interpreter the CPU tests run cannot mask
    strided loads and stores). Otherwise the op's glue normalizes with `rms_norm` first."""
    return S == 0 or (S >= 8 and S & (S - 1) == 0)


def column_pieces(geo: ScanGeometry):
    """(kernel-layout start, width, raw start, raw stride) of each piece of the layout."""
    S, Sp = geo.num_angles, geo.angle_width
    out = []
    for name, start, width in geo.pieces:
        if name in ("even", "odd"):
            out.append((start, width, 0 if name == "even" else 1, 2))
        else:
            out.append((start, width, 2 * S + (start - 2 * Sp), 1))
    return tuple(out)


def raw_width(geo: ScanGeometry):
    """Columns of the raw rows the pieces reach (>= N): Q, K and the weights are zero-padded to it (no
    padding at the benchmark shape, N = 128 with S = 32); zero columns add nothing to the sums, and
    what the backward writes there is cut off."""
    return max([geo.d_state] + [raw + stride * (width - 1) + 1 for _, width, raw, stride in column_pieces(geo)])


def _cols(piece):
    _, width, raw, stride = piece
    return pl.ds(raw, width, stride) if stride > 1 else pl.ds(raw, width)


def row_scale(xs, n, eps):
    """r = 1/√(Σ x²/n + eps) [L, 1] of a row split into float32 column pieces xs [L, width] (n the true
    column count: padding columns are zeros)."""
    total = None
    for x in xs:
        part = jnp.sum(x * x, axis=1)
        total = part if total is None else total + part
    return jax.lax.rsqrt(total / n + eps)[:, None]


def norm_backward(xs, load_dy, load_w, r, n, store):
    """The backward of y = (x·r)·w over the float32 pieces of x [L, width]: dy and w of piece i come from
    load_dy(i) [L, width] and load_w(i) [width] as the walk reaches them, and store(i, dx, dw partial)
    takes each piece's results at once (fewer live registers than whole lists): x̂ = x·r, g = dy·w,
    dx = r·(g − x̂·Σ g·x̂ / n), dw = Σ_rows dy·x̂ (the reference's formulas)."""
    xhats, gs, dys, total = [], [], [], None
    for i, x in enumerate(xs):
        xhat = x * r
        dy = load_dy(i)
        g = dy * load_w(i)[None, :]
        part = jnp.sum(g * xhat, axis=1)
        total = part if total is None else total + part
        xhats.append(xhat), gs.append(g), dys.append(dy)
    mean = (total / n)[:, None]
    for i, (xhat, g, dy) in enumerate(zip(xhats, gs, dys)):
        store(i, r * (g - xhat * mean), jnp.sum(dy * xhat, axis=0))


def _forward_body(refs, *, pieces, n, eps):
    for name in ("Q", "K"):
        xs = [refs[name][:, _cols(p)].astype(F32) for p in pieces]
        r = row_scale(xs, n, eps)
        out = refs[name + "k"]
        for p, x in zip(pieces, xs):
            w = refs[name + "_weight"][_cols(p)].astype(F32)
            out[:, pl.ds(p[0], p[1])] = (x * r * w[None, :]).astype(out.dtype)


def _backward_body(refs, *, pieces, n, eps):
    for name in ("Q", "K"):
        xs = [refs[name][:, _cols(p)].astype(F32) for p in pieces]

        def store(i, dx, dw, name=name):
            refs["d" + name][:, _cols(pieces[i])] = dx.astype(refs["d" + name].dtype)
            refs["d" + name + "_weight"][_cols(pieces[i])] = dw

        norm_backward(xs, lambda i: refs["d" + name + "k"][:, pl.ds(pieces[i][0], pieces[i][1])].astype(F32),
                      lambda i: refs[name + "_weight"][_cols(pieces[i])].astype(F32), row_scale(xs, n, eps), n, store)


def _grid(geo: ScanGeometry, groups):
    return FlatGrid((geo.batch, geo.n_chunks, groups))


def _rows(grid: FlatGrid, L, width):
    """[Bt, Tp, G, width]: the program's [L, width] rows of its group."""
    return pl.BlockSpec((None, L, None, width),
                        lambda p: (grid.coordinate(p, 0), grid.coordinate(p, 1), grid.coordinate(p, 2), 0))


def _partials(grid: FlatGrid, width):
    """[Bt, nc, G, width]: the program's [width] row."""
    return pl.BlockSpec((None, None, None, width),
                        lambda p: (grid.coordinate(p, 0), grid.coordinate(p, 1), grid.coordinate(p, 2), 0))


def _vector(width):
    return pl.BlockSpec((width,), lambda p: (0,))


def normalized_kernel_layout_forward(geo: ScanGeometry, Q, K, Q_weight, K_weight, eps):
    """(Qk, Kk) [Bt, Tp, G, Np] in Q's and K's dtypes from Q, K [Bt, Tp, G, N] and the weights [N] (module docstring)."""
    bsz, Tp, G, N = Q.shape
    grid, L, Np = _grid(geo, G), geo.chunk, geo.padded_state
    Q, K, Q_weight, K_weight, Nr = _padded(geo, Q, K, Q_weight, K_weight)
    res = run_kernel(
        functools.partial(_forward_body, pieces=column_pieces(geo), n=N, eps=eps), grid=grid.size,
        inputs=[("Q", Q, _rows(grid, L, Nr)), ("K", K, _rows(grid, L, Nr)),
                ("Q_weight", Q_weight, _vector(Nr)), ("K_weight", K_weight, _vector(Nr))],
        outputs=[("Qk", jax.ShapeDtypeStruct((bsz, Tp, G, Np), Q.dtype), _rows(grid, L, Np)),
                 ("Kk", jax.ShapeDtypeStruct((bsz, Tp, G, Np), K.dtype), _rows(grid, L, Np))],
        name="mamba3_siso_fwd_qk_norm", num_warps=NUM_WARPS_FORWARD, num_stages=geo.config.num_stages,
        interpret=geo.interpret)
    return res["Qk"], res["Kk"]


def normalized_kernel_layout_backward(geo: ScanGeometry, Q, K, Q_weight, K_weight, eps, dQk, dKk):
    """(dQ, dK [Bt, Tp, G, N] in Q's and K's dtypes, dQ_weight, dK_weight [N] float32)."""
    bsz, Tp, G, N = Q.shape
    grid, L, Np = _grid(geo, G), geo.chunk, geo.padded_state
    Q, K, Q_weight, K_weight, Nr = _padded(geo, Q, K, Q_weight, K_weight)
    partial = jax.ShapeDtypeStruct((bsz, geo.n_chunks, G, Nr), F32)
    res = run_kernel(
        functools.partial(_backward_body, pieces=column_pieces(geo), n=N, eps=eps), grid=grid.size,
        inputs=[("Q", Q, _rows(grid, L, Nr)), ("K", K, _rows(grid, L, Nr)),
                ("Q_weight", Q_weight, _vector(Nr)), ("K_weight", K_weight, _vector(Nr)),
                ("dQk", dQk, _rows(grid, L, Np)), ("dKk", dKk, _rows(grid, L, Np))],
        outputs=[("dQ", jax.ShapeDtypeStruct(Q.shape, Q.dtype), _rows(grid, L, Nr)),
                 ("dK", jax.ShapeDtypeStruct(K.shape, K.dtype), _rows(grid, L, Nr)),
                 ("dQ_weight", partial, _partials(grid, Nr)), ("dK_weight", partial, _partials(grid, Nr))],
        name="mamba3_siso_bwd_qk_norm", num_warps=NUM_WARPS_BACKWARD, num_stages=geo.config.num_stages,
        interpret=geo.interpret)
    # the programs' partial sums, reduced in a fixed order (deterministic); the raw padding cut off
    return (res["dQ"][..., :N], res["dK"][..., :N], res["dQ_weight"].sum(axis=(0, 1, 2))[:N],
            res["dK_weight"].sum(axis=(0, 1, 2))[:N])


def _padded(geo, Q, K, Q_weight, K_weight):
    """Q, K, the weights zero-padded along d_state to raw_width(geo), and that width."""
    Nr = raw_width(geo)
    if Nr == geo.d_state:
        return Q, K, Q_weight, K_weight, Nr
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Nr - geo.d_state)])
    return pad(Q), pad(K), pad(Q_weight), pad(K_weight), Nr


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def normalized_kernel_layout(geo: ScanGeometry, Q, K, Q_weight, K_weight, eps):
    """(Qk, Kk) [Bt, Tp, G, Np] in Q's and K's dtypes: RMSNorm(Q)·Q_weight and RMSNorm(K)·K_weight over d_state,
    in the kernel layout (module docstring).

    Args:
      geo: the call's ScanGeometry (chunk, d_state, angle and padded widths, config, interpret flag).
      Q, K: [Bt, Tp, G, N] raw (pre-norm) rows, time-padded with zeros, any float dtype (16-bit in
        the model); Q_weight, K_weight: [N] float32 norm weights.
      eps: the norms' epsilon (a Python float).
    """
    if not fuses_num_angles(geo.num_angles):
        raise ValueError(f"normalized_kernel_layout: num_angles S={geo.num_angles} must be 0 or a power of two "
                         f">= 8 (fuses_num_angles)")
    return normalized_kernel_layout_forward(geo, Q, K, Q_weight.astype(F32), K_weight.astype(F32), eps)


def _fwd(geo, Q, K, Q_weight, K_weight, eps):
    return normalized_kernel_layout(geo, Q, K, Q_weight, K_weight, eps), (Q, K, Q_weight, K_weight)


def _bwd(geo, eps, residuals, cotangents):
    Q, K, Q_weight, K_weight = residuals
    dQk, dKk = cotangents
    dQ, dK, dQw, dKw = normalized_kernel_layout_backward(geo, Q, K, Q_weight.astype(F32), K_weight.astype(F32),
                                                         eps, dQk, dKk)
    return dQ, dK, dQw.astype(Q_weight.dtype), dKw.astype(K_weight.dtype)


normalized_kernel_layout.defvjp(_fwd, _bwd)
