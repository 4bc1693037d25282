"""The Mamba-3 SISO scan op and its decode step: public functions, sequential reference, chunked
XLA and (GPU) Pallas implementations."""

from jmamba.ops.mamba3_siso_scan.api import mamba3_siso_scan
from jmamba.ops.mamba3_siso_scan.common import Mamba3QKNorm, Mamba3ScanState, Mamba3ScanTuning
from jmamba.ops.mamba3_siso_scan.projected import mamba3_siso_scan_projected
from jmamba.ops.mamba3_siso_scan.per_position import projected_inputs as mamba3_projected_inputs
from jmamba.ops.mamba3_siso_scan.step import mamba3_siso_step

__all__ = ["Mamba3QKNorm", "Mamba3ScanState", "Mamba3ScanTuning", "mamba3_projected_inputs", "mamba3_siso_scan", "mamba3_siso_scan_projected", "mamba3_siso_step"]
