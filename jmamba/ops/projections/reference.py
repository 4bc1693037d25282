"""The "reference" split_dense: one matmul per column block, each on its own barrier copy of x,
differentiated by JAX (api.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def column_blocks(w, sizes):
    """[w[:, :s0], w[:, s0:s0+s1], ...] for w [d_in, d_out]."""
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + s))
        lo += s
    return [w[:, a:b] for a, b in bounds]


def barrier_copies(x, n):
    """n copies of x that XLA cannot identify with each other (so no dot merger joins their matmuls);
    no data moves."""
    return jax.lax.optimization_barrier((x,) * n)


def split_dense_reference(x, w, sizes):
    """(x·w_0, x·w_1, ...) for the column blocks w_i of w; JAX's transpose sums dx behind a barrier."""
    blocks = column_blocks(w, sizes)
    return tuple(jnp.dot(xi, wi) for xi, wi in zip(barrier_copies(x, len(blocks)), blocks))
