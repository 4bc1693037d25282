"""`mamba3_siso_step`: one decode step of the Mamba-3 SISO recurrence (docs/mamba3_siso.md §3.5).

It is the scan of a one-token window (`mamba3_siso_step(...)` equals `mamba3_siso_scan(...)` on
`x[:, None]`; tests/test_mamba3_scan_step.py checks it against the float64 numpy model). The
"reference" implementation is the recurrence (`common.siso_step`) in the accumulation dtype; the
"xla" one is the same program (one step has nothing to chunk), registered so that automatic
dispatch behaves as for the scans.
"""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.core.validation import check_array, check_bool_mask, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.mamba3_siso_scan.api import check_state, per_head_angles
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanState, expand_groups, siso_step, zero_states

OP = "mamba3_siso_step"


def mamba3_siso_step(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, z=None, *,
                     initial_state=None, reset=None, implementation=None):
    """One token of the Mamba-3 SISO scan.

    Args:
      Q, K: [Bt, G, N] this token's query (C) and key (B), normed, before the biases.
      V: [Bt, H, P] value (x). ADT, DT, Trap: [Bt, H]. Q_bias, K_bias: [H, N].
      Angles: [Bt, S] or [Bt, H, S] raw angles. D: optional [H]. z: optional [Bt, H, P] gate.
      initial_state: the `Mamba3ScanState` before the token (zeros when None).
      reset: optional [Bt] bool; True zeroes the row's four states before the token.
      implementation: None (automatic), "reference" or "xla".

    Returns:
      (out [Bt, H, P] in V.dtype, the `Mamba3ScanState` after the token, float32).
    """
    check_array("V", V, (None, None, None), "[batch, nheads, headdim]")
    bsz, H, P = shape_of(V)
    check_array("Q", Q, (bsz, None, None), "[batch, ngroups, d_state]")
    G, N = shape_of(Q)[1:]
    if G < 1 or H % G:
        raise ValueError(f"Q: the number of groups ({G}) must divide the number of heads of V ({H})")
    check_array("K", K, (bsz, G, N), "[batch, ngroups, d_state] like Q")
    for name, x in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_array(name, x, (bsz, H), "[batch, nheads]")
    check_array("Q_bias", Q_bias, (H, N), "[nheads, d_state]")
    check_array("K_bias", K_bias, (H, N), "[nheads, d_state]")
    Angles = per_head_angles(Angles, (bsz,), H, N)
    S = shape_of(Angles)[-1]
    if D is not None:
        check_array("D", D, (H,), "[nheads]")
    if z is not None:
        check_array("z", z, (bsz, H, P), "[batch, nheads, headdim] like V")
    state = None if initial_state is None else check_state(initial_state, bsz, H, P, N, S)
    if reset is not None:
        check_bool_mask("reset", reset, [(bsz,)], "[batch]")
    impl = dispatch.choose(OP, implementation, Q=Q, V=V)
    out, new = call_batch_sharded(impl.fn, (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, state, reset),
                                  (True,) * 6 + (False, False, True, False, True, True, True))
    return out, Mamba3ScanState(*new)


def mamba3_siso_step_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, state, reset):
    """The step in the accumulation dtype: (out [Bt, H, P] in V.dtype, Mamba3ScanState)."""
    bsz, H, P = V.shape
    N = Q.shape[-1]
    S = Angles.shape[-1]
    acc = accum_dtype(*[a.dtype for a in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles)],
                      *[a.dtype for a in (D, z) if a is not None],
                      *([] if state is None else [s.dtype for s in state]))
    states = (zero_states(bsz, H, P, N, S, acc) if state is None
              else Mamba3ScanState(*(s.astype(acc) for s in state)))
    if reset is not None:
        states = Mamba3ScanState(*(jnp.where(reset.reshape((bsz,) + (1,) * (s.ndim - 1)), 0.0, s) for s in states))
    q_bar = expand_groups(Q.astype(acc), H) + Q_bias.astype(acc)                    # [Bt, H, N]
    k_bar = expand_groups(K.astype(acc), H) + K_bias.astype(acc)
    y, new = siso_step(states, q_bar, k_bar, V.astype(acc), ADT.astype(acc), DT.astype(acc),
                       Trap.astype(acc), Angles.astype(acc), None if D is None else D.astype(acc),
                       None if z is None else z.astype(acc))
    return y.astype(V.dtype), new


def _load():
    return dispatch.Implementation(mamba3_siso_step_reference, lambda **_: None)


dispatch.register(OP, "reference", _load)
dispatch.register(OP, "xla", _load)
