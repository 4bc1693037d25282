"""Static tiling of the sum-of-squares kernel: `block_size` elements per program (a power of two),
`num_warps` Triton warps, at most `max_leaves_per_call` arrays per launch (each array is one pointer
argument of the kernel; the bound keeps the argument list far below CUDA's 4 KiB limit and the
per-program leaf lookup short)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2


@dataclasses.dataclass(frozen=True)
class SumOfSquaresConfig:
    """Attributes: block_size, num_warps (powers of two); max_leaves_per_call (int >= 1)."""

    block_size: int = 8192
    num_warps: int = 4
    max_leaves_per_call: int = 128

    def validate(self) -> "SumOfSquaresConfig":
        for name in ("block_size", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"SumOfSquaresConfig.{name} must be a positive power of two, got {v!r}")
        v = self.max_leaves_per_call
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"SumOfSquaresConfig.max_leaves_per_call must be an int >= 1, got {v!r}")
        return self


DEFAULT_SUM_OF_SQUARES_CONFIG = SumOfSquaresConfig()
