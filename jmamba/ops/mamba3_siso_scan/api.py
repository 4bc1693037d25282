"""`mamba3_siso_scan`: the Mamba-3 SISO scan op (semantics of the official `mamba3_siso_combined`).

Per batch row, head h (group g = h // (H/G)) and position t (spec/mamba3_siso.md §3.2 steps 8-12):

    q̄_t = Q_t[g] + Q_bias[h],   k̄_t = K_t[g] + K_bias[h]                 (Q ≡ Ĉ, K ≡ B̂, V ≡ x)
    θ_t = (θ_{t-1} + π·tanh(Angles_t[h])·DT_t) mod 2π                      θ_{-1} = angle state
    q_t = R(θ_t) q̄_t,   k_t = R(θ_t) k̄_t                  (rotation of adjacent pairs, first 2S dims)
    λ_t = σ(Trap_t),  α_t = e^{ADT_t},  β_t = (1-λ_t)·DT_t·α_t,  γ_t = λ_t·DT_t
    h_t = α_t h_{t-1} + β_t v_{t-1} k_{t-1}ᵀ + γ_t v_t k_tᵀ                 h_{-1}, k_{-1}, v_{-1} = states
    y_t = h_t q_t + D[h]·v_t,    out_t = y_t·silu(Z_t)  (when Z is given)

Channels-last layouts (the official kernel takes ADT/DT/Trap as [Bt, H, T]; here they are
[Bt, T, H] like every other jmamba op). The scan state and all accumulation are float32 (float64
when any input is float64); `out` has `V.dtype`; the final states are float32. Every array argument,
the four initial states included, is differentiable, and cotangents of the final states are
accepted (exact BPTT when windows are chained; `stop_gradient` on the states gives TBPTT).

Implementation contract (what "reference", "xla" and a future "pallas" register with `dispatch`):

    fn(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset, *, chunk_size)
        -> (out [Bt, T, H, P] in V.dtype, Mamba3ScanStates(angle, ssm, k, v) in float32 / float64)

with arguments already validated and normalized: Q, K [Bt, T, G, N]; V [Bt, T, H, P]; ADT, DT,
Trap [Bt, T, H] (ADT = A·DT < 0, DT > 0, Trap the raw logit; any float dtype, cast to float32 inside);
Q_bias, K_bias [H, N];
Angles [Bt, T, H, S] raw (pre-tanh), S <= N/2; D [H] or None; Z [Bt, T, H, P] or None;
initial_states None (all zeros) or a 4-tuple (angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N],
v [Bt, H, P]); reset None or a [Bt, T] bool mask (True at t: all four states entering t are
zero, so the row restarts as a fresh sequence there); chunk_size a positive int (a tuning knob:
it must not change the result beyond rounding). The function always returns the final states
(the API drops them when not requested) and must be differentiable w.r.t. every array argument
(a Pallas kernel provides this with a `custom_vjp`; spec §4.4 has the backward, §4.5 the
official kernel boundary this mirrors). Register it like the two below:
`dispatch.register("mamba3_siso_scan", "pallas", loader)`, where `loader()` returns
`dispatch.Implementation(fn, supported)` and `supported(platform=..., Q=, V=, Angles=,
initial_states=, reset=, chunk_size=)` returns None or a sentence saying why it cannot run (e.g.
"N must be a power of two"); `implementation=None` then falls back to "xla" and says why once.
The "reference" and "xla" implementations are the oracles a kernel is tested against
(tests/test_mamba3_scan.py checks both against an independent float64 numpy model).
"""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanStates
from jmamba.ops.selective_scan.common import reset_from_row_mask
from jmamba.ops.validation import check_array, check_bool_mask, check_float, shape_of

OP = "mamba3_siso_scan"
STATE_NAMES = ("angle", "ssm", "k", "v")


def mamba3_siso_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None,
                     initial_states=None, return_final_states=False, chunk_size=64,
                     implementation=None, *, reset=None):
    """Mamba-3 SISO scan, channels-last.

    Args:
      Q: [Bt, T, G, N] query = BC-normed C (pre-bias). K: [Bt, T, G, N] key = BC-normed B.
      V: [Bt, T, H, P] value = x; G must divide H.
      ADT: [Bt, T, H] log-decay A·DT (negative). DT: [Bt, T, H] step size (positive).
      Trap: [Bt, T, H] raw trapezoid logit (the op applies the sigmoid).
      Q_bias, K_bias: [H, N] per-head biases (C_bias, B_bias).
      Angles: [Bt, T, S] (shared by all heads, as the module produces) or [Bt, T, H, S] raw angles;
        S <= N/2 pairs are rotated.
      D: optional [H] skip. Z: optional [Bt, T, H, P] gate (out = y·silu(Z)).
      initial_states: optional (angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N], v [Bt, H, P]);
        None = zeros (a fresh sequence).
      return_final_states: also return `Mamba3ScanStates` after the last position.
      chunk_size: chunk length of the chunked implementations (positive int).
      implementation: None (automatic), "reference", "xla" or "pallas".
      reset: optional [Bt] or [Bt, T] bool mask; True zeroes the four states entering that row
        (at that position); a [Bt] mask acts at t = 0. (jmamba extension for document boundaries.)

    Returns:
      out [Bt, T, H, P] in V.dtype, or (out, Mamba3ScanStates) when return_final_states.
    """
    check_array("V", V, (None, None, None, None), "[batch, seqlen, nheads, headdim]")
    bsz, T, H, P = shape_of(V)
    check_array("Q", Q, (bsz, T, None, None), "[batch, seqlen, ngroups, d_state]")
    G, N = shape_of(Q)[2:]
    if G < 1 or H % G:
        raise ValueError(f"Q: the number of groups ({G}) must divide the number of heads of V ({H})")
    check_array("K", K, (bsz, T, G, N), "[batch, seqlen, ngroups, d_state] like Q")
    for name, x in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_array(name, x, (bsz, T, H), "[batch, seqlen, nheads]")
    check_array("Q_bias", Q_bias, (H, N), "[nheads, d_state]")
    check_array("K_bias", K_bias, (H, N), "[nheads, d_state]")
    check_float("Angles", Angles)
    if len(shape_of(Angles)) == 3:
        check_array("Angles", Angles, (bsz, T, None), "[batch, seqlen, num_angles]")
        Angles = _broadcast_heads(Angles, H)
    else:
        check_array("Angles", Angles, (bsz, T, H, None),
                    "[batch, seqlen, num_angles] or [batch, seqlen, nheads, num_angles]")
    S = shape_of(Angles)[-1]
    if 2 * S > N:
        raise ValueError(f"Angles: num_angles ({S}) must be at most d_state/2 ({N // 2})")
    if D is not None:
        check_array("D", D, (H,), "[nheads]")
    if Z is not None:
        check_array("Z", Z, (bsz, T, H, P), "[batch, seqlen, nheads, headdim] like V")
    if initial_states is not None:
        initial_states = check_states(initial_states, bsz, H, P, N, S)
    if reset is not None:
        check_bool_mask("reset", reset, [(bsz,), (bsz, T)], "[batch] or [batch, seqlen]")
        reset = reset_from_row_mask(reset, bsz, T)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(return_final_states, bool):
        raise TypeError(f"return_final_states must be a bool, got {type(return_final_states).__name__}")

    impl = dispatch.choose(OP, implementation, Q=Q, V=V, Angles=Angles, initial_states=initial_states,
                           reset=reset, chunk_size=chunk_size)
    # batched: Q K V ADT DT Trap | biases replicated | Angles batched, D replicated, Z, states, reset batched
    out, final = call_batch_sharded(
        impl.fn, (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset),
        (True,) * 6 + (False, False, True, False, True, True, True), chunk_size=chunk_size)
    return (out, Mamba3ScanStates(*final)) if return_final_states else out


def _broadcast_heads(angles, H):
    b, t, s = shape_of(angles)
    return jnp.broadcast_to(angles[:, :, None, :], (b, t, H, s))


def check_states(states, bsz, H, P, N, S, name="initial_states"):
    """Raises unless `states` is a 4-tuple (angle, ssm, k, v) of float arrays of the right shapes."""
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise ValueError(f"{name} must be a tuple (angle, ssm, k, v) of 4 arrays, got "
                         f"{type(states).__name__}" + (f" of length {len(states)}" if isinstance(states, (tuple, list)) else ""))
    want = {"angle": ((bsz, H, S), "[batch, nheads, num_angles]"),
            "ssm": ((bsz, H, P, N), "[batch, nheads, headdim, d_state]"),
            "k": ((bsz, H, N), "[batch, nheads, d_state]"),
            "v": ((bsz, H, P), "[batch, nheads, headdim]")}
    for field, x in zip(STATE_NAMES, states):
        check_array(f"{name}.{field}", x, *want[field])
    return tuple(states)


def _always(**_):
    return None


def _load_reference():
    from jmamba.ops.mamba3_siso_scan.reference import mamba3_siso_scan_reference
    return dispatch.Implementation(mamba3_siso_scan_reference, _always)


def _load_xla():
    from jmamba.ops.mamba3_siso_scan.xla import mamba3_siso_scan_xla
    return dispatch.Implementation(mamba3_siso_scan_xla, _always)


dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)


def _load_pallas():
    from jmamba.ops.mamba3_siso_scan.pallas import implementation
    return implementation()


dispatch.register(OP, "pallas", _load_pallas)
