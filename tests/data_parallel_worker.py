"""Subprocess worker for tests/test_data_parallel.py: runs with 4 simulated CPU devices (or, on a
multi-GPU machine, over its GPUs: `python tests/data_parallel_worker.py out.json`).

    python data_parallel_worker.py OUT_JSON [CASE ...]

Each case compares a data-parallel run on a 4-device mesh with the single-device run on the same
global batch and writes the largest relative differences (and any exact-equality facts) to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmamba  # noqa: E402
from builders import TINY_CHUNK, d_out_batch, gradient_capture, gradient_recorder, max_rel, tiny_backbone  # noqa: E402
from jmamba.io.checkpoint import restore_checkpoint, save_checkpoint  # noqa: E402
from jmamba.ops import dispatch  # noqa: E402
from jmamba.parallel import make_data_mesh, shard_state  # noqa: E402
from pallas_kernels.mamba3_siso import Mamba3ScanConfig  # noqa: E402

# several Mamba-3 scan chunks per window of 6
jmamba.ops.set_default_tuning("mamba3_siso_scan", jmamba.ops.Mamba3ScanTuning(chunk_size=TINY_CHUNK))


def model_for(arch):
    if arch == "mamba3_projection":   # d_state 32, 8 angles: a geometry the projection kernels run
        return tiny_backbone(cfg=jmamba.Mamba3Config(d_model=16, n_layers=2, d_state=32, headdim=8, input_dim=3))
    return tiny_backbone(arch)


def batch(i, bsz=8, T=6):
    return d_out_batch(100 + i, bsz, T)


# An "optimizer" whose state is the (clipped) gradient it received: compares gradients exactly.
CAPTURE = gradient_capture()


def run_fused(arch, mesh, fsdp, precision="f32", steps=3, poison=(), opt=None):
    model = model_for(arch)
    opt = opt or optax.adamw(1e-2)
    state = jmamba.TrainState.create(model, opt, 8, precision=precision)
    if precision == "f16":   # a scale at which clean steps are finite, so the decisions vary
        state = state.replace(loss_scale=jmamba.DynamicLossScale(jnp.asarray(8.0), jnp.asarray(0, jnp.int32)))
    if mesh is not None:
        state = shard_state(state, mesh, fsdp=fsdp)
    step = jmamba.make_train_step(model, opt, precision=precision, clip_max_norm=1.0, mesh=mesh, fsdp=fsdp)
    decisions = []
    for i in range(steps):
        b = batch(i)
        if precision == "f16":
            b["d_out"] = b["d_out"] * 1e-3
        if i in poison:
            b["d_out"] = b["d_out"].at[5, 2, 1].set(jnp.inf)
        state, m = step(state, b)
        decisions.append([bool(m.get("overflow_skipped", False)), float(m.get("loss_scale", 0.0))])
    return state, decisions


def run_recorded(arch, mesh, fsdp):
    """(state after three AdamW steps, the gradients the first step handed the optimizer), one compiled
    step: the first step's gradients are copied before the next step (which may donate them)."""
    model = model_for(arch)
    opt = gradient_recorder(optax.adamw(1e-2))
    state = jmamba.TrainState.create(model, opt, 8)
    if mesh is not None:
        state = shard_state(state, mesh, fsdp=fsdp)
    step = jmamba.make_train_step(model, opt, clip_max_norm=1.0, mesh=mesh, fsdp=fsdp)
    first = None
    for i in range(3):
        state, _ = step(state, batch(i))
        if i == 0:
            first = jax.tree.map(np.asarray, state.opt_state[0])
    return state, first


def case_fused(arch, fsdp):
    """One step's gradients (as the optimizer receives them), the parameters, optimizer state and
    recurrent state after three AdamW steps, the shardings: the 4-device mesh vs one device (the
    one-device run is shared by the FSDP and the replicated case)."""
    mesh = make_data_mesh()
    if arch not in _SINGLE:
        _SINGLE[arch] = run_recorded(arch, None, False)
    single, g_single = _SINGLE[arch]
    multi, g_multi = run_recorded(arch, mesh, fsdp)
    _SHARDED[(arch, fsdp)] = multi
    sharded = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in jax.tree_util.tree_leaves_with_path(multi)
               if hasattr(x, "sharding") and hasattr(x.sharding, "spec")}
    return {"grads": max_rel(g_multi, g_single),
            "params": max_rel(multi.params, single.params),
            "opt_state": max_rel(multi.opt_state[1], single.opt_state[1]),   # AdamW's (after the recorder's)
            "recurrent": max_rel(multi.recurrent_state, single.recurrent_state),
            "step_equal": int(multi.step) == int(single.step),
            "recurrent_spec": sharded[".recurrent_state[0].ssm"],
            "param_spec": sharded[".params['layers'][0]['mixer']['out_proj']['kernel']"]}


def case_f16_scaler():
    mesh = make_data_mesh()
    _, d1 = run_fused("mamba1", None, False, precision="f16", steps=5, poison=(1, 3))
    _, d4 = run_fused("mamba1", mesh, False, precision="f16", steps=5, poison=(1, 3))
    return {"single": d1, "multi": d4}


def case_split():
    mesh = make_data_mesh()
    model = model_for("mamba1")
    opt = optax.adamw(1e-2)
    out = {}
    for name, m in (("single", None), ("multi", mesh)):
        state = jmamba.TrainState.create(model, opt, 8)
        for i in range(2):
            b = batch(i)
            y, ctx, state = jmamba.forward(model, state, {"inputs": b["inputs"]}, mesh=m)
            state, _ = jmamba.backward_step(opt, state, ctx, b["d_out"], clip_max_norm=1.0)
        out[name] = state
    return {"params": max_rel(out["multi"].params, out["single"].params)}


def case_checkpoint():
    """The FSDP state of case_fused (three AdamW steps on the mesh) saved and restored into a sharded
    template: equal leaves, the template's shardings."""
    mesh = make_data_mesh()
    state = _SHARDED.get(("mamba1", True)) or run_recorded("mamba1", mesh, True)[0]
    d = tempfile.mkdtemp()
    save_checkpoint(d, state)
    opt = gradient_recorder(optax.adamw(1e-2))   # the optimizer of case_fused's state
    like = shard_state(jmamba.TrainState.create(model_for("mamba1"), opt, 8), mesh, fsdp=True)
    restored = restore_checkpoint(d, like)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    same_sharding = all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(like)))
    return {"equal": same, "same_sharding": same_sharding}


def case_pallas(fsdp=False):
    """The Pallas kernels (interpreted on CPU; the fused mixer core follows the selective_scan
    preference; the add + RMSNorm kernels too) inside the sharded step: one kernel per device; with
    FSDP the ops' weights are gathered at their shard_map entry."""
    with dispatch.prefer("selective_scan", "pallas"), dispatch.prefer("add_rms_norm", "pallas"):
        mesh = make_data_mesh()
        if "pallas" not in _SINGLE:   # the one-device run is shared by both cases (interpreted: slow)
            _SINGLE["pallas"] = run_fused("mamba1", None, False, steps=1, opt=CAPTURE)[0]
        multi, _ = run_fused("mamba1", mesh, fsdp, steps=1, opt=CAPTURE)
    return {"grads": max_rel(multi.opt_state, _SINGLE["pallas"].opt_state)}


def case_pallas_mamba3_projection():
    """The Mamba-3 projection kernels (pallas_kernels/mamba3_siso/projection.py, interpreted) inside the
    sharded step: rest and the states split over `data`, the norm weights and dt_bias replicated (their
    gradients summed by shard_map's transpose)."""
    tuning = jmamba.ops.Mamba3ScanTuning(chunk_size=TINY_CHUNK,
                                         pallas_config=Mamba3ScanConfig(fuse_projection=True))
    with dispatch.prefer("mamba3_siso_scan", "pallas"), jmamba.ops.tuning("mamba3_siso_scan", tuning):
        single = run_fused("mamba3_projection", None, False, steps=1, opt=CAPTURE)[0]
        multi, _ = run_fused("mamba3_projection", make_data_mesh(), False, steps=1, opt=CAPTURE)
        x = jnp.zeros((2, 6, 3))
        ran = "mamba3_siso_fwd_projection" in str(jax.make_jaxpr(lambda x: model_for("mamba3_projection")(x))(x))
    return {"grads": max_rel(multi.opt_state, single.opt_state), "projection_kernels_ran": ran}


_SINGLE = {}    # one-device runs shared by cases: {arch: run_recorded(...)}, {"pallas": state}
_SHARDED = {}   # case_fused's mesh states, {(arch, fsdp): state}: case_checkpoint saves the FSDP one


CASES = {
    "mamba1": lambda: case_fused("mamba1", False),
    "mamba1_fsdp": lambda: case_fused("mamba1", True),
    "mamba3": lambda: case_fused("mamba3", False),
    "f16_scaler": case_f16_scaler,
    "split": case_split,
    "checkpoint": case_checkpoint,
    "pallas_fsdp": lambda: case_pallas(fsdp=True),
    "pallas": case_pallas,
    "pallas_mamba3_projection": case_pallas_mamba3_projection,
}

if __name__ == "__main__":
    assert len(jax.devices()) >= 2, jax.devices()   # 4 simulated CPU devices, or the GPUs of the machine
    names = sys.argv[2:] or list(CASES)
    results = {name: CASES[name]() for name in names}
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
