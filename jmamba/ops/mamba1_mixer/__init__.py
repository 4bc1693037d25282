"""The fused Mamba-1 mixer core op (`mamba1_mixer_core`): causal conv + SiLU, the x/Δ projections and
the selective scan with D and the z gate, as one op whose backward keeps or recomputes the conv output
and Δ (`SelectiveScanTuning.mixer_residuals`)."""

from jmamba.ops.mamba1_mixer.api import mamba1_mixer_core
from jmamba.ops.mamba1_mixer.common import Mamba1CoreState, causal_conv1d, causal_conv1d_step

__all__ = ["Mamba1CoreState", "causal_conv1d", "causal_conv1d_step", "mamba1_mixer_core"]
