"""`adamw_update`: one AdamW step over lists of parameter leaves (torch.optim.AdamW numerics).

    m' = b1·m + (1 − b1)·g·s,  v' = b2·v + (1 − b2)·(g·s)²
    p' = p − lr·wd·p·[decay] − step_size · m' / (√v' / √bc2 + eps)          (all float32)

with the step's scalars (`step_scalars`: lr/bc1, √bc2, lr·wd, the gradient factor s, skip) built
once per step; `skip` != 0 returns p, m, v unchanged. This is the op behind `jmamba.fused_adamw`
(the optax transformation lives in `jmamba.optim`); its implementations: "reference" / "xla"
(plain JAX, one fused loop per leaf) and "pallas" (one kernel pass over all leaves, in place).

Implementation contract:

    fn(ps, gs, ms, vs, scalars, decay, *, compute_dtype, tuning)
        -> (new_ps, new_ms, new_vs, compute_copies or None)        (lists in the input order)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jmamba.ops import dispatch
from jmamba.ops.settings import current_tuning, register_tuning
from pallas_kernels.fused_adamw import KernelConfig as AdamWKernelConfig   # a plain config class

OP = "adamw_update"
FLAT_OP = "adamw_update_flat"
COMPUTE_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class AdamWTuning:
    """Tuning of `adamw_update`: `pallas_config`, an `AdamWKernelConfig` (launch shape of the fused
    kernel) or None (its default)."""

    pallas_config: Any = None

    def __post_init__(self):
        if self.pallas_config is not None:
            if not isinstance(self.pallas_config, AdamWKernelConfig):
                raise TypeError(f"pallas_config must be an AdamWKernelConfig or None, got "
                                f"{type(self.pallas_config).__name__}")
            self.pallas_config.validate()


def adamw_update(params, grads, mus, nus, scalars, decay, *, compute_dtype=None, implementation=None,
                 tuning=None):
    """One AdamW step of every leaf.

    Args:
      params, mus, nus: lists of float32 arrays (leaf k of each has the same shape).
      grads: list of float arrays shaped like params.
      scalars: this step's `AdamWStepScalars` (`step_scalars(...)`).
      decay: one Python bool per leaf (False: no weight decay).
      compute_dtype: None, or bfloat16 / float16: also return the new params in that dtype.
      implementation: None (automatic: the kernel on a CUDA GPU), "reference", "xla" or "pallas".
      tuning: an `AdamWTuning` (None: the current `jmamba.ops.tuning` settings).

    Returns:
      (new_params, new_mus, new_nus, compute_params or None), lists.
    """
    n = len(params)
    for name, xs in (("grads", grads), ("mus", mus), ("nus", nus), ("decay", decay)):
        if len(xs) != n:
            raise ValueError(f"{name} must have one entry per parameter leaf ({n}), got {len(xs)}")
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in [jnp.dtype(d) for d in COMPUTE_DTYPES]:
        raise ValueError(f"compute_dtype must be None, bfloat16 or float16, got {compute_dtype!r}")
    tuning = current_tuning(OP, tuning)
    impl = dispatch.choose(OP, implementation)
    return impl.fn(list(params), list(grads), list(mus), list(nus), scalars, list(decay),
                   compute_dtype=None if compute_dtype is None else jnp.dtype(compute_dtype), tuning=tuning)


def adamw_update_flat(flat_params, grads, flat_mus, flat_nus, scalars, decay, *, offsets,
                      implementation=None, tuning=None):
    """`adamw_update` for leaves that live inside three flat float32 buffers (a flat TrainState).

    Leaf k is elements [offsets[k], offsets[k] + grads[k].size) of each buffer, row-major; its
    gradient is the separate array grads[k]. Elements outside every leaf (padding) are returned
    unchanged. Each leaf's values are bit-identical to `adamw_update` on that leaf with the same
    implementation.

    Args:
      flat_params, flat_mus, flat_nus: 1-D float32 arrays of one length.
      grads: list of float arrays; offsets: one static int per leaf (ranges must not overlap).
      scalars, decay, tuning: as `adamw_update` (the same `AdamWTuning`).
      implementation: None (automatic; follows `dispatch.prefer("adamw_update", ...)`), "reference",
        "xla" or "pallas".

    Returns:
      (new_flat_params, new_flat_mus, new_flat_nus). Under a donating jit the Pallas kernel updates
      the buffers in place.
    """
    n = len(grads)
    for name, xs in (("offsets", offsets), ("decay", decay)):
        if len(xs) != n:
            raise ValueError(f"{name} must have one entry per leaf ({n}), got {len(xs)}")
    for name, x in (("flat_params", flat_params), ("flat_mus", flat_mus), ("flat_nus", flat_nus)):
        if jnp.result_type(x) != jnp.float32 or jnp.ndim(x) != 1 or jnp.shape(x) != jnp.shape(flat_params):
            raise ValueError(f"{name} must be a 1-D float32 array of flat_params' length, got "
                             f"{jnp.result_type(x)}{list(jnp.shape(x))}")
    tuning = current_tuning(OP, tuning)
    impl = dispatch.choose(FLAT_OP, implementation if implementation is not None else dispatch.preferred(OP))
    return impl.fn(flat_params, list(grads), flat_mus, flat_nus, scalars, list(decay),
                   offsets=tuple(int(o) for o in offsets), tuning=tuning)


def _load_reference():
    from jmamba.ops.adamw.reference import adamw_update_reference
    return dispatch.Implementation(adamw_update_reference, lambda **_: None)


def _load_pallas():
    from jmamba.ops.adamw.pallas import implementation
    return implementation()


def _load_flat_reference():
    from jmamba.ops.adamw.reference import adamw_update_flat_reference
    return dispatch.Implementation(adamw_update_flat_reference, lambda **_: None)


def _load_flat_pallas():
    from jmamba.ops.adamw.pallas import flat_implementation
    return flat_implementation()


register_tuning(OP, AdamWTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_reference)
dispatch.register(OP, "pallas", _load_pallas)
dispatch.register(FLAT_OP, "reference", _load_flat_reference)
dispatch.register(FLAT_OP, "xla", _load_flat_reference)
dispatch.register(FLAT_OP, "pallas", _load_flat_pallas)
