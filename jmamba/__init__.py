"""jmamba: a functional JAX/Pallas training library for Mamba-1 and Mamba-3 SISO backbones.

Public entry points (docs/api.md): configs and Flax NNX modules, the `ops` kernel boundary, the
functional `TrainState` / `make_train_step`, the LM wrapper, generation and weight I/O. The layers
and who may import whom: docs/architecture.md.
"""

from jmamba import ops
from jmamba.architectures import Architecture, architecture_names, get_architecture, register_architecture
from jmamba.core.precision import Precision
from jmamba.data.packing import pack_documents
from jmamba.generate import generate
from jmamba.interop.hf_mamba import load_hf_mamba, save_hf_mamba
from jmamba.interop.official_lm import load_official_lm, save_official_lm
from jmamba.interop.official_mamba3 import load_official_mamba3
from jmamba.io.checkpoint import CheckpointError, CheckpointMismatchError, restore_checkpoint, save_checkpoint
from jmamba.io.safetensors_io import load_safetensors, save_safetensors
from jmamba.io.weights import LoadReport, load_weights
from jmamba.lm import MambaLM, MambaLMConfig
from jmamba.mamba1 import Mamba1Backbone, Mamba1Config, Mamba1LayerState, Mamba1Mixer
from jmamba.mamba3 import Mamba3Backbone, Mamba3Config, Mamba3LayerState, Mamba3Mixer
from jmamba.optim import find_fused_apply, fused_adamw, no_decay_mask
from jmamba.training.loss_scale import DynamicLossScale
from jmamba.training.losses import next_token_loss
from jmamba.training.metrics_log import MetricsLogger
from jmamba.training.split import ForwardContext, backward_step, forward
from jmamba.training.train_state import TrainState
from jmamba.training.train_step import make_train_step

__all__ = [
    "Architecture", "CheckpointError", "CheckpointMismatchError", "DynamicLossScale", "LoadReport", "ForwardContext", "Mamba1Backbone", "Mamba1Config", "Mamba1LayerState",
    "Mamba1Mixer", "Mamba3Backbone", "Mamba3Config", "Mamba3LayerState", "Mamba3Mixer", "MambaLM",
    "MambaLMConfig", "MetricsLogger", "Precision", "TrainState", "architecture_names", "backward_step", "find_fused_apply",
    "forward", "fused_adamw", "generate", "get_architecture", "load_hf_mamba", "load_official_lm", "load_official_mamba3",
    "load_safetensors", "load_weights", "make_train_step", "next_token_loss", "no_decay_mask", "pack_documents", "ops", "register_architecture",
    "restore_checkpoint", "save_checkpoint", "save_hf_mamba", "save_official_lm", "save_safetensors",
]
