"""The plain-JAX RMSNorm (with its memory-lean custom VJP) and the add + RMSNorm composition.

`rms_norm` is the functional norm every jmamba model uses (`jmamba.layers.RMSNorm` calls it);
`add_rms_norm_reference` is the "reference" / "xla" implementation of `jmamba.ops.add_rms_norm`:
h = residual + x, y = rms_norm(h, weight), two XLA fusions each way that autodiff differentiates.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype


def rms_norm(x, weight, eps, out_dtype=None):
    """Functional RMSNorm over the last axis.

    Args:
      x: [..., D] any float dtype; normalized in float32.
      weight: [D] (or any shape that broadcasts against x, e.g. [H, P] for x [..., H, P]).
      eps: added to the mean square inside the square root (a Python float: static).
      out_dtype: dtype of the result (default: x.dtype).

    Backward: a custom VJP that saves only x (its own dtype), weight and the per-row
    r = rsqrt(mean(x²) + eps) [..., 1] in the accumulation dtype (float32; float64 for float64 x),
    instead of autodiff's float32 x·r [..., D] and the rounded output. It recomputes x̂ = x·r and,
    in that dtype, with g = dy·w: dx = r·(g − x̂·mean(g·x̂)) (cast to x.dtype) and
    dw = Σ dy·x̂ over the broadcast (leading) axes (cast to weight.dtype). Reverse mode only:
    `jax.jvp` / `jacfwd` through it raise (a custom_vjp has no forward rule).
    """
    return _rms_norm(x, weight, float(eps), None if out_dtype is None else jnp.dtype(out_dtype))


def add_rms_norm_reference(x, residual, weight, *, eps, out_dtype, tuning=None):
    """(y, h): h = residual + x in residual's dtype (h = x without a residual), y = rms_norm(h, weight)."""
    h = x if residual is None else residual + x.astype(residual.dtype)
    return rms_norm(h, weight, eps, out_dtype), h


def _forward(x, weight, eps, out_dtype):
    """The forward (the exact ops of the autodiff version) -> (y, r [..., 1] accumulation dtype)."""
    acc = accum_dtype(x.dtype)
    xf = x.astype(acc)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf * r * weight.astype(acc)
    return y.astype(out_dtype or x.dtype), r


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, out_dtype):
    return _forward(x, weight, eps, out_dtype)[0]


def _rms_norm_fwd(x, weight, eps, out_dtype):
    y, r = _forward(x, weight, eps, out_dtype)
    return y, (x, weight, r)


def _rms_norm_bwd(eps, out_dtype, res, dy):
    x, weight, r = res                                    # x [..., D], weight [D], r [..., 1]
    acc = accum_dtype(x.dtype)                            # = r.dtype: float32 (float64 for float64 x)
    xhat = x.astype(acc) * r                              # [..., D]
    dy = dy.astype(acc)
    g = dy * weight.astype(acc)                           # dL/dx̂
    dx = r * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    # dw: Σ dy·x̂ over the axes weight was broadcast along (the leading ones, and any size-1 axis)
    dw = jnp.sum(dy * xhat, axis=tuple(range(x.ndim - weight.ndim)))
    dw = jnp.sum(dw, axis=tuple(i for i, n in enumerate(weight.shape) if n < dw.shape[i]), keepdims=True)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
