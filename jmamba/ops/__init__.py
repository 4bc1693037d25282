"""The kernel boundary: every op the models and the optimizer call, each with several implementations.

Public names (models, training and users import only these):
  scans:       selective_scan, mamba3_siso_scan          (+ their states and tuning types, Mamba3QKNorm),
               mamba3_siso_scan_projected (the Mamba-3 scan fed from in_proj's last block) and its
               per-position inputs as XLA ops, mamba3_projected_inputs (decode)
  fused mixer: mamba1_mixer_core, Mamba1CoreState, causal_conv1d, causal_conv1d_step
  norms:       add_rms_norm (the pre-norm residual step), rms_norm   (+ RMSNormTuning)
  reductions:  log_sum_exp (one pass over wide rows: the cross entropy's normalizer)   (+ LogSumExpTuning),
               sum_of_squares (Σ x² over a list of arrays: the global gradient norm)   (+ SumOfSquaresTuning),
               finite_rows (the rows of a list of arrays that are all finite: the guard's state check)
               (+ FiniteRowsTuning)
  projections: split_dense (a dense layer's output as column blocks, one matmul each)
  decode:      selective_scan_step, mamba3_siso_step
  optimizer:   adamw_update, adamw_update_flat, step_scalars, bias_correction, AdamWTuning, AdamWKernelConfig
  elementwise: softplus_thresholded
  choosing:    dispatch (`dispatch.prefer`), tuning / current_tuning / set_default_tuning

Both scan ops share one calling convention: arrays positional; options keyword-only with the same
names (`initial_state`, `return_final_state`, `reset`, `implementation`, `tuning`); the result is
`out` or `(out, state)` with a NamedTuple state. `implementation=None` picks the best available on
the current backend (see `dispatch`); tuning knobs (chunk sizes, kernel configs) are per-op
settings (see `tuning`), never model config. Under a mesh with a `data` axis the ops run per device on
its batch rows (`batch_sharding`); with a `seq` axis the scans split the time axis as well and pass
their states between the shards (`sequence_sharding`, docs/sequence_parallel.md).
"""

import warnings as _warnings

from jmamba.ops import dispatch
from jmamba.ops.adamw import (AdamWKernelConfig, AdamWTuning, adamw_update, adamw_update_flat, bias_correction,
                              step_scalars)
from jmamba.ops.mamba1_mixer import Mamba1CoreState, causal_conv1d, causal_conv1d_step, mamba1_mixer_core
from jmamba.ops.norms import RMSNormTuning, add_rms_norm, rms_norm
from jmamba.ops.projections import split_dense
from jmamba.ops.reductions import (FiniteRowsTuning, LogSumExpTuning, SumOfSquaresTuning, finite_rows, log_sum_exp,
                                   sum_of_squares)
from jmamba.ops.mamba3_siso_scan import (Mamba3QKNorm, Mamba3ScanState, Mamba3ScanTuning, mamba3_siso_scan,
                                         mamba3_projected_inputs, mamba3_siso_scan_projected,
                                         mamba3_siso_step)
from jmamba.ops.selective_scan import (SelectiveScanState, SelectiveScanTuning, selective_scan,
                                       selective_scan_step)
from jmamba.ops.selective_scan.common import softplus_thresholded
from jmamba.ops.settings import current_tuning, set_default_tuning, tuning

__all__ = ["AdamWKernelConfig", "AdamWTuning", "FiniteRowsTuning", "LogSumExpTuning", "Mamba1CoreState", "Mamba3QKNorm", "Mamba3ScanState", "Mamba3ScanTuning",
           "RMSNormTuning", "SelectiveScanState", "SelectiveScanTuning", "SumOfSquaresTuning", "add_rms_norm",
           "adamw_update", "adamw_update_flat", "bias_correction", "causal_conv1d", "causal_conv1d_step", "current_tuning", "dispatch", "finite_rows", "log_sum_exp",
           "mamba1_mixer_core", "mamba3_projected_inputs", "mamba3_siso_scan", "mamba3_siso_scan_projected",
           "mamba3_siso_step", "rms_norm", "selective_scan", "selective_scan_step", "set_default_tuning",
           "softplus_thresholded", "split_dense", "step_scalars", "sum_of_squares", "tuning"]

_RENAMED = {"Mamba3ScanStates": "Mamba3ScanState"}


def __getattr__(name):
    if name in _RENAMED:
        _warnings.warn(f"jmamba.ops.{name} is deprecated; use jmamba.ops.{_RENAMED[name]}",
                       DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'jmamba.ops' has no attribute {name!r}")
