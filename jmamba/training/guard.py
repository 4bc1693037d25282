"""The non-finite guard: nothing non-finite reaches the weights or the carried state.

Policy (docs/numerics.md §10), in every precision unless the step is built with
`nonfinite_guard=False`:

* a step whose loss, gradients or optimizer update holds inf/NaN is skipped: parameters, optimizer
  state, step counters and gradient accumulator stay bit-identical; `metrics["skipped"]` is True
  and `TrainState.consecutive_skips` counts the skips in a row (0 after an applied step). With
  float16 the dynamic loss scale halves as before (an overflow is the usual cause).
* a recurrent-state row that comes out of a window non-finite is not carried into the next window:
  the row restarts from zeros, as if a document boundary were there, and
  `metrics["state_rows_reset"]` counts the rows.

With `nonfinite_guard=False` the step applies whatever it computed (PyTorch's behaviour); float16
loss scaling still skips overflowing steps, as `torch.cuda.amp.GradScaler` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba import ops


def all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite (bool scalar)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def finite_rows(state, batch_size: int) -> jax.Array:
    """[B] bool: True where every leaf of `state` (each with leading axis B) is finite in that row
    (`jmamba.ops.finite_rows`: one XLA row reduction per leaf, or with `dispatch.prefer("finite_rows",
    "pallas")` every leaf in one kernel launch; the answer is the same exactly)."""
    return ops.finite_rows(jax.tree.leaves(state), batch_size)


def restart_nonfinite_rows(state):
    """(state with its non-finite rows zeroed, number of such rows int32). No leaves: (state, 0)."""
    leaves = jax.tree.leaves(state)
    if not leaves:
        return state, jnp.zeros((), jnp.int32)
    bsz = leaves[0].shape[0]
    ok = finite_rows(state, bsz)
    clean = jax.tree.map(lambda x: jnp.where(ok.reshape((bsz,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x)), state)
    return clean, jnp.sum(~ok).astype(jnp.int32)
