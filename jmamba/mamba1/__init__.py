"""Mamba-1 (selective SSM) backbone."""

from jmamba.mamba1.backbone import Mamba1Backbone
from jmamba.mamba1.config import Mamba1Config
from jmamba.mamba1.mixer import Mamba1LayerState, Mamba1Mixer

__all__ = ["Mamba1Backbone", "Mamba1Config", "Mamba1LayerState", "Mamba1Mixer"]
