"""Saving and loading weights and checkpoints."""

from jmamba.io import pretrained  # noqa: E402,F401  (registers MambaLM.save_pretrained / from_pretrained)
