"""`selective_scan`: the Mamba-1 selective-scan op (semantics of the official `selective_scan_fn`).

Per batch row b, channel e and state index n (channels-last layout):

    δ_t   = softplus_thr(delta_t + delta_bias)       (or delta_t + delta_bias without softplus)
    h_t   = exp(δ_t[e]·A[e, n]) · h_{t-1} + δ_t[e] · B_t[g(e), n] · u_t[e],   h_{-1} = initial_state
    y_t   = Σ_n h_t[e, n] · C_t[g(e), n] + D[e] · u_t[e]
    out_t = y_t · silu(z_t[e])                       (when z is given)

with g(e) = e // (d / groups). The state and all accumulation are float32 whatever the input
dtype; `out` has `u.dtype`, the final state is float32. Every array argument, `initial_state`
included, is differentiable.
"""

from __future__ import annotations

from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.selective_scan.common import reset_from_row_mask
from jmamba.ops.validation import check_array, check_bool_mask, check_float, shape_of

OP = "selective_scan"


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_final_state=False, implementation=None, *, reset=None):
    """Selective scan (S6), channels-last.

    Args:
      u: [Bt, T, d] input (f32 / bf16 / f16).
      delta: [Bt, T, d] time step before bias and softplus.
      A: [d, n] state matrix (negative; float32 recommended).
      B, C: [Bt, T, n] or [Bt, T, g, n] input-dependent projections (g divides d).
      D: optional [d] skip connection.
      z: optional [Bt, T, d] gate; the output is multiplied by silu(z).
      delta_bias: optional [d] added to delta before the softplus.
      delta_softplus: apply softplus (threshold 20) to delta + delta_bias.
      initial_state: optional [Bt, d, n] state h_{-1} (zeros when None).
      return_final_state: also return h_{T-1} [Bt, d, n] float32.
      implementation: None (automatic), "reference", "xla" or "pallas".
      reset: optional [Bt] or [Bt, T] bool mask; True zeroes the state entering that row (at that
        position); a [Bt] mask acts at t = 0. (jmamba extension, used for document boundaries.)

    Returns:
      out [Bt, T, d] in u.dtype, or (out, final_state) when return_final_state.
    """
    check_array("u", u, (None, None, None), "[batch, seqlen, d]")
    bsz, seqlen, d = shape_of(u)
    check_array("delta", delta, (bsz, seqlen, d), "[batch, seqlen, d] like u")
    check_array("A", A, (d, None), "[d, n]")
    n = shape_of(A)[1]
    B = _groups("B", B, bsz, seqlen, d, n)
    C = _groups("C", C, bsz, seqlen, d, n)
    if shape_of(B)[2] != shape_of(C)[2]:
        raise ValueError(f"B and C must have the same number of groups, got {shape_of(B)[2]} and {shape_of(C)[2]}")
    if D is not None:
        check_array("D", D, (d,), "[d]")
    if z is not None:
        check_array("z", z, (bsz, seqlen, d), "[batch, seqlen, d] like u")
    if delta_bias is not None:
        check_array("delta_bias", delta_bias, (d,), "[d]")
    if initial_state is not None:
        check_array("initial_state", initial_state, (bsz, d, n), "[batch, d, n]")
    if reset is not None:
        check_bool_mask("reset", reset, [(bsz,), (bsz, seqlen)], "[batch] or [batch, seqlen]")
        reset = reset_from_row_mask(reset, bsz, seqlen)
    if not isinstance(delta_softplus, bool):
        raise TypeError(f"delta_softplus must be a bool, got {type(delta_softplus).__name__}")

    impl = dispatch.choose(OP, implementation, u=u, A=A, B=B, initial_state=initial_state, reset=reset)
    # batch-sharded under a data-parallel mesh: u delta | A | B C | D | z | delta_bias | state reset
    out, final_state = call_batch_sharded(
        impl.fn, (u, delta, A, B, C, D, z, delta_bias, initial_state, reset),
        (True, True, False, True, True, False, True, False, True, True), delta_softplus=delta_softplus)
    return (out, final_state) if return_final_state else out


def _groups(name, x, bsz, seqlen, d, n):
    check_float(name, x)
    s = shape_of(x)
    if len(s) == 3:
        check_array(name, x, (bsz, seqlen, n), "[batch, seqlen, n]")
        return x[:, :, None, :]
    check_array(name, x, (bsz, seqlen, None, n), "[batch, seqlen, n] or [batch, seqlen, groups, n]")
    g = s[2]
    if g < 1 or d % g:
        raise ValueError(f"{name}: the number of groups ({g}) must divide d ({d})")
    return x


def _always(**_):
    return None


def _load_reference():
    from jmamba.ops.selective_scan.reference import selective_scan_reference
    return dispatch.Implementation(selective_scan_reference, _always)


def _load_xla():
    from jmamba.ops.selective_scan.xla import selective_scan_xla
    return dispatch.Implementation(selective_scan_xla, _always)


dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)


def _load_pallas():
    from jmamba.ops.selective_scan.pallas import implementation
    return implementation()


dispatch.register(OP, "pallas", _load_pallas)
