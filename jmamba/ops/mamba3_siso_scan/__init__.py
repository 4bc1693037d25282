"""The Mamba-3 SISO scan op: public function, sequential reference and chunked XLA implementations."""

from jmamba.ops.mamba3_siso_scan.api import mamba3_siso_scan
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanStates

__all__ = ["Mamba3ScanStates", "mamba3_siso_scan"]
