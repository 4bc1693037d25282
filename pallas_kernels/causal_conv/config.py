"""Static tiling of the causal-conv kernels: `block_t` positions x `block_e` channels per program.

A program loads its [block_t, block_e] rows of each operand one row at a time (static indices, so
every load of the program is in flight at once), plus `halo` rows before (and, in the backward,
after) its block, where halo = the next power of two >= d_conv - 1 rows (4 for d_conv = 4).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2


@dataclasses.dataclass(frozen=True)
class ConvBlockConfig:
    """Attributes: block_t (positions per program, power of two >= the halo), block_e (channels per
    program, power of two), num_warps (Triton warps per program);
    fast_math: the sigmoid as 1 / (1 + 2^(−c·log2 e)) with the hardware ex2 and rcp.approx (one
      instruction each; ~4e-6 relative against float64, `selective_scan.kernel_math`) instead of
      libdevice's exp and an IEEE division (~10 instructions);
    fused_multiply_add: the taps' and the weight sums' a·b + c as one `fma.rn.f32` (XLA does not let
      the compiler contract them; one rounding instead of two).
    Both change only the float32 rounding inside the kernels and only on the GPU (the interpreter
    computes the exact forms). Off by default until timed on the H200: the backward kernel compiles
    to 255 registers at one warp and ~81 SASS instructions per element (benchmarks/triton_inspect.py
    conv), so it is instruction-bound well above its ~40 µs byte floor at B=8 T=2048."""

    block_t: int = 32
    block_e: int = 64
    num_warps: int = 1
    fast_math: bool = False
    fused_multiply_add: bool = False

    def validate(self) -> "ConvBlockConfig":
        for name in ("block_t", "block_e", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"ConvBlockConfig.{name} must be a positive power of two, got {v!r}")
        for name in ("fast_math", "fused_multiply_add"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ConvBlockConfig.{name} must be a bool, got {getattr(self, name)!r}")
        return self


DEFAULT_CONV_CONFIG = ConvBlockConfig()
