"""Meshes and shardings for data-parallel training.

    mesh  = make_data_mesh()                      # all devices on one `data` axis (all hosts' devices
                                                  # after jax.distributed.initialize())
    state = shard_state(TrainState.create(...), mesh, fsdp=False)
    step  = make_train_step(model, opt, loss_fn=..., mesh=mesh)     # same step, now SPMD
    state, metrics = step(state, batch)           # batch: global batch, split over `data`

Placement, read from each state field's `placement` metadata (so this module needs no knowledge of
the training layer; `TrainState` declares it):
  * "rows" (batch and recurrent state): the leading (batch) axis is split over `data`;
  * "weights" (parameters, optimizer state, gradient accumulator): replicated, or with `fsdp=True`
    split over `data` along their largest axis divisible by the axis size (leaves with none stay
    replicated); XLA then all-gathers them for the forward/backward and reduce-scatters the gradients;
  * "replicated" (step counters, loss scale).
XLA inserts the collectives (gradient all-reduce or reduce-scatter); the Pallas kernels run inside
`jax.shard_map` on each device's local batch (see `jmamba.ops.batch_sharding`).

Multi-host: call `jax.distributed.initialize()` (coordinator address, process count and id from the
cluster environment) in every process before anything else; `make_data_mesh()` then spans every
host's devices, each process passes its own slice of the global batch through
`jax.make_array_from_process_local_data`, and checkpoints are written collectively by orbax.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmamba.core.axes import DATA_AXIS

PLACEMENTS = ("weights", "rows", "replicated")


def make_data_mesh(devices: Optional[Sequence] = None) -> jax.sharding.Mesh:
    """A 1-D mesh named `data` over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must not be empty")
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)


def _check_mesh(mesh):
    if not isinstance(mesh, jax.sharding.Mesh) or DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a '{DATA_AXIS}' axis (make_data_mesh())")


def _fsdp_spec(shape, n):
    """Split the largest axis divisible by n (ties: the first); replicate when none is."""
    dims = [d for d in np.argsort([-s for s in shape], kind="stable") if shape[d] % n == 0 and shape[d] >= n]
    if not dims:
        return P()
    spec = [None] * len(shape)
    spec[dims[0]] = DATA_AXIS
    return P(*spec)


def state_shardings(state, mesh, *, fsdp: bool = False):
    """The NamedSharding of every leaf of `state` (a pytree shaped like the state).

    `state` is a dataclass pytree (a `jmamba.TrainState`) whose array fields carry `placement`
    metadata ("weights", "rows" or "replicated").
    """
    _check_mesh(mesh)
    fields = [f for f in getattr(type(state), "__dataclass_fields__", {}).values()
              if f.metadata.get("pytree_node", True)]
    if not fields or any(f.metadata.get("placement") not in PLACEMENTS for f in fields):
        raise TypeError(f"state must be a jmamba.TrainState (a dataclass whose fields declare a placement), "
                        f"got {type(state).__name__}")
    n = mesh.shape[DATA_AXIS]
    rep = NamedSharding(mesh, P())

    def weights(x):
        return NamedSharding(mesh, _fsdp_spec(np.shape(x), n)) if fsdp else rep

    def batch_rows(x):
        if np.ndim(x) == 0 or np.shape(x)[0] % n:
            raise ValueError(f"recurrent-state batch ({np.shape(x)[0] if np.ndim(x) else 'scalar'}) must be "
                             f"divisible by the '{DATA_AXIS}' axis ({n})")
        return NamedSharding(mesh, P(DATA_AXIS))

    place = {"weights": weights, "rows": batch_rows, "replicated": lambda _: rep}
    return state.replace(**{f.name: jax.tree.map(place[f.metadata["placement"]], getattr(state, f.name))
                            for f in fields})


def batch_shardings(batch: dict, mesh):
    """Batch-axis split for every array of `batch` with a leading batch axis; scalars replicated."""
    _check_mesh(mesh)
    n = mesh.shape[DATA_AXIS]

    def one(x):
        if np.ndim(x) == 0:
            return NamedSharding(mesh, P())
        if np.shape(x)[0] % n:
            raise ValueError(f"batch size {np.shape(x)[0]} must be divisible by the '{DATA_AXIS}' axis ({n})")
        return NamedSharding(mesh, P(DATA_AXIS))

    return jax.tree.map(one, batch)


def shard_state(state, mesh, *, fsdp: bool = False):
    """Places `state` on the mesh (see the module docstring)."""
    return jax.device_put(state, state_shardings(state, mesh, fsdp=fsdp))


def shard_batch(batch: dict, mesh) -> dict:
    """Places a global batch on the mesh, split along the batch axis."""
    return jax.device_put(batch, batch_shardings(batch, mesh))
