"""Static tiling of the finite-rows kernel: `block_size` elements of one row per program (a power of
two), `num_warps` Triton warps, at most `max_leaves_per_call` arrays per launch (each array is one
pointer argument; the bound keeps the argument list far below CUDA's 4 KiB limit and the per-program
array lookup short)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2


@dataclasses.dataclass(frozen=True)
class FiniteRowsConfig:
    """Attributes: block_size, num_warps (powers of two); max_leaves_per_call (int >= 1)."""

    block_size: int = 4096
    num_warps: int = 4
    max_leaves_per_call: int = 128

    def validate(self) -> "FiniteRowsConfig":
        for name in ("block_size", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"FiniteRowsConfig.{name} must be a positive power of two, got {v!r}")
        v = self.max_leaves_per_call
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"FiniteRowsConfig.max_leaves_per_call must be an int >= 1, got {v!r}")
        return self


DEFAULT_FINITE_ROWS_CONFIG = FiniteRowsConfig()
