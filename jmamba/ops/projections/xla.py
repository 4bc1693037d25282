"""The "xla" split_dense: the reference forward with a custom VJP whose dx sum has no barrier (api.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmamba.ops.projections.reference import barrier_copies, column_blocks, split_dense_reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def split_dense_summed_dx(x, w, sizes):
    """(x·w_0, x·w_1, ...) for the column blocks w_i of w: x [..., d_in], w [d_in, d_out]."""
    return split_dense_reference(x, w, sizes)


def _forward(x, w, sizes):
    return split_dense_reference(x, w, sizes), (x, w)


def _backward(sizes, residuals, cotangents):
    """dw_i = xᵀ·dy_i on barrier copies of x (kept apart from each other: no merged matmul over a
    concatenated cotangent); dx = dy_0·w_0ᵀ + (dy_1·w_1ᵀ + (... + dy_k·w_kᵀ)), right to left, with
    nothing between a product and its sum.

    Why right to left: XLA's GEMM rewriter folds `add(gemm, c)` into the GEMM as its matrix bias (cuBLAS
    beta = 1) only while that GEMM has no bias yet, and it takes the first operand of the add that is a
    GEMM: in (g0 + g1) + g2 the outer add finds g1's GEMM already biased with g0 and stays an add, while
    in g0 + (g1 + g2) both adds fold. On Hopper the rewriter sees these dots as cuBLAS calls only with
    the XLA option `xla_gpu_triton_gemm_any=false`; by default they become Triton GEMM fusions before it
    runs and the adds one loop fusion (measured in isolation on an H100, session 41:
    benchmarks/notes_training_step.md)."""
    x, w = residuals
    blocks = column_blocks(w, sizes)
    lead = tuple(range(x.ndim - 1))
    # dy_iᵀ·x then transposed, as JAX's own transpose of the forward matmul forms it
    dws = [jax.lax.dot_general(dy, xi, ((lead, lead), ((), ()))).T.astype(w.dtype)
           for xi, dy in zip(barrier_copies(x, len(blocks)), cotangents)]
    dx = None
    for dy, wi in reversed(list(zip(cotangents, blocks))):
        term = jnp.dot(dy, wi.T).astype(x.dtype)
        dx = term if dx is None else term + dx
    return dx, jnp.concatenate(dws, axis=1)


split_dense_summed_dx.defvjp(_forward, _backward)
