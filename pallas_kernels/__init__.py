"""Pallas GPU kernels for jmamba.

Packages: selective_scan (Mamba-1 scan), mamba3_siso (Mamba-3 SISO scan), fused_adamw (optimizer
step), causal_conv, rms_norm, log_sum_exp, sum_of_squares (the global gradient norm over many arrays in one
launch), common (helpers they share). Importing a package loads only its configuration types; the
kernels, and with them `jax.experimental.pallas`, are imported when an entry point is first used.
"""
