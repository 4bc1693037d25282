"""Running a scan op with its time axis split over the mesh's `seq` axis (sequence parallelism).

Under a mesh with a `seq` axis (set by the sharded train step with `jax.set_mesh`), each device
holds a contiguous time shard of every sequence. A scan is a chain of state transitions, and over a
whole shard the transition is affine in the state that enters it:

    state_out = transfer_j(state_in)          (e.g. Mamba-1: h_out = Λ_j ⊙ h_in + h_j)

where the shard's *summary* (Λ_j, h_j) comes from the shard alone: h_j is the shard's final state
when it starts from zeros, Λ_j the product of its decays. So each device (inside `jax.shard_map`):

  1. runs its shard from the zero state (pass 1) and forms its summary;
  2. all-gathers the summaries over `seq` (a few [Bt, ...] state-sized arrays per device) and folds
     them in order, s_0 = the initial state, s_{j+1} = transfer_j(s_j): s_j is the true state
     entering shard j, s_k the final state of the whole sequence (every device computes the same fold,
     in the same order: deterministic, and the final state is replicated over `seq`);
  3. runs its shard again from s_j (pass 2): its outputs are the one-device outputs, to rounding.

The backward is JAX autodiff of the above: the transpose of the all-gather sends each device the
cotangent of its summary, i.e. the state adjoints travel the other way (from later shards to
earlier ones), and both passes' kernels run their own backward. Replicated arguments (weights) get
their cotangents summed over the mesh by `shard_map`'s transpose, as in data parallelism.

Cost per device: two scans of its shard forward and backward (pass 1 is needed for the summary)
plus state-sized collectives; with S shards each device does 2/S of the one-device scan work.
Ops that need more than the state across a boundary (the causal conv's last K-1 inputs) gather
that halo before pass 1 with the same fold (its transfer ignores the incoming value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmamba.core.axes import DATA_AXIS, SEQ_AXIS


def _mesh_axes():
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def sequence_sharded() -> bool:
    """True when the current (abstract) mesh has a `seq` axis: the scan ops then split the time axis."""
    return SEQ_AXIS in _mesh_axes()


def seq_axis_size() -> int:
    """Size of the `seq` axis of the current mesh (1 when there is none)."""
    return _mesh_axes().get(SEQ_AXIS, 1)


def call_sequence_sharded(body, args, roles, out_roles, *, op):
    """body(*local_args) per device on its (batch, time) shard, inside `jax.shard_map`.

    Args:
      body: the per-device function (it uses `seq_shard_index`, `gather_and_fold`, ...).
      args: positional arguments (None allowed).
      roles: one per argument: "time" ([Bt, T, ...]: batch over `data`, time over `seq`), "rows"
        ([Bt, ...] states: batch over `data`, replicated over `seq`) or "weights" (replicated).
      out_roles: the same for each output of `body`.
      op: the op's name, for error messages.
    """
    axes = _mesh_axes()
    data = DATA_AXIS if DATA_AXIS in axes else None
    n_seq, n_data = axes[SEQ_AXIS], axes.get(DATA_AXIS, 1)
    bsz, seqlen = args[0].shape[0], args[0].shape[1]
    if bsz % n_data:
        raise ValueError(f"{op}: the batch ({bsz}) must be divisible by the mesh's '{DATA_AXIS}' axis ({n_data})")
    if seqlen % n_seq:
        raise ValueError(f"{op}: the sequence length ({seqlen}) must be divisible by the mesh's '{SEQ_AXIS}' "
                         f"axis ({n_seq}): each device holds an equal time shard")
    spec = {"time": P(data, SEQ_AXIS), "rows": P(data), "weights": P()}
    # check_vma=False as in batch_sharding (Pallas outputs carry no varying-axis types). Outputs with
    # role "rows" are the same on every `seq` device (the fold is replicated); shard_map's transpose
    # then divides their cotangent by the `seq` size and sums the devices' contributions back.
    return jax.shard_map(body, in_specs=tuple(spec[r] for r in roles),
                         out_specs=tuple(spec[r] for r in out_roles), check_vma=False)(*args)


def seq_shard_index():
    """This device's position along `seq` (0 = the first time shard); inside the shard_map body."""
    return jax.lax.axis_index(SEQ_AXIS)


def gather_and_fold(summary, initial, transfer):
    """(state entering this device's shard, final state of the whole sequence).

    Args:
      summary: this shard's summary (a pytree of arrays).
      initial: the state entering the first shard (replicated over `seq`).
      transfer: transfer(summary_j, state) -> the state after shard j given the state before it.
    """
    n = seq_axis_size()
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, SEQ_AXIS), summary)   # leading axis: shard
    states = [initial]
    for j in range(n):
        states.append(transfer(jax.tree.map(lambda g: g[j], gathered), states[-1]))
    idx = seq_shard_index()
    entering = jax.tree.map(lambda *xs: jnp.stack(xs)[idx], *states[:n])
    return entering, states[n]


def any_reset(reset, bsz):
    """[Bt] bool: True where the row's shard holds a reset (so nothing before the shard reaches its end)."""
    if reset is None:
        return jnp.zeros((bsz,), bool)
    return jnp.any(reset, axis=1)


def keep(mask, x):
    """x where the row keeps its incoming state (mask [Bt] True), 0 elsewhere; x [Bt, ...]."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))

