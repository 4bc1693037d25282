"""The Mamba-1 selective-scan op and its decode step: public functions, reference, XLA and (GPU)
Pallas implementations."""

from jmamba.ops.selective_scan.api import selective_scan
from jmamba.ops.selective_scan.common import SelectiveScanState, SelectiveScanTuning
from jmamba.ops.selective_scan.step import selective_scan_step

__all__ = ["SelectiveScanState", "SelectiveScanTuning", "selective_scan", "selective_scan_step"]
