"""Plain-JAX implementation of `adamw_update`: one fused elementwise loop per leaf.

XLA fuses `adamw_leaf_update` into one multi-output loop per leaf (read p, g, m, v; write p, m, v:
28 bytes per parameter), the same arithmetic as the Pallas kernel (see pallas_kernels/fused_adamw).
It is the oracle the kernel is tested against and the "xla" implementation (for a per-leaf
elementwise update the reference already is the fast XLA program).
"""

from __future__ import annotations

import jax
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


def adamw_update_flat_reference(flat_p, gs, flat_m, flat_v, scalars, decay, *, offsets, tuning=None):
    """`adamw_update_flat` in plain JAX: each leaf's window sliced out and updated by
    `adamw_leaf_update`, and each buffer rebuilt by one concatenate of the new windows and the
    untouched gaps (one pass over the buffers; per-leaf in-place updates of one buffer would make XLA
    copy the whole buffer per leaf)."""
    del tuning
    order = sorted((off, k) for k, off in enumerate(offsets) if gs[k].size)
    new = {}
    for off, k in order:
        g = gs[k]
        window = lambda x: jax.lax.slice(x, (off,), (off + g.size,)).reshape(g.shape)   # noqa: E731
        new[k] = adamw_leaf_update(window(flat_p), g, window(flat_m), window(flat_v), scalars, decay=decay[k])

    def rebuild(old, which):
        parts, end = [], 0
        for off, k in order:
            if off > end:
                parts.append(jax.lax.slice(old, (end,), (off,)))
            parts.append(new[k][which].reshape(-1))
            end = off + gs[k].size
        if end < old.shape[0]:
            parts.append(jax.lax.slice(old, (end,), (old.shape[0],)))
        return jnp.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else old)

    return rebuild(flat_p, 0), rebuild(flat_m, 1), rebuild(flat_v, 2)
