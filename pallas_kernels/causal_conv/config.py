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
    program, power of two), num_warps (Triton warps per program)."""

    block_t: int = 32
    block_e: int = 64
    num_warps: int = 1

    def validate(self) -> "ConvBlockConfig":
        for name in ("block_t", "block_e", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"ConvBlockConfig.{name} must be a positive power of two, got {v!r}")
        return self


DEFAULT_CONV_CONFIG = ConvBlockConfig()
