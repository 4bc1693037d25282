"""Where the Pallas-Triton kernels can run: CUDA GPUs (compiled) and the CPU (interpreted, for tests)."""

from __future__ import annotations

import jax

GPU_PLATFORMS = ("gpu", "cuda")


def _is_rocm() -> bool:
    try:
        return "rocm" in jax.devices("gpu")[0].client.platform_version.lower()
    except Exception:  # no GPU client at all: not ROCm
        return False


def triton_platform_reason(platform: str, what: str):
    """None when `what` (e.g. "the Pallas selective-scan kernel") can run on `platform`, else why not."""
    if platform not in GPU_PLATFORMS + ("cpu",):
        return (f"{what} targets CUDA GPUs through Triton (and CPU in interpret mode); platform "
                f"{platform!r} is not supported")
    if platform in GPU_PLATFORMS and _is_rocm():
        return f"{what} is only built and tested for CUDA GPUs, not ROCm"
    return None


def interpret_mode() -> bool:
    """Run Pallas kernels in the interpreter (no GPU backend)."""
    return jax.default_backend() not in GPU_PLATFORMS
