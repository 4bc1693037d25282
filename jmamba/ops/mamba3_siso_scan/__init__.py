"""The Mamba-3 SISO scan op and its decode step: public functions, sequential reference, chunked
XLA and (GPU) Pallas implementations."""

from jmamba.ops.mamba3_siso_scan.api import mamba3_siso_scan
from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanState, Mamba3ScanTuning
from jmamba.ops.mamba3_siso_scan.step import mamba3_siso_step

__all__ = ["Mamba3ScanState", "Mamba3ScanTuning", "mamba3_siso_scan", "mamba3_siso_step"]
