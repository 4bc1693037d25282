"""`Mamba1Mixer`: one Mamba-1 (S6) mixer layer, no residual and no norm (docs/mamba1.md §3.3).

    xz = x_in · W_in                    [Bt, T, 2E] -> x, z
    c  = causal_conv(S_conv ++ x)       [Bt, T, E]                       ┐
    u  = silu(c)                                                         │ one op:
    Δin, B, C = split(u · W_x, [R, N, N])                                │ ops.mamba1_mixer_core
    y  = selective_scan(u, Δin · W_dt, A = −exp(A_log), B, C, D, z, delta_bias = b_dt, softplus) ┘
    out = y · W_out                     [Bt, T, D]

The full-window forward calls the fused op (whose Pallas backward recomputes c, u and Δ instead of
saving them); `step` (decode) runs the same math one position at a time with the step ops.

Precision: the matmuls run in the dtype of `x_in` (the compute dtype); conv, A, Δ softplus, the scan
state and its accumulation are float32. The recurrent state (`Mamba1LayerState`) is float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba import ops
from jmamba.core.dtypes import accum_dtype
from jmamba.core.tags import OFFICIAL, REFERENCE
from jmamba.layers.causal_conv import CausalConv1d
from jmamba.layers.dense import Dense
from jmamba.layers.initializers import inverse_softplus_dt_bias, uniform
from jmamba.layers.tags import param
from jmamba.mamba1.config import Mamba1Config

f32 = jnp.float32


class Mamba1LayerState(NamedTuple):
    """Recurrent state of one Mamba-1 layer.

    Attributes:
      conv: [Bt, K-1, E] float32, the last K-1 pre-conv inputs x, oldest first.
      ssm: [Bt, E, N] float32, the scan state h.
    """

    conv: jax.Array
    ssm: jax.Array


class Mamba1Mixer(nnx.Module):
    """One Mamba-1 mixer with the official init (docs/mamba1.md §2.2).

    No-weight-decay tags (docs/mamba1.md §2.3): A_log and D in both groups, dt_proj.bias in the
    "reference" group.
    """

    def __init__(self, cfg: Mamba1Config, *, rngs: nnx.Rngs):
        cfg.validate()
        self.config = cfg
        D, E, N, R = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank
        self.in_proj = Dense(D, 2 * E, rngs=rngs)
        self.conv1d = CausalConv1d(E, cfg.d_conv, use_bias=cfg.conv_bias, rngs=rngs)
        self.x_proj = Dense(E, R + 2 * N, rngs=rngs)
        self.dt_proj = Dense(R, E, use_bias=True, rngs=rngs)
        s = R ** -0.5 * cfg.dt_scale
        w = uniform(rngs.params(), (R, E), s) if cfg.dt_init == "random" else jnp.full((R, E), s, f32)
        self.dt_proj.kernel = nnx.Param(w)
        self.dt_proj.bias = param(
            inverse_softplus_dt_bias(rngs.params(), (E,), cfg.dt_min, cfg.dt_max, cfg.dt_init_floor),
            no_decay=(REFERENCE,))
        self.A_log = param(jnp.log(jnp.broadcast_to(jnp.arange(1, N + 1, dtype=f32), (E, N))),
                           no_decay=(REFERENCE, OFFICIAL))
        self.D = param(jnp.ones((E,), f32), no_decay=(REFERENCE, OFFICIAL))
        scale = cfg.n_layers ** -0.5 if cfg.rescale_out_proj else 1.0
        self.out_proj = Dense(E, D, init_scale=scale, rngs=rngs)

    def init_state(self, batch: int) -> Mamba1LayerState:
        cfg = self.config
        return Mamba1LayerState(conv=jnp.zeros((batch, cfg.d_conv - 1, cfg.d_inner), f32),
                                ssm=jnp.zeros((batch, cfg.d_inner, cfg.d_state), f32))

    def _split_x_dbl(self, u):
        R, N = self.config.resolved_dt_rank, self.config.d_state
        x_dbl = self.x_proj(u)
        return x_dbl[..., :R], x_dbl[..., R:R + N], x_dbl[..., R + N:]

    def __call__(self, x, state: Mamba1LayerState | None = None, *, reset=None):
        """Mixes a window.

        Args:
          x: [Bt, T, D] normalized input, in the compute dtype.
          state: incoming state (zeros when None).
          reset: optional [Bt, T] (or [Bt]: at t = 0) bool; True zeroes the state entering position t.

        Returns:
          (out [Bt, T, D] in x.dtype, new state).
        """
        if state is None:
            state = self.init_state(x.shape[0])
        # in_proj is one matmul; the op takes its packed [Bt, T, 2E] output (x | z) as is, so neither
        # the forward's split nor the backward's [dx | dz] join is a copy (the Pallas op reads and
        # writes the halves in place). (in_proj and x_proj are bias-free Dense layers, as in the
        # official model.)
        xz = jnp.dot(x, self.in_proj.kernel[...].astype(x.dtype))
        y, core_state = ops.mamba1_mixer_core(
            xz, None, self.conv1d.kernel[...], None if self.conv1d.bias is None else self.conv1d.bias[...],
            self.x_proj.kernel[...],
            self.dt_proj.kernel[...], self.dt_proj.bias[...], self._A(), self.D[...],
            initial_state=ops.Mamba1CoreState(conv=state.conv, ssm=state.ssm), return_final_state=True,
            reset=reset, xz_packed=True)
        return self.out_proj(y), Mamba1LayerState(conv=core_state.conv, ssm=core_state.ssm)

    def _A(self):
        """A = −exp(A_log) [E, N] in float32 (float64 for float64 masters)."""
        return -jnp.exp(self.A_log[...].astype(accum_dtype(self.A_log.dtype)))

    def step(self, x_t, state: Mamba1LayerState):
        """Single-token decode (docs/mamba1.md §4.2). x_t: [Bt, D] -> (out [Bt, D], new state)."""
        E = self.config.d_inner
        xz = self.in_proj(x_t)
        xs, z = xz[..., :E], xz[..., E:]
        c, conv_state = self.conv1d.step(xs, state.conv)
        u = jax.nn.silu(c).astype(x_t.dtype)
        dt_in, Bm, Cm = self._split_x_dbl(u)
        delta = jnp.dot(dt_in, self.dt_proj.kernel[...].astype(x_t.dtype))
        y, ssm_state = ops.selective_scan_step(
            u, delta, self._A(), Bm, Cm, self.D[...], z, self.dt_proj.bias[...], delta_softplus=True,
            initial_state=ops.SelectiveScanState(state.ssm))
        return self.out_proj(y), Mamba1LayerState(conv=conv_state, ssm=ssm_state.ssm)
