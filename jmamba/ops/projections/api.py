"""`split_dense(x, w, sizes)`: x · w as column blocks [x·w[:, :s0], x·w[:, s0:s0+s1], ...], one matmul each.

Why: a projection whose output is split at once (Mamba-3's in_proj: z, xv and the rest) pays, as one
matmul, a copy of every block out of the packed product forward and a concatenate of every block's
cotangent back into one array backward. As separate matmuls each block is a contiguous array and each
cotangent feeds its own backward matmuls. XLA's dot merger would join matmuls that share x back into one
(forward, and the weight gradients backward), so every matmul reads its own copy of x through an
`optimization_barrier` (no data moves).

Implementations:
  "reference" (the automatic choice): the forward above, differentiated by JAX. The barrier's transpose
    puts a barrier on the blocks' input cotangents too, so dx = Σ_i dy_i·w_iᵀ is a separate elementwise
    pass over three [.., d_in] products.
  "xla": the same forward with a custom VJP: the weight gradients xᵀ·dy_i keep the barrier (one matmul
    each, no merged concatenate), while dx = dy_0·w_0ᵀ + (dy_1·w_1ᵀ + dy_2·w_2ᵀ) is formed with no barrier
    between the products and the sums, right to left: the one order in which XLA's GPU GEMM rewriter
    can fold both sums into the matmuls (cuBLAS with beta = 1; xla.py says why). On Hopper it does so
    only when the dots reach it as cuBLAS calls (XLA option `xla_gpu_triton_gemm_any=false`): by default
    they become Triton GEMM fusions first and the adds stay one loop fusion. Measured on an H100 with the
    sum left to right and default options (session 30, the Mamba-3 train step): 0.3 ms (synchronised) /
    0.6 ms (back to back) slower than "reference". Kept selectable for that A/B.
Numerics: every block is the matmul of x and its column block (as one matmul's); dw in w.dtype and dx in
x.dtype, each product rounded to that dtype as JAX's own transpose rounds it. The two implementations
differ only in how dx's sum is rounded: "reference" adds the products left to right (JAX's transpose),
"xla" right to left (on a GPU, with the GEMM rewriter's accumulation, each sum is formed in the matmul's
float32 epilogue). Tested on CPU: the blocks and dw agree to the last bit, dx is each one's order of the
same rounded products.

Implementation contract:

    fn(x, w, sizes) -> tuple of len(sizes) arrays [..., s_i] in result_type(x, w)
"""

from __future__ import annotations

from jmamba.core.validation import check_float, shape_of
from jmamba.ops import dispatch

OP = "split_dense"
# What implementation=None runs when no `dispatch.prefer` block names one (module docstring: "xla" was
# measured slower on a GPU).
AUTOMATIC = "reference"


def split_dense(x, w, sizes, *, implementation=None):
    """The column blocks of x · w, one matmul each (module docstring).

    Args:
      x: [..., d_in] float array (the activations; any leading shape, including none).
      w: [d_in, d_out] float array of x's dtype (cast it to the compute dtype first).
      sizes: positive ints summing to d_out: the widths of the blocks, in column order.
      implementation: None (a `dispatch.prefer` choice, else `AUTOMATIC`), "reference" or "xla".

    Returns:
      tuple of len(sizes) arrays, block i of shape [..., sizes[i]] in x.dtype.
    """
    check_float("x", x)
    check_float("w", w)
    xs, ws = shape_of(x), shape_of(w)
    if len(xs) < 1:
        raise ValueError(f"x must have shape [..., d_in], got {xs}")
    if len(ws) != 2 or ws[0] != xs[-1]:
        raise ValueError(f"w must have shape [d_in, d_out] with d_in = x.shape[-1] = {xs[-1]}, got {ws}")
    if x.dtype != w.dtype:
        raise TypeError(f"w must have x's dtype {x.dtype} (cast it to the compute dtype first), got {w.dtype}")
    sizes = tuple(sizes)
    if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ValueError(f"sizes must be a non-empty sequence of positive ints, got {sizes}")
    if sum(sizes) != ws[1]:
        raise ValueError(f"sizes must sum to w.shape[1] = {ws[1]} (d_out), got {sizes} (sum {sum(sizes)})")
    if implementation is None and dispatch.preferred(OP) is None:
        implementation = AUTOMATIC
    impl = dispatch.choose(OP, implementation, x=x, w=w)
    return impl.fn(x, w, sizes)


def _load_reference():
    from jmamba.ops.projections.reference import split_dense_reference
    return dispatch.Implementation(split_dense_reference, lambda **_: None)


def _load_xla():
    from jmamba.ops.projections.xla import split_dense_summed_dx
    return dispatch.Implementation(split_dense_summed_dx, lambda **_: None)


dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)
