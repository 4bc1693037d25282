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
    Both change only the float32 rounding inside the kernels; the hardware forms exist only on the GPU
    (the interpreter computes the exp2 form of the sigmoid with an exact division, and a·b + c). Both on
    by default since 2026-12-06: the backward kernel compiled to 255 registers at one warp and ~81 SASS
    instructions per element (benchmarks/triton_inspect.py conv), instruction-bound well above its
    ~40 µs byte floor at B=8 T=2048; with both, 3240 instead of 5216 instructions per program
    (forward 1096 instead of 2256), and on an H100 the op's backward 287 → 263 µs per call
    (bench_causal_conv.py), the train step −1.1 ms (benchmarks/notes_training_step.md, session 27).
    loop_rows: the kernels walk the block's positions in a loop carrying a window of K-1 rows
      (rows_loop.py) instead of loading every row of the block first (kernels.py): far fewer
      registers per program (254 -> 71 in the backward), the same values. Timed on an H100
      (2026-12-06, session 28): no faster (op backward 0.251 -> 0.255 ms, train step within noise), so off."""

    block_t: int = 32
    block_e: int = 64
    num_warps: int = 1
    fast_math: bool = True
    fused_multiply_add: bool = True
    loop_rows: bool = False

    def validate(self) -> "ConvBlockConfig":
        for name in ("block_t", "block_e", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"ConvBlockConfig.{name} must be a positive power of two, got {v!r}")
        for name in ("fast_math", "fused_multiply_add", "loop_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ConvBlockConfig.{name} must be a bool, got {getattr(self, name)!r}")
        return self


DEFAULT_CONV_CONFIG = ConvBlockConfig()
