"""Subprocess worker for the checkpoint tests (a fresh process per phase).

    python checkpoint_worker.py train  DIR ARCH N M   # N steps, save, and separately N+M steps straight
    python checkpoint_worker.py resume DIR ARCH N M   # restore the step-N checkpoint, run M more steps
    python checkpoint_worker.py crash  DIR            # save step 1, then get killed while saving step 2

Results are written as .npz files in DIR, one per precision.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmamba
from builders import TINY, TINY_CHUNK, d_out_batch, tiny_backbone
from jmamba.io.checkpoint import restore_checkpoint, save_checkpoint

PRECISIONS = ("f32", "bf16")
# several Mamba-3 scan chunks per window of 6
jmamba.ops.set_default_tuning("mamba3_siso_scan", jmamba.ops.Mamba3ScanTuning(chunk_size=TINY_CHUNK))


def build(arch):
    return TINY[arch], tiny_backbone(arch)


def batch(i):
    return d_out_batch(1000 + i, bsz=2, T=6)


def setup(arch, precision):
    cfg, model = build(arch)
    opt = optax.adamw(1e-2)
    step = jax.jit(make_step(model, opt, precision))
    return cfg, model, opt, step


def make_step(model, opt, precision):
    return jmamba.make_train_step(model, opt, precision=precision, clip_max_norm=1.0, jit=False)


def run(step, state, start, count):
    for i in range(start, start + count):
        state, _ = step(state, batch(i))
    return state


def dump(path, state):
    np.savez(path, *[np.asarray(x, np.float32) if x.dtype == jnp.bfloat16 else np.asarray(x)
                     for x in jax.tree.leaves(state)])


def main(argv):
    phase, directory = argv[0], argv[1]
    if phase == "crash":
        cfg, model = build("mamba1")
        state = jmamba.TrainState.create(model, optax.adamw(1e-2), 2)
        save_checkpoint(directory, state.replace(step=jnp.asarray(1, jnp.int32)), config=cfg)
        real_rename = os.rename

        def rename_then_die(src, dst, *a, **k):
            if "tmp" in os.fspath(src):
                os.kill(os.getpid(), signal.SIGKILL)   # dies before the checkpoint is committed
            return real_rename(src, dst, *a, **k)

        os.rename = rename_then_die
        save_checkpoint(directory, state.replace(step=jnp.asarray(2, jnp.int32)), config=cfg)
        print("NOT KILLED")
        return 1
    arch, n, m = argv[2], int(argv[3]), int(argv[4])
    for precision in PRECISIONS:
        cfg, model, opt, step = setup(arch, precision)
        ckdir = os.path.join(directory, f"ck_{precision}")
        like = jmamba.TrainState.create(model, opt, 2, precision=precision)
        if phase == "train":
            state = run(step, like, 0, n)
            save_checkpoint(ckdir, state, config=cfg, extras={"next_batch": n})
            dump(os.path.join(directory, f"straight_{precision}.npz"), run(step, state, n, m))
        else:
            state = restore_checkpoint(ckdir, like, config=cfg)
            dump(os.path.join(directory, f"resumed_{precision}.npz"), run(step, state, n, m))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
