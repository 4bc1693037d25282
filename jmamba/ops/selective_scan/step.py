"""`selective_scan_step`: one decode step of the selective scan (docs/mamba1.md §4.2).

    δ   = softplus_thr(delta + delta_bias)                    [Bt, d] float32
    h'  = exp(δ[e]·A[e, n]) · h + δ[e] · B[g(e), n] · u[e]     [Bt, d, n] float32
    out = (Σ_n h'[e, n] · C[g(e), n] + D[e] · u[e]) · silu(z[e])

It is the scan of a one-token window: `selective_scan_step(...)` equals `selective_scan(...)` on
`x[:, None]` (tests/test_selective_scan_step.py checks both against the float64 numpy model). The
"reference" implementation is this recurrence in float32; the "xla" one is the same program (a
single step has nothing to chunk), registered so that automatic dispatch behaves as for the scans.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.core.validation import check_array, check_bool, check_bool_mask, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.selective_scan.api import state_array, with_groups
from jmamba.ops.selective_scan.common import SelectiveScanState, expand_groups, prepare_delta

OP = "selective_scan_step"


def selective_scan_step(u, delta, A, B, C, D=None, z=None, delta_bias=None, *, initial_state=None,
                        delta_softplus=False, reset=None, implementation=None):
    """One token of the selective scan.

    Args:
      u, delta: [Bt, d] this token's input and raw time step.
      A: [d, n]. B, C: [Bt, n] or [Bt, g, n]. D, delta_bias: optional [d]. z: optional [Bt, d] gate.
      initial_state: the `SelectiveScanState` before the token (zeros when None).
      delta_softplus: apply softplus (threshold 20) to delta + delta_bias.
      reset: optional [Bt] bool; True zeroes the row's state before the token.
      implementation: None (automatic), "reference" or "xla".

    Returns:
      (out [Bt, d] in u.dtype, the `SelectiveScanState` after the token, float32).
    """
    check_array("u", u, (None, None), "[batch, d]")
    bsz, d = shape_of(u)
    check_array("delta", delta, (bsz, d), "[batch, d] like u")
    check_array("A", A, (d, None), "[d, n]")
    n = shape_of(A)[1]
    B = with_groups("B", B, (bsz,), d, n)
    C = with_groups("C", C, (bsz,), d, n)
    if shape_of(B)[-2] != shape_of(C)[-2]:
        raise ValueError(f"B and C must have the same number of groups, got {shape_of(B)[-2]} and {shape_of(C)[-2]}")
    for name, x in (("D", D), ("delta_bias", delta_bias)):
        if x is not None:
            check_array(name, x, (d,), "[d]")
    if z is not None:
        check_array("z", z, (bsz, d), "[batch, d] like u")
    h0 = state_array(initial_state, bsz, d, n, stacklevel=3)
    if reset is not None:
        check_bool_mask("reset", reset, [(bsz,)], "[batch]")
    check_bool("delta_softplus", delta_softplus)
    impl = dispatch.choose(OP, implementation, u=u, A=A)
    out, h = call_batch_sharded(impl.fn, (u, delta, A, B, C, D, z, delta_bias, h0, reset),
                                (True, True, False, True, True, False, True, False, True, True),
                                delta_softplus=delta_softplus)
    return out, SelectiveScanState(h)


def selective_scan_step_reference(u, delta, A, B, C, D, z, delta_bias, h0, reset, *, delta_softplus):
    """The step in float32 (float64 when an input is): (out [Bt, d] in u.dtype, h [Bt, d, n])."""
    bsz, d = u.shape
    n = A.shape[-1]
    f32 = accum_dtype(u.dtype, A.dtype)
    dl = prepare_delta(delta, delta_bias, delta_softplus, f32)                 # [Bt, d]
    h = jnp.zeros((bsz, d, n), f32) if h0 is None else h0.astype(f32)
    if reset is not None:
        h = jnp.where(reset[:, None, None], 0.0, h)
    uf = u.astype(f32)
    Bf = expand_groups(B.astype(f32), d)                                      # [Bt, d, n]
    Cf = expand_groups(C.astype(f32), d)
    h = jnp.exp(dl[:, :, None] * A.astype(f32)) * h + (dl * uf)[:, :, None] * Bf
    y = jnp.sum(h * Cf, axis=-1)
    if D is not None:
        y = y + D.astype(f32) * uf
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    return y.astype(u.dtype), h


def _load():
    return dispatch.Implementation(selective_scan_step_reference, lambda **_: None)


dispatch.register(OP, "reference", _load)
dispatch.register(OP, "xla", _load)
