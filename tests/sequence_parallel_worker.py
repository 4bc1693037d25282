"""Subprocess worker for tests/test_sequence_parallel.py: 4 simulated CPU devices (the device count must
be set before JAX starts).

    python sequence_parallel_worker.py OUT_JSON [CASE ...]

Each case runs the same computation on one device and with the time axis split over a `seq` mesh
axis (alone, and as a data x seq mesh), and writes the largest relative differences to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmamba  # noqa: E402
from builders import (TINY_CHUNK, d_out_batch, gradient_capture, gradient_recorder,  # noqa: E402
                      mamba1_implementation_args, mamba1_scan_inputs, mamba3_scan_inputs, max_rel, tiny_backbone)
from jmamba import ops  # noqa: E402
from jmamba.io.checkpoint import restore_checkpoint, save_checkpoint  # noqa: E402
from jmamba.parallel import make_mesh as _make_mesh  # noqa: E402
from jmamba.parallel import shard_state  # noqa: E402

jmamba.ops.set_default_tuning("mamba3_siso_scan", jmamba.ops.Mamba3ScanTuning(chunk_size=TINY_CHUNK))
MESHES = {"seq4": dict(data=1, seq=4), "data2_seq2": dict(data=2, seq=2)}


def make_mesh(**kw):
    """A mesh over the first 4 devices (so the worker also runs on a machine with more GPUs)."""
    return _make_mesh(devices=jax.devices()[:4], **kw)


def resets(bsz, T):
    """Resets inside a shard, at a shard's first position and at the window's first position (on either
    mesh: T // 2 begins a time shard of both the 4-way and the 2-way split)."""
    r = np.zeros((bsz, T), bool)
    r[1, T // 2 + 1] = r[2, T // 2] = r[3, 0] = True
    return jnp.asarray(r)


def fixed_weights(shape):
    """Deterministic weights in [-1, 1] of `shape` (a different one at every position)."""
    return jnp.cos(1.0 + 0.7 * jnp.arange(int(np.prod(shape)), dtype=jnp.float32)).reshape(shape)


def grad_fn(f, nargs):
    """jit of: args -> (cotangents of every argument, outputs) of Σ (w·y + tanh(y)) over the outputs y,
    w fixed. The cotangent w + sech²(y) varies with y yet has a bounded derivative, so the rounding
    of the outputs (outputs of tens of units) does not reach the compared gradients amplified, as
    it does for a loss like Σ y·sin(y) whose cotangent moves by |y| per unit of y."""
    def scalar(*a):
        outs = f(*a)
        return sum(jnp.sum(fixed_weights(x.shape) * x.astype(jnp.float32) + jnp.tanh(x.astype(jnp.float32)))
                   for x in jax.tree.leaves(outs)), outs
    return jax.jit(jax.grad(scalar, argnums=tuple(range(nargs)), has_aux=True))


def loss_and_grads(f, args, fn=None):
    """(outputs, cotangents of every argument) (see `grad_fn`)."""
    grads, outs = (fn or grad_fn(f, len(args)))(*args)
    return outs, grads


def compare(f, args, meshes=tuple(MESHES)):
    """{mesh: [outputs rel diff, gradients rel diff]} of f(*args) against one device; for low-precision
    args also "bf16_vs_f32": the same differences of each run from the one-device float32 run (the
    sharded run must be as close to it as the one-device run is)."""
    outs1, grads1 = loss_and_grads(f, args)
    res = {}
    low = any(getattr(a, "dtype", None) == jnp.bfloat16 for a in args)
    if low:
        wide = tuple(None if a is None else a.astype(jnp.float32) for a in args)
        outs32, grads32 = loss_and_grads(f, wide)
        res["single_vs_f32"] = [max_rel(outs1, outs32), max_rel(grads1, grads32)]
    for name in meshes:
        with jax.set_mesh(make_mesh(**MESHES[name])):
            fn = grad_fn(f, len(args))
            outs, grads = loss_and_grads(f, args, fn)
            again = loss_and_grads(f, args, fn)
        res[name] = [max_rel(outs, outs1), max_rel(grads, grads1)]
        res[name + "_bit_identical_rerun"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                                 zip(jax.tree.leaves((outs, grads)), jax.tree.leaves(again)))
        if low:
            res[name + "_vs_f32"] = [max_rel(outs, outs32), max_rel(grads, grads32)]
    return res


def angle_free(state):
    """A Mamba-3 state with its angle as (cos, sin) (the wrap at 2π makes θ itself discontinuous)."""
    return (jnp.cos(state.angle), jnp.sin(state.angle)) + tuple(state[1:])


def case_selective_scan(dtype, impl, meshes=tuple(MESHES)):
    shape = (4, 16, 8, 4, 1)   # Bt, T, d, n, groups
    kw, _ = mamba1_scan_inputs(shape, dtype)
    arrays = mamba1_implementation_args(kw)     # u delta A B C D z delta_bias h0
    reset = resets(4, 16)

    def f(*a):
        out, st = ops.selective_scan(*a[:-1], delta_softplus=True, initial_state=ops.SelectiveScanState(a[-1]),
                                     return_final_state=True, reset=reset, implementation=impl)
        return out, st.ssm
    return compare(f, arrays, meshes)


def case_mixer_core(dtype, impl, meshes=tuple(MESHES)):
    r = np.random.default_rng(3)
    B, T, E, N, R, K = 4, 16, 8, 4, 2, 4
    a = lambda *s, scale=1.0: jnp.asarray(r.normal(size=s) * scale, jnp.float32)
    args = (a(B, T, 2 * E).astype(dtype), a(K, E, scale=0.5), a(E), a(E, R + 2 * N, scale=0.5), a(R, E, scale=0.5),
            a(E), -jnp.exp(a(E, N)), a(E), a(B, K - 1, E), a(B, E, N))
    reset = resets(B, T)

    def f(xz, ck, cb, xp, dp, db, A, D, conv, ssm):
        y, st = ops.mamba1_mixer_core(xz, None, ck, cb, xp, dp, db, A, D, initial_state=ops.Mamba1CoreState(conv, ssm),
                                      return_final_state=True, reset=reset, implementation=impl, xz_packed=True)
        return y, st.conv, st.ssm
    return compare(f, args, meshes)


def case_mamba3(dtype, impl, per_head_angles, with_reset=True, meshes=tuple(MESHES)):
    shape = (4, 16, 4, 2, 8, 4, 2)   # Bt, T, H, G, N, P, S
    arrays, state = mamba3_scan_inputs(shape, dtype, per_head_angles=per_head_angles)
    names = list(arrays)
    reset = resets(4, 16) if with_reset else None   # (the Pallas kernels take no resets)

    def f(*a):
        kw = dict(zip(names, a[:len(names)]))
        out, st = ops.mamba3_siso_scan(*[kw[n] for n in names], initial_state=ops.Mamba3ScanState(*a[len(names):]),
                                       return_final_state=True, reset=reset, implementation=impl)
        return out, angle_free(st)
    return compare(f, tuple(arrays.values()) + tuple(state), meshes)


def run_steps(arch, mesh, precision="f32", steps=3, opt=None, T=16):
    """(state after `steps` steps, the optimizer state after the first step); the optimizer is by
    default AdamW behind a gradient recorder (`gradient_recorder`: one compiled step gives both the
    first step's gradients, `[0]` of the second, and the trained parameters)."""
    model = tiny_backbone(arch)
    opt = opt or gradient_recorder(optax.adamw(1e-2))
    state = jmamba.TrainState.create(model, opt, 8, precision=precision)
    if mesh is not None:
        state = shard_state(state, mesh)
    step = jmamba.make_train_step(model, opt, precision=precision, clip_max_norm=1.0, mesh=mesh)
    first = None
    for i in range(steps):   # windows chained through the recurrent state; resets in the second one
        b = d_out_batch(100 + i, 8, T)
        if i == 1:
            b["reset"] = jnp.asarray(np.eye(8, T, k=3, dtype=bool))
        state, _ = step(state, b)
        if i == 0:   # (copied now: the next step may donate these buffers)
            first = jax.tree.map(np.asarray, state.opt_state)
    return state, first


def case_train(arch):
    """f32: one step's gradients (as the optimizer receives them), parameters after three AdamW steps
    and the recurrent state after three chained windows, on the data x seq mesh vs one device."""
    mesh = make_mesh(data=2, seq=2)
    # Mamba-1 with the add + RMSNorm kernels (interpreted): per device on its batch rows and time shard
    with ops.dispatch.prefer("add_rms_norm", "pallas" if arch == "mamba1" else "xla"):
        (s1, g1), (s, g) = (run_steps(arch, m) for m in (None, mesh))
    _TRAINED[arch] = s
    _F32_GRADS[arch] = g1[0]
    rec = (lambda x: x) if arch == "mamba1" else (lambda x: [angle_free(r) for r in x])
    return {"grads": max_rel(g[0], g1[0]), "params": max_rel(s.params, s1.params),
            "recurrent": max_rel(rec(s.recurrent_state), rec(s1.recurrent_state)),
            "recurrent_spec": str(jax.tree.leaves(s.recurrent_state)[0].sharding.spec)}


def case_train_bf16(arch):
    """bf16 compute: one step's gradients on one device and on the data x seq mesh, each against the
    one-device float32 step (the sharded step must be as close to it as the one-device step)."""
    mesh = make_mesh(data=2, seq=2)
    g32 = _F32_GRADS[arch] if arch in _F32_GRADS else run_steps(arch, None, "f32", steps=1)[1][0]
    (_, g1), (_, g) = (run_steps(arch, m, "bf16", steps=1, opt=gradient_capture()) for m in (None, mesh))
    return {"single_vs_f32": max_rel(g1, g32), "multi_vs_f32": max_rel(g, g32), "multi_vs_single": max_rel(g, g1)}


def case_split():
    model, opt = tiny_backbone("mamba1"), optax.adamw(1e-2)
    out = {}
    for name, mesh in (("single", None), ("multi", make_mesh(data=2, seq=2))):
        state = jmamba.TrainState.create(model, opt, 8)
        for i in range(2):
            b = d_out_batch(100 + i, 8, 16)
            y, ctx, state = jmamba.forward(model, state, {"inputs": b["inputs"]}, mesh=mesh)
            state, _ = jmamba.backward_step(opt, state, ctx, b["d_out"], clip_max_norm=1.0)
        out[name] = state
    return {"params": max_rel(out["multi"].params, out["single"].params)}


_TRAINED = {}     # the data x seq states of case_train, reused by case_checkpoint
_F32_GRADS = {}   # the one-device float32 first-step gradients of case_train, reused by case_train_bf16


def case_checkpoint():
    mesh = make_mesh(data=2, seq=2)
    state = _TRAINED.get("mamba1") or run_steps("mamba1", mesh)[0]
    d = tempfile.mkdtemp()
    save_checkpoint(d, state)
    opt = gradient_recorder(optax.adamw(1e-2))   # the optimizer of case_train's state
    like = shard_state(jmamba.TrainState.create(tiny_backbone("mamba1"), opt, 8), mesh)
    restored = restore_checkpoint(d, like)
    return {"equal": all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state))),
            "same_sharding": all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like)))}


def case_errors():
    """Messages for what a `seq` axis cannot split (one string per check)."""
    out = {}
    mesh = make_mesh(data=1, seq=4)
    kw, _ = mamba1_scan_inputs((2, 6, 8, 4, 1), jnp.float32)
    arrays = mamba1_implementation_args(kw)[:-1]
    seq_only = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    state = jmamba.TrainState.create(tiny_backbone("mamba1"), optax.adamw(1e-2), 8)
    checks = {"seqlen": lambda: jax.jit(lambda: ops.selective_scan(*arrays, delta_softplus=True))(),
              "conv_tail": lambda: jax.jit(case_short_conv)(),
              "mesh_product": lambda: make_mesh(data=3, seq=2),
              "mesh_divides": lambda: make_mesh(seq=3),
              "mesh_positive": lambda: make_mesh(seq=0),
              "batch_time": lambda: jmamba.parallel.batch_spec(make_mesh(data=2, seq=2), (4, 7), "batch['inputs']"),
              "batch_rows": lambda: jmamba.parallel.batch_spec(make_mesh(data=2, seq=2), (3, 8), "batch['inputs']"),
              "fsdp_without_data": lambda: shard_state(state, seq_only, fsdp=True)}
    for name, call in checks.items():
        try:
            with jax.set_mesh(mesh):
                call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def case_short_conv():
    r = np.random.default_rng(0)
    B, T, E, N, R, K = 2, 8, 8, 4, 2, 4      # 2 positions per shard < d_conv - 1
    a = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    return ops.mamba1_mixer_core(a(B, T, E), a(B, T, E), a(K, E), None, a(E, R + 2 * N), a(R, E), None,
                                 -jnp.exp(a(E, N)), None)


# The XLA cases run on the data x seq mesh, the Pallas cases on the seq-only mesh (4 time shards): each
# op is compared on both meshes, with the same resets.
CASES = {
    "selective_scan_f32": lambda: case_selective_scan(jnp.float32, "xla", ("data2_seq2",)),
    "selective_scan_bf16": lambda: case_selective_scan(jnp.bfloat16, "xla", ("data2_seq2",)),
    "selective_scan_pallas": lambda: case_selective_scan(jnp.float32, "pallas", ("seq4",)),
    "mixer_core_f32": lambda: case_mixer_core(jnp.float32, "xla", ("data2_seq2",)),
    "mixer_core_bf16": lambda: case_mixer_core(jnp.bfloat16, "xla", ("data2_seq2",)),
    "mixer_core_pallas": lambda: case_mixer_core(jnp.float32, "pallas", ("seq4",)),
    "mamba3_f32": lambda: case_mamba3(jnp.float32, "xla", True, meshes=("data2_seq2",)),
    "mamba3_bf16_shared_angles": lambda: case_mamba3(jnp.bfloat16, "xla", False, meshes=("data2_seq2",)),
    "mamba3_pallas": lambda: case_mamba3(jnp.float32, "pallas", False, with_reset=False, meshes=("seq4",)),
    "train_mamba1": lambda: case_train("mamba1"),
    "train_mamba3": lambda: case_train("mamba3"),
    "train_mamba1_bf16": lambda: case_train_bf16("mamba1"),
    "train_mamba3_bf16": lambda: case_train_bf16("mamba3"),
    "split": case_split,
    "checkpoint": case_checkpoint,
    "errors": case_errors,
}

if __name__ == "__main__":
    assert len(jax.devices()) >= 4, jax.devices()
    names = sys.argv[2:] or list(CASES)
    results = {}
    for name in names:
        t0 = time.time()
        results[name] = CASES[name]()
        print(f"{name} ({time.time() - t0:.0f} s)", json.dumps(results[name]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
