"""Helpers shared by the Pallas kernel packages (selective_scan, mamba3_siso, fused_adamw).

Modules:
  dtypes   dtype aliases (F32, I32) and the 16-bit float types the kernels accept
  sizes    power-of-two and rounding arithmetic on static sizes (block widths, padded lengths)
  padding  zero (or constant) padding of one axis up to a static length
  grid     multi-axis program grids flattened to the one Pallas grid axis
  lazy     PEP 562 lazy exports, so that a kernel package's configuration imports without Pallas
  launch   `run_kernel`: one `pl.pallas_call` with named refs and Triton launch parameters
  inline_ptx  single PTX instructions (fma, sin.approx, ...) elementwise inside Triton kernels

Only `launch` and `inline_ptx` (inside its function) import `jax.experimental.pallas`; nothing is
imported here, so importing any other module of this package does not load a Pallas backend.
"""
