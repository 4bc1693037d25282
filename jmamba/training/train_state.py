"""`TrainState`: everything a training step reads and writes, as one pytree.

Fields:
  params: float32 master parameters (an `nnx.State` of `nnx.Param`s, from `nnx.split`).
  opt_state: the optax optimizer state for `params`.
  recurrent_state: the model's recurrent state carried between windows (`model.init_state(B)`).
  step: int32 scalar, the number of optimizer updates applied.
  loss_scale: dynamic loss-scale state for float16 training, or None.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct


class TrainState(struct.PyTreeNode):
    params: Any
    opt_state: Any
    recurrent_state: Any
    step: jax.Array
    loss_scale: Any = None

    @classmethod
    def create(cls, model: nnx.Module, optimizer: optax.GradientTransformation, batch_size: int,
               *, loss_scale=None) -> "TrainState":
        """Initial state: the model's parameters as float32 masters, a fresh optimizer and zero state.

        Args:
          model: an nnx module with `init_state(batch)` (a backbone or `MambaLM`).
          optimizer: any optax transformation (e.g. `optax.adamw(...)` or `jmamba.fused_adamw(...)`).
          batch_size: rows of the carried recurrent state.
        """
        # A copy: the train step donates its input buffers, which must not be the model's own arrays.
        params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(params)
               if v.dtype != jnp.float32]
        if bad:
            raise TypeError(f"master parameters must be float32; these are not: {bad[:5]}")
        return cls(params=params, opt_state=optimizer.init(params),
                   recurrent_state=model.init_state(batch_size),
                   step=jnp.zeros((), jnp.int32), loss_scale=loss_scale)

    def reset_recurrent_state(self, rows=None) -> "TrainState":
        """Zeroes the carried state (all rows, or rows where the [B] bool mask `rows` is True)."""
        if rows is None:
            return self.replace(recurrent_state=jax.tree.map(jnp.zeros_like, self.recurrent_state))
        rows = jnp.asarray(rows, bool)

        def zero(a):
            return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a)

        return self.replace(recurrent_state=jax.tree.map(zero, self.recurrent_state))
