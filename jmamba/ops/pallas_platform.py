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


def whole_array_kernel_reason(platform: str, what: str, sharded: str):
    """None when `what`, a kernel that reads whole arrays (no per-device split), can run here, else why
    not: the platform (triton_platform_reason), or an active mesh with an axis of size > 1, under which
    `sharded` (e.g. "the arrays") may be sharded."""
    reason = triton_platform_reason(platform, what)
    if reason:
        return reason
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and any(size > 1 for size in mesh.shape.values()):
        return f"the kernel reads whole arrays, and a mesh {dict(mesh.shape)} is active ({sharded} may be sharded)"
    return None


def interpret_mode() -> bool:
    """Run Pallas kernels in the interpreter (no GPU backend)."""
    return jax.default_backend() not in GPU_PLATFORMS
