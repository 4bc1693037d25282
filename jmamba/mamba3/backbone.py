"""`Mamba3Backbone`: input projection → Mamba-3 SISO pre-norm residual blocks → final RMSNorm."""

from __future__ import annotations

from jmamba.backbone import ResidualBackbone
from jmamba.core.tags import REFERENCE
from jmamba.mamba3.mixer import Mamba3Mixer


class Mamba3Backbone(ResidualBackbone):
    """Mamba-3 SISO backbone (docs/mamba3_siso.md §3.1). See `ResidualBackbone` for the call contract.

    Parameters (nnx paths): `input_proj.{kernel,bias}` (when input_dim is set),
    `layers[i].norm.weight`, `layers[i].mixer.{in_proj.kernel, dt_bias, B_bias, C_bias,
    B_norm.weight, C_norm.weight, D, norm.weight (is_outproj_norm only), out_proj.kernel}`,
    `norm_f.weight`. State: a tuple of one `Mamba3LayerState` per layer.
    """

    mixer_cls = Mamba3Mixer
    input_bias_no_decay = (REFERENCE,)   # every Mamba-3 bias is in the "reference" no-decay group
