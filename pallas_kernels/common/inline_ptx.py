"""Single PTX instructions inside Pallas-Triton kernels, elementwise on float32 values.

Why: XLA compiles the Triton kernels without letting LLVM or ptxas contract a multiply and an add,
and jnp's transcendental functions become libdevice routines (range reductions, polynomials,
branches). Where a kernel's inner loop is dominated by those, one hardware instruction per element
(`fma.rn`, `ex2.approx`, `rcp.approx`, `sin.approx`, `cos.approx`) is cheaper. Inline assembly
exists only in the Triton lowering: callers pass `gpu=False` in the Pallas interpreter (CPU tests)
and get the plain jnp form there.

Used by `selective_scan.kernel_math.KernelMath` and the Mamba-3 kernels' rotation, gate and decays
(`mamba3_siso.chunk_math`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def f32_instruction(asm: str, *args):
    """The PTX `asm` ("op $0, $1, ...;") applied elementwise to float32 `args` (broadcast together)."""
    from jax.experimental.pallas import triton as plt
    args = jnp.broadcast_arrays(*[jnp.asarray(a, jnp.float32) for a in args])
    constraints = ",".join(["=f"] + ["f"] * len(args))
    [out] = plt.elementwise_inline_asm(asm, args=list(args), constraints=constraints, pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out


def cos_sin_of_wrapped(theta, *, gpu: bool):
    """(cos θ, sin θ) float32 for angles already wrapped into [0, 2π), from the hardware's
    `cos.approx` / `sin.approx` on x = θ − π ∈ [−π, π), where they are accurate (about 2^-21
    absolute: CUDA's __cosf / __sinf), as cos θ = −cos x, sin θ = −sin x. A θ a rounding outside
    [0, 2π) stays within the instructions' accurate range. In the interpreter (gpu=False) the same
    shift with jnp.cos / jnp.sin, so CPU tests exercise the formula."""
    x = theta - math.pi
    if gpu:
        return -f32_instruction("cos.approx.ftz.f32 $0, $1;", x), -f32_instruction("sin.approx.ftz.f32 $0, $1;", x)
    return -jnp.cos(x), -jnp.sin(x)


LOG2_E = 1.0 / math.log(2.0)


def fast_sigmoid(x, *, gpu: bool):
    """σ(x) = 1 / (1 + 2^(−x·log2 e)) float32 from the hardware's `ex2.approx` (jnp.exp2 in the Triton
    lowering) and `rcp.approx.ftz` (1 ulp): two MUFU instructions per element instead of libdevice's
    expf and a full division (~20 instructions with their special-case tests). Within ~4e-6 relative
    of the exact σ, far below the bf16 rounding of the operands (3.9e-3). x → −∞ gives 1/∞ = 0, x → +∞
    gives 1. In the interpreter (gpu=False) the same formula with a plain division. The Mamba-1 kernels'
    fast σ (selective_scan.kernel_math.KernelMath) is this function."""
    denominator = 1.0 + jnp.exp2(x * -LOG2_E)
    if gpu:
        return f32_instruction("rcp.approx.ftz.f32 $0, $1;", denominator)
    return 1.0 / denominator
