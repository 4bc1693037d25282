"""`selective_scan`: the Mamba-1 selective-scan op (semantics of the official `selective_scan_fn`).

Per batch row b, channel e and state index n (channels-last layout; docs/mamba1.md §3.4):

    δ_t   = softplus_thr(delta_t + delta_bias)       (or delta_t + delta_bias without softplus)
    h_t   = exp(δ_t[e]·A[e, n]) · h_{t-1} + δ_t[e] · B_t[g(e), n] · u_t[e],   h_{-1} = initial_state
    y_t   = Σ_n h_t[e, n] · C_t[g(e), n] + D[e] · u_t[e]
    out_t = y_t · silu(z_t[e])                       (when z is given)

with g(e) = e // (d / groups). The state and all accumulation are float32 whatever the input
dtype; `out` has `u.dtype`, the final state is float32. Every array argument, `initial_state`
included, is differentiable.

Implementation contract (what "reference", "xla" and "pallas" register with `dispatch`):

    fn(u, delta, A, B, C, D, z, delta_bias, h0, reset, *, delta_softplus, tuning)
        -> (out [Bt, T, d] in u.dtype, h_last [Bt, d, n] float32)

with arguments validated and normalized once here (`normalize_arguments`): B, C [Bt, T, g, n];
h0 a [Bt, d, n] array or None (zeros); reset a [Bt, T] bool mask or None; tuning a
`SelectiveScanTuning`.
"""

from __future__ import annotations

import warnings

from jmamba.core.validation import check_array, check_bool, check_float, normalize_reset, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.sequence_sharding import sequence_sharded
from jmamba.ops.selective_scan.common import SelectiveScanState, SelectiveScanTuning
from jmamba.ops.selective_scan.sequence import selective_scan_sequence_sharded
from jmamba.ops.settings import current_tuning, register_tuning

OP = "selective_scan"
_LEGACY_POSITIONAL = ("delta_softplus", "initial_state", "return_final_state", "implementation")


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, *legacy, delta_softplus=False,
                   initial_state=None, return_final_state=False, reset=None, implementation=None,
                   tuning=None):
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
      initial_state: optional `SelectiveScanState` (ssm [Bt, d, n]); zeros when None.
      return_final_state: also return the state after the last position.
      reset: optional [Bt] or [Bt, T] bool mask; True zeroes the state entering that row (at that
        position); a [Bt] mask acts at t = 0 (document boundaries).
      implementation: None (automatic), "reference", "xla" or "pallas".
      tuning: a `SelectiveScanTuning` (None: the current `jmamba.ops.tuning` settings).

    Returns:
      out [Bt, T, d] in u.dtype, or (out, SelectiveScanState) when return_final_state.
    """
    if legacy:
        opts = _legacy_options(legacy, delta_softplus=delta_softplus, initial_state=initial_state,
                               return_final_state=return_final_state, implementation=implementation)
        delta_softplus, initial_state, return_final_state, implementation = opts
    args = normalize_arguments(u, delta, A, B, C, D, z, delta_bias, initial_state, reset)
    check_bool("delta_softplus", delta_softplus)
    check_bool("return_final_state", return_final_state)
    tuning = current_tuning(OP, tuning)
    u, _, A, B, _, _, _, _, h0, reset = args
    impl = dispatch.choose(OP, implementation, u=u, A=A, B=B, initial_state=h0, reset=reset, tuning=tuning)
    if sequence_sharded():   # time split over the mesh's `seq` axis (jmamba.ops.sequence_sharding)
        out, h_last = selective_scan_sequence_sharded(impl.fn, args, delta_softplus=delta_softplus, tuning=tuning)
        return (out, SelectiveScanState(h_last)) if return_final_state else out
    # batch-sharded under a data-parallel mesh: u delta | A | B C | D | z | delta_bias | state reset
    out, h_last = call_batch_sharded(
        impl.fn, args, (True, True, False, True, True, False, True, False, True, True),
        delta_softplus=delta_softplus, tuning=tuning)
    return (out, SelectiveScanState(h_last)) if return_final_state else out


def normalize_arguments(u, delta, A, B, C, D, z, delta_bias, initial_state, reset):
    """Validates a call and returns the implementation arguments
    (u, delta, A, B [Bt, T, g, n], C [Bt, T, g, n], D, z, delta_bias, h0 [Bt, d, n] | None, reset [Bt, T] | None)."""
    check_array("u", u, (None, None, None), "[batch, seqlen, d]")
    bsz, seqlen, d = shape_of(u)
    check_array("delta", delta, (bsz, seqlen, d), "[batch, seqlen, d] like u")
    check_array("A", A, (d, None), "[d, n]")
    n = shape_of(A)[1]
    B = with_groups("B", B, (bsz, seqlen), d, n)
    C = with_groups("C", C, (bsz, seqlen), d, n)
    if shape_of(B)[-2] != shape_of(C)[-2]:
        raise ValueError(f"B and C must have the same number of groups, got {shape_of(B)[-2]} and {shape_of(C)[-2]}")
    if D is not None:
        check_array("D", D, (d,), "[d]")
    if z is not None:
        check_array("z", z, (bsz, seqlen, d), "[batch, seqlen, d] like u")
    if delta_bias is not None:
        check_array("delta_bias", delta_bias, (d,), "[d]")
    h0 = state_array(initial_state, bsz, d, n)
    reset = normalize_reset(reset, bsz, seqlen)
    return u, delta, A, B, C, D, z, delta_bias, h0, reset


def with_groups(name, x, lead, d, n):
    """Checks B or C ([*lead, n] or [*lead, g, n]) and returns it as [*lead, g, n]."""
    check_float(name, x)
    s = shape_of(x)
    dims = "[batch, seqlen" if len(lead) == 2 else "[batch"
    if len(s) == len(lead) + 1:
        check_array(name, x, lead + (n,), f"{dims}, n]")
        return x[..., None, :]
    check_array(name, x, lead + (None, n), f"{dims}, n] or {dims}, groups, n]")
    g = s[-2]
    if g < 1 or d % g:
        raise ValueError(f"{name}: the number of groups ({g}) must divide d ({d})")
    return x


def state_array(state, bsz, d, n, name="initial_state", stacklevel=4):
    """The [Bt, d, n] array of a `SelectiveScanState` (None stays None). A bare array is accepted
    with a DeprecationWarning (the state used to be a plain array)."""
    if state is None:
        return None
    if isinstance(state, SelectiveScanState):
        h = state.ssm
        check_array(f"{name}.ssm", h, (bsz, d, n), "[batch, d, n]")
        return h
    if hasattr(state, "shape") and not isinstance(state, tuple):
        warnings.warn(f"passing {name} as a bare [batch, d, n] array is deprecated; pass "
                      "jmamba.ops.SelectiveScanState(ssm=...)", DeprecationWarning, stacklevel=stacklevel)
        check_array(name, state, (bsz, d, n), "[batch, d, n]")
        return state
    raise TypeError(f"{name} must be a jmamba.ops.SelectiveScanState (ssm [batch, d, n]) or None, "
                    f"got {type(state).__name__}")


def _legacy_options(legacy, **given):
    """Options passed positionally (the old signature): accepted with a DeprecationWarning."""
    if len(legacy) > len(_LEGACY_POSITIONAL):
        raise TypeError(f"selective_scan() takes at most 8 positional arrays and {len(_LEGACY_POSITIONAL)} "
                        f"legacy positional options, got {8 + len(legacy)} positional arguments")
    defaults = {"delta_softplus": False, "initial_state": None, "return_final_state": False,
                "implementation": None}
    out = dict(given)
    for name, value in zip(_LEGACY_POSITIONAL, legacy):
        if given[name] is not defaults[name]:
            raise TypeError(f"selective_scan() got {name} both positionally and by keyword")
        out[name] = value
    warnings.warn(f"passing {', '.join(_LEGACY_POSITIONAL[:len(legacy)])} positionally to selective_scan is "
                  "deprecated; options are keyword-only", DeprecationWarning, stacklevel=3)
    return tuple(out[k] for k in _LEGACY_POSITIONAL)


def _always(**_):
    return None


def _load_reference():
    from jmamba.ops.selective_scan.reference import selective_scan_reference
    return dispatch.Implementation(selective_scan_reference, _always)


def _load_xla():
    from jmamba.ops.selective_scan.xla import selective_scan_xla
    return dispatch.Implementation(selective_scan_xla, _always)


def _load_pallas():
    from jmamba.ops.selective_scan.pallas import implementation
    return implementation()


register_tuning(OP, SelectiveScanTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)
dispatch.register(OP, "pallas", _load_pallas)
