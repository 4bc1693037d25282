"""`mamba1_mixer_core` with the time axis split over the mesh's `seq` axis (jmamba.ops.sequence_sharding).

Two states cross a shard boundary:
  * conv: the last K-1 pre-conv inputs (zeroed before a reset). When a shard holds at least K-1
    positions this is a function of the shard alone (`conv_new_state`), so every device gathers the
    shards' tails first and starts from its predecessor's tail (the first shard from the given state).
  * ssm: h_out = Λ ⊙ h_in + h⁰ as for `selective_scan` (selective_scan/sequence.py), with the step
    sizes δ recomputed here from the shard's conv output (`scan_operands`, the "xla" composition's
    own preprocessing) to form Λ.
Pass 1 runs the op's implementation from (true conv tail, zero ssm state) for h⁰; pass 2 from the
true incoming states. Memory: the recomputed δ path keeps what autodiff of `scan_operands` keeps
(the shard's u and δ) for the backward of Λ.
"""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.core.axes import SEQ_AXIS
from jmamba.core.dtypes import accum_dtype
from jmamba.ops.mamba1_mixer.common import conv_new_state, scan_operands
from jmamba.ops.selective_scan.sequence import shard_decay
from jmamba.ops.sequence_sharding import call_sequence_sharded, gather_and_fold, seq_axis_size

# x z conv_kernel conv_bias x_proj_kernel dt_proj_kernel dt_bias A D conv_state ssm_state reset
ROLES = ("time", "time") + ("weights",) * 7 + ("rows", "rows", "time")


def mamba1_mixer_core_sequence_sharded(fn, args, *, tuning, xz_packed):
    """The implementation `fn` (contract of mamba1_mixer/api.py) over time shards; same results."""
    k_size = args[2].shape[0]
    shard = args[0].shape[1] // seq_axis_size()
    if shard < k_size - 1:
        raise ValueError(f"mamba1_mixer_core: each time shard ({shard} positions) must hold at least d_conv - 1 "
                         f"= {k_size - 1} positions under the mesh's '{SEQ_AXIS}' axis (the conv state is the shard's tail)")

    def body(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state, ssm_state,
             reset):
        xs = x[..., :conv_kernel.shape[1]] if xz_packed else x
        acc = accum_dtype(xs.dtype, conv_kernel.dtype, conv_state.dtype)
        tail = conv_new_state(xs, jnp.zeros(conv_state.shape, acc), reset, k_size, acc)
        conv_in, conv_final = gather_and_fold(tail, conv_state.astype(acc), lambda t, _: t)
        run = lambda h: fn(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                           conv_in.astype(conv_state.dtype), h, reset, tuning=tuning, xz_packed=xz_packed)
        _, _, h_zero = run(None)                                                        # pass 1
        _, delta, _, _, _ = scan_operands(xs, conv_in, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel,
                                          reset)
        summary = (shard_decay(delta, dt_bias, True, A, reset, acc), h_zero.astype(acc))
        initial = jnp.zeros(h_zero.shape, acc) if ssm_state is None else ssm_state.astype(acc)
        h_in, h_final = gather_and_fold(summary, initial, lambda s, h: s[0] * h + s[1])
        y, _, _ = run(h_in.astype(h_zero.dtype))                                        # pass 2
        return y, conv_final.astype(conv_state.dtype), h_final.astype(h_zero.dtype)

    return call_sequence_sharded(body, args, ROLES, ("time", "rows", "rows"), op="mamba1_mixer_core")
