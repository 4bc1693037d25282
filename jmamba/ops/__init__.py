"""The kernel boundary: every op the models call, each with several implementations.

`implementation=None` picks the best available on the current backend (see `dispatch`).
"""

from jmamba.ops.mamba3_siso_scan import mamba3_siso_scan
from jmamba.ops.selective_scan import selective_scan

__all__ = ["mamba3_siso_scan", "selective_scan"]
