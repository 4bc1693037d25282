"""The "pallas" implementation of `log_sum_exp`: the one-pass kernel of `pallas_kernels.log_sum_exp`
over the rows [prod(leading axes), V] (a reshape, no copy). Not differentiable (the cross entropy's
custom VJP uses only its value)."""

from __future__ import annotations

import jax.numpy as jnp

from jmamba.ops.pallas_platform import interpret_mode, triton_platform_reason


def supported(*, platform, x, **_):
    reason = triton_platform_reason(platform, "the Pallas log-sum-exp kernel")
    if reason:
        return reason
    if jnp.dtype(x.dtype) == jnp.dtype(jnp.float64):
        return "the kernel computes in float32, got float64 x"
    if x.ndim < 1 or x.size == 0:
        return f"the kernel needs a non-empty [..., V] array, got shape {x.shape}"
    return None


def log_sum_exp_pallas(x, *, tuning=None):
    from pallas_kernels.log_sum_exp import row_log_sum_exp

    out = row_log_sum_exp(x.reshape(-1, x.shape[-1]), config=tuning and tuning.pallas_config,
                          interpret=interpret_mode())
    return out.reshape(x.shape[:-1])


def implementation():
    from jmamba.ops import dispatch

    return dispatch.Implementation(log_sum_exp_pallas, supported)
