"""The per-position formulas between a Mamba-3 mixer's in_proj and its scan (docs/mamba3_siso.md §3.2
steps 2-7), shared by the XLA composition, the decode step and the Pallas projection kernels (which get
`per_head` as an argument and differentiate it with `jax.vjp`): one definition, one set of numerics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.selective_scan.common import softplus_thresholded


def heavy_tail(u):
    """φ(u) = 1 + u for u >= 0, 1/(1 − u) for u < 0 (the official `heavy_tail_activation`)."""
    # The official clamp form: both branches are finite everywhere, so no NaN reaches the gradient.
    return jnp.maximum(u, 0.0) + 1.0 / (1.0 - jnp.minimum(u, 0.0))


def decay_and_step(dd_dt, dd_A, dt_bias, A_floor):
    """(ADT, DT) = (A·DT, softplus(dd_dt + dt_bias)) with A = min(−φ(dd_A), −A_floor), in the inputs'
    dtype (cast them to the accumulation dtype first). At dd_A = 0 exactly jnp.maximum / minimum split the
    tie (φ' = 1 where torch's autograd of the official φ gives 2; measure zero, docs/mamba3_siso.md §5)."""
    A = jnp.minimum(-heavy_tail(dd_A), -A_floor)
    DT = softplus_thresholded(dd_dt + dt_bias)
    return A * DT, DT


def per_head(dd_dt, dd_A, trap, dt_bias, *, A_floor):
    """(ADT, DT, γ, β/α) of one head at a block of positions (all float32, same shapes): the values the
    Pallas core reads, γ = σ(trap)·DT and β/α = DT·(1 − σ(trap)) being the trapezoid weights
    (common.trapezoid_weights)."""
    adt, dt = decay_and_step(dd_dt, dd_A, dt_bias, A_floor)
    lam = jax.nn.sigmoid(trap)
    return adt, dt, lam * dt, dt * (1.0 - lam)


@functools.lru_cache(maxsize=None)
def per_head_for(A_floor: float):
    """`per_head` with A_floor bound, one object per value (a static, hashable argument of the kernels)."""
    return functools.partial(per_head, A_floor=A_floor)


def split_rest(rest, G, N, H):
    """(B, C [.., G, N], dd_dt, dd_A, trap [.., H], angles [.., S]) of rest [.., 2GN + 3H + S]."""
    lead = rest.shape[:-1]
    bounds = [G * N, 2 * G * N, 2 * G * N + H, 2 * G * N + 2 * H, 2 * G * N + 3 * H]
    B, C, dd_dt, dd_A, trap, angles = jnp.split(rest, bounds, axis=-1)
    return B.reshape(lead + (G, N)), C.reshape(lead + (G, N)), dd_dt, dd_A, trap, angles


def projected_inputs(rest, dt_bias, *, ngroups, d_state, nheads, A_floor):
    """The scan's per-position inputs from rest, as XLA ops (the composition): (B, C raw [.., G, N] in
    rest's dtype, ADT, DT, trap [.., H] and angles [.., S] in the accumulation dtype)."""
    acc = accum_dtype(rest.dtype, dt_bias.dtype)
    B, C, dd_dt, dd_A, trap, angles = split_rest(rest, ngroups, d_state, nheads)
    ADT, DT = decay_and_step(dd_dt.astype(acc), dd_A.astype(acc), dt_bias.astype(acc), A_floor)
    return B, C, ADT, DT, trap.astype(acc), angles.astype(acc)
