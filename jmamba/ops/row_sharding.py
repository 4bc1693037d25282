"""Running a per-row op (every [B, T] position independent: norms, log-sum-exp) per device under a mesh.

Under a mesh with a `data` axis (batch rows) and / or a `seq` axis (time shards), XLA cannot split a
Pallas kernel (a custom call), so the op runs inside `jax.shard_map`: arguments whose leading axes are
[B, T] (or [B]) are split over `data` and `seq`, the others (weights) replicated; every output keeps
its leading axes' sharding. Without such a mesh, or for arrays of rank < 2, the op is called directly.
Replicated arguments' cotangents are summed over the mesh by `shard_map`'s transpose.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jmamba.core.axes import DATA_AXIS, SEQ_AXIS


def call_rows_sharded(fn, args, per_row, **static):
    """fn(*args, **static), per device on its rows when a `data` / `seq` mesh is active.

    Args:
      fn: the implementation; every output has args[0]'s leading (batch, time) axes.
      args: positional arguments (None allowed); args[0] is a row array [B, T, ...] or [B, ...].
      per_row: one bool per argument: True = split along the leading axes like args[0].
    """
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    x = args[0]
    lead = [DATA_AXIS if DATA_AXIS in sizes and x.ndim >= 2 else None]
    if x.ndim >= 3:
        lead.append(SEQ_AXIS if SEQ_AXIS in sizes else None)
    if not any(lead):
        return fn(*args, **static)
    for axis, name in enumerate(lead):
        if name and x.shape[axis] % sizes[name]:
            raise ValueError(f"the input's axis {axis} ({x.shape[axis]}) must be divisible by the mesh's "
                             f"'{name}' axis ({sizes[name]})")
    rows = P(*lead)
    # check_vma=False: Pallas kernels build their outputs without varying-axis types (batch_sharding.py)
    return jax.shard_map(functools.partial(fn, **static), in_specs=tuple(rows if r else P() for r in per_row),
                         out_specs=rows, check_vma=False)(*args)
