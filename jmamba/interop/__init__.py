"""Reading and writing other implementations' checkpoints."""

from jmamba.interop.official_lm import load_official_lm, save_official_lm
from jmamba.interop.official_mamba3 import load_official_mamba3, save_official_mamba3

__all__ = ["load_official_lm", "load_official_mamba3", "save_official_lm", "save_official_mamba3"]
