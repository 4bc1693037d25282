"""Scalar math shared by the selective-scan kernels, written with ops the Pallas-Triton lowering supports.

Every function here runs inside a kernel on float32 values (rows `[block_d]` or tiles
`[n, block_d]`), and also outside kernels in interpret mode, so only elementwise jnp ops are used.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels.common.inline_ptx import LOG2_E, f32_instruction, fast_sigmoid

SOFTPLUS_THRESHOLD = 20.0
# The kernels receive A·log2(e) ("A2") and form ā = exp2(δ·A2): on CUDA exp2 is one `ex2.approx`
# instruction (max relative error ~2^-22), exp a longer libdevice routine (the official kernel does
# the same with exp2f).
LN_2 = math.log(2.0)


def softplus_thresholded(x):
    """`x if x > 20 else log1p(exp(x))` (torch `F.softplus`, the official CUDA kernel)."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def softplus_thresholded_grad(x):
    """d softplus_thr / dx: σ(x) at or below the threshold, exactly 1 above it."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, 1.0, sigmoid(x))


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def time_step(raw, bias, softplus: bool):
    """δ = softplus_thr(raw + bias) (or raw + bias), float32. `bias` may be None."""
    x = raw.astype(jnp.float32)
    if bias is not None:
        x = x + bias
    return softplus_thresholded(x) if softplus else x


def decay(delta_row, A2_tile, keep):
    """ā = exp(δ·A) = exp2(δ·A2) as an [n, block_d] tile; `keep` (0 or 1, or None) zeroes it at a reset."""
    a = jnp.exp2(delta_row[None, :] * A2_tile)
    return a if keep is None else a * keep


# ------------------------------------------------------------------------------------ per-kernel math
# The exact forms above go through libdevice: `exp` is a range reduction plus a polynomial, `log1p`
# another polynomial with branches, a division ten instructions. In the Mamba-1 kernels softplus and
# the sigmoids run once per channel and step in every pass: ~40 of the ~160 instructions of a forward
# step (SASS of the chunk-summaries loop, benchmarks/triton_inspect.py). The fast forms below use
# the hardware's ex2 and rcp (one MUFU instruction each) and a short series:
#   σ(x)          = 1 / (1 + 2^(−x·log2 e))
#   softplus(x)   = max(x, 0) + log1p(e),  e = 2^(−|x|·log2 e) ∈ (0, 1],
#   log1p(e)      = 2·atanh(s),  s = e / (2 + e) ∈ (0, 1/3],  2·atanh(s) = 2s·Σ_k s^(2k)/(2k+1), k < 6
# (the six-term truncation is 1.5e-7 relative at s = 1/3, i.e. x = 0). Measured in float32 against
# float64 over |x| <= 20: softplus within 1.0e-6 relative (the truncation near x = 0, the rounding of
# x·log2 e at large |x|; libdevice's log1p(exp(x)) is within 2.5e-7), σ within 3.8e-6. (On the CPU,
# XLA folds 1 / (1 + 2^(−x·log2 e)) back into its own sigmoid, so the fast σ's rounding is checked
# only by the GPU test in tests/test_kernel_math.py.) The GPU forms add ex2.approx (2^-22 relative)
# and rcp.approx (1 ulp). Both are far below the bf16 rounding of the inputs (3.9e-3).
ATANH_SERIES = tuple(2.0 / (2 * k + 1) for k in range(6))


class KernelMath:
    """The scalar functions of one kernel: exact (libdevice) or fast (ex2 / rcp / series), and the
    multiply-add either as two roundings or as one `fma` instruction.

    Why a fused multiply-add needs asking for: XLA compiles the Triton kernels without letting LLVM or
    ptxas contract a multiply and an add (Nsight Compute on the H200: 19 M fused and 435 M unfused
    float32 instructions in the Mamba-1 gradients kernel), so `a * b + c` costs two instructions and
    two roundings. On the GPU `fma` emits PTX `fma.rn.f32` through inline assembly (one instruction,
    one rounding); in the interpreter (CPU tests) it is `a * b + c`.

    Args (from the kernel's ScanProblem): fast (config.fast_math), fused (config.fused_multiply_add),
    gpu (not problem.interpret: inline assembly exists only in the Triton lowering).
    """

    def __init__(self, *, fast: bool, fused: bool, gpu: bool):
        self.fast, self.fused, self.gpu = fast, fused, gpu

    @classmethod
    def of(cls, problem) -> "KernelMath":
        cfg = problem.config
        return cls(fast=cfg.fast_math, fused=cfg.fused_multiply_add, gpu=not problem.interpret)

    def fma(self, a, b, c):
        """a·b + c, float32 (one rounding on the GPU with fused_multiply_add)."""
        if self.fused and self.gpu:
            return f32_instruction("fma.rn.f32 $0, $1, $2, $3;", a, b, c)
        return a * b + c

    def reciprocal(self, x):
        """1 / x (rcp.approx.ftz on the GPU in fast mode: 1 ulp)."""
        if self.fast and self.gpu:
            return f32_instruction("rcp.approx.ftz.f32 $0, $1;", x)
        return 1.0 / x

    def sigmoid(self, x):
        if not self.fast:
            return sigmoid(x)
        return fast_sigmoid(x, gpu=self.gpu)

    def softplus(self, x):
        """`x if x > 20 else log1p(exp(x))` (the thresholded softplus), float32."""
        if not self.fast:
            return softplus_thresholded(x)
        e = jnp.exp2(jnp.abs(x) * -LOG2_E)
        s = e * self.reciprocal(2.0 + e)
        s2 = s * s
        p = jnp.full_like(s, ATANH_SERIES[-1])
        for c in reversed(ATANH_SERIES[:-1]):
            p = self.fma(p, s2, c)
        return jnp.where(x > SOFTPLUS_THRESHOLD, x, self.fma(s, p, jnp.maximum(x, 0.0)))

    def softplus_grad(self, x):
        """d softplus_thr / dx: σ(x) at or below the threshold, exactly 1 above it."""
        return jnp.where(x > SOFTPLUS_THRESHOLD, 1.0, self.sigmoid(x))

    def time_step(self, raw, softplus: bool):
        """δ = softplus_thr(raw) (or raw), float32; raw already biased."""
        x = raw.astype(jnp.float32)
        return self.softplus(x) if softplus else x

    def decay(self, delta_row, A2_tile, keep):
        """ā = exp2(δ·A2) as an [n, block_d] tile (0 at a reset)."""
        return decay(delta_row, A2_tile, keep)
