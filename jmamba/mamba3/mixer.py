"""`Mamba3Mixer`: one Mamba-3 SISO mixer layer, no residual and no norm (docs/mamba3_siso.md §3.2).

    proj = x · W_in                                   [Bt, T, 2Di + 2GN + 3H + S]
    z, xv, B, C, dd_dt, dd_A, trap, angles = split(proj)          (this order; computed as three
                                                       matmuls: z, xv and the rest, see _project)
    A    = min(−φ(dd_A), −A_floor),  φ(u) = 1 + u (u >= 0), 1/(1 − u) (u < 0)
    DT   = softplus(dd_dt + dt_bias),  ADT = A·DT                  [Bt, T, H]
    B̂, Ĉ = RMSNorm_N(B)·w_B, RMSNorm_N(C)·w_C                      [Bt, T, G, N]
    y    = mamba3_siso_scan(Q=Ĉ, K=B̂, V=xv, ADT, DT, trap, C_bias, B_bias, angles, D, Z=z)
           (a window: steps 2-11 are one op, `mamba3_siso_scan_projected`; decode does them here)
    g    = y (already gated by silu(z))   or   GatedRMSNorm_P(y)·w ⊙ silu(z)  (is_outproj_norm)
    out  = g · W_out                                  [Bt, T, Dm]

Precision: in_proj, the B/C norms' outputs, x, z, the scan output and out_proj are in the dtype
of `x` (the compute dtype); A, DT, ADT, the trap logit and the raw angles are float32 (the
scan computes its state, rotation and accumulation in float32; the norms' statistics are f32).
Parameters are float32 masters. The recurrent state (`Mamba3LayerState`) is float32. Float64
inputs and parameters stay float64 throughout (for finite-difference checks).

Boundary detail (docs/mamba3_siso.md §5): at dd_A == 0 exactly, torch autograd of the official φ gives φ' = 2;
here jnp.maximum/minimum split the tie, giving φ' = 1 (as mamba-rs). This is measure-zero.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from jmamba import ops
from jmamba.core.dtypes import accum_dtype
from jmamba.core.tags import OFFICIAL, REFERENCE
from jmamba.core.validation import check_float, shape_of
from jmamba.layers.dense import Dense
from jmamba.layers.initializers import inverse_softplus_dt_bias
from jmamba.layers.rmsnorm import RMSNorm, rms_norm
from jmamba.layers.tags import param
from jmamba.mamba3.config import Mamba3Config

f32 = jnp.float32

# The recurrent state of one Mamba-3 layer is exactly the scan's four states (docs/mamba3_siso.md §3.3):
# angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N] (post-norm, post-bias, post-RoPE B), v [Bt, H, P].
Mamba3LayerState = ops.Mamba3ScanState


class Mamba3Mixer(nnx.Module):
    """One Mamba-3 SISO mixer with the official init (docs/mamba3_siso.md §2.1, §2.3).

    Parameters (nnx paths, all float32): `in_proj.kernel [d_model, in_proj_dim]`, `dt_bias [H]`,
    `B_bias [H, N]`, `C_bias [H, N]`, `B_norm.weight [N]`, `C_norm.weight [N]`, `D [H]`,
    `norm.weight [d_inner]` (only when is_outproj_norm), `out_proj.kernel [d_inner, d_model]`.
    No-weight-decay tags (docs/mamba3_siso.md §2.4): dt_bias and D in both groups; the biases and
    every norm scale in the "reference" group.
    """

    def __init__(self, cfg: Mamba3Config, *, rngs: nnx.Rngs):
        cfg.validate()
        self.config = cfg
        Dm, Di, H, N = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.d_state
        self.in_proj = Dense(Dm, cfg.in_proj_dim, rngs=rngs)
        self.dt_bias = param(
            inverse_softplus_dt_bias(rngs.params(), (H,), cfg.dt_min, cfg.dt_max, cfg.dt_init_floor),
            no_decay=(REFERENCE, OFFICIAL))
        self.B_bias = param(jnp.ones((H, N), f32), no_decay=(REFERENCE,))
        self.C_bias = param(jnp.ones((H, N), f32), no_decay=(REFERENCE,))
        self.B_norm = RMSNorm(N, cfg.norm_eps)
        self.C_norm = RMSNorm(N, cfg.norm_eps)
        self.D = param(jnp.ones((H,), f32), no_decay=(REFERENCE, OFFICIAL))
        self.norm = RMSNorm(Di, cfg.norm_eps) if cfg.is_outproj_norm else None
        scale = cfg.n_layers ** -0.5 if cfg.rescale_out_proj else 1.0
        self.out_proj = Dense(Di, Dm, init_scale=scale, rngs=rngs)

    def init_state(self, batch: int) -> Mamba3LayerState:
        cfg = self.config
        H, P, N, S = cfg.nheads, cfg.headdim, cfg.d_state, cfg.num_rope_angles
        return Mamba3LayerState(angle=jnp.zeros((batch, H, S), f32), ssm=jnp.zeros((batch, H, P, N), f32),
                                k=jnp.zeros((batch, H, N), f32), v=jnp.zeros((batch, H, P), f32))

    # ------------------------------------------------------------------------------ shared pieces
    def _project(self, x):
        """Step 1 on x [..., Dm]: (z, xv [..., H, P], rest [..., 2GN + 3H + S]), all in x.dtype."""
        cfg = self.config
        Di, H, P = cfg.d_inner, cfg.nheads, cfg.headdim
        # in_proj as three matmuls over column blocks of its one kernel (`ops.split_dense`): z and xv
        # ([.., Di] each) are then contiguous arrays the scan kernels read as they are, and their
        # cotangents feed the backward matmuls directly (slicing one packed [.., in_proj_dim] product
        # made XLA copy z and xv out of it forward and concatenate all eight cotangents back into it
        # backward). Numerics: the outputs are as one matmul's; the cotangent of x is the sum of three
        # products (bf16: rms error ~0.29% of the cotangent vs ~0.17% for one product rounded once,
        # when each product is rounded before the sum).
        w = self.in_proj.kernel[...].astype(x.dtype)
        z, xv, rest = ops.split_dense(x, w, (Di, Di, cfg.in_proj_dim - 2 * Di))
        lead = x.shape[:-1]
        return z.reshape(lead + (H, P)), xv.reshape(lead + (H, P)), rest

    def _per_position(self, rest):
        """Steps 2-7 on rest [..., 2GN + 3H + S] (decode; a window's scan does them itself, fused):
        (B̂, Ĉ [..., G, N] in rest's dtype; ADT, DT, trap [..., H] and raw angles [..., S] in the
        accumulation dtype)."""
        cfg = self.config
        B, C, ADT, DT, trap, angles = ops.mamba3_projected_inputs(
            rest, self.dt_bias[...], ngroups=cfg.ngroups, d_state=cfg.d_state, nheads=cfg.nheads, A_floor=cfg.A_floor)
        return self.B_norm(B, rest.dtype), self.C_norm(C, rest.dtype), ADT, DT, trap, angles

    def _output(self, y, z):
        """Steps 12-13: y [..., H, P] (gated already unless is_outproj_norm) -> out [..., Dm]."""
        cfg = self.config
        if self.norm is not None:
            acc = accum_dtype(y.dtype, self.norm.weight.dtype)
            w = self.norm.weight[...].astype(acc).reshape(cfg.nheads, cfg.headdim)
            # gated RMSNorm: statistics per head (group = headdim), the gate multiplies after the norm
            y = (rms_norm(y.astype(acc), w, cfg.norm_eps) * jax.nn.silu(z.astype(acc))).astype(z.dtype)
        return self.out_proj(y.reshape(y.shape[:-2] + (cfg.d_inner,)))

    def _check_x(self, x, ndim):
        check_float("x", x)
        s = shape_of(x)
        if len(s) != ndim or s[-1] != self.config.d_model:
            what = "[batch, seqlen, %d]" if ndim == 3 else "[batch, %d]"
            raise ValueError(f"x must have shape {what % self.config.d_model} (d_model), got {s}")

    # ------------------------------------------------------------------------------------ forward
    def __call__(self, x, state: Mamba3LayerState | None = None, *, reset=None):
        """Mixes a window.

        Args:
          x: [Bt, T, d_model] normalized input, in the compute dtype.
          state: incoming state (zeros when None).
          reset: optional [Bt] or [Bt, T] bool; True zeroes the four states entering the row
            (at position t), i.e. a fresh sequence starts there.

        Returns:
          (out [Bt, T, d_model] in x.dtype, new Mamba3LayerState).
        """
        self._check_x(x, 3)
        cfg = self.config
        z, xv, rest = self._project(x)
        # steps 2-11: the per-position work and the scan as one op (fused around the Pallas kernels)
        y, final = ops.mamba3_siso_scan_projected(
            rest, xv, None if self.norm is not None else z, self.dt_bias[...], self.B_norm.weight[...],
            self.C_norm.weight[...], self.B_bias[...], self.C_bias[...], self.D[...], ngroups=cfg.ngroups,
            A_floor=cfg.A_floor, norm_eps=cfg.norm_eps, initial_state=state, return_final_state=True,
            reset=reset, tuning=self._tuning())
        return self._output(y, z), final

    def _tuning(self):
        """The scan's tuning: the deprecated `Mamba3Config.chunk_size` when set, else the op's current one."""
        chunk = self.config.chunk_size
        if chunk is None:
            return None
        current = ops.current_tuning("mamba3_siso_scan")
        return ops.Mamba3ScanTuning(chunk_size=chunk, pallas_config=current.pallas_config)

    def step(self, x_t, state: Mamba3LayerState):
        """Single-token decode (docs/mamba3_siso.md §3.5). x_t: [Bt, d_model] -> (out [Bt, d_model], new state)."""
        self._check_x(x_t, 2)
        z, xv, rest = self._project(x_t)
        B_hat, C_hat, ADT, DT, trap, angles = self._per_position(rest)
        y, new = ops.mamba3_siso_step(
            C_hat, B_hat, xv, ADT, DT, trap, self.C_bias[...], self.B_bias[...], angles, self.D[...],
            None if self.norm is not None else z, initial_state=state)
        return self._output(y, z), new
