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


def _load_reference():
    from jmamba.ops.adamw.reference import adamw_update_reference
    return dispatch.Implementation(adamw_update_reference, lambda **_: None)


def _load_pallas():
    from jmamba.ops.adamw.pallas import implementation
    return implementation()


register_tuning(OP, AdamWTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_reference)
dispatch.register(OP, "pallas", _load_pallas)
