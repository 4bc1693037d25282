"""`mamba3_siso_scan`: the Mamba-3 SISO scan op (semantics of the official `mamba3_siso_combined`).

Per batch row, head h (group g = h // (H/G)) and position t (docs/mamba3_siso.md §3.2 steps 8-12):

    q̄_t = Q_t[g] + Q_bias[h],   k̄_t = K_t[g] + K_bias[h]                 (Q ≡ Ĉ, K ≡ B̂, V ≡ x)
    θ_t = (θ_{t-1} + π·tanh(Angles_t[h])·DT_t) mod 2π                      θ_{-1} = angle state
    q_t = R(θ_t) q̄_t,   k_t = R(θ_t) k̄_t                  (rotation of adjacent pairs, first 2S dims)
    λ_t = σ(Trap_t),  α_t = e^{ADT_t},  β_t = (1-λ_t)·DT_t·α_t,  γ_t = λ_t·DT_t
    h_t = α_t h_{t-1} + β_t v_{t-1} k_{t-1}ᵀ + γ_t v_t k_tᵀ                 h_{-1}, k_{-1}, v_{-1} = state
    y_t = h_t q_t + D[h]·v_t,    out_t = y_t·silu(z_t)  (when z is given)

Channels-last layouts (the official kernel takes ADT/DT/Trap as [Bt, H, T]; here they are
[Bt, T, H] like every other jmamba op). The scan state and all accumulation are float32 (float64
when any input is float64); `out` has `V.dtype`; the final state is float32. Every array argument,
the four initial states included, is differentiable, and cotangents of the final state are
accepted (exact BPTT when windows are chained; `stop_gradient` on the state gives TBPTT).

Implementation contract (what "reference", "xla" and "pallas" register with `dispatch`):

    fn(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, initial_state, reset, *, tuning)
        -> (out [Bt, T, H, P] in V.dtype, Mamba3ScanState(angle, ssm, k, v) in float32 / float64)

with arguments validated and normalized once here (`normalize_arguments`): Q, K [Bt, T, G, N];
V [Bt, T, H, P]; ADT, DT, Trap [Bt, T, H] (ADT = A·DT < 0, DT > 0, Trap the raw logit; any float
dtype); Q_bias, K_bias [H, N]; Angles [Bt, T, H or 1, S] raw (pre-tanh; 1: shared by the heads), S <= N/2; D [H] or None;
z [Bt, T, H, P] or None; initial_state None (all zeros) or a `Mamba3ScanState` (angle [Bt, H, S],
ssm [Bt, H, P, N], k [Bt, H, N], v [Bt, H, P]); reset None or a [Bt, T] bool mask (True at t: all
four states entering t are zero, so the row restarts as a fresh sequence there); tuning a
`Mamba3ScanTuning` (its chunk_size must not change the result beyond rounding). The function always
returns the final state (the API drops it when not requested) and is differentiable w.r.t. every
array argument (the Pallas kernels through a `custom_vjp`; docs/mamba3_siso.md §4.4 has the
backward). `supported(platform=..., Q=, V=, Angles=, initial_state=, reset=, tuning=)` returns None
or a sentence saying why it cannot run; `implementation=None` then falls back to "xla" and says why
once. "reference" and "xla" are the oracles a kernel is tested against (tests/test_mamba3_scan.py
checks both against an independent float64 numpy model).
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from jmamba.core.validation import check_array, check_bool, check_float, normalize_reset, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.core.dtypes import accum_dtype
from jmamba.ops.mamba3_siso_scan.common import Mamba3QKNorm, Mamba3ScanState, Mamba3ScanTuning, zero_states
from jmamba.ops.norms.reference import rms_norm
from jmamba.ops.mamba3_siso_scan.sequence import mamba3_siso_scan_sequence_sharded
from jmamba.ops.sequence_sharding import sequence_sharded
from jmamba.ops.settings import current_tuning, register_tuning

OP = "mamba3_siso_scan"
STATE_NAMES = Mamba3ScanState._fields
_LEGACY_POSITIONAL = ("initial_state", "return_final_state", "chunk_size", "implementation")
_RENAMED = {"Z": "z", "initial_states": "initial_state", "return_final_states": "return_final_state"}


def mamba3_siso_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, z=None, *legacy,
                     initial_state=None, return_final_state=False, reset=None, implementation=None,
                     tuning=None, qk_norm=None, **deprecated):
    """Mamba-3 SISO scan, channels-last.

    Args:
      Q: [Bt, T, G, N] query = BC-normed C (pre-bias). K: [Bt, T, G, N] key = BC-normed B.
        With `qk_norm`, the raw C and B instead (the op normalizes them).
      V: [Bt, T, H, P] value = x; G must divide H.
      ADT: [Bt, T, H] log-decay A·DT (negative). DT: [Bt, T, H] step size (positive).
      Trap: [Bt, T, H] raw trapezoid logit (the op applies the sigmoid).
      Q_bias, K_bias: [H, N] per-head biases (C_bias, B_bias).
      Angles: [Bt, T, S] (shared by all heads, as the module produces) or [Bt, T, H, S] raw angles;
        S <= N/2 pairs are rotated.
      D: optional [H] skip. z: optional [Bt, T, H, P] gate (out = y·silu(z)).
      initial_state: optional `Mamba3ScanState` (angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N],
        v [Bt, H, P]); None = zeros (a fresh sequence).
      return_final_state: also return the `Mamba3ScanState` after the last position.
      reset: optional [Bt] or [Bt, T] bool mask; True zeroes the four states entering that row
        (at that position); a [Bt] mask acts at t = 0 (document boundaries).
      implementation: None (automatic), "reference", "xla" or "pallas".
      tuning: a `Mamba3ScanTuning` (chunk size, kernel config); None: the current `jmamba.ops.tuning`.
      qk_norm: optional `Mamba3QKNorm(Q_weight [N], K_weight [N], eps)`: Q and K are raw and the op
        applies the mixer's B/C RMSNorms first (jmamba.ops.rms_norm, rounded to Q's / K's dtype). The
        Pallas path fuses them with its kernel-layout step (one kernel each way,
        pallas_kernels/mamba3_siso/qk_norm.py); the others, and the sequence-sharded path, normalize
        with `rms_norm` before the scan. Gradients reach both weights.

    Deprecated spellings (accepted with a DeprecationWarning): `Z=`, `initial_states=`,
    `return_final_states=`, `chunk_size=` (now `tuning=Mamba3ScanTuning(chunk_size=...)`), and the
    options passed positionally.

    Returns:
      out [Bt, T, H, P] in V.dtype, or (out, Mamba3ScanState) when return_final_state.
    """
    z, initial_state, return_final_state, implementation, tuning = _resolve_deprecated(
        legacy, deprecated, z=z, initial_state=initial_state, return_final_state=return_final_state,
        implementation=implementation, tuning=tuning)
    args = normalize_arguments(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, initial_state, reset)
    check_bool("return_final_state", return_final_state)
    Q, _, V, _, _, _, _, _, Angles, _, _, states, reset = args
    if qk_norm is not None:
        qk_norm = check_qk_norm(qk_norm, shape_of(Q)[-1])
    if shape_of(V)[1] == 0:   # an empty window: nothing to scan, the state passes through
        return _empty_window(V, Q, Angles, states, return_final_state)
    impl = dispatch.choose(OP, implementation, Q=Q, V=V, Angles=Angles, initial_state=states,
                           reset=reset, tuning=tuning)
    # batched: Q K V ADT DT Trap | biases replicated | Angles batched, D replicated, z, state, reset batched
    fn, batched = impl.fn, (True,) * 6 + (False, False, True, False, True, True, True)
    if qk_norm is not None:
        if getattr(impl.fn, "fuses_qk_norm", False) and not sequence_sharded():
            fn, args, batched = _with_fused_qk_norm(impl.fn, qk_norm.eps), args + qk_norm[:2], batched + (False, False)
        else:
            args = (rms_norm(Q, qk_norm.Q_weight, qk_norm.eps, Q.dtype),
                    rms_norm(args[1], qk_norm.K_weight, qk_norm.eps, args[1].dtype)) + args[2:]
    if sequence_sharded():   # time split over the mesh's `seq` axis (jmamba.ops.sequence_sharding)
        out, final = mamba3_siso_scan_sequence_sharded(fn, args, tuning=tuning)
        return (out, Mamba3ScanState(*final)) if return_final_state else out
    out, final = call_batch_sharded(fn, args, batched, tuning=tuning)
    return (out, Mamba3ScanState(*final)) if return_final_state else out


def _with_fused_qk_norm(fn, eps):
    """fn over the 13 normalized arguments and the two norm weights (replicated under a mesh)."""
    def run(*args, tuning):
        return fn(*args[:13], tuning=tuning, qk_norm=Mamba3QKNorm(args[13], args[14], eps))
    return run


def check_qk_norm(qk_norm, N) -> Mamba3QKNorm:
    """Raises unless `qk_norm` is a `Mamba3QKNorm` (or a 3-tuple) of two float [N] weights and a positive
    eps; returns it with eps as a Python float."""
    if not isinstance(qk_norm, (tuple, list)) or len(qk_norm) != 3:
        raise ValueError(f"qk_norm must be a Mamba3QKNorm(Q_weight, K_weight, eps), got {type(qk_norm).__name__}")
    Q_weight, K_weight, eps = qk_norm
    check_array("qk_norm.Q_weight", Q_weight, (N,), "[d_state]")
    check_array("qk_norm.K_weight", K_weight, (N,), "[d_state]")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"qk_norm.eps must be a positive Python float, got {eps!r}")
    return Mamba3QKNorm(Q_weight, K_weight, float(eps))


def _empty_window(V, Q, Angles, states, return_final_state):
    bsz, _, H, P = shape_of(V)
    N, S = shape_of(Q)[-1], shape_of(Angles)[-1]
    out = jnp.zeros((bsz, 0, H, P), V.dtype)
    if not return_final_state:
        return out
    acc = accum_dtype(V.dtype, *([] if states is None else [s.dtype for s in states]))
    final = (zero_states(bsz, H, P, N, S, acc) if states is None
             else Mamba3ScanState(*(s.astype(acc) for s in states)))
    return out, final


def normalize_arguments(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, initial_state, reset):
    """Validates a call and returns the implementation arguments (Angles as [Bt, T, H, S], the state
    as a `Mamba3ScanState` or None, reset as [Bt, T] or None)."""
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
    Angles = per_head_angles(Angles, (bsz, T), H, N)
    S = shape_of(Angles)[-1]
    if D is not None:
        check_array("D", D, (H,), "[nheads]")
    if z is not None:
        check_array("z", z, (bsz, T, H, P), "[batch, seqlen, nheads, headdim] like V")
    states = None if initial_state is None else check_state(initial_state, bsz, H, P, N, S)
    reset = normalize_reset(reset, bsz, T)
    return Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, states, reset


def per_head_angles(Angles, lead, H, N):
    """Checks raw angles ([*lead, S] shared by the heads, or [*lead, H, S]).

    Returns [*lead, H, S], or [*lead, 1, S] for shared angles: the implementations broadcast that heads
    axis where the angles meet DT (`angle_increment`), so tanh runs once per position and the
    backward keeps no per-head copy of it (the Pallas path's saved tanh was [Bt, T, H, S] float32).
    """
    check_float("Angles", Angles)
    dims = "[batch, seqlen" if len(lead) == 2 else "[batch"
    if len(shape_of(Angles)) == len(lead) + 1:
        check_array("Angles", Angles, lead + (None,), f"{dims}, num_angles]")
        Angles = Angles[..., None, :]
    else:
        check_array("Angles", Angles, lead + (H, None),
                    f"{dims}, num_angles] or {dims}, nheads, num_angles]")
    S = shape_of(Angles)[-1]
    if 2 * S > N:
        raise ValueError(f"Angles: num_angles ({S}) must be at most d_state/2 ({N // 2})")
    return Angles


def check_state(state, bsz, H, P, N, S, name="initial_state") -> Mamba3ScanState:
    """Raises unless `state` is a `Mamba3ScanState` (or a 4-tuple angle, ssm, k, v) of float arrays
    of the right shapes; returns it as a `Mamba3ScanState`."""
    if not isinstance(state, (tuple, list)) or len(state) != 4:
        raise ValueError(f"{name} must be a Mamba3ScanState (angle, ssm, k, v) of 4 arrays, got "
                         f"{type(state).__name__}" + (f" of length {len(state)}" if isinstance(state, (tuple, list)) else ""))
    want = {"angle": ((bsz, H, S), "[batch, nheads, num_angles]"),
            "ssm": ((bsz, H, P, N), "[batch, nheads, headdim, d_state]"),
            "k": ((bsz, H, N), "[batch, nheads, d_state]"),
            "v": ((bsz, H, P), "[batch, nheads, headdim]")}
    for field, x in zip(STATE_NAMES, state):
        check_array(f"{name}.{field}", x, *want[field])
    return Mamba3ScanState(*state)


def _resolve_deprecated(legacy, deprecated, *, z, initial_state, return_final_state, implementation, tuning):
    """Maps the old spellings onto the new options (each with one DeprecationWarning)."""
    given = {"z": z, "initial_state": initial_state, "return_final_state": return_final_state,
             "implementation": implementation, "chunk_size": None}
    defaults = {"z": None, "initial_state": None, "return_final_state": False, "implementation": None,
                "chunk_size": None}
    used = []
    if len(legacy) > len(_LEGACY_POSITIONAL):
        raise TypeError(f"mamba3_siso_scan() takes at most 11 positional arrays and {len(_LEGACY_POSITIONAL)} "
                        f"legacy positional options, got {11 + len(legacy)} positional arguments")
    for name, value in zip(_LEGACY_POSITIONAL, legacy):
        if given[name] is not defaults[name]:
            raise TypeError(f"mamba3_siso_scan() got {name} both positionally and by keyword")
        given[name] = value
        used.append(f"{name} (positional)")
    for old, value in deprecated.items():
        new = _RENAMED.get(old, old if old == "chunk_size" else None)
        if new is None:
            raise TypeError(f"mamba3_siso_scan() got an unexpected keyword argument {old!r}")
        if given[new] is not defaults[new]:
            raise TypeError(f"mamba3_siso_scan() got both {new}= and its deprecated spelling {old}=")
        given[new] = value
        used.append(f"{old}=")
    if used:
        warnings.warn(f"mamba3_siso_scan: {', '.join(used)} deprecated: options are keyword-only and named "
                      "z, initial_state, return_final_state, implementation; chunk_size is "
                      "tuning=jmamba.ops.Mamba3ScanTuning(chunk_size=...)", DeprecationWarning, stacklevel=3)
    if given["chunk_size"] is not None:
        if tuning is not None:
            raise TypeError("mamba3_siso_scan() got both tuning= and the deprecated chunk_size=")
        c = given["chunk_size"]
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {c!r}")
        tuning = Mamba3ScanTuning(chunk_size=c, pallas_config=current_tuning(OP).pallas_config)
    return (given["z"], given["initial_state"], given["return_final_state"], given["implementation"],
            current_tuning(OP, tuning))


def _always(**_):
    return None


def _load_reference():
    from jmamba.ops.mamba3_siso_scan.reference import mamba3_siso_scan_reference
    return dispatch.Implementation(mamba3_siso_scan_reference, _always)


def _load_xla():
    from jmamba.ops.mamba3_siso_scan.xla import mamba3_siso_scan_xla
    return dispatch.Implementation(mamba3_siso_scan_xla, _always)


def _load_pallas():
    from jmamba.ops.mamba3_siso_scan.pallas import implementation
    return implementation()


register_tuning(OP, Mamba3ScanTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)
dispatch.register(OP, "pallas", _load_pallas)
