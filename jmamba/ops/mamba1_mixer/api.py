"""`mamba1_mixer_core`: the Mamba-1 mixer between its two projections, as one op (docs/mamba1.md §3.3).

    c  = causal_conv(S_conv ++ x) + conv_bias            [Bt, T, E]   float32
    u  = silu(c)                                          rounded to x.dtype
    Δin, B, C = split(u · W_x, [R, N, N]);  delta = Δin · W_dt     (matmuls in x.dtype)
    y  = selective_scan(u, delta, A, B, C, D, z, delta_bias = dt_bias, softplus)

It is the unfused mixer's composition, bit for bit in the forward. The "pallas" implementation is
one `custom_vjp` that keeps u, delta and the x projection for its backward (the default tuning), or,
with `SelectiveScanTuning(mixer_residuals="inputs")`, recomputes c, u and delta from x instead of
saving them (activation memory near the official fused path's); "reference" and "xla" are the plain
composition with the scan's reference / xla implementation, differentiated by autodiff.

Implementation contract (what "reference", "xla" and "pallas" register with `dispatch`):

    fn(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
       ssm_state, reset, *, tuning, xz_packed) -> (y [Bt, T, E] x.dtype, new conv state [Bt, K-1, E] f32,
                                                   h_last [Bt, E, N] f32)

with arguments validated once here; conv_state an array (zeros when no state was given), ssm_state
an array or None (zeros), reset a [Bt, T] bool mask or None, tuning a `SelectiveScanTuning`, and
`xz_packed` True when x is the packed [Bt, T, 2E] (x | z) array and z is None.

Choosing: `implementation=None` uses a preference set for this op with `dispatch.prefer`, else one
set for "selective_scan" (the op is a composition around that scan), else the automatic order.
"""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.core.validation import check_array, check_bool, normalize_reset, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.mamba1_mixer.common import Mamba1CoreState
from jmamba.ops.mamba1_mixer.sequence import mamba1_mixer_core_sequence_sharded
from jmamba.ops.sequence_sharding import sequence_sharded
from jmamba.ops.selective_scan.api import OP as SCAN_OP
from jmamba.ops.settings import current_tuning

OP = "mamba1_mixer_core"


def mamba1_mixer_core(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, *,
                      initial_state=None, return_final_state=False, reset=None, implementation=None,
                      tuning=None, xz_packed=False):
    """Causal conv + SiLU, the x / Δ projections and the selective scan (softplus Δ, D, z gate).

    Args:
      x: [Bt, T, E] pre-conv input (the first half of in_proj's output), float32 / bf16 / f16: the
        compute dtype of the two matmuls and of y. With `xz_packed=True`: in_proj's whole output
        [Bt, T, 2E], the conv input in its first E channels and the gate z in its last E.
      z: [Bt, T, E] gate (y is multiplied by silu(z)), or None (no gate; must be None when packed).
      conv_kernel: [K, E] depthwise taps (`kernel[k, e] = torch conv1d.weight[e, 0, k]`); conv_bias: [E] or None.
      x_proj_kernel: [E, R + 2N] (Δin | B | C). dt_proj_kernel: [R, E]. dt_bias: [E] or None (added to
        delta before the thresholded softplus).
      A: [E, N] state matrix (negative; float32). D: [E] skip, or None.
      initial_state: a `Mamba1CoreState` (conv [Bt, K-1, E], ssm [Bt, E, N]) or None (zeros).
      return_final_state: also return the state after the last position.
      reset: optional [Bt] or [Bt, T] bool mask; True zeroes both states entering that row (at that
        position): the conv sees nothing before it, the scan restarts from 0.
      implementation: None (see the module docstring), "reference", "xla" or "pallas".
      tuning: a `SelectiveScanTuning` (None: the current `jmamba.ops.tuning` settings of selective_scan).
      xz_packed: x is the packed [Bt, T, 2E] array (above). Same values as passing its two halves;
        the Pallas implementation then reads both halves in place and returns x's cotangent packed
        the same way, so neither direction copies them apart (in_proj stays one matmul).

    Returns:
      y [Bt, T, E] in x.dtype, or (y, Mamba1CoreState) when return_final_state (both float32).
    """
    check_bool("xz_packed", xz_packed)
    args = normalize_arguments(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                               initial_state, reset, xz_packed=xz_packed)
    check_bool("return_final_state", return_final_state)
    tuning = current_tuning(SCAN_OP, tuning)
    if implementation is None:
        implementation = dispatch.preferred(OP) or dispatch.preferred(SCAN_OP)
    impl = dispatch.choose(OP, implementation, x=args[0], A=args[7], initial_state=args[10], reset=args[11],
                           tuning=tuning)
    if sequence_sharded():   # time split over the mesh's `seq` axis (jmamba.ops.sequence_sharding)
        y, conv_last, h_last = mamba1_mixer_core_sequence_sharded(impl.fn, args, tuning=tuning, xz_packed=xz_packed)
        return (y, Mamba1CoreState(conv=conv_last, ssm=h_last)) if return_final_state else y
    # batch-sharded under a data-parallel mesh: x z | weights | states reset
    y, conv_last, h_last = call_batch_sharded(
        impl.fn, args, (True, True, False, False, False, False, False, False, False, True, True, True),
        tuning=tuning, xz_packed=xz_packed)
    return (y, Mamba1CoreState(conv=conv_last, ssm=h_last)) if return_final_state else y


def normalize_arguments(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                        initial_state, reset, *, xz_packed=False):
    """Validates a call; returns the implementation arguments (conv state zeros when none was given)."""
    if xz_packed:
        check_array("x", x, (None, None, None), "[batch, seqlen, 2 * d_inner] (xz_packed: x | z)")
        bsz, seqlen, e2 = shape_of(x)
        if e2 % 2:
            raise ValueError(f"x must have an even number of channels (x | z halves) with xz_packed=True, "
                             f"got shape {shape_of(x)}")
        if z is not None:
            raise ValueError("z must be None with xz_packed=True (the gate is x's second half)")
        e = e2 // 2
    else:
        check_array("x", x, (None, None, None), "[batch, seqlen, d_inner]")
        bsz, seqlen, e = shape_of(x)
    if z is not None:
        check_array("z", z, (bsz, seqlen, e), "[batch, seqlen, d_inner] like x")
    check_array("conv_kernel", conv_kernel, (None, e), "[d_conv, d_inner]")
    k = shape_of(conv_kernel)[0]
    if k < 1:
        raise ValueError(f"conv_kernel must have at least one tap, got shape {shape_of(conv_kernel)}")
    if conv_bias is not None:
        check_array("conv_bias", conv_bias, (e,), "[d_inner]")
    check_array("A", A, (e, None), "[d_inner, d_state]")
    n = shape_of(A)[1]
    check_array("dt_proj_kernel", dt_proj_kernel, (None, e), "[dt_rank, d_inner]")
    rank = shape_of(dt_proj_kernel)[0]
    check_array("x_proj_kernel", x_proj_kernel, (e, rank + 2 * n),
                f"[d_inner, dt_rank + 2 * d_state] = [{e}, {rank + 2 * n}]")
    if dt_bias is not None:
        check_array("dt_bias", dt_bias, (e,), "[d_inner]")
    if D is not None:
        check_array("D", D, (e,), "[d_inner]")
    if initial_state is None:
        conv_state, ssm_state = jnp.zeros((bsz, k - 1, e), jnp.float32), None
    elif isinstance(initial_state, Mamba1CoreState):
        conv_state, ssm_state = initial_state
        check_array("initial_state.conv", conv_state, (bsz, k - 1, e), "[batch, d_conv - 1, d_inner]")
        check_array("initial_state.ssm", ssm_state, (bsz, e, n), "[batch, d_inner, d_state]")
    else:
        raise TypeError(f"initial_state must be a jmamba.ops.Mamba1CoreState (conv, ssm) or None, "
                        f"got {type(initial_state).__name__}")
    reset = normalize_reset(reset, bsz, seqlen)
    return (x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state, ssm_state,
            reset)


def _always(**_):
    return None


def _load_reference():
    from jmamba.ops.mamba1_mixer.composed import reference
    return dispatch.Implementation(reference(), _always)


def _load_xla():
    from jmamba.ops.mamba1_mixer.composed import xla
    return dispatch.Implementation(xla(), _always)


def _load_pallas():
    from jmamba.ops.mamba1_mixer.pallas import implementation
    return implementation()


dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)
dispatch.register(OP, "pallas", _load_pallas)
