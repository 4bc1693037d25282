"""`mamba3_siso_scan_projected`: the Mamba-3 scan fed straight from in_proj's last column block.

A Mamba-3 mixer's in_proj ends in `rest` [Bt, T, R], R = 2GN + 3H + S, holding per position B, C
[G·N each], dd_dt, dd_A, trap [H each] and the raw angles [S] (shared by the heads). Between it and the
scan sit the per-position steps of docs/mamba3_siso.md §3.2 (per_position.py):

    A = min(−φ(dd_A), −A_floor),  DT = softplus(dd_dt + dt_bias),  ADT = A·DT           [Bt, T, H] float32
    B̂, Ĉ = RMSNorm(B)·w_B, RMSNorm(C)·w_C  (over N, rounded to rest's dtype)               [Bt, T, G, N]
    out, state = mamba3_siso_scan(Ĉ, B̂, V, ADT, DT, trap, C_bias, B_bias, angles, D, z)

As XLA ops that is ~50 launches a layer (slices of rest, the norms, the trapezoid weights, the layout
permutation; backward their transposes and the concatenate of eight cotangents into d rest). When the
scan runs its Pallas kernels, this op instead runs one kernel forward and one backward around them
(pallas_kernels/mamba3_siso/projection.py: rest read once, d rest written once) with the same formulas
(the per-head ones are per_position.py's `per_head`, differentiated inside the kernel by `jax.vjp`). Otherwise
(another implementation, reset masks, a `seq` mesh, a geometry the kernels do not fit, or
`Mamba3ScanConfig.fuse_projection` off; on by default since session 31) it is exactly
that composition, with `qk_norm` for the norms.
"""

from __future__ import annotations

import functools

from jmamba.core.validation import check_array, check_bool, check_float, shape_of
from jmamba.ops import dispatch
from jmamba.ops.batch_sharding import call_batch_sharded
from jmamba.ops.mamba3_siso_scan.api import OP, mamba3_siso_scan, normalize_arguments
from jmamba.ops.mamba3_siso_scan.common import Mamba3QKNorm, Mamba3ScanState
from jmamba.ops.mamba3_siso_scan.per_position import projected_inputs
from jmamba.ops.sequence_sharding import sequence_sharded
from jmamba.ops.settings import current_tuning


def mamba3_siso_scan_projected(rest, V, z, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, ngroups,
                               A_floor, norm_eps, initial_state=None, return_final_state=False, reset=None,
                               implementation=None, tuning=None):
    """The scan of one Mamba-3 mixer from in_proj's rest block (module docstring).

    Args:
      rest: [Bt, T, 2GN + 3H + S] float (in_proj's compute dtype).
      V: [Bt, T, H, P] the values x; z: [Bt, T, H, P] gate or None.
      dt_bias: [H]; B_norm_weight, C_norm_weight: [N]; B_bias, C_bias: [H, N]; D: [H] or None.
      ngroups: G; A_floor: A <= −A_floor (a float >= 0); norm_eps: the B/C norms' epsilon (> 0).
      initial_state, return_final_state, reset, implementation, tuning: as `mamba3_siso_scan`
        (`implementation` names the scan's).

    Returns:
      out [Bt, T, H, P] in V.dtype, or (out, Mamba3ScanState) when return_final_state.
    """
    check_array("V", V, (None, None, None, None), "[batch, seqlen, nheads, headdim]")
    bsz, T, H, P = shape_of(V)
    check_array("B_norm_weight", B_norm_weight, (None,), "[d_state]")
    N = shape_of(B_norm_weight)[0]
    check_array("C_norm_weight", C_norm_weight, (N,), "[d_state] like B_norm_weight")
    if isinstance(ngroups, bool) or not isinstance(ngroups, int) or ngroups < 1 or H % ngroups:
        raise ValueError(f"ngroups must be a positive int dividing the number of heads ({H}), got {ngroups!r}")
    G = ngroups
    check_float("rest", rest)
    R = shape_of(rest)[-1] if len(shape_of(rest)) == 3 else None
    S = None if R is None else R - 2 * G * N - 3 * H
    if R is None or shape_of(rest)[:2] != (bsz, T) or S < 0 or 2 * S > N:
        raise ValueError(f"rest must have shape [batch, seqlen, 2·G·N + 3·H + S] = [{bsz}, {T}, {2 * G * N + 3 * H} + S] "
                         f"with 0 <= S <= N/2 = {N // 2} (G={G}, N={N}, H={H}), got {shape_of(rest)}")
    check_array("dt_bias", dt_bias, (H,), "[nheads]")
    check_array("B_bias", B_bias, (H, N), "[nheads, d_state]")
    check_array("C_bias", C_bias, (H, N), "[nheads, d_state]")
    check_bool("return_final_state", return_final_state)
    A_floor, norm_eps = float(A_floor), float(norm_eps)
    if not norm_eps > 0 or not A_floor >= 0:
        raise ValueError(f"norm_eps must be > 0 and A_floor >= 0, got {norm_eps} and {A_floor}")
    tuning = current_tuning(OP, tuning)
    B, C, ADT, DT, trap, angles = projected_inputs(rest, dt_bias, ngroups=G, d_state=N, nheads=H, A_floor=A_floor)
    qk_norm = Mamba3QKNorm(C_norm_weight, B_norm_weight, norm_eps)
    # every argument checked as the scan checks it, whichever path runs (z, D, the biases, the state, reset)
    _, _, _, _, _, _, _, _, shared_angles, _, _, states, reset_mask = normalize_arguments(
        C, B, V, ADT, DT, trap, C_bias, B_bias, angles, D, z, initial_state, reset)

    def composition(impl_name):
        return mamba3_siso_scan(C, B, V, ADT, DT, trap, C_bias, B_bias, angles, D, z, initial_state=initial_state,
                                return_final_state=return_final_state, reset=reset, implementation=impl_name,
                                tuning=tuning, qk_norm=qk_norm)

    if T == 0:
        return composition(implementation)
    impl = dispatch.choose(OP, implementation, Q=C, V=V, Angles=shared_angles, initial_state=states,
                           reset=reset_mask, tuning=tuning)
    fused = getattr(impl.fn, "projected", None)
    # (a reset mask never reaches here with the Pallas scan: its `supported` refuses them)
    if fused is None or reset_mask is not None or sequence_sharded() or not fused.fits(
            N=N, S=S, config=tuning.pallas_config):
        return composition(implementation)
    run = functools.partial(fused, groups=G, A_floor=A_floor, eps=norm_eps, tuning=tuning)
    out, final = call_batch_sharded(
        lambda *a, **k: run(*a), (rest, V, z, states, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D),
        (True, True, True, True, False, False, False, False, False, False))
    return (out, Mamba3ScanState(*final)) if return_final_state else out
