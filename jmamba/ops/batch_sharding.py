"""Running an op implementation on the local batch of each device of a data-parallel mesh.

Every jmamba op is independent per batch row. Under a mesh with a `data` axis (set by the sharded
train step with `jax.set_mesh`), XLA's partitioner cannot split a Pallas kernel (a custom call), so
the op's implementation is wrapped in `jax.shard_map`: batch-dimension arguments are split over
`data`, parameters (A, D, biases) are replicated, and the outputs stay batch-sharded. Autodiff of
`shard_map` sums the replicated arguments' cotangents across devices, which is the gradient
all-reduce. Without such a mesh the implementation is called directly.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jmamba.core.axes import DATA_AXIS


def data_axis_size() -> int:
    """Size of the `data` axis of the current (abstract) mesh, or 1 when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[DATA_AXIS]


def call_batch_sharded(fn, args, batched, **static):
    """fn(*args, **static), per device on its batch shard when a `data` mesh is active.

    Args:
      fn: the implementation; every output must have the batch as its leading axis.
      args: positional arguments (None allowed).
      batched: one bool per argument: True = leading axis is the batch (split), False = replicated.
    """
    n = data_axis_size()
    if n == 1:
        return fn(*args, **static)
    bsz = args[0].shape[0]
    if bsz % n:
        raise ValueError(f"the batch ({bsz}) must be divisible by the mesh's '{DATA_AXIS}' axis ({n})")
    specs = tuple(P(DATA_AXIS) if b else P() for b in batched)
    # check_vma=False: Pallas kernels build their outputs from ShapeDtypeStructs without varying-axis
    # types. The transpose still sums replicated arguments' cotangents over `data` (tested against the
    # single-device gradients in tests/test_data_parallel.py, Pallas kernel included).
    return jax.shard_map(functools.partial(fn, **static), in_specs=specs, out_specs=P(DATA_AXIS),
                         check_vma=False)(*args)
