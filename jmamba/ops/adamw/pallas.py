"""Glue between `adamw_update` and the fused Pallas kernel in `pallas_kernels/fused_adamw`.

The kernel updates every leaf's p, m, v in one HBM pass (a few launches for the whole tree; leaves
aliased input → output, so under a donating jit the update is in place). Compiled through Triton on
a CUDA GPU, interpreted on CPU.
"""

from __future__ import annotations

from jmamba.ops.pallas_platform import triton_platform_reason


def adamw_update_pallas(ps, gs, ms, vs, scalars, decay, *, compute_dtype, tuning=None):
    from pallas_kernels.fused_adamw import fused_adamw_leaves

    return fused_adamw_leaves(ps, gs, ms, vs, scalars, decay, compute_dtype=compute_dtype,
                              config=None if tuning is None else tuning.pallas_config)


def adamw_update_flat_pallas(flat_p, gs, flat_m, flat_v, scalars, decay, *, offsets, tuning=None):
    from pallas_kernels.fused_adamw import fused_adamw_flat

    return fused_adamw_flat(flat_p, gs, flat_m, flat_v, offsets, scalars, decay,
                            config=None if tuning is None else tuning.pallas_config)


def supported(*, platform, **_):
    return triton_platform_reason(platform, "the fused AdamW kernel")


def implementation():
    from jmamba.ops import dispatch

    return dispatch.Implementation(adamw_update_pallas, supported)


def flat_implementation():
    from jmamba.ops import dispatch

    return dispatch.Implementation(adamw_update_flat_pallas, supported)
