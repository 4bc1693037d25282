"""The flat TrainState (`TrainState.create(..., flat=True)`): params and optimizer moments in flat
buffers, bit-identical training to the default layout, and the flat AdamW kernel against the
per-leaf kernel and the plain-JAX path (values, untouched padding, in-place H200 lowering)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmamba
from builders import d_out_batch, tiny_backbone
from jmamba import TrainState, fused_adamw, make_train_step, ops
from jmamba.optim import KernelConfig, no_decay_mask
from jmamba.core.flat_buffers import ALIGN, FlatSpec, FlatTree
from pallas_kernels.fused_adamw import fused_adamw_flat, fused_adamw_leaves

f32 = jnp.float32


def _draw(shapes, seed, dtype=f32, scale=1.0):
    r = np.random.default_rng(seed)
    return [jnp.asarray(scale * r.normal(size=s), dtype) for s in shapes]


# ---------------------------------------------------------------------------------- FlatTree
def test_pack_unpack_round_trip_with_alignment_and_mixed_dtypes():
    leaves = [jnp.arange(7, dtype=f32).reshape(7), jnp.ones((3, 5), jnp.bfloat16), jnp.asarray(2.5, f32),
              jnp.zeros((0, 4), f32), jnp.arange(ALIGN + 1, dtype=f32), jnp.full((2, 2), 3, jnp.int32)]
    spec = FlatSpec.of(leaves)
    assert FlatSpec.of([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]) is spec   # interned
    assert [str(d) for d, _ in spec.buffers] == ["float32", "bfloat16", "int32"]
    assert all(off % ALIGN == 0 for _, off in spec.places)
    f32_places = [off for (b, off) in spec.places if b == 0]
    assert f32_places == [0, ALIGN, 2 * ALIGN, 2 * ALIGN]   # 7 -> one slot, scalar -> one, empty -> none
    assert spec.buffers[0][1] == 2 * ALIGN + 2 * ALIGN     # the ALIGN+1 leaf takes two slots
    flat = FlatTree.pack(leaves, spec)
    assert len(jax.tree.leaves(flat)) == 3
    for got, want in zip(flat.unpack(), leaves):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # padding is zeros
    buf = np.asarray(flat.buffers[0])
    assert not buf[7:ALIGN].any() and not buf[ALIGN + 1:2 * ALIGN].any()
    # a pytree node: jit passes it through
    again = jax.jit(lambda t: t)(flat)
    assert isinstance(again, FlatTree) and again.spec is spec


def test_pack_checks_its_leaves():
    spec = FlatSpec.of([jnp.zeros((2, 3)), jnp.zeros(4)])
    with pytest.raises(ValueError, match="expected 2 leaves"):
        FlatTree.pack([jnp.zeros((2, 3))], spec)
    with pytest.raises(ValueError, match=r"leaf 1 is float32\[5\]"):
        FlatTree.pack([jnp.zeros((2, 3)), jnp.zeros(5)], spec)


# ---------------------------------------------------------------------------- the flat kernel
SHAPES = [(5, 7), (1,), (), (64, 33), (0, 3), (2048,), (3, 1000)]


def _flat_case(seed=0, grad_dtype=f32):
    ps = _draw(SHAPES, seed)
    gs = _draw(SHAPES, seed + 1, grad_dtype)
    ms = _draw(SHAPES, seed + 2, scale=0.1)
    vs = [jnp.abs(x) for x in _draw(SHAPES, seed + 3, scale=0.01)]
    spec = FlatSpec.of(ps)
    sentinel = 7.0   # in the gaps between leaves: must come back untouched

    def flat(xs):
        buf = np.full((spec.buffers[0][1],), sentinel, np.float32)
        for x, (_, off) in zip(xs, spec.places):
            buf[off:off + x.size] = np.asarray(x).reshape(-1)
        return jnp.asarray(buf)

    offsets = tuple(off for _, off in spec.places)
    return ps, gs, ms, vs, flat, offsets, spec


def _gaps(buf, spec):
    inside = np.zeros(buf.shape, bool)
    for shape, (_, off) in zip(spec.shapes, spec.places):
        inside[off:off + math.prod(shape)] = True
    return np.asarray(buf)[~inside]


@pytest.mark.parametrize("grad_dtype", [f32, jnp.bfloat16])
def test_flat_kernel_is_bit_identical_to_the_leaf_kernel(grad_dtype):
    ps, gs, ms, vs, flat, offsets, spec = _flat_case(grad_dtype=grad_dtype)
    decay = [True, False, True, True, False, False, True]
    scalars = ops.step_scalars(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=3,
                               grad_scale=jnp.asarray(0.5, f32), skip=jnp.asarray(False))
    # a small block and two leaves per launch: several blocks per leaf, masked tails, four launches
    cfg = KernelConfig(block_size=256, max_leaves_per_call=2, interpret=True)
    want_p, want_m, want_v, _ = fused_adamw_leaves(ps, gs, ms, vs, scalars, decay, config=cfg)
    got = jax.jit(lambda p, m, v, g: fused_adamw_flat(p, g, m, v, offsets, scalars, decay, config=cfg))(
        flat(ps), flat(ms), flat(vs), gs)
    for buf, want in zip(got, (want_p, want_m, want_v)):
        np.testing.assert_array_equal(np.asarray(buf), np.asarray(flat(want)))
        assert (_gaps(buf, spec) == 7.0).all()
    # the plain-JAX flat path: the same values as the plain-JAX leaf path, gaps kept
    ref = ops.adamw_update(ps, gs, ms, vs, scalars, decay, implementation="reference")
    got_ref = ops.adamw_update_flat(flat(ps), gs, flat(ms), flat(vs), scalars, decay, offsets=offsets,
                                    implementation="reference")
    for buf, want in zip(got_ref, ref[:3]):
        np.testing.assert_array_equal(np.asarray(buf), np.asarray(flat(want)))
        assert (_gaps(buf, spec) == 7.0).all()


def test_flat_kernel_skip_keeps_everything():
    ps, gs, ms, vs, flat, offsets, spec = _flat_case(seed=5)
    scalars = ops.step_scalars(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=1,
                               skip=jnp.asarray(True))
    for impl in ("pallas", "reference"):
        out = ops.adamw_update_flat(flat(ps), gs, flat(ms), flat(vs), scalars, [True] * len(ps), offsets=offsets,
                                    implementation=impl)
        for buf, want in zip(out, (ps, ms, vs)):
            np.testing.assert_array_equal(np.asarray(buf), np.asarray(flat(want)))


def test_flat_kernel_checks_its_arguments():
    ps, gs, ms, vs, flat, offsets, spec = _flat_case()
    s = ops.step_scalars(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    d = [True] * len(ps)
    P, M, V = flat(ps), flat(ms), flat(vs)
    with pytest.raises(ValueError, match="overlap"):
        fused_adamw_flat(P, gs, M, V, (0,) * len(gs), s, d)
    with pytest.raises(ValueError, match=r"offsets\[0\]"):
        fused_adamw_flat(P, gs, M, V, (P.shape[0],) + offsets[1:], s, d)
    with pytest.raises(TypeError, match="flat_mu must be a 1-D float32"):
        fused_adamw_flat(P, gs, M.astype(jnp.bfloat16), V, offsets, s, d)
    with pytest.raises(ValueError, match="offsets must have one entry per leaf"):
        ops.adamw_update_flat(P, gs, M, V, s, d, offsets=offsets[:-1])


def _lower_for_h200(fn, *args, donate):
    mesh = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,),
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_flat_kernel_lowers_for_h200_in_place():
    ps, gs, ms, vs, flat, offsets, spec = _flat_case()
    s = ops.step_scalars(learning_rate=1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, step=1)
    cfg = KernelConfig(block_size=1024, max_leaves_per_call=3, interpret=False)
    fn = lambda p, m, v, g: fused_adamw_flat(p, g, m, v, offsets, s, [True] * len(ps), config=cfg)   # noqa: E731
    txt = _lower_for_h200(fn, flat(ps), flat(ms), flat(vs), gs, donate=(0, 1, 2))
    calls = [l for l in txt.splitlines() if "__gpu$xla.gpu.triton" in l]
    assert len(calls) == 2 and all('name = "fused_adamw_flat"' in l for l in calls)   # 6 non-empty leaves
    assert txt.count("#stablehlo.output_operand_alias<") == 3 * 2
    sizes = [math.prod(int(d) for d in m.split("x")[:-1]) for m in
             re.findall(r"stablehlo.concatenate[^\n]*-> tensor<([0-9x]*f32)>", txt)]
    assert all(n <= 16 for n in sizes), f"a buffer-sized concatenate appeared: {sizes}"   # (the 10 scalars)
    assert "stablehlo.copy" not in txt


# ---------------------------------------------------------------------------- the train state
def _train(arch, opt, flat, steps=3, **step_kw):
    model = tiny_backbone(arch)
    state = TrainState.create(model, opt, 2, flat=flat)
    step = make_train_step(model, opt, clip_max_norm=1.0, **step_kw)
    metrics = []
    for i in range(steps):
        state, m = step(state, d_out_batch(i, bsz=2, T=5))
        metrics.append(m)
    return state, metrics


OPTIMIZERS = {
    "fused_pallas": lambda m: fused_adamw(1e-2, weight_decay=0.1, mask=no_decay_mask(m), implementation="pallas"),
    "fused_xla": lambda m: fused_adamw(1e-2, weight_decay=0.1, implementation="xla"),
    "optax_chain": lambda m: optax.chain(optax.clip(0.5), optax.adamw(1e-2)),
}


@pytest.mark.parametrize("arch,opt_name", [("mamba1", "fused_pallas"), ("mamba3", "fused_xla"),
                                           ("mamba3", "optax_chain")])
def test_flat_state_trains_bit_identically(arch, opt_name):
    opt = OPTIMIZERS[opt_name](tiny_backbone(arch))
    ref, ref_m = _train(arch, opt, flat=False)
    got, got_m = _train(arch, opt, flat=True)
    assert got.is_flat and not ref.is_flat
    assert isinstance(got.params, FlatTree)
    assert len(jax.tree.leaves(got)) < len(jax.tree.leaves(ref)) // 4
    for a, b in zip(jax.tree.leaves(ref.nnx_view()), jax.tree.leaves(got.nnx_view())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(ref_m, got_m):
        assert jax.tree.map(float, a) == jax.tree.map(float, b)


def test_flat_fused_adamw_runs_in_place_on_the_buffers(monkeypatch):
    """The fused step hands the flat buffers to the flat op (no unpack / repack of the moments)."""
    calls = []
    real = ops.adamw_update_flat

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(ops, "adamw_update_flat", spy)
    opt = OPTIMIZERS["fused_xla"](None)
    state, _ = _train("mamba1", opt, flat=True, steps=1)
    assert calls == [state.params.buffers[0].shape]


def test_flat_state_split_api_accumulation_and_skips_match_the_fused_step():
    model = tiny_backbone("mamba1")
    opt = fused_adamw(1e-2, implementation="xla")
    out = {}
    for flat in (False, True):
        state = TrainState.create(model, opt, 2, accumulate=True, flat=flat)
        batch = d_out_batch(0, bsz=2, T=5)
        _, ctx, state = jmamba.forward(model, state, batch)
        state, _ = jmamba.backward_step(opt, state, ctx, batch["d_out"], accumulate_only=True)
        second = d_out_batch(1, bsz=2, T=5)
        _, ctx, state = jmamba.forward(model, state, second)
        state, m = jmamba.backward_step(opt, state, ctx, second["d_out"])
        bad = d_out_batch(9, bsz=2, T=5)
        bad["d_out"] = bad["d_out"].at[0, 0, 0].set(jnp.nan)
        _, ctx, state = jmamba.forward(model, state, bad)
        state, m = jmamba.backward_step(opt, state, ctx, bad["d_out"])
        assert bool(m["skipped"])
        out[flat] = state
    assert isinstance(out[True].grad_accum, FlatTree)
    for a, b in zip(jax.tree.leaves(out[False].nnx_view()), jax.tree.leaves(out[True].nnx_view())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flat_state_checkpoints_model_and_errors(tmp_path):
    model = tiny_backbone("mamba3")
    opt = fused_adamw(1e-2, implementation="xla")
    state, _ = _train("mamba3", opt, flat=True, steps=2)
    jmamba.save_checkpoint(str(tmp_path), state)
    # a checkpoint of a flat state is the usual tree: it restores into either layout
    for flat in (True, False):
        like = TrainState.create(model, opt, 2, flat=flat)
        back = jmamba.restore_checkpoint(str(tmp_path), like)
        assert back.is_flat == flat
        for a, b in zip(jax.tree.leaves(state.nnx_view()), jax.tree.leaves(back.nnx_view())):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trained = state.to_model(model)
    for a, b in zip(jax.tree.leaves(nnx.state(trained, nnx.Param)),
                    jax.tree.leaves(state.nnx_params())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="flat must be a bool"):
        TrainState.create(model, opt, 2, flat="yes")


def test_flat_state_refuses_a_mesh():
    from jmamba.parallel import make_data_mesh, shard_state

    model = tiny_backbone("mamba1")
    opt = fused_adamw(1e-2)
    state = TrainState.create(model, opt, 2, flat=True)
    step = make_train_step(model, opt, mesh=make_data_mesh(devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="flat TrainState .* runs on one device"):
        step(state, d_out_batch(0, bsz=2, T=5))
    with pytest.raises(ValueError, match="flat TrainState .* runs on one device"):
        shard_state(state, make_data_mesh(devices=jax.devices()[:1]))
    with pytest.raises(ValueError, match="flat TrainState .* runs on one device"):
        jmamba.forward(model, state, d_out_batch(0, bsz=2, T=5), mesh=make_data_mesh(devices=jax.devices()[:1]))


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_flat_kernel_matches_the_leaf_kernel_bit_for_bit():
    """The compiled flat kernel against the compiled leaf kernel at LM-like sizes, both jitted."""
    shapes = [(50280, 64), (64,), (64, 256), (3, 17), (), (128, 4, 33)]
    ps, gs, ms = _draw(shapes, 0), _draw(shapes, 1, jnp.bfloat16), _draw(shapes, 2, scale=0.1)
    vs = [jnp.abs(x) for x in _draw(shapes, 3, scale=0.01)]
    spec = FlatSpec.of(ps)
    offsets = tuple(off for _, off in spec.places)
    scalars = ops.step_scalars(learning_rate=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, step=7,
                               grad_scale=jnp.asarray(0.25, f32))
    decay = [True, False, True, True, False, True]
    want = jax.jit(lambda p, g, m, v: ops.adamw_update(p, g, m, v, scalars, decay, implementation="pallas"))(
        ps, gs, ms, vs)
    flat = lambda xs: FlatTree.pack(xs, spec).buffers[0]   # noqa: E731
    got = jax.jit(lambda p, m, v, g: ops.adamw_update_flat(p, g, m, v, scalars, decay, offsets=offsets,
                                                            implementation="pallas"),
                  donate_argnums=(0, 1, 2))(flat(ps), flat(ms), flat(vs), gs)
    for name, buf, w in zip("pmv", got, want[:3]):
        a, b = np.asarray(buf), np.asarray(flat(w))
        assert np.array_equal(a, b), f"{name}: {np.sum(a != b)} elements differ, max |diff| {np.abs(a - b).max()}"


@pytest.mark.gpu
def test_gpu_flat_train_step_matches_the_default_layout():
    """A tiny LM trained 3 steps with each layout on the GPU. The two programs are compiled separately,
    and XLA's GEMM autotuning may pick other algorithms for each, so the comparison is not bit for bit:
    the losses agree closely and so do the parameters' total updates (a misplaced leaf would differ
    by the whole update)."""
    cfg = jmamba.Mamba3Config(d_model=64, n_layers=2, d_state=16, headdim=16)
    lm = jmamba.MambaLM(cfg, 256, rngs=nnx.Rngs(0))
    opt = fused_adamw(1e-3, weight_decay=0.1, mask=no_decay_mask(lm))
    r = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(r.integers(0, 256, (2, 64)), jnp.int32),
             "targets": jnp.asarray(r.integers(0, 256, (2, 64)), jnp.int32)}
    p0 = [np.asarray(x) for x in jax.tree.leaves(nnx.state(lm, nnx.Param))]
    out = {}
    for flat_state in (False, True):
        state = TrainState.create(lm, opt, 2, flat=flat_state)
        step = make_train_step(lm, opt, loss_fn=jmamba.next_token_loss, precision="bf16", clip_max_norm=1.0)
        losses = []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        out[flat_state] = (state, losses)
    assert out[True][0].is_flat
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=2e-3)
    for k, (a, b, x0) in enumerate(zip(jax.tree.leaves(out[False][0].nnx_view().params),
                                       jax.tree.leaves(out[True][0].nnx_view().params), p0)):
        da, db = np.asarray(a) - x0, np.asarray(b) - x0
        err = np.linalg.norm(da - db) / max(np.linalg.norm(da), 1e-12)
        assert err < 2e-2, f"parameter leaf {k}: the updates differ by {err:.2e} of their norm"
