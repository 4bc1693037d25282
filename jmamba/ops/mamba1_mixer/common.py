"""Pieces shared by every implementation of `mamba1_mixer_core` (pure JAX): the state type, the
causal depthwise conv1d (with carried context and resets) and the per-position preprocessing that
turns the pre-conv input into the scan's operands (docs/mamba1.md §3.3).

    x̃ = concat_time(S_conv, x)                         [Bt, K-1+T, E]
    c_t[e] = bias[e] + Σ_k kernel[k, e] · x̃[t + k, e]   tap K-1 multiplies x_t, tap 0 x_{t-K+1}
    u = silu(c)  (rounded to x.dtype);  Δin, B, C = split(u · W_x, [R, N, N]);  delta = Δin · W_dt

Numerics: the conv is float32 (K multiply-adds per element; float64 inputs stay float64); the two
matmuls run in x.dtype (the compute dtype), as the unfused mixer always did.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.core.validation import check_array, normalize_reset, shape_of


class Mamba1CoreState(NamedTuple):
    """Recurrent state of one Mamba-1 mixer core.

    Attributes:
      conv: [Bt, K-1, E] float32 (float64 for float64 inputs), the last K-1 pre-conv inputs x, oldest first.
      ssm: [Bt, E, N] float32, the scan state h.
    """

    conv: jax.Array
    ssm: jax.Array


def causal_conv1d(x, conv_state, kernel, bias, reset=None):
    """Depthwise causal convolution over time (PyTorch cross-correlation with padding K-1, first T
    outputs kept; `kernel[k, e] = conv1d.weight[e, 0, k]`).

    With a reset mask, an input older than the most recent reset at or before t is treated as zero,
    exactly as if the sequence had restarted there; the returned state is zeroed likewise, so a window
    boundary is invisible.

    Args:
      x: [Bt, T, E] new inputs.
      conv_state: [Bt, K-1, E] the K-1 inputs before x, oldest first.
      kernel: [K, E]. bias: [E] or None.
      reset: optional [Bt, T] bool; True at t means nothing before t is seen by outputs ≥ t.

    Returns:
      (c [Bt, T, E] float32, new_state [Bt, K-1, E] float32 = the last K-1 inputs).

    Backward: a `jax.custom_vjp` (`_conv_bwd`) that saves only the inputs (x in its own dtype) and
    materializes nothing [Bt, T, E]-sized besides the cotangents: autodiff of the forward would keep
    each float32 tap x̃[t + k] alive for the weight gradient, so XLA writes every tap to memory.
    Cotangents come back in the inputs' dtypes (accumulated in float32, float64 for float64 inputs).
    Reverse mode only: `jax.jvp` / `jacfwd` through it raise (a custom_vjp has no forward rule).
    A `[Bt]` reset acts at t = 0, as everywhere in jmamba.ops.
    """
    bsz, seqlen = check_conv_arguments(x, conv_state, kernel, bias, time_axis=True)
    return _conv(x, conv_state, kernel, bias, normalize_reset(reset, bsz, seqlen))


def check_conv_arguments(x, conv_state, kernel, bias, *, time_axis):
    """Validates the conv's arrays (names as in `causal_conv1d`); returns (Bt, T) (T = 1 for a step)."""
    check_array("kernel", kernel, (None, None), "[d_conv, channels]")
    k, e = shape_of(kernel)
    if k < 1:
        raise ValueError(f"kernel must have at least one tap, got shape {shape_of(kernel)}")
    if time_axis:
        check_array("x", x, (None, None, e), "[batch, seqlen, channels]")
        bsz, seqlen = shape_of(x)[:2]
    else:
        check_array("x_t", x, (None, e), "[batch, channels]")
        bsz, seqlen = shape_of(x)[0], 1
    check_array("conv_state", conv_state, (bsz, k - 1, e), "[batch, d_conv - 1, channels]")
    if bias is not None:
        check_array("bias", bias, (e,), "[channels]")
    return bsz, seqlen


@jax.custom_vjp
def _conv(x, conv_state, kernel, bias, reset):
    """The forward of `causal_conv1d` (the primal; also run by `_conv_fwd`)."""
    f32 = accum_dtype(x.dtype, kernel.dtype)
    k_size = kernel.shape[0]
    seqlen = x.shape[1]
    state, xf, w = conv_state.astype(f32), x.astype(f32), kernel.astype(f32)

    def tap_input(k):
        """x̃[t + k] for t < T: [Bt, T, E]. One small concatenation per tap (fused by XLA into its
        consumer) rather than one materialized [Bt, K-1+T, E] float32 copy shared by every tap."""
        j = k_size - 1 - k                      # how far back tap k looks
        if j == 0:
            return xf
        if j >= seqlen:
            return state[:, k:k + seqlen]
        return jnp.concatenate([state[:, k:], xf[:, :seqlen - j]], axis=1)

    new_state = conv_new_state(x, conv_state, reset, k_size, f32)
    if reset is None or seqlen == 0:     # (an empty window has nothing to reset)
        c = sum(w[k] * tap_input(k) for k in range(k_size))
    else:
        # Segment id of every position of x̃: the carried context is segment 0, each reset starts a new one.
        seg_x, seg = _segments(reset, k_size)
        c = sum(w[k] * jnp.where((seg[:, k:k + seqlen] == seg_x)[..., None], tap_input(k), 0.0)
                for k in range(k_size))
    return (c if bias is None else c + bias.astype(f32)), new_state


def _segments(reset, k_size):
    """Segment ids of x ([Bt, T]) and of x̃ ([Bt, K-1+T]; the carried context is segment 0)."""
    seg_x = jnp.cumsum(reset.astype(jnp.int32), axis=1)
    return seg_x, jnp.concatenate([jnp.zeros((reset.shape[0], k_size - 1), jnp.int32), seg_x], axis=1)


def new_state_keep(reset, k_size):
    """[Bt, K-1, 1] bool: which rows of the new conv state survive the window's resets (None: all)."""
    if reset is None or reset.shape[1] == 0:
        return None
    seg_x, seg = _segments(reset, k_size)
    return (seg[:, reset.shape[1]:] == seg_x[:, -1:])[..., None]


def conv_new_state(x, conv_state, reset, k_size, f32):
    """The conv state after the window: x̃'s last K-1 rows in `f32` (the conv's accumulation dtype),
    zeroed before a reset."""
    state, xf, seqlen = conv_state.astype(f32), x.astype(f32), x.shape[1]
    if k_size == 1:
        new_state = state
    elif seqlen >= k_size - 1:
        new_state = xf[:, seqlen - (k_size - 1):]
    else:
        new_state = jnp.concatenate([state[:, seqlen:], xf], axis=1)
    keep = new_state_keep(reset, k_size)
    return new_state if keep is None else jnp.where(keep, new_state, 0.0)


def _conv_fwd(x, conv_state, kernel, bias, reset):
    return _conv(x, conv_state, kernel, bias, reset), (x, conv_state, kernel, bias, reset)


def _conv_bwd(res, cts):
    """Cotangents of `_conv`, each a sum of shifted slices of dc (XLA fuses each into one pass).

    With j = K-1-k the look-back of tap k (tap k reads x̃[t + k] = state[k + t] for t < j, else
    x[t - j]) and m_k[b, t] = "x̃[t + k] is in t's segment" (all True without resets):
      d_tap_k = w[k] · m_k · dc                                             [Bt, T, E]
      dx[t] = Σ_k d_tap_k[t + j] (t + j < T)  + d_new_state routed back     [Bt, T, E]
      d_state[k + t] += d_tap_k[t] (t < j)    + d_new_state routed back     [Bt, K-1, E]
      dkernel[k] = Σ_{b,t} m_k · dc · x̃[t + k], as a sum over the state part and one over the x part
                   (slices of dc and x, no concatenation); dbias = Σ_{b,t} dc.
    new_state[i] = x̃[T + i] (zeroed where the forward's `keep` is False). Float32 accumulation
    (float64 for float64 inputs); the cotangents are cast to the inputs' dtypes.
    """
    x, conv_state, kernel, bias, reset = res
    dc, d_new = cts
    f32 = accum_dtype(x.dtype, kernel.dtype)
    k_size, (bt, seqlen, e) = kernel.shape[0], x.shape
    state, xf, w = conv_state.astype(f32), x.astype(f32), kernel.astype(f32)
    dc, d_new = dc.astype(f32), d_new.astype(f32)
    if seqlen == 0:
        reset = None        # as in the forward: an empty window resets nothing
    if reset is not None:   # the forward's segment ids and masks
        seg_x, seg = _segments(reset, k_size)
        d_new = jnp.where(new_state_keep(reset, k_size), d_new, 0.0)

    def dc_tap(k, lo, hi):
        """m_k · dc[lo:hi]: [Bt, hi-lo, E], a fresh select for each consumer (none is materialized)."""
        d = dc[:, lo:hi]
        return d if reset is None else jnp.where((seg[:, k + lo:k + hi] == seg_x[:, lo:hi])[..., None], d, 0.0)

    def pad(a, lo, hi):     # zeros before / after along time
        return jax.lax.pad(a, jnp.zeros((), f32), ((0, 0, 0), (lo, hi, 0), (0, 0, 0)))

    # new_state = x̃[T:T+K-1]: its first max(K-1-T, 0) rows are state rows T.., the rest x rows.
    lo = k_size - 1 - seqlen
    dx = d_new[:, lo:] if lo >= 0 else pad(d_new, -lo, 0)
    d_state = pad(d_new[:, :lo], seqlen, 0) if lo > 0 else jnp.zeros_like(state)
    dkernel = []
    for k in range(k_size):
        j, n = k_size - 1 - k, min(k_size - 1 - k, seqlen)   # look-back; positions reading the state
        dk = jnp.zeros((e,), f32)
        if n > 0:       # t < n reads state[k + t]
            d_state = d_state + pad(w[k] * dc_tap(k, 0, n), k, j - n)
            dk = dk + jnp.sum(dc_tap(k, 0, n) * state[:, k:k + n], axis=(0, 1))
        if j < seqlen:  # t ≥ j reads x[t - j]
            dx = dx + pad(w[k] * dc_tap(k, j, seqlen), 0, j)
            dk = dk + jnp.sum(dc_tap(k, j, seqlen) * xf[:, :seqlen - j], axis=(0, 1))
        dkernel.append(dk)
    dbias = None if bias is None else jnp.sum(dc, axis=(0, 1)).astype(bias.dtype)
    return (dx.astype(x.dtype), d_state.astype(conv_state.dtype), jnp.stack(dkernel).astype(kernel.dtype),
            dbias, None)


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d_step(x_t, conv_state, kernel, bias):
    """One decode step. x_t: [Bt, E]; conv_state: [Bt, K-1, E] -> (c_t [Bt, E] f32, new_state)."""
    check_conv_arguments(x_t, conv_state, kernel, bias, time_axis=False)
    f32 = accum_dtype(x_t.dtype, kernel.dtype)
    win = jnp.concatenate([conv_state.astype(f32), x_t.astype(f32)[:, None]], axis=1)  # [Bt, K, E]
    c = jnp.sum(win * kernel.astype(f32), axis=1)
    return (c if bias is None else c + bias.astype(f32)), win[:, 1:]


def scan_operands(x, conv_state, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, reset):
    """The selective scan's per-position operands from the pre-conv input (module docstring).

    Args:
      x: [Bt, T, E] pre-conv input (compute dtype). conv_state: [Bt, K-1, E]. conv_kernel: [K, E].
      conv_bias: [E] or None. x_proj_kernel: [E, R+2N]. dt_proj_kernel: [R, E]. reset: [Bt, T] bool or None.

    Returns:
      (u [Bt, T, E] x.dtype, delta [Bt, T, E] x.dtype (before bias and softplus), B, C [Bt, T, 1, N]
      x.dtype, new conv state [Bt, K-1, E] float32).
    """
    c, new_conv = _conv(x, conv_state, conv_kernel, conv_bias, reset)   # arguments checked by the op
    u = jax.nn.silu(c).astype(x.dtype)
    delta, Bm, Cm = projections(u, x_proj_kernel, dt_proj_kernel)
    return u, delta, Bm, Cm, new_conv


def projections(u, x_proj_kernel, dt_proj_kernel):
    """(delta [Bt, T, E], B, C [Bt, T, 1, N]) from u [Bt, T, E]: Δin, B, C = split(u · W_x), delta =
    Δin · W_dt, both matmuls in u.dtype."""
    x_dbl, delta = x_projection_and_delta(u, x_proj_kernel, dt_proj_kernel)
    return (delta,) + b_and_c(x_dbl, dt_proj_kernel.shape[0])


def x_projection_and_delta(u, x_proj_kernel, dt_proj_kernel):
    """(x_dbl = u · W_x [Bt, T, R + 2N] = Δin | B | C, delta = Δin · W_dt [Bt, T, E]), matmuls in u.dtype."""
    x_dbl = jnp.dot(u, x_proj_kernel.astype(u.dtype))
    return x_dbl, jnp.dot(x_dbl[..., :dt_proj_kernel.shape[0]], dt_proj_kernel.astype(u.dtype))


def b_and_c(x_dbl, rank):
    """(B, C [Bt, T, 1, N]) from the x projection x_dbl = Δin | B | C (Δin of width `rank`)."""
    n = (x_dbl.shape[-1] - rank) // 2
    return x_dbl[..., None, rank:rank + n], x_dbl[..., None, rank + n:]
