"""Subprocess worker for tests/test_multiprocess.py: the sequence-parallel train step under
`jax.distributed`, one process per "host" with 2 simulated CPU devices each.

    python multiprocess_worker.py OUT_DIR PROCESS_ID NUM_PROCESSES PORT    # one process of the run
    python multiprocess_worker.py OUT_DIR single                          # the one-device reference

Every process builds the same tiny Mamba-1 LM state, joins the data x seq mesh over all processes'
devices (`make_mesh(data=2, seq=2)`), feeds its own part of the global batch with
`jax.make_array_from_process_local_data` (its data row: the mesh puts each process's devices on one
`data` index), runs three chained windows and writes the parameters and recurrent state (gathered
over processes) to OUT_DIR/result_<id>.npz.
"""

from __future__ import annotations

import sys

import jax

OUT, WHO = sys.argv[1], sys.argv[2]
if WHO != "single":
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[4]}", num_processes=int(sys.argv[3]), process_id=int(WHO))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jmamba  # noqa: E402
from jmamba.parallel import batch_spec, make_mesh, shard_state  # noqa: E402

CFG, VOCAB = jmamba.Mamba1Config(d_model=16, n_layers=2, d_state=4), 40
BSZ, T = 4, 16


def global_batch(i):
    r = np.random.default_rng(100 + i)
    ids = r.integers(0, VOCAB, (BSZ, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def local_part(mesh, batch):
    """This process's rows of each array, as global arrays sharded like `shard_batch` would."""
    rows = [i for i, row in enumerate(mesh.devices) if any(d.process_index == jax.process_index() for d in row)]
    out = {}
    for k, v in batch.items():
        sharding = NamedSharding(mesh, batch_spec(mesh, v.shape, k))
        per_row = v.shape[0] // mesh.devices.shape[0]
        local = np.concatenate([v[r * per_row:(r + 1) * per_row] for r in rows])
        out[k] = jax.make_array_from_process_local_data(sharding, local, v.shape)
    return out


def main():
    model = jmamba.MambaLM(CFG, VOCAB, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-2)
    state = jmamba.TrainState.create(model, opt, BSZ)
    mesh = None if WHO == "single" else make_mesh(data=2, seq=2)
    if mesh is not None:
        state = shard_state(state, mesh)
    step = jmamba.make_train_step(model, opt, loss_fn=jmamba.next_token_loss, clip_max_norm=1.0, mesh=mesh)
    losses = []
    for i in range(3):
        b = global_batch(i)
        state, m = step(state, b if mesh is None else local_part(mesh, b))
        losses.append(float(m["loss"]))
    leaves = jax.tree.leaves((state.params, state.recurrent_state))
    if mesh is not None:
        leaves = [multihost_utils.process_allgather(x, tiled=True) for x in leaves]
    np.savez(f"{OUT}/result_{WHO}.npz", losses=np.asarray(losses), *[np.asarray(x) for x in leaves])
    print(WHO, "losses", losses, "devices", len(jax.devices()), flush=True)


if __name__ == "__main__":
    main()
