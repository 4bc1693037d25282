"""Program grids of several logical axes flattened to the one Pallas grid axis.

Why flat: Triton grids have at most three axes and every `vmap` of a `pallas_call` prepends one, so
the kernels launch over a 1-D grid and stay usable under (nested) vmap. A kernel family names its
logical axes (e.g. batch row, time chunk, channel block) and sizes them outermost first; the last
axis varies fastest, so neighbouring program ids differ only in it (programs that read the same rows
run together).

Integer arithmetic only (`//`, `%`): it applies to Python ints and to the traced program id inside
index maps and kernel bodies alike. The outermost coordinate is taken without a modulo and the
fastest without a division (program ids are in range); every other axis is divided and reduced even
when a size is 1, so the index maps lower to the same Triton IR as the kernels' original formulas.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class FlatGrid:
    """A row-major flattening of the logical grid `axes` (sizes, outermost first)."""

    axes: tuple[int, ...]

    @property
    def size(self) -> tuple[int]:
        """The Pallas grid: one axis of prod(axes) programs."""
        return (math.prod(self.axes),)

    def coordinate(self, p, axis: int):
        """Program p's coordinate along `axis`: (p // stride) % axes[axis], stride = prod(axes[axis+1:])."""
        q = p if axis == len(self.axes) - 1 else p // math.prod(self.axes[axis + 1:])
        return q if axis == 0 else q % self.axes[axis]

    def coordinates(self, p) -> tuple:
        """Program p's coordinates along every axis, outermost first."""
        return tuple(self.coordinate(p, a) for a in range(len(self.axes)))
