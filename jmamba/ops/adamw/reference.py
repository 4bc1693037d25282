"""Plain-JAX implementation of `adamw_update`: one fused elementwise loop per leaf.

XLA fuses `adamw_leaf_update` into one multi-output loop per leaf (read p, g, m, v; write p, m, v:
28 bytes per parameter), the same arithmetic as the Pallas kernel (see pallas_kernels/fused_adamw).
It is the oracle the kernel is tested against and the "xla" implementation (for a per-leaf
elementwise update the reference already is the fast XLA program).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fused_adamw import AdamWStepScalars

f32 = jnp.float32


def adamw_leaf_update(p, g, m, v, s: AdamWStepScalars, *, decay: bool):
    """One AdamW step of one leaf in plain JAX (float32), the same arithmetic as the Pallas kernel.

    Args:
      p, m, v: float32 arrays of one shape; g: a float array of that shape.
      s: this step's scalars.
      decay: apply the decoupled weight decay to this leaf.

    Returns:
      (p', m', v') float32.
    """
    g = g.astype(f32) * s.grad_scale
    m_new = s.b1 * m + s.one_minus_b1 * g
    v_new = s.b2 * v + s.one_minus_b2 * (g * g)
    denom = jnp.sqrt(v_new) / s.sqrt_bc2 + s.eps
    step = s.step_size * (m_new / denom)
    # One rounding at the parameter's scale (see pallas_kernels/fused_adamw/kernel.py on torch's two).
    p_new = p - (s.lr_wd * p + step if decay else step)
    keep = s.skip != 0
    return jnp.where(keep, p, p_new), jnp.where(keep, m, m_new), jnp.where(keep, v, v_new)


def adamw_update_reference(ps, gs, ms, vs, scalars, decay, *, compute_dtype, tuning=None):
    """The op's implementation signature (see api.py): lists of leaves in, lists out."""
    del tuning
    outs = [adamw_leaf_update(p, g, m, v, scalars, decay=d) for p, g, m, v, d in zip(ps, gs, ms, vs, decay)]
    new_p = [o[0] for o in outs]
    new_c = None if compute_dtype is None else [p.astype(compute_dtype) for p in new_p]
    return new_p, [o[1] for o in outs], [o[2] for o in outs], new_c
