"""jmamba: a functional JAX/Pallas training library for Mamba-1 and Mamba-3 SISO backbones.

Public entry points (see API.md): configs and Flax NNX modules, the `ops` kernel boundary, the
functional `TrainState` / `make_train_step`, the LM wrapper, generation and weight I/O.
"""

from jmamba import ops
from jmamba.generate import generate
from jmamba.io.checkpoint import restore_checkpoint, save_checkpoint
from jmamba.interop.hf_mamba import load_hf_mamba, save_hf_mamba
from jmamba.io.safetensors_io import load_safetensors, save_safetensors
from jmamba.lm import MambaLM, MambaLMConfig
from jmamba.interop.official_mamba3 import load_official_mamba3
from jmamba.optim import fused_adamw, no_decay_mask
from jmamba.mamba1 import Mamba1Backbone, Mamba1Config, Mamba1LayerState, Mamba1Mixer
from jmamba.mamba3 import Mamba3Backbone, Mamba3Config, Mamba3LayerState, Mamba3Mixer
from jmamba.training.loss_scale import DynamicLossScale
from jmamba.training.split import ForwardContext, backward_step, forward
from jmamba.training.train_state import TrainState
from jmamba.training.train_step import make_train_step

__all__ = [
    "Mamba1Backbone", "Mamba1Config", "Mamba1LayerState", "Mamba1Mixer", "MambaLM", "MambaLMConfig",
    "Mamba3Backbone", "Mamba3Config", "Mamba3LayerState", "Mamba3Mixer", "load_official_mamba3",
    "DynamicLossScale", "ForwardContext", "TrainState", "backward_step", "forward", "fused_adamw", "generate", "load_hf_mamba", "load_safetensors", "make_train_step", "no_decay_mask", "ops", "restore_checkpoint", "save_checkpoint", "save_hf_mamba", "save_safetensors",
]
