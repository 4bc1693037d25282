"""Reference Mamba-3 SISO scan: a sequential `lax.scan` over time (the oracle for xla and pallas).

It is docs/mamba3_siso.md §6.1 verbatim, vectorised over batch and heads: per step the angle is
accumulated and wrapped, q̄/k̄ are rotated, and h_t = α h_{t-1} + β v_{t-1}k_{t-1}ᵀ + γ v_t k_tᵀ.

Numerics: every input is cast to the accumulation dtype first (float32; float64 stays float64 for
gradient checks); states, products and the output are computed there, and the output is cast to
`V.dtype` at the very end. Memory: autodiff through `lax.scan` stores the [Bt, H, P, N] state of
every step, so this is for testing and short sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanState, expand_groups, siso_step, zero_states


def mamba3_siso_scan_reference(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states,
                               reset, *, tuning=None):
    """Sequential scan; the normalized implementation contract of `mamba3_siso_scan` (see api.py).

    `tuning` is accepted for the common signature and ignored.
    """
    del tuning
    bsz, T, H, P = V.shape
    N = Q.shape[-1]
    S = Angles.shape[-1]
    acc = accum_dtype(*[a.dtype for a in (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles)],
                      *[a.dtype for a in (D, Z) if a is not None],
                      *([] if initial_states is None else [s.dtype for s in initial_states]))
    q_bar = expand_groups(Q.astype(acc), H) + Q_bias.astype(acc)      # [Bt, T, H, N]
    k_bar = expand_groups(K.astype(acc), H) + K_bias.astype(acc)
    Df = None if D is None else D.astype(acc)
    states = (zero_states(bsz, H, P, N, S, acc) if initial_states is None
              else Mamba3ScanState(*(s.astype(acc) for s in initial_states)))
    rs = jnp.zeros((bsz, T), bool) if reset is None else reset

    def step(carry, xs):
        q_t, k_t, v_t, a_t, dt_t, tr_t, ang_t, z_t, r_t = xs
        # a reset forgets all four incoming states: the row restarts as a fresh sequence (docs/mamba3_siso.md §3.3)
        carry = Mamba3ScanState(*(jnp.where(r_t.reshape((bsz,) + (1,) * (s.ndim - 1)), 0.0, s) for s in carry))
        y, carry = siso_step(carry, q_t, k_t, v_t, a_t, dt_t, tr_t, ang_t, Df, z_t)
        return carry, y

    xs = (q_bar, k_bar, V.astype(acc), ADT.astype(acc), DT.astype(acc), Trap.astype(acc),
          Angles.astype(acc), None if Z is None else Z.astype(acc), rs)
    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs)       # time-major; None (no Z) stays None
    final, ys = jax.lax.scan(step, states, xs)
    return jnp.swapaxes(ys, 0, 1).astype(V.dtype), final
