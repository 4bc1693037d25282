"""`TrainState`: everything a training step reads and writes, as one pytree.

Fields (arrays):
  params: float32 master parameters (an `nnx.State` of `nnx.Param`s, from `nnx.split`).
  opt_state: the optax optimizer state for `params`.
  recurrent_state: the model's recurrent state carried between windows (`model.init_state(B)`).
  step: int32 scalar, the number of optimizer updates applied.
  loss_scale: `DynamicLossScale` for float16 training, else None.
  grad_accum: float32 gradient accumulator (same tree as params) when created with `accumulate=True`.

Static fields (host-side bookkeeping, not arrays; checked before anything runs):
  accumulating: an accumulation window is open (micro-batch gradients wait in `grad_accum`).
  pending_forward: token of a split-API `forward` whose `backward_step` has not run yet.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from jmamba.training.loss_scale import DynamicLossScale

PRECISIONS = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def check_precision(precision):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")


class TrainState(struct.PyTreeNode):
    params: Any
    opt_state: Any
    recurrent_state: Any
    step: jax.Array
    loss_scale: Optional[DynamicLossScale] = None
    grad_accum: Any = None
    accumulating: bool = struct.field(pytree_node=False, default=False)
    pending_forward: Optional[int] = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, model: nnx.Module, optimizer: optax.GradientTransformation, batch_size: int,
               *, precision: str = "f32", accumulate: bool = False) -> "TrainState":
        """Initial state: float32 master copies of the model's parameters, a fresh optimizer, zero state.

        Args:
          model: an nnx module with `init_state(batch)` (a backbone or `MambaLM`).
          optimizer: any optax transformation (e.g. `optax.adamw(...)` or `jmamba.fused_adamw(...)`).
          batch_size: rows of the carried recurrent state.
          precision: "f32", "bf16" or "f16"; "f16" creates the dynamic loss scale.
          accumulate: allocate a float32 gradient accumulator (for `backward_step(accumulate_only=True)`).
        """
        check_precision(precision)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        if not hasattr(model, "init_state"):
            raise TypeError(f"model must have init_state(batch) (a backbone or MambaLM), got {type(model).__name__}")
        bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
               if v.dtype != jnp.float32]
        if bad:
            raise TypeError(f"master parameters must be float32; these are not: {bad[:5]}")
        # A copy: the train step donates its input buffers, which must not be the model's own arrays.
        params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        return cls(params=params, opt_state=optimizer.init(params),
                   recurrent_state=model.init_state(batch_size),
                   step=jnp.zeros((), jnp.int32),
                   loss_scale=DynamicLossScale.create() if precision == "f16" else None,
                   grad_accum=jax.tree.map(jnp.zeros_like, params) if accumulate else None)

    def reset_recurrent_state(self, rows=None) -> "TrainState":
        """Zeroes the carried state (all rows, or rows where the [B] bool mask `rows` is True)."""
        if rows is None:
            return self.replace(recurrent_state=jax.tree.map(jnp.zeros_like, self.recurrent_state))
        rows = jnp.asarray(rows, bool)

        def zero(a):
            return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a)

        return self.replace(recurrent_state=jax.tree.map(zero, self.recurrent_state))
