"""Pieces shared by every `mamba3_siso_scan` implementation and by the Mamba-3 decode step.

Everything here computes in the accumulation dtype (`jmamba.core.dtypes.accum_dtype`: float32, or
float64 when an input is float64). Shapes use Bt batch, T time, H heads, G groups, N d_state,
P headdim, S rope angles (docs/mamba3_siso.md §0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

TWO_PI = 2.0 * math.pi


class Mamba3ScanState(NamedTuple):
    """The four recurrent states of a Mamba-3 SISO scan (official `Input_States` order); also the
    recurrent state of one Mamba-3 layer (`jmamba.Mamba3LayerState` is this class).

    Attributes:
      angle: [Bt, H, S] accumulated RoPE angle θ_{T-1}, wrapped into [0, 2π).
      ssm: [Bt, H, P, N] the true SSM state h_{T-1} (no pending β term).
      k: [Bt, H, N] the last key k_{T-1}: post-norm, post-bias, post-RoPE, not scaled.
      v: [Bt, H, P] the last value x_{T-1} (the raw in_proj x slice).
    """

    angle: jax.Array
    ssm: jax.Array
    k: jax.Array
    v: jax.Array


class Mamba3QKNorm(NamedTuple):
    """The B/C RMSNorms of the Mamba-3 mixer, applied by `mamba3_siso_scan` to its raw Q (C) and K (B):
    Q̂ = RMSNorm(Q)·Q_weight and K̂ = RMSNorm(K)·K_weight over d_state, in float32, rounded to Q's
    and K's dtypes (`jmamba.ops.rms_norm`). The Pallas path fuses them with the kernels' layout step.

    Attributes:
      Q_weight: [N] the C norm's weight.  K_weight: [N] the B norm's weight.
      eps: added to the mean square (a positive Python float).
    """

    Q_weight: jax.Array
    K_weight: jax.Array
    eps: float


@dataclasses.dataclass(frozen=True)
class Mamba3ScanTuning:
    """Tuning of `mamba3_siso_scan` (speed and rounding only; see `jmamba.ops.tuning`).

    Attributes:
      chunk_size: chunk length of the chunked implementations ("xla" uses it as given; the Pallas
        kernels round it to a power of two in [16, 128]). It must not change results beyond rounding.
      pallas_config: a `pallas_kernels.mamba3_siso.Mamba3ScanConfig` (None: the kernels' default).
    """

    chunk_size: int = 64
    pallas_config: Any = None

    def __post_init__(self):
        c = self.chunk_size
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {c!r}")


def zero_states(bsz, H, P, N, S, dtype) -> Mamba3ScanState:
    return Mamba3ScanState(jnp.zeros((bsz, H, S), dtype), jnp.zeros((bsz, H, P, N), dtype),
                            jnp.zeros((bsz, H, N), dtype), jnp.zeros((bsz, H, P), dtype))


def expand_groups(x, nheads):
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G) (contiguous blocks, as official)."""
    return jnp.repeat(x, nheads // x.shape[-2], axis=-2)


def rotate_pairs(x, theta):
    """Rotates adjacent pairs (2a, 2a+1) of x by +θ_a for a < S; dims 2S.. pass through.

    x: [..., N]; theta: [..., S] with S <= N/2 (broadcastable leading dims). docs/mamba3_siso.md §3.2 step 10.
    """
    S = theta.shape[-1]
    x0, x1 = x[..., 0:2 * S:2], x[..., 1:2 * S:2]
    c, s = jnp.cos(theta), jnp.sin(theta)
    rotated = jnp.stack([c * x0 - s * x1, s * x0 + c * x1], axis=-1).reshape(x.shape[:-1] + (2 * S,))
    return jnp.concatenate([rotated, x[..., 2 * S:]], axis=-1)


def angle_rate(angles):
    """π·tanh(angles_raw): the RoPE angle per unit of DT, angles' shape."""
    return math.pi * jnp.tanh(angles)


def angle_increment(angles, dt):
    """π·tanh(angles_raw)·DT: the per-step RoPE angle increment [..., H, S]. angles [..., H or 1, S], dt [..., H]."""
    return angle_rate(angles) * dt[..., None]


def wrap_angle(theta):
    """Floor-mod into [0, 2π); its derivative is 1 (docs/mamba3_siso.md §4.4 step 5 treats the wrap as identity)."""
    return jnp.mod(theta, TWO_PI)


def siso_step(states: Mamba3ScanState, q_bar, k_bar, v, adt, dt, trap, angles, D, z):
    """One step of the trapezoidal recurrence (docs/mamba3_siso.md §3.2 steps 9-12, §6.1), all heads at once.

    Args:
      states: the incoming states (angle [Bt,H,S], ssm [Bt,H,P,N], k [Bt,H,N], v [Bt,H,P]).
      q_bar, k_bar: [Bt, H, N] biased, unrotated query (C) and key (B).
      v: [Bt, H, P] value (x). adt, dt, trap: [Bt, H] (ADT = A·DT, DT, raw trap logit).
      angles: [Bt, H, S] raw angles. D: [H] or None. z: [Bt, H, P] gate or None.

    Returns:
      (y [Bt, H, P], new states). Everything in the dtype of the inputs (the caller casts).
    """
    theta = wrap_angle(states.angle + angle_increment(angles, dt))
    q = rotate_pairs(q_bar, theta)
    k = rotate_pairs(k_bar, theta)
    lam = jax.nn.sigmoid(trap)
    alpha = jnp.exp(adt)
    beta = (1.0 - lam) * dt * alpha        # weight of the previous input v_{t-1} k_{t-1}ᵀ
    gamma = lam * dt                       # weight of the current input v_t k_tᵀ
    h = (alpha[..., None, None] * states.ssm
         + beta[..., None, None] * states.v[..., :, None] * states.k[..., None, :]
         + gamma[..., None, None] * v[..., :, None] * k[..., None, :])
    y = jnp.einsum("bhpn,bhn->bhp", h, q, precision=jax.lax.Precision.HIGHEST)
    if D is not None:
        y = y + D[:, None] * v
    if z is not None:
        y = y * jax.nn.silu(z)
    return y, Mamba3ScanState(theta, h, k, v)


def trapezoid_weights(DT, Trap, acc):
    """The per-position weights of the chunked forms (docs/mamba3_siso.md §4.1), [Bt, T, H] in `acc`.

    Returns (γ, β/α, s): γ_t = λ_t·DT_t, β_t/α_t = DT_t(1 − λ_t), and the key scale
    s_t = γ_t + σ̂_t with σ̂_t = DT_{t+1}(1 − λ_{t+1}) (0 at the window end): the β term of step t+1
    moved onto key t. λ = σ(Trap).
    """
    dt = DT.astype(acc)
    lam = jax.nn.sigmoid(Trap.astype(acc))
    gamma = lam * dt
    prev_weight = dt * (1.0 - lam)                                      # β_t / α_t
    shifted = jnp.concatenate([prev_weight[:, 1:], jnp.zeros_like(prev_weight[:, :1])], axis=1)   # σ̂_t
    return gamma, prev_weight, gamma + shifted


def entering_ssm(state: Mamba3ScanState, prev_weight0):
    """S_0 = h_{-1} + DT_0(1 − λ_0)·v_{-1}k_{-1}ᵀ [Bt, H, P, N]: the carried state with the β_0 term of
    the carried (k, v) folded in (docs/mamba3_siso.md §4.1); prev_weight0 [Bt, H]."""
    return state.ssm + prev_weight0[..., None, None] * state.v[..., :, None] * state.k[..., None, :]
