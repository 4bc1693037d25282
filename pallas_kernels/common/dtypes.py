"""Dtype aliases of the kernel packages: the float32 every kernel computes in, and the 16-bit floats.

The kernels load activations in their own dtype and compute in float32; bfloat16 / float16 inputs
select tensor-core dot operands (mamba3_siso) or a low-precision parameter copy (fused_adamw).
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32
I32 = jnp.int32

# The 16-bit float types, bfloat16 first (the training dtype).
SIXTEEN_BIT_FLOATS = (jnp.bfloat16, jnp.float16)


def is_sixteen_bit_float(dtype) -> bool:
    """True for bfloat16 and float16 (any spelling jnp.dtype accepts), False for every other dtype."""
    return jnp.dtype(dtype) in tuple(jnp.dtype(d) for d in SIXTEEN_BIT_FLOATS)
