"""Meshes and shardings for data-parallel and sequence-parallel training.

    mesh  = make_data_mesh()                      # all devices on one `data` axis (all hosts' devices
                                                  # after jax.distributed.initialize())
    mesh  = make_mesh(data=2, seq=4)              # 2-D: batch rows over `data`, each sequence's time
                                                  # axis over `seq` (docs/sequence_parallel.md)
    state = shard_state(TrainState.create(...), mesh, fsdp=False)
    step  = make_train_step(model, opt, loss_fn=..., mesh=mesh)     # same step, now SPMD
    state, metrics = step(state, batch)           # batch: global batch, split over `data`

Placement, read from each state field's `placement` metadata (so this module needs no knowledge of
the training layer; `TrainState` declares it):
  * "rows" (batch and recurrent state): the leading (batch) axis is split over `data`; batch arrays
    of rank >= 2 ([B, T, ...]) also split their time axis over `seq` when the mesh has one (the
    recurrent state has no time axis: it is replicated over `seq`);
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

from jmamba.core.axes import DATA_AXIS, SEQ_AXIS

PLACEMENTS = ("weights", "rows", "replicated")


def make_data_mesh(devices: Optional[Sequence] = None) -> jax.sharding.Mesh:
    """A 1-D mesh named `data` over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must not be empty")
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)


def make_mesh(*, data: Optional[int] = None, seq: int = 1, devices: Optional[Sequence] = None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all devices of all processes) with a `data` axis and, when
    seq > 1, a `seq` axis (sequence parallelism: each sequence's time axis split over `seq` devices).

    Args:
      data: size of the `data` axis (None: the devices left, len(devices) // seq).
      seq: size of the `seq` axis; 1 gives the plain data mesh (no `seq` axis, the one-pass scans).
      devices: the devices, in mesh order (row-major: consecutive devices share a `data` index).
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must not be empty")
    for name, v in (("seq", seq), ("data", data)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if data is None:
        if len(devices) % seq:
            raise ValueError(f"seq ({seq}) must divide the number of devices ({len(devices)})")
        data = len(devices) // seq
    if data * seq != len(devices):
        raise ValueError(f"data x seq = {data} x {seq} = {data * seq} must equal the number of devices ({len(devices)})")
    if seq == 1:
        return make_data_mesh(devices)
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((data, seq), (DATA_AXIS, SEQ_AXIS), axis_types=(auto, auto), devices=devices)


def _check_mesh(mesh):
    if not isinstance(mesh, jax.sharding.Mesh) or not {DATA_AXIS, SEQ_AXIS} & set(mesh.axis_names):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a '{DATA_AXIS}' and/or a '{SEQ_AXIS}' axis "
                         "(make_data_mesh() or make_mesh(data=..., seq=...))")


def _axis(mesh, name):
    """(the axis name or None, its size: 1 when the mesh has no such axis)."""
    return (name, mesh.shape[name]) if name in mesh.axis_names else (None, 1)


def batch_spec(mesh, shape, what="batch array"):
    """PartitionSpec of a batch array: [B] over `data`, [B, T, ...] over `data` and `seq`; scalars replicated."""
    _check_mesh(mesh)
    if len(shape) == 0:
        return P()
    data, n_data = _axis(mesh, DATA_AXIS)
    seq, n_seq = _axis(mesh, SEQ_AXIS)
    if shape[0] % n_data:
        raise ValueError(f"{what}: batch size {shape[0]} must be divisible by the '{DATA_AXIS}' axis ({n_data})")
    if len(shape) == 1:
        return P(data)
    if shape[1] % n_seq:
        raise ValueError(f"{what}: sequence length {shape[1]} (axis 1) must be divisible by the '{SEQ_AXIS}' "
                         f"axis ({n_seq})")
    return P(data, seq)


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
    if fsdp and DATA_AXIS not in mesh.axis_names:
        raise ValueError(f"fsdp=True shards the weights over the '{DATA_AXIS}' axis: the mesh has none")
    fields = [f for f in getattr(type(state), "__dataclass_fields__", {}).values()
              if f.metadata.get("pytree_node", True)]
    if not fields or any(f.metadata.get("placement") not in PLACEMENTS for f in fields):
        raise TypeError(f"state must be a jmamba.TrainState (a dataclass whose fields declare a placement), "
                        f"got {type(state).__name__}")
    if getattr(state, "is_flat", False):
        raise ValueError("a flat TrainState (TrainState.create(..., flat=True)) runs on one device: "
                         "create the state with flat=False to place it on a mesh")
    data, n = _axis(mesh, DATA_AXIS)
    rep = NamedSharding(mesh, P())

    def weights(x):
        return NamedSharding(mesh, _fsdp_spec(np.shape(x), n)) if fsdp else rep

    def batch_rows(x):
        if np.ndim(x) == 0 or np.shape(x)[0] % n:
            raise ValueError(f"recurrent-state batch ({np.shape(x)[0] if np.ndim(x) else 'scalar'}) must be "
                             f"divisible by the '{DATA_AXIS}' axis ({n})")
        return NamedSharding(mesh, P(data))

    place = {"weights": weights, "rows": batch_rows, "replicated": lambda _: rep}
    return state.replace(**{f.name: jax.tree.map(place[f.metadata["placement"]], getattr(state, f.name))
                            for f in fields})


def batch_shardings(batch: dict, mesh):
    """The NamedSharding of every array of `batch` (`batch_spec`: batch axis over `data`, the time
    axis of [B, T, ...] arrays over `seq`; scalars replicated)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, batch_spec(mesh, np.shape(x), f"batch{jax.tree_util.keystr(path)}")),
        batch)


def shard_state(state, mesh, *, fsdp: bool = False):
    """Places `state` on the mesh (see the module docstring)."""
    return jax.device_put(state, state_shardings(state, mesh, fsdp=fsdp))


def shard_batch(batch: dict, mesh) -> dict:
    """Places a global batch on the mesh, split along the batch axis."""
    return jax.device_put(batch, batch_shardings(batch, mesh))
