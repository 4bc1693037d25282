"""Mamba-3 SISO backbone."""

from jmamba.mamba3.backbone import Mamba3Backbone
from jmamba.mamba3.config import Mamba3Config
from jmamba.mamba3.mixer import Mamba3LayerState, Mamba3Mixer

__all__ = ["Mamba3Backbone", "Mamba3Config", "Mamba3LayerState", "Mamba3Mixer"]
