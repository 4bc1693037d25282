"""`mamba3_siso_scan(..., qk_norm=Mamba3QKNorm(...))`: the B/C RMSNorms applied by the op, fused in the
Pallas path with the kernel-layout step (pallas_kernels/mamba3_siso/qk_norm.py).

CPU (interpreter): the fused kernels against `rms_norm` + `to_kernel_layout` (values and the cotangents
of Q, K and both weights; S = 0, 8, 32, groups, d_state not a power of two, f32 / bf16 / f16, time
padding); the op with `qk_norm` against the op on inputs normalized by `jmamba.ops.rms_norm` first, for
every implementation and for the Pallas path that cannot fuse (S = 3), with initial and final states
and their cotangents; the model's output unchanged by the move; bad `qk_norm` arguments; lowering for an
abstract H200. GPU (`-m gpu`): the op at the benchmark shape against the unfused path, bit-identical reruns.
"""

from __future__ import annotations

import functools
import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see test_mamba3_scan_pallas.py)
import jax.numpy as jnp
import numpy as np
import pytest

from builders import MAMBA3_ARRAYS as ARRAYS
from builders import mamba3_scan_inputs
from helpers import assert_close, lowered_for_h200
from jmamba import ops
from jmamba.ops import Mamba3QKNorm, Mamba3ScanTuning, mamba3_siso_scan
from jmamba.ops.mamba3_siso_scan import pallas as pallas_glue
from pallas_kernels.mamba3_siso import Mamba3ScanConfig
from pallas_kernels.mamba3_siso.config import make_geometry
from pallas_kernels.mamba3_siso.qk_norm import fuses_num_angles, normalized_kernel_layout
from pallas_kernels.mamba3_siso.queries_keys import to_kernel_layout

EPS = 1e-5


def weights(N, seed=3):
    r = np.random.default_rng(seed)
    return (jnp.asarray(1 + 0.3 * r.normal(size=N), jnp.float32), jnp.asarray(1 + 0.3 * r.normal(size=N), jnp.float32))


def composed(geo, Q, K, wq, wk):
    """The unfused path: the model's norms, then the scan's layout step."""
    return (to_kernel_layout(geo, ops.rms_norm(Q, wq, EPS, Q.dtype)),
            to_kernel_layout(geo, ops.rms_norm(K, wk, EPS, K.dtype)))


@pytest.mark.parametrize("N,S,G,T,dtype,tol", [
    (16, 0, 1, 32, jnp.float32, 2e-6),
    (32, 8, 2, 32, jnp.bfloat16, 1e-2),
    (24, 8, 1, 48, jnp.float32, 2e-6),      # rest pieces past N: raw rows zero-padded to 32
    (20, 0, 1, 16, jnp.float16, 2e-3),
    (128, 32, 1, 32, jnp.bfloat16, 1e-2),   # the model's d_state and angles
    (64, 32, 1, 16, jnp.float32, 2e-6),     # rope_fraction 1.0: no rest pieces
], ids=["S0", "groups-bf16", "N-not-pow2", "f16", "model-bf16", "full-rope"])
def test_kernels_match_the_norms_then_the_layout(N, S, G, T, dtype, tol):
    geo = make_geometry(batch=2, seqlen=T, heads=2 * G, groups=G, headdim=8, d_state=N, num_angles=S,
                        chunk_size=16, has_z=False, matmul_dtype=jnp.float32, io_dtype=dtype, interpret=True)
    r = np.random.default_rng(0)
    Q = jnp.asarray(r.normal(size=(2, T, G, N)), dtype)
    K = jnp.asarray(3 * r.normal(size=(2, T, G, N)), dtype)
    wq, wk = weights(N)
    dq, dk = (jnp.asarray(r.normal(size=(2, T, G, geo.padded_state)), dtype) for _ in range(2))
    want, want_vjp = jax.vjp(functools.partial(composed, geo), Q, K, wq, wk)
    got, got_vjp = jax.vjp(lambda *a: normalized_kernel_layout(geo, *a, EPS), Q, K, wq, wk)
    for name, g, w in zip(("Qk", "Kk"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(name, g, w, tol)
    for name, g, w in zip(("dQ", "dK", "dQ_weight", "dK_weight"), got_vjp((dq, dk)), want_vjp((dq, dk))):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(name, g, w, tol)


def test_padding_columns_of_the_layout_are_zeros_and_unfused_geometries_are_refused():
    geo = make_geometry(batch=1, seqlen=16, heads=1, groups=1, headdim=8, d_state=24, num_angles=8, chunk_size=16,
                        has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32, interpret=True)
    Q = jnp.asarray(np.random.default_rng(1).normal(size=(1, 16, 1, 24)), jnp.float32)
    Qk, _ = normalized_kernel_layout(geo, Q, Q, *weights(24), EPS)
    assert geo.padded_state == 32 and np.all(np.asarray(Qk[..., 24:]) == 0)
    assert [fuses_num_angles(s) for s in (0, 3, 4, 8, 12, 16, 32)] == [True, False, False, True, False, True, True]
    odd = make_geometry(batch=1, seqlen=16, heads=1, groups=1, headdim=8, d_state=24, num_angles=3, chunk_size=16,
                        has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="num_angles S=3"):
        normalized_kernel_layout(odd, Q, Q, *weights(24), EPS)
    with pytest.raises(ValueError, match="fuse_qk_norm must be True or False"):
        Mamba3ScanConfig(fuse_qk_norm="yes").validate()


def op_loss(impl, fuse, arrays, state, wq, wk, d, config=None):
    """A scalar of the op's output and final states, with the norms applied by the op (fuse) or before."""
    a = dict(arrays)
    kw = dict(implementation=impl, return_final_state=True, initial_state=state,
              tuning=Mamba3ScanTuning(chunk_size=16, pallas_config=config))
    if fuse:
        kw["qk_norm"] = Mamba3QKNorm(wq, wk, EPS)
    else:
        a["Q"], a["K"] = ops.rms_norm(a["Q"], wq, EPS, a["Q"].dtype), ops.rms_norm(a["K"], wk, EPS, a["K"].dtype)
    out, final = mamba3_siso_scan(*[a[k] for k in ARRAYS], **kw)
    return (jnp.sum(out.astype(jnp.float32) * d["out"]) + sum(jnp.sum(s * c) for s, c in zip(final, d["final"])))


FUSED = Mamba3ScanConfig(fuse_qk_norm=True)       # off by default until timed on a GPU
UNFUSED = Mamba3ScanConfig(fuse_qk_norm=False)


@pytest.mark.parametrize("impl,shape,dtype,config,tol", [
    ("reference", (2, 20, 4, 2, 16, 8, 4), jnp.float32, None, 1e-6),
    ("xla", (2, 20, 4, 2, 16, 8, 4), jnp.float32, None, 1e-6),
    ("pallas", (2, 40, 4, 2, 32, 8, 8), jnp.float32, FUSED, 2e-5),      # fused; T not a multiple of the chunk
    ("pallas", (2, 40, 4, 1, 32, 8, 8), jnp.bfloat16, FUSED, 3e-2),
    ("pallas", (2, 24, 2, 1, 20, 8, 3), jnp.float32, FUSED, 2e-5),      # S = 3: rms_norm in the glue
], ids=["reference", "xla", "pallas-fused", "pallas-fused-bf16", "pallas-unfused-S3"])
def test_the_op_normalizes_as_rms_norm_before_it(impl, shape, dtype, config, tol):
    arrays, state = mamba3_scan_inputs(shape, dtype, per_head_angles=False)
    bsz, T, H, G, N, P, S = shape
    wq, wk = weights(N)
    r = np.random.default_rng(5)
    d = dict(out=jnp.asarray(r.normal(size=(bsz, T, H, P)), jnp.float32),
             final=[jnp.asarray(r.normal(size=s.shape), jnp.float32) for s in state])
    args = (arrays, state, wq, wk)
    grad = lambda fuse: jax.jit(jax.value_and_grad(
        lambda arrays, state, wq, wk: op_loss(impl, fuse, arrays, state, wq, wk, d, config), argnums=(0, 1, 2, 3)))(*args)
    got, want = grad(True), grad(False)
    assert_close("value", got[0], want[0], tol)
    wanted = dict(jax.tree_util.tree_leaves_with_path(want[1]))
    for path, g in jax.tree_util.tree_leaves_with_path(got[1]):
        assert_close(jax.tree_util.keystr(path), g, wanted[path], tol)


def test_the_mamba3_mixer_output_is_unchanged_by_the_move():
    """The mixer's window output and gradients with the norms in the op equal the old composition (norms in
    the mixer, the op on normalized Q, K), here on the XLA path where both are the same `rms_norm`."""
    from flax import nnx

    from jmamba.mamba3 import Mamba3Config
    from jmamba.mamba3.mixer import Mamba3Mixer

    mixer = Mamba3Mixer(Mamba3Config(d_model=32, n_layers=1, d_state=16, headdim=8), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 32)), jnp.float32)

    def old_call(m, x):
        z, xv, rest = m._project(x)
        B_hat, C_hat, ADT, DT, trap, angles = m._per_position(rest)
        y, final = mamba3_siso_scan(C_hat, B_hat, xv, ADT, DT, trap, m.C_bias[...], m.B_bias[...], angles, m.D[...],
                                    None if m.norm is not None else z, return_final_state=True)
        return m._output(y, z), final

    graph, params = nnx.split(mixer)
    f = lambda call: jax.value_and_grad(lambda p: jnp.sum(jnp.sin(call(nnx.merge(graph, p), x)[0])))(params)
    (a, ga), (b, gb) = f(lambda m, x: m(x)), f(old_call)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("qk_norm,error,words", [
    ((jnp.ones(16), jnp.ones(16)), ValueError, "qk_norm must be a Mamba3QKNorm"),
    (Mamba3QKNorm(jnp.ones(15), jnp.ones(16), 1e-5), ValueError, r"qk_norm.Q_weight must have shape \[d_state\]"),
    (Mamba3QKNorm(jnp.ones(16), jnp.ones((16, 1)), 1e-5), ValueError, "qk_norm.K_weight must have shape"),
    (Mamba3QKNorm(jnp.ones(16), jnp.ones(16, jnp.int32), 1e-5), TypeError, "qk_norm.K_weight"),
    (Mamba3QKNorm(jnp.ones(16), jnp.ones(16), 0.0), ValueError, "qk_norm.eps must be a positive"),
    (Mamba3QKNorm(jnp.ones(16), jnp.ones(16), "1e-5"), ValueError, "qk_norm.eps must be a positive"),
])
def test_bad_qk_norm_is_named(qk_norm, error, words):
    arrays, _ = mamba3_scan_inputs((1, 4, 2, 1, 16, 4, 4), jnp.float32, with_states=False)
    with pytest.raises(error, match=words):
        mamba3_siso_scan(*[arrays[k] for k in ARRAYS], qk_norm=qk_norm)


def test_fused_kernels_lower_for_h200():
    """Forward + backward of the op with qk_norm at the benchmark shape, lowered for an abstract H200: the
    two qk_norm kernels beside the scan's seven (keys and queries in one launch, the default)."""
    shape = (8, 2048, 24, 1, 128, 64, 32)
    arrays, _ = mamba3_scan_inputs((1, 1) + shape[2:], jnp.bfloat16, per_head_angles=False, with_states=False)
    specs = {k: None if v is None else jax.ShapeDtypeStruct((8, 2048) + v.shape[2:] if v.ndim > 2 else v.shape, v.dtype)
             for k, v in arrays.items()}
    specs["Angles"] = jax.ShapeDtypeStruct((8, 2048, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((128,), jnp.float32)

    def loss(vals, wq, wk):
        out = mamba3_siso_scan(*[vals[k] for k in ARRAYS], implementation="pallas", qk_norm=Mamba3QKNorm(wq, wk, EPS),
                               tuning=Mamba3ScanTuning(chunk_size=64, pallas_config=FUSED))
        return jnp.sum(out.astype(jnp.float32))

    text = lowered_for_h200(jax.grad(loss, argnums=(0, 1, 2)), specs, w, w, glue_modules=(pallas_glue,))
    assert text.count("__gpu$xla.gpu.triton") == 9
    assert "mamba3_siso_fwd_qk_norm" in text and "mamba3_siso_bwd_qk_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-4)])
def test_gpu_the_op_normalizes_as_rms_norm_before_it(dtype, tol):
    """The benchmark's layer shape (B=2 to fit beside the reference-free check), fused vs unfused Pallas."""
    shape = (2, 2048, 24, 1, 128, 64, 32)
    arrays, state = mamba3_scan_inputs(shape, dtype, per_head_angles=False)
    wq, wk = weights(128)
    r = np.random.default_rng(5)
    d = dict(out=jnp.asarray(r.normal(size=(2, 2048, 24, 64)), jnp.float32),
             final=[jnp.asarray(r.normal(size=s.shape), jnp.float32) for s in state])
    grad = lambda fuse: jax.jit(jax.value_and_grad(
        lambda arrays, state, wq, wk: op_loss("pallas", fuse, arrays, state, wq, wk, d, FUSED), argnums=(0, 1, 2, 3)))
    got = grad(True)(arrays, state, wq, wk)
    again = grad(True)(arrays, state, wq, wk)
    want = grad(False)(arrays, state, wq, wk)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))          # deterministic
    assert_close("value", got[0], want[0], tol)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert_close("cotangent", g, w, tol)


@pytest.mark.parametrize("S,config,fused", [(8, FUSED, True), (8, UNFUSED, False), (8, None, False), (3, FUSED, False)],
                         ids=["fused", "off-by-config", "off-by-default", "S3"])
def test_the_kernels_run_only_where_they_apply(S, config, fused):
    arrays, _ = mamba3_scan_inputs((1, 16, 2, 1, 16, 4, S), jnp.float32, per_head_angles=False, with_states=False)
    w = jnp.ones(16)
    text = str(jax.make_jaxpr(lambda a: mamba3_siso_scan(
        *[a[k] for k in ARRAYS], implementation="pallas", qk_norm=Mamba3QKNorm(w, w, EPS),
        tuning=Mamba3ScanTuning(chunk_size=16, pallas_config=config)))(arrays))
    assert ("mamba3_siso_fwd_qk_norm" in text) == fused
