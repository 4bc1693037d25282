"""The configuration side of the fused AdamW kernel: its per-step scalars, launch shape and the
dtypes of its optional compute copy.

No Pallas import here: `jmamba.optim` imports these types at `import jmamba`, and the kernel
(kernel.py) is loaded only when a step first runs it. The update these scalars parameterize is
documented in kernel.py.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32, SIXTEEN_BIT_FLOATS
from pallas_kernels.common.sizes import is_power_of_2

# Dtypes the kernel can also write the new parameters in (`compute_dtype`): bfloat16, float16.
COMPUTE_DTYPES = SIXTEEN_BIT_FLOATS


class AdamWStepScalars(NamedTuple):
    """The per-step float32 scalars of the AdamW update (runtime values: changing them never recompiles).

    Attributes:
      b1, one_minus_b1, b2, one_minus_b2: moment decay rates and their complements (computed in
        float64 on the host when the betas are Python floats).
      eps: added after the square root.
      step_size: lr / (1 − b1^t).
      sqrt_bc2: √(1 − b2^t).
      lr_wd: lr · weight_decay (used only on decayed leaves).
      grad_scale: multiplies the gradient (1 = none; a clipping factor or 1/loss_scale).
      skip: nonzero = leave p, m, v unchanged (e.g. non-finite gradients under loss scaling).
    """

    b1: jax.Array
    one_minus_b1: jax.Array
    b2: jax.Array
    one_minus_b2: jax.Array
    eps: jax.Array
    step_size: jax.Array
    sqrt_bc2: jax.Array
    lr_wd: jax.Array
    grad_scale: jax.Array
    skip: jax.Array

    def as_vector(self) -> jax.Array:
        return jnp.stack([jnp.asarray(s, F32).reshape(()) for s in self])


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch shape of the fused AdamW kernel.

    Attributes:
      block_size: elements per program (a power of 2).
      num_warps: Triton warps per program.
      max_leaves_per_call: leaves sharing one launch (bounds the kernel's argument list).
      interpret: run in the Pallas interpreter; None = when JAX's default backend is the CPU
        (False lets a CPU machine lower the real Triton kernel for an abstract GPU).
    """

    block_size: int = 2048
    num_warps: int = 4
    max_leaves_per_call: int = 32
    interpret: Optional[bool] = None

    def validate(self) -> "KernelConfig":
        for name in ("block_size", "num_warps", "max_leaves_per_call"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"kernel_config.{name} must be a positive int, got {v!r}")
        if self.interpret is not None and not isinstance(self.interpret, bool):
            raise ValueError(f"kernel_config.interpret must be None or a bool, got {self.interpret!r}")
        for name in ("block_size", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"kernel_config.{name} must be a power of 2, got {v}")
        return self
