"""The Mamba-3 mixer's per-position work between in_proj and the chunked core: one kernel each way.

in_proj's last column block `rest` [Bt, T, R] holds, per position (R = 2GN + 3H + S, this order),
B [G, N], C [G, N], dd_dt [H], dd_A [H], trap [H] and the raw angles [S]. The forward kernel reads each
row once and writes the core's operands:

    Kk, Qk = kernel layout of RMSNorm(B)·w_B, RMSNorm(C)·w_C        [Bt, Tp, G, Np], rest's dtype
    ADT, DT, γ, β/α = per_head(dd_dt, dd_A, trap, dt_bias)         [Bt, Tp, H] float32
    angles = float32(raw angles)                                   [Bt, Tp, 1, S]

(the norms as qk_norm.py; `per_head` is given by the caller: the op's formulas, A = min(−φ(dd_A), −A_floor),
DT = softplus(dd_dt + dt_bias), ADT = A·DT, γ = σ(trap)·DT, β/α = DT·(1 − σ(trap))). The backward kernel
takes the cotangents of all of them and writes d rest [Bt, Tp, R] in rest's order (no concatenate),
with per-program float32 partials of the gradients of dt_bias and of both norm weights, which XLA sums in
a fixed order. The per-head backward is `jax.vjp` of `per_head` inside the kernel: the same formulas
(and tie rules) as the XLA path differentiated by JAX.

Rows past the window (T up to whole chunks; `rest` is zero-padded there) give zeros everywhere and add
nothing to the partials, so the padding steps are identity steps with zero input.

Geometry: `fits(geo)` (d_state a power of two >= the config's min_width, S = 0 or a power of two >= 8: every column
piece is exact, no masking). Grid: programs (b, j) over batch rows and row blocks of L' = chunk /
`config.projection_row_splits` rows; each handles its L' rows for every group and head (the work is
per row, so any split gives the same values; the weight-gradient partials are per program). The heads
are one [L', HP] block (HP = H rounded up to a power of two; loads and stores masked past H on the GPU,
zero-padded in the interpreter): a loop over heads of [L] columns strided by R was latency-bound
(93 µs per layer backward on an H100, session 30). Warps: `config.num_warps_projection` forward,
`num_warps_projection_grad` backward.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.common.sizes import next_power_of_2
from pallas_kernels.mamba3_siso.config import ScanGeometry
from pallas_kernels.mamba3_siso.qk_norm import column_pieces, fuses_num_angles, norm_backward, row_scale

PerHead = Callable[..., tuple]   # elementwise: (dd_dt, dd_A, trap, dt_bias) -> (ADT, DT, γ, β/α), float32 [rows, HP] each


def fits_shape(N: int, S: int, config) -> bool:
    """Whether the kernels handle d_state N with S rotated pairs under `config` (a Mamba3ScanConfig): the
    kernel layout must be the raw row permuted, with no padding columns (N a power of two, at least the
    config's min_width; S = 0 or a power of two >= 8)."""
    return N >= config.min_width and N & (N - 1) == 0 and fuses_num_angles(S)


def fits(geo: ScanGeometry) -> bool:
    """Whether the kernels handle this geometry (module docstring)."""
    return fits_shape(geo.d_state, geo.num_angles, geo.config) and geo.padded_state == geo.d_state


def columns(geo: ScanGeometry):
    """First column in `rest` of B, C, dd_dt, dd_A, trap and the angles."""
    G, N, H = geo.groups, geo.d_state, geo.heads
    return dict(B=0, C=G * N, dd_dt=2 * G * N, dd_A=2 * G * N + H, trap=2 * G * N + 2 * H, angles=2 * G * N + 3 * H)


def block_rows(geo: ScanGeometry) -> int:
    """Rows per program: the chunk split into `config.projection_row_splits` blocks."""
    return geo.chunk // geo.config.projection_row_splits


def _cols(piece, offset):
    _, width, raw, stride = piece
    return pl.ds(offset + raw, width, stride) if stride > 1 else pl.ds(offset + raw, width)


def _row_mask(geo: ScanGeometry, seqlen, chunk):
    """[rows] bool, True on the program's rows inside the window, or None when the window is whole chunks
    (no padding rows: they must give zeros, and the per-head formulas of a zero row do not)."""
    rows = block_rows(geo)
    if seqlen % geo.chunk == 0:
        return None
    return chunk * rows + jnp.arange(rows) < seqlen


def _masked(x, rows):
    if rows is None:
        return x
    return jnp.where(rows.reshape(rows.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def _raw_pieces(refs, geo, name, g, rows):
    """The pieces of group g of B or C (kernel-layout order) as float32 [rows, width], masked rows zero."""
    offset = columns(geo)[name] + g * geo.d_state
    return [_masked(refs["rest"][:, _cols(p, offset)].astype(F32), rows) for p in column_pieces(geo)]


def _head_window(ref, start, geo: ScanGeometry):
    """How to reach ref[.., start : start + H] as [.., HP] (HP = H rounded up to a power of two, Triton's
    tensors being powers of two): (index, mask of the first H columns), or (index of exactly H columns,
    None) where no mask is needed (HP = H) or possible (the interpreter, which clamps a window past the
    block's edge and does not mask)."""
    H, HP = geo.heads, next_power_of_2(geo.heads)
    lead = (slice(None),) * (len(ref.shape) - 1)
    if geo.interpret or HP == H:
        return lead + (pl.ds(start, H),), None
    # A traced start: pl.ds's static bounds check does not know the mask, and the window may reach past
    # the block's last column (trap's window when S < HP - H; the [H]-wide outputs). Masked lanes are
    # never accessed.
    start = start + 0 * pl.program_id(0)
    return lead + (pl.ds(start, HP),), (jnp.arange(HP) < H).reshape((1,) * len(lead) + (HP,))


def _load_heads(ref, start, geo: ScanGeometry):
    """ref[.., start : start + H] as float32 [.., HP], zero past H."""
    index, mask = _head_window(ref, start, geo)
    if mask is None:
        return pad_axis_to(ref[index].astype(F32), -1, next_power_of_2(geo.heads))
    return plt.load(ref.at[index], mask=mask, other=0.0).astype(F32)


def _store_heads(ref, start, value, geo: ScanGeometry):
    """ref[.., start : start + H] = value[.., :H] (value [.., HP])."""
    index, mask = _head_window(ref, start, geo)
    value = value.astype(ref.dtype)
    if mask is None:   # the interpreter's [.., HP] value is cut to H; with HP = H nothing is sliced (Triton)
        ref[index] = value if value.shape[-1] == geo.heads else value[..., :geo.heads]
    else:
        plt.store(ref.at[index], value, mask=mask)


def _per_head_inputs(refs, geo):
    """(dd_dt, dd_A, trap, dt_bias) float32 [rows, HP] for every head at once (columns past H zero)."""
    c = columns(geo)
    vals = [_load_heads(refs["rest"], c[k], geo) for k in ("dd_dt", "dd_A", "trap")]
    bias = jnp.zeros_like(vals[0]) + _load_heads(refs["dt_bias"], 0, geo)[None, :]
    return vals + [bias]


def _per_head_masked(per_head, rows):
    def f(*args):
        return tuple(_masked(v, rows) for v in per_head(*args))
    return f


def _forward_body(refs, *, geo: ScanGeometry, seqlen, eps, per_head: PerHead, flat: FlatGrid):
    rows = _row_mask(geo, seqlen, flat.coordinate(pl.program_id(0), 1))
    pieces = column_pieces(geo)
    for name, out_name, w_name in (("B", "Kk", "K_weight"), ("C", "Qk", "Q_weight")):
        for g in range(geo.groups):
            xs = _raw_pieces(refs, geo, name, g, rows)
            r = row_scale(xs, geo.d_state, eps)
            for p, x in zip(pieces, xs):
                w = refs[w_name][_cols(p, 0)].astype(F32)
                refs[out_name][:, g, pl.ds(p[0], p[1])] = (x * r * w[None, :]).astype(refs[out_name].dtype)
    f = _per_head_masked(per_head, rows)
    for out_name, v in zip(("adt", "dt", "gamma", "prev_weight"), f(*_per_head_inputs(refs, geo))):
        _store_heads(refs[out_name], 0, v, geo)
    if geo.num_angles:
        a = refs["rest"][:, pl.ds(columns(geo)["angles"], geo.num_angles)].astype(F32)
        refs["angles"][:, 0, :] = _masked(a, rows)


def _backward_body(refs, *, geo: ScanGeometry, seqlen, eps, per_head: PerHead, flat: FlatGrid):
    rows = _row_mask(geo, seqlen, flat.coordinate(pl.program_id(0), 1))
    pieces, out = column_pieces(geo), refs["d_rest"]
    for name, cot_name, w_name in (("B", "dKk", "K_weight"), ("C", "dQk", "Q_weight")):
        w_total = [None] * len(pieces)
        for g in range(geo.groups):
            xs = _raw_pieces(refs, geo, name, g, rows)
            offset = columns(geo)[name] + g * geo.d_state

            def store(i, dx, dw, offset=offset):
                out[:, _cols(pieces[i], offset)] = dx.astype(out.dtype)
                w_total[i] = dw if w_total[i] is None else w_total[i] + dw

            norm_backward(
                xs, lambda i: _masked(refs[cot_name][:, g, pl.ds(pieces[i][0], pieces[i][1])].astype(F32), rows),
                lambda i: refs[w_name][_cols(pieces[i], 0)].astype(F32), row_scale(xs, geo.d_state, eps),
                geo.d_state, store)
        for p, dw in zip(pieces, w_total):
            refs["d_" + w_name][_cols(p, 0)] = dw
    f = _per_head_masked(per_head, rows)
    c = columns(geo)
    _, pullback = jax.vjp(f, *_per_head_inputs(refs, geo))
    d_dd_dt, d_dd_A, d_trap, d_bias = pullback(
        tuple(_load_heads(refs[k], 0, geo) for k in ("d_adt", "d_dt", "d_gamma", "d_prev_weight")))
    for k, v in (("dd_dt", d_dd_dt), ("dd_A", d_dd_A), ("trap", d_trap)):
        _store_heads(out, c[k], v, geo)
    _store_heads(refs["d_dt_bias"], 0, jnp.sum(d_bias, axis=0), geo)
    if geo.num_angles:
        out[:, pl.ds(c["angles"], geo.num_angles)] = refs["d_angles"][:, 0, :].astype(out.dtype)


def _specs(geo: ScanGeometry, flat: FlatGrid, R):
    b, c = (lambda p: flat.coordinate(p, 0)), (lambda p: flat.coordinate(p, 1))
    L, G, Np, H, N, S = block_rows(geo), geo.groups, geo.padded_state, geo.heads, geo.d_state, geo.num_angles
    return dict(
        rest=pl.BlockSpec((None, L, R), lambda p: (b(p), c(p), 0)),
        layout=pl.BlockSpec((None, L, G, Np), lambda p: (b(p), c(p), 0, 0)),
        heads=pl.BlockSpec((None, L, H), lambda p: (b(p), c(p), 0)),
        angles=pl.BlockSpec((None, L, 1, S), lambda p: (b(p), c(p), 0, 0)),
        head_vector=pl.BlockSpec((H,), lambda p: (0,)),
        state_vector=pl.BlockSpec((N,), lambda p: (0,)),
        head_partial=pl.BlockSpec((None, None, H), lambda p: (b(p), c(p), 0)),
        state_partial=pl.BlockSpec((None, None, N), lambda p: (b(p), c(p), 0)),
    )


def projection_forward(geo: ScanGeometry, rest, dt_bias, K_weight, Q_weight, *, seqlen, eps, per_head: PerHead):
    """(Kk, Qk [Bt, Tp, G, Np] in rest's dtype, ADT, DT, γ, β/α [Bt, Tp, H] float32, angles [Bt, Tp, 1, S]
    float32 or None) from rest [Bt, Tp, R] (zero rows past `seqlen`), dt_bias [H], the norm weights [N]."""
    bsz, Tp, R = rest.shape
    flat = FlatGrid((bsz, Tp // block_rows(geo)))
    sp = _specs(geo, flat, R)
    layout = jax.ShapeDtypeStruct((bsz, Tp, geo.groups, geo.padded_state), rest.dtype)
    heads = jax.ShapeDtypeStruct((bsz, Tp, geo.heads), F32)
    outputs = [("Kk", layout, sp["layout"]), ("Qk", layout, sp["layout"])]
    outputs += [(k, heads, sp["heads"]) for k in ("adt", "dt", "gamma", "prev_weight")]
    if geo.num_angles:
        outputs.append(("angles", jax.ShapeDtypeStruct((bsz, Tp, 1, geo.num_angles), F32), sp["angles"]))
    res = run_kernel(
        functools.partial(_forward_body, geo=geo, seqlen=seqlen, eps=eps, per_head=per_head, flat=flat),
        grid=flat.size,
        inputs=[("rest", rest, sp["rest"]), ("dt_bias", dt_bias, sp["head_vector"]),
                ("K_weight", K_weight, sp["state_vector"]), ("Q_weight", Q_weight, sp["state_vector"])],
        outputs=outputs, name="mamba3_siso_fwd_projection", num_warps=geo.config.num_warps_projection,
        num_stages=geo.config.num_stages, interpret=geo.interpret)
    return (res["Kk"], res["Qk"], res["adt"], res["dt"], res["gamma"], res["prev_weight"], res.get("angles"))


def projection_backward(geo: ScanGeometry, rest, dt_bias, K_weight, Q_weight, cotangents, *, seqlen, eps,
                        per_head: PerHead):
    """(d rest [Bt, Tp, R] in rest's dtype, d dt_bias [H], d K_weight, d Q_weight [N] float32) from the
    cotangents (dKk, dQk, dADT, dDT, dγ, d β/α, d angles or None) of projection_forward's outputs."""
    bsz, Tp, R = rest.shape
    dKk, dQk, d_adt, d_dt, d_gamma, d_pw, d_angles = cotangents
    nc = Tp // block_rows(geo)
    flat = FlatGrid((bsz, nc))
    sp = _specs(geo, flat, R)
    res = run_kernel(
        functools.partial(_backward_body, geo=geo, seqlen=seqlen, eps=eps, per_head=per_head, flat=flat),
        grid=flat.size,
        inputs=[("rest", rest, sp["rest"]), ("dt_bias", dt_bias, sp["head_vector"]),
                ("K_weight", K_weight, sp["state_vector"]), ("Q_weight", Q_weight, sp["state_vector"]),
                ("dKk", dKk, sp["layout"]), ("dQk", dQk, sp["layout"]),
                ("d_adt", d_adt, sp["heads"]), ("d_dt", d_dt, sp["heads"]), ("d_gamma", d_gamma, sp["heads"]),
                ("d_prev_weight", d_pw, sp["heads"]),
                ("d_angles", d_angles if geo.num_angles else None, sp["angles"])],
        outputs=[("d_rest", jax.ShapeDtypeStruct(rest.shape, rest.dtype), sp["rest"]),
                 ("d_dt_bias", jax.ShapeDtypeStruct((bsz, nc, geo.heads), F32), sp["head_partial"]),
                 ("d_K_weight", jax.ShapeDtypeStruct((bsz, nc, geo.d_state), F32), sp["state_partial"]),
                 ("d_Q_weight", jax.ShapeDtypeStruct((bsz, nc, geo.d_state), F32), sp["state_partial"])],
        name="mamba3_siso_bwd_projection", num_warps=geo.config.num_warps_projection_grad,
        num_stages=geo.config.num_stages, interpret=geo.interpret)
    # the programs' partial sums, reduced in a fixed order (deterministic)
    return (res["d_rest"], res["d_dt_bias"].sum(axis=(0, 1)), res["d_K_weight"].sum(axis=(0, 1)),
            res["d_Q_weight"].sum(axis=(0, 1)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def projection(geo: ScanGeometry, rest, dt_bias, K_weight, Q_weight, seqlen, eps, per_head: PerHead):
    """The core's operands from in_proj's rest block, differentiable (module docstring).

    Args:
      geo: the call's ScanGeometry (`fits(geo)` must hold).
      rest: [Bt, Tp, R] (time-padded with zeros), any float dtype (in_proj's compute dtype).
      dt_bias: [H]; K_weight, Q_weight: [N] the B and C norms' weights (float32 masters).
      seqlen: T, the window's true length (static); eps: the norms' epsilon (static);
      per_head: the per-head formulas (static, hashable: a module-level function or a functools.partial).

    Returns:
      (Kk, Qk, ADT, DT, γ, β/α, angles or None), see `projection_forward`.
    """
    if not fits(geo):
        raise ValueError(f"projection: d_state N={geo.d_state} must be a power of two >= min_width "
                         f"({geo.config.min_width}) and num_angles S={geo.num_angles} 0 or a power of two >= 8 (fits)")
    if geo.config.projection_row_splits > geo.chunk:
        raise ValueError(f"Mamba3ScanConfig.projection_row_splits ({geo.config.projection_row_splits}) must be "
                         f"<= the chunk length ({geo.chunk}): each program takes chunk / splits rows")
    return projection_forward(geo, rest, dt_bias.astype(F32), K_weight.astype(F32), Q_weight.astype(F32),
                              seqlen=seqlen, eps=eps, per_head=per_head)


def _fwd(geo, rest, dt_bias, K_weight, Q_weight, seqlen, eps, per_head):
    out = projection(geo, rest, dt_bias, K_weight, Q_weight, seqlen, eps, per_head)
    return out, (rest, dt_bias, K_weight, Q_weight)


def _bwd(geo, seqlen, eps, per_head, residuals, cotangents):
    rest, dt_bias, K_weight, Q_weight = residuals
    d_rest, d_bias, dKw, dQw = projection_backward(
        geo, rest, dt_bias.astype(F32), K_weight.astype(F32), Q_weight.astype(F32),
        cotangents, seqlen=seqlen, eps=eps, per_head=per_head)
    return d_rest, d_bias.astype(dt_bias.dtype), dKw.astype(K_weight.dtype), dQw.astype(Q_weight.dtype)


projection.defvjp(_fwd, _bwd)
