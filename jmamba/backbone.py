"""`ResidualBackbone`: the pre-norm residual stack shared by the Mamba-1 and Mamba-3 backbones.

    h_0     = x · W_ip + b_ip              (or x itself when input_dim is None)
    h_{l+1} = h_l + Mixer_l(RMSNorm_l(h_l))     residual stream kept in float32
    y       = RMSNorm_f(h_L)                    float32 output [Bt, T, d_model]

The mixer class is the only architecture-specific part; it must provide `__call__(x, state, *, reset)`,
`step(x_t, state)` and `init_state(batch)`. The mixers see activations in the compute dtype of the
`precision` ("f32" default, "bf16", "f16"; a `jmamba.Precision`); norms, residual and the output
stay float32 (docs/numerics.md). Without remat the stream's add and the next norm are one op
(`jmamba.ops.add_rms_norm`: one kernel each way on a GPU instead of XLA's two to three passes over
the float32 stream); with remat the blocks keep their own boundaries (a block's only saved input is h).

Memory (`remat`): by default the backward pass keeps what autodiff saves for every layer. With
`remat="layer"` each residual block is rematerialised (`nnx.remat`): only its input [Bt, T, D] is kept
and the block's forward runs again in the backward pass; a `jax.checkpoint_policies` policy (e.g.
`dots_with_no_batch_dims_saveable`) keeps what it names and recomputes the rest. Results are the
same to rounding (the same program runs twice); `make_train_step(remat=...)` passes it through.

State across windows: `__call__` starts from the given state and returns the state after the last
token. With `truncate_bptt=True` (default, as mamba-rs) no gradient flows into the incoming state;
`truncate_bptt=False` differentiates through it (exact BPTT when windows are chained in one program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba.core.deprecation import reject_unknown, take_renamed
from jmamba.core.dtypes import accum_dtype
from jmamba.core.precision import as_precision
from jmamba.core.validation import check_bool_mask, check_float, normalize_reset, shape_of
from jmamba.layers.dense import Dense
from jmamba.layers.rmsnorm import RMSNorm

f32 = jnp.float32


def take_compute_dtype(deprecated: dict, precision, where: str):
    """`precision`, or the deprecated `compute_dtype=` keyword (a dtype) found in `deprecated`."""
    precision = take_renamed(deprecated, "compute_dtype", "precision", precision, where=where, stacklevel=5)
    reject_unknown(deprecated, where)
    return precision


class ResidualBlock(nnx.Module):
    """RMSNorm → mixer; the caller adds the residual."""

    def __init__(self, cfg, mixer_cls, *, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer_cls(cfg, rngs=rngs)


class ResidualBackbone(nnx.Module):
    """Input projection → n_layers pre-norm residual blocks → final RMSNorm."""

    mixer_cls = None  # set by subclasses
    # no-weight-decay modes of input_proj.bias (architecture-specific: docs/mamba3_siso.md §2.4)
    input_bias_no_decay: tuple = ()

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        cfg.validate()
        self.config = cfg
        self.input_proj = (None if cfg.input_dim is None else
                           Dense(cfg.input_dim, cfg.d_model, use_bias=True,
                                 bias_no_decay=self.input_bias_no_decay, rngs=rngs))
        self.layers = nnx.List([ResidualBlock(cfg, self.mixer_cls, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)

    # ----------------------------------------------------------------------------------------- state
    def init_state(self, batch: int):
        """Zero recurrent state: a tuple with one per-layer state (see the mixer) per layer."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        return tuple(layer.mixer.init_state(batch) for layer in self.layers)

    def check_state(self, state, batch: int):
        """Raises ValueError/TypeError unless `state` matches `init_state(batch)` in structure, shape, dtype.

        (float64 states are accepted too, for float64 gradient checks.)
        """
        want = jax.eval_shape(lambda: self.init_state(batch))
        if not isinstance(state, tuple) or len(state) != len(want):
            raise ValueError(f"state must be a tuple of {len(want)} per-layer states (init_state(batch)), "
                             f"got {type(state).__name__}" + (f" of length {len(state)}" if isinstance(state, tuple) else ""))
        for i, (got_l, want_l) in enumerate(zip(state, want)):
            if type(got_l) is not type(want_l):
                raise TypeError(f"state[{i}] must be a {type(want_l).__name__}, got {type(got_l).__name__}")
            for field in want_l._fields:
                g, w = getattr(got_l, field), getattr(want_l, field)
                if shape_of(g) != w.shape:
                    raise ValueError(f"state[{i}].{field} must have shape {w.shape}, got {shape_of(g)}")
                if jnp.result_type(g) not in (w.dtype, jnp.float64):   # float64 only for x64 gradient checks
                    raise TypeError(f"state[{i}].{field} must have dtype {w.dtype}, got {jnp.result_type(g)}")

    # ------------------------------------------------------------------------------------- forward
    def _check_input(self, x, ndim):
        check_float("x", x)
        want = self.config.backbone_input_dim
        s = shape_of(x)
        if len(s) != ndim or s[-1] != want:
            what = "[batch, seqlen, %d]" if ndim == 3 else "[batch, %d]"
            raise ValueError(f"x must have shape {what % want} (input_dim), got {s}")

    def _embed(self, x):
        acc = accum_dtype(x.dtype)   # the residual stream: float32 (float64 for x64 checks)
        return x.astype(acc) if self.input_proj is None else self.input_proj(x.astype(acc))

    def __call__(self, x, state=None, *, reset=None, precision=None, truncate_bptt: bool = True,
                 remat=None, **deprecated):
        """Runs a window of T steps.

        Args:
          x: [Bt, T, input_dim] float.
          state: recurrent state from `init_state` / a previous call (None = zeros).
          reset: optional [Bt] or [Bt, T] bool mask zeroing the state entering a row (at a position).
          precision: compute precision of the mixers' matmuls and activations: "f32" (default),
            "bf16", "f16", a `jmamba.Precision` or a dtype. (`compute_dtype=` is its deprecated name.)
          truncate_bptt: stop gradients into the incoming state (default True).
          remat: None / "none" (save everything), "layer" (recompute each block in the backward
            pass), or a `jax.checkpoint_policies` policy applied per block.

        Returns:
          (y [Bt, T, d_model] float32, new_state).
        """
        cdt = as_precision(take_compute_dtype(deprecated, precision, f"{type(self).__name__}.__call__")).compute_dtype
        self._check_input(x, 3)
        bsz, seqlen = shape_of(x)[:2]
        if state is None:
            state = self.init_state(bsz)
        else:
            self.check_state(state, bsz)
            if truncate_bptt:
                state = jax.lax.stop_gradient(state)
        reset = normalize_reset(reset, bsz, seqlen)
        remat = check_remat(remat)
        h = self._embed(x)
        if remat is None:
            return self._fused_stack(h, state, reset, cdt)
        block = _block_fn(remat, cdt)
        new_state = []
        for layer, s in zip(self.layers, state):
            h, s = block(layer, h, s, reset)
            new_state.append(s)
        return self.norm_f(h, h.dtype), tuple(new_state)

    def _fused_stack(self, h, state, reset, cdt):
        """The blocks without remat: each norm also adds the previous block's output to the stream
        (`RMSNorm.add_and_norm`, one op: h_l + out_{l-1} and the norm of the sum), the final norm
        the last block's. The same values as `_residual_block` one block at a time."""
        out, new_state = None, []
        for layer, s in zip(self.layers, state):
            y, h = layer.norm.add_and_norm(h, None, cdt) if out is None else layer.norm.add_and_norm(out, h, cdt)
            out, s = layer.mixer(y, s, reset=reset)
            new_state.append(s)
        y, _ = self.norm_f.add_and_norm(h, None, h.dtype) if out is None else self.norm_f.add_and_norm(out, h, h.dtype)
        return y, tuple(new_state)

    def step(self, x_t, state, *, reset=None, precision=None, **deprecated):
        """Single-token decode: x_t [Bt, input_dim] -> (y_t [Bt, d_model] float32, new_state).

        `reset` is an optional [Bt] bool mask zeroing the state of a row before this token;
        `precision` as in `__call__`.
        """
        cdt = as_precision(take_compute_dtype(deprecated, precision, f"{type(self).__name__}.step")).compute_dtype
        self._check_input(x_t, 2)
        bsz = shape_of(x_t)[0]
        self.check_state(state, bsz)
        if reset is not None:
            check_bool_mask("reset", reset, [(bsz,)], "[batch]")
            state = jax.tree.map(lambda a: jnp.where(reset.reshape((bsz,) + (1,) * (a.ndim - 1)), 0, a), state)
        h = self._embed(x_t)
        new_state = []
        for layer, s in zip(self.layers, state):
            out, s = layer.mixer.step(layer.norm(h, cdt), s)
            h = h + out.astype(h.dtype)
            new_state.append(s)
        return self.norm_f(h, h.dtype), tuple(new_state)


REMAT_MODES = (None, "none", "layer")


def check_remat(remat):
    """None, "none", "layer" or a callable `jax.checkpoint_policies` policy; ValueError otherwise."""
    if remat in REMAT_MODES or callable(remat):
        return None if remat == "none" else remat
    raise ValueError(f"remat must be None, 'none', 'layer' or a jax.checkpoint_policies policy, got {remat!r}")


def _residual_block(layer, h, s, reset, cdt):
    out, s = layer.mixer(layer.norm(h, cdt), s, reset=reset)
    return h + out.astype(h.dtype), s


def _block_fn(remat, cdt):
    """One residual block as a function of (layer, h, state, reset), rematerialised as asked."""
    def block(layer, h, s, reset):
        return _residual_block(layer, h, s, reset, cdt)
    if remat is None:
        return block
    return nnx.remat(block, policy=None if remat == "layer" else remat)
