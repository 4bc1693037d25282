"""`mamba3_siso_scan` with the time axis split over the mesh's `seq` axis (jmamba.ops.sequence_sharding).

Over one shard of a row without a reset, the four states (angle θ, ssm h, key k, value v) leave as
an affine function of the ones that enter, given the shard's run from zero states (θ⁰, h⁰, k⁰, v⁰):

    θ_out = wrap(θ_in + θ⁰)                      the angles add (both are sums of increments)
    k_out = R(θ_in) k⁰                           every key of the shard is rotated by θ_in as well
    v_out = v⁰
    h_out = Λ h_in + c · v_in k_inᵀ + h⁰ R(θ_in)ᵀ
with Λ = exp(Σ_t ADT_t) (the product of the decays α_t), c = (1 − σ(Trap_0))·DT_0·Λ the weight the
first step's β term gives the incoming v_in k_inᵀ after decaying to the end, and R(θ) the rotation of
the key / state dims' first 2S pairs (h⁰ R(θ_in)ᵀ rotates h⁰'s key axis: h accumulates v kᵀ). A row
with a reset in its shard leaves with (θ⁰, h⁰, k⁰, v⁰): nothing from before the reset survives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanState, rotate_pairs, wrap_angle, zero_states
from jmamba.ops.sequence_sharding import any_reset, call_sequence_sharded, gather_and_fold, keep

# Q K V ADT DT Trap Q_bias K_bias Angles D z state reset
ROLES = ("time",) * 6 + ("weights", "weights", "time", "weights", "time", "rows", "time")


def transfer(summary, s):
    """The states after a shard from the states before it (module docstring)."""
    kept, decay, prev_weight, zero = summary
    theta_in = keep(kept, s.angle)
    ssm = (decay[..., None, None] * s.ssm + prev_weight[..., None, None] * s.v[..., :, None] * s.k[..., None, :]
           + rotate_pairs(zero.ssm, theta_in[:, :, None, :]))
    return Mamba3ScanState(wrap_angle(theta_in + zero.angle), ssm, rotate_pairs(zero.k, theta_in), zero.v)


def mamba3_siso_scan_sequence_sharded(fn, args, *, tuning):
    """The implementation `fn` (contract of mamba3_siso_scan/api.py) over time shards; same results."""

    def body(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, states, reset):
        bsz, _, H, P = V.shape
        acc = accum_dtype(Q.dtype, V.dtype, ADT.dtype, DT.dtype, Angles.dtype,
                          *([] if states is None else [s.dtype for s in states]))
        run = lambda st: fn(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, st, reset, tuning=tuning)
        _, zero = run(None)                                                             # pass 1
        kept = ~any_reset(reset, bsz)
        decay = keep(kept, jnp.exp(jnp.sum(ADT.astype(acc), axis=1)))                  # [Bt, H]
        prev_weight = (1.0 - jax.nn.sigmoid(Trap[:, 0].astype(acc))) * DT[:, 0].astype(acc) * decay
        summary = (kept, decay, prev_weight, Mamba3ScanState(*(s.astype(acc) for s in zero)))
        initial = (zero_states(bsz, H, P, Q.shape[-1], Angles.shape[-1], acc) if states is None
                   else Mamba3ScanState(*(s.astype(acc) for s in states)))
        entering, final = gather_and_fold(summary, initial, transfer)
        out, _ = run(Mamba3ScanState(*(s.astype(z0.dtype) for s, z0 in zip(entering, zero))))   # pass 2
        return out, tuple(s.astype(z0.dtype) for s, z0 in zip(final, zero))

    return call_sequence_sharded(body, args, ROLES, ("time", "rows"), op="mamba3_siso_scan")
