"""Pallas GPU kernels for jmamba."""
