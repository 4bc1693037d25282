"""Static tiling of the log-sum-exp kernel: `block_rows` rows per program, walked `width` columns at a
time (the last piece masked), `num_warps` Triton warps, `num_stages` software-pipelining depth of the
walk (loads of the next pieces in flight while the current one is reduced)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common.sizes import is_power_of_2


@dataclasses.dataclass(frozen=True)
class LogSumExpConfig:
    """Attributes: block_rows, width, num_warps (powers of two); num_stages (>= 1)."""

    block_rows: int = 1
    width: int = 4096
    num_warps: int = 8
    num_stages: int = 3

    def validate(self) -> "LogSumExpConfig":
        for name in ("block_rows", "width", "num_warps"):
            v = getattr(self, name)
            if not is_power_of_2(v):
                raise ValueError(f"LogSumExpConfig.{name} must be a positive power of two, got {v!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"LogSumExpConfig.num_stages must be an int >= 1, got {self.num_stages!r}")
        return self


DEFAULT_LSE_CONFIG = LogSumExpConfig()
