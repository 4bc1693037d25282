"""Saving and loading weights and checkpoints."""
