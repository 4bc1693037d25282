"""Global-norm gradient clipping with torch semantics (`torch.nn.utils.clip_grad_norm_`).

    norm = sqrt(Σ_leaves Σ g²)                 (float32, `jmamba.ops.sum_of_squares` over the leaves)
    coef = max_norm / (norm + 1e-6);  g ← g · coef  only when coef < 1

The pre-clip norm is reported. `sum_of_squares` combines its partial sums in a fixed order, so the
result does not depend on scheduling. On one CUDA GPU it reads every leaf in one kernel launch; on the
CPU and under a multi-device mesh it reduces each leaf with XLA and adds the sums in tree order
(`dispatch.prefer("sum_of_squares", "xla")` asks for that everywhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba import ops

CLIP_EPS = 1e-6


def global_norm(tree) -> jax.Array:
    """sqrt(Σ over every leaf of Σ x²), float32 scalar (leaves: float16 / bfloat16 / float32 arrays)."""
    return jnp.sqrt(ops.sum_of_squares(jax.tree.leaves(tree)))


def clip_coefficient(norm, max_norm):
    """max_norm / (norm + 1e-6) when that is < 1, else 1 (float32 scalar)."""
    coef = max_norm / (norm + CLIP_EPS)
    return jnp.where(coef < 1.0, coef, 1.0).astype(jnp.float32)


def clip_by_global_norm(tree, max_norm):
    """Returns (clipped tree, pre-clip norm)."""
    norm = global_norm(tree)
    scale = clip_coefficient(norm, max_norm)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), tree), norm


def check_max_norm(clip_max_norm):
    if clip_max_norm is None:
        return
    if isinstance(clip_max_norm, bool) or not isinstance(clip_max_norm, (int, float)) or not clip_max_norm > 0:
        raise ValueError(f"clip_max_norm must be None or a positive number, got {clip_max_norm!r}")
