"""The "pallas" implementation of `add_rms_norm`: one `custom_vjp` around the two kernels of
`pallas_kernels.rms_norm` (one pass over the rows each way).

Forward: h = residual + x (float32), y = (h·r)·weight, r = 1/√(mean(h²) + eps) per row.
Saved for the backward: h (which the next layer keeps anyway: it is the stream), weight and r [N];
nothing in the output dtype. Backward: one kernel forms the norm's cotangent of h, adds the incoming
cotangent of h and writes the sum in float32 (the residual's cotangent) and in x's dtype (x's, the
same values), with per-block partials of dweight summed by XLA in a fixed order (deterministic).

Numerics: the reference's float32 formulas (reference.py) up to the order of the row sums (the mean
square, Σ g·x̂) and of dweight's sum over rows; h is bit-identical to the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmamba.ops.pallas_platform import interpret_mode, triton_platform_reason

F32 = jnp.float32


def supported(*, platform, x, residual, weight, **_):
    """None when the kernels can run the call (float32 residual stream, a [D] weight), else why not."""
    reason = triton_platform_reason(platform, "the Pallas add + RMSNorm kernel")
    if reason:
        return reason
    if residual is not None and jnp.dtype(residual.dtype) != jnp.dtype(F32):
        return f"the kernels keep the residual stream in float32, got residual dtype {residual.dtype}"
    if residual is None and jnp.dtype(x.dtype) == jnp.dtype(jnp.float64):
        return "the kernels compute in float32, got float64 x"
    if jnp.ndim(weight) != 1:
        return f"the kernels take a [D] weight, got shape {jnp.shape(weight)}"
    return None


def add_rms_norm_pallas(x, residual, weight, *, eps, out_dtype, tuning=None):
    """The op's implementation signature (api.py); `tuning.pallas_config`: a NormBlockConfig or None."""
    static = (float(eps), jnp.dtype(out_dtype), tuning and tuning.pallas_config, interpret_mode(),
              jnp.dtype(x.dtype))
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, d)
    if residual is None:
        return _norm(static, x2, weight).reshape(x.shape), x
    y, h = _add_norm(static, x2, residual.reshape(-1, d), weight)
    return y.reshape(x.shape), h.reshape(lead + (d,))


def _kernel_args(static):
    eps, out_dtype, config, interpret, _ = static
    return dict(config=config, interpret=interpret), eps, out_dtype


# ------------------------------------------------------------------------- with a residual: (y, h)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _add_norm(static, x, residual, weight):
    return _add_norm_fwd(static, x, residual, weight)[0]


def _add_norm_fwd(static, x, residual, weight):
    from pallas_kernels.rms_norm import add_rms_norm_forward
    kw, eps, out_dtype = _kernel_args(static)
    y, h, r = add_rms_norm_forward(x, residual, weight, eps=eps, out_dtype=out_dtype, **kw)
    return (y, h), (h, r, weight)


def _add_norm_bwd(static, res, cotangents):
    from pallas_kernels.rms_norm import add_rms_norm_backward
    h, r, weight = res
    dy, dh = cotangents
    kw, _, _ = _kernel_args(static)
    dx, d_res, dw = add_rms_norm_backward(h, r, weight, dy, dh.astype(F32), x_dtype=static[-1],
                                          with_stream=True, **kw)
    return dx, d_res, dw.astype(weight.dtype)


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


# ---------------------------------------------------------------------- without a residual: y only
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(static, x, weight):
    return _norm_fwd(static, x, weight)[0]


def _norm_fwd(static, x, weight):
    from pallas_kernels.rms_norm import add_rms_norm_forward
    kw, eps, out_dtype = _kernel_args(static)
    y, _, r = add_rms_norm_forward(x, None, weight, eps=eps, out_dtype=out_dtype, **kw)
    return y, (x, r, weight)


def _norm_bwd(static, res, dy):
    from pallas_kernels.rms_norm import add_rms_norm_backward
    x, r, weight = res
    kw, _, _ = _kernel_args(static)
    dx, _, dw = add_rms_norm_backward(x, r, weight, dy, None, x_dtype=x.dtype, with_stream=False, **kw)
    return dx, dw.astype(weight.dtype)


_norm.defvjp(_norm_fwd, _norm_bwd)


def implementation():
    from jmamba.ops import dispatch

    return dispatch.Implementation(add_rms_norm_pallas, supported)
