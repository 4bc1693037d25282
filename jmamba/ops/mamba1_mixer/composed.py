"""The "reference" and "xla" implementations of `mamba1_mixer_core`: `scan_operands` followed by the
selective scan's own reference / xla implementation, differentiated by JAX autodiff (so they save
what autodiff saves: the conv output, u and delta among them)."""

from __future__ import annotations

from jmamba.ops.mamba1_mixer.common import scan_operands


def composed(scan_fn):
    """An implementation of the op contract (api.py) from a selective-scan implementation function."""

    def mixer_core(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
                   ssm_state, reset, *, tuning=None, xz_packed=False):
        if xz_packed:       # in_proj's whole output: x | z halves
            e = conv_kernel.shape[1]
            x, z = x[..., :e], x[..., e:]
        u, delta, Bm, Cm, new_conv = scan_operands(x, conv_state, conv_kernel, conv_bias, x_proj_kernel,
                                                   dt_proj_kernel, reset)
        y, h_last = scan_fn(u, delta, A, Bm, Cm, D, z, dt_bias, ssm_state, reset, delta_softplus=True,
                            tuning=tuning)
        return y, new_conv, h_last

    return mixer_core


def reference():
    from jmamba.ops.selective_scan.reference import selective_scan_reference
    return composed(selective_scan_reference)


def xla():
    from jmamba.ops.selective_scan.xla import selective_scan_xla
    return composed(selective_scan_xla)
