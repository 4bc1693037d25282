"""The Mamba-1 selective-scan op: public function, reference, XLA and (GPU) Pallas implementations."""

from jmamba.ops.selective_scan.api import selective_scan

__all__ = ["selective_scan"]
