"""`selective_scan` with the time axis split over the mesh's `seq` axis (jmamba.ops.sequence_sharding).

A shard's transition of the scan state is h_out = Λ ⊙ h_in + h⁰ with
    Λ[b, e, n] = exp(A[e, n] · Σ_t δ_t[b, e])   (0 when the shard holds a reset of row b)
    h⁰         = the shard's final state from h_in = 0,
δ_t the processed step size (bias added, softplus when asked). Each device forms (Λ, h⁰) for its
shard, the summaries are gathered and folded in order, and the shard is run again from its true
incoming state. Λ is formed from the step sizes in float32 (the kernel multiplies the per-step
decays instead: the two differ by rounding only).
"""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.selective_scan.common import prepare_delta
from jmamba.ops.sequence_sharding import any_reset, call_sequence_sharded, gather_and_fold, keep

# u delta A B C D z delta_bias h0 reset
ROLES = ("time", "time", "weights", "time", "time", "weights", "time", "weights", "rows", "time")


def shard_decay(delta, delta_bias, delta_softplus, A, reset, acc):
    """Λ [Bt, d, n]: the product of the shard's decays, 0 for rows with a reset in the shard."""
    total = jnp.sum(prepare_delta(delta, delta_bias, delta_softplus, acc), axis=1)      # [Bt, d]
    return keep(~any_reset(reset, delta.shape[0]), jnp.exp(A.astype(acc)[None] * total[..., None]))


def selective_scan_sequence_sharded(fn, args, *, delta_softplus, tuning):
    """The implementation `fn` (contract of selective_scan/api.py) over time shards; same results."""

    def body(u, delta, A, B, C, D, z, delta_bias, h0, reset):
        acc = accum_dtype(u.dtype, delta.dtype, A.dtype, *([] if h0 is None else [h0.dtype]))
        run = lambda h: fn(u, delta, A, B, C, D, z, delta_bias, h, reset, delta_softplus=delta_softplus,
                           tuning=tuning)
        _, h_zero = run(None)                                                           # pass 1
        summary = (shard_decay(delta, delta_bias, delta_softplus, A, reset, acc), h_zero.astype(acc))
        initial = (jnp.zeros(h_zero.shape, acc) if h0 is None else h0.astype(acc))
        entering, final = gather_and_fold(summary, initial, lambda s, h: s[0] * h + s[1])
        out, _ = run(entering)                                                          # pass 2
        return out, final.astype(h_zero.dtype)

    return call_sequence_sharded(body, args, ROLES, ("time", "rows"), op="selective_scan")
