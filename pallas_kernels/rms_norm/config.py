"""Static tiling of the add + RMSNorm kernels: `block_rows` rows per program, all D columns.

A program holds its rows' whole feature vectors in registers (the row sums need every column before
any output), read as D / width column pieces of `width` = the largest power of two dividing D, at
most `max_width` (Triton tensors have power-of-two extents; D = 768 is 3 pieces of 256).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2


@dataclasses.dataclass(frozen=True)
class NormBlockConfig:
    """Attributes: block_rows (rows per program, power of two), max_width (widest column piece,
    power of two >= 16), num_warps (Triton warps per program, power of two)."""

    block_rows: int = 8
    max_width: int = 1024
    num_warps: int = 4

    def validate(self) -> "NormBlockConfig":
        for name in ("block_rows", "max_width", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"NormBlockConfig.{name} must be a positive power of two, got {v!r}")
        if self.max_width < 16:
            raise ValueError(f"NormBlockConfig.max_width must be at least 16, got {self.max_width}")
        return self


DEFAULT_NORM_CONFIG = NormBlockConfig()
