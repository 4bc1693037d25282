"""`Mamba1Backbone`: input projection → Mamba-1 pre-norm residual blocks → final RMSNorm."""

from __future__ import annotations

from jmamba.backbone import ResidualBackbone
from jmamba.mamba1.mixer import Mamba1Mixer


class Mamba1Backbone(ResidualBackbone):
    """Mamba-1 backbone (docs/mamba1.md §3.2). See `ResidualBackbone` for the call contract.

    Parameters (nnx paths): `input_proj.{kernel,bias}` (when input_dim is set),
    `layers[i].norm.weight`, `layers[i].mixer.{in_proj.kernel, conv1d.kernel, conv1d.bias,
    x_proj.kernel, dt_proj.kernel, dt_proj.bias, A_log, D, out_proj.kernel}`, `norm_f.weight`.
    """

    mixer_cls = Mamba1Mixer
