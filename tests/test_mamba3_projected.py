"""`mamba3_siso_scan_projected`: the Mamba-3 scan fed from in_proj's rest block, and its fused Pallas path
(pallas_kernels/mamba3_siso/projection.py: the per-position work in one kernel each way).

CPU (interpreter): the fused path against the same op with the fusion off (the XLA per-position ops
around the Pallas scan) and against the all-XLA composition, values and every cotangent (rest, V, z,
dt_bias, both norm weights, both biases, D, the four initial states); groups, T not a multiple of the
chunk, S = 0, no gate, bf16; where the fused kernels run and where the composition does (reset masks,
S = 3, the config switch, other implementations); bad arguments; lowering for an abstract H200.
GPU (`-m gpu`): the benchmark layer shape and one whose masked head window reaches past rest's last
column (H = 6, S = 0), fused vs unfused, bit-identical reruns.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see test_mamba3_scan_pallas.py)
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, lowered_for_h200
from jmamba import ops
from jmamba.ops import Mamba3ScanState, Mamba3ScanTuning
from jmamba.ops.mamba3_siso_scan import pallas as pallas_glue
from pallas_kernels.mamba3_siso import Mamba3ScanConfig

FUSED = Mamba3ScanConfig(fuse_projection=True)      # the default since session 31
UNFUSED = Mamba3ScanConfig(fuse_projection=False)
NAMES = ("rest", "V", "z", "dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D")


def make(shape, dtype, *, with_z=True, with_D=True, with_state=True, seed=0):
    """Arguments like a Mamba-3 layer's: rest, V, z in `dtype` (rest scaled like in_proj outputs), the
    parameters float32 and perturbed from their init; shape = (Bt, T, H, G, N, P, S)."""
    bsz, T, H, G, N, P, S = shape
    r = np.random.default_rng(seed)
    f = lambda *s, scale=1.0, dt=jnp.float32: jnp.asarray(scale * r.normal(size=s), dt)
    args = dict(rest=f(bsz, T, 2 * G * N + 3 * H + S, dt=dtype), V=f(bsz, T, H, P, dt=dtype),
                z=f(bsz, T, H, P, dt=dtype) if with_z else None, dt_bias=f(H) - 3.0,
                B_norm_weight=1 + f(N, scale=0.2), C_norm_weight=1 + f(N, scale=0.2),
                B_bias=1 + f(H, N, scale=0.2), C_bias=1 + f(H, N, scale=0.2), D=f(H) if with_D else None)
    state = (Mamba3ScanState(f(bsz, H, S), f(bsz, H, P, N), f(bsz, H, N), f(bsz, H, P)) if with_state else None)
    return args, state, G


def run(args, state, G, *, impl="pallas", config=FUSED, reset=None):
    """(value, gradients) of a scalar of out and the final state."""
    r = np.random.default_rng(9)
    bsz, T, H, P = args["V"].shape
    d_out = jnp.asarray(r.normal(size=(bsz, T, H, P)), jnp.float32)

    def loss(args, state):
        out, final = ops.mamba3_siso_scan_projected(
            *[args[k] for k in NAMES], ngroups=G, A_floor=1e-4, norm_eps=1e-5, initial_state=state,
            return_final_state=True, reset=reset, implementation=impl,
            tuning=Mamba3ScanTuning(chunk_size=16, pallas_config=config))
        return jnp.sum(out.astype(jnp.float32) * d_out) + sum(jnp.sum(jnp.cos(s)) for s in final)

    argnums = (0, 1) if state is not None else (0,)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums))(args, state)


def compare(got, want, tol):
    assert_close("value", got[0], want[0], tol)
    wanted = dict(jax.tree_util.tree_leaves_with_path(want[1]))
    for path, g in jax.tree_util.tree_leaves_with_path(got[1]):
        assert g.dtype == wanted[path].dtype
        assert_close(jax.tree_util.keystr(path), g, wanted[path], tol)


CASES = [
    ("groups-odd-T-state", (2, 40, 4, 2, 16, 8, 8), jnp.float32, {}, 2e-5),
    ("bf16", (2, 32, 4, 1, 32, 8, 8), jnp.bfloat16, dict(with_state=False), 1e-2),
    ("no-angles-no-gate-no-D", (1, 16, 2, 1, 16, 8, 0), jnp.float32, dict(with_z=False, with_D=False), 2e-5),
    ("model-like-N", (1, 32, 2, 1, 64, 16, 16), jnp.float32, {}, 2e-5),
    ("six-heads-three-groups", (1, 20, 6, 3, 16, 8, 8), jnp.float32, {}, 2e-5),
]


@pytest.mark.parametrize("shape,dtype,options,tol", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fused_matches_the_unfused_pallas_path(shape, dtype, options, tol):
    args, state, G = make(shape, dtype, **options)
    compare(run(args, state, G), run(args, state, G, config=UNFUSED), tol)


@pytest.mark.parametrize("shape,options", [(CASES[0][1], {}), (CASES[2][1], CASES[2][3]),
                                           ((1, 33, 6, 2, 16, 8, 0), dict(with_z=False))],
                         ids=["state", "S0", "six-heads-two-groups-odd-T"])
def test_fused_matches_the_xla_composition(shape, options):
    args, state, G = make(shape, jnp.float32, **options)
    compare(run(args, state, G), run(args, state, G, impl="xla"), 5e-5)


def test_row_splits_change_nothing():
    """More, smaller programs (projection_row_splits: 16 programs of one row per chunk of 16) give the
    one-program-per-chunk values and cotangents: T = 42 ends inside a chunk, so the rows past it are
    masked, and the weight-gradient partials are per program (one row each)."""
    args, state, G = make((2, 42, 6, 2, 16, 8, 8), jnp.float32, seed=3)
    split = Mamba3ScanConfig(fuse_projection=True, projection_row_splits=16, num_warps_projection=2,
                             num_warps_projection_grad=4)
    compare(run(args, state, G, config=split), run(args, state, G), 2e-6)


def test_more_row_splits_than_chunk_rows_is_refused_by_name():
    args, state, G = make((1, 16, 2, 1, 16, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match="projection_row_splits \\(32\\) must be <= the chunk length \\(16\\)"):
        run(args, state, G, config=Mamba3ScanConfig(fuse_projection=True, projection_row_splits=32))


@pytest.mark.parametrize("field,value", [("projection_row_splits", 3), ("projection_row_splits", 0),
                                         ("num_warps_projection", 6), ("num_warps_projection_grad", 64)])
def test_bad_projection_launch_settings_are_named(field, value):
    with pytest.raises(ValueError, match=f"Mamba3ScanConfig.{field} must be"):
        Mamba3ScanConfig(**{field: value}).validate()


def runs_the_kernels(args, state, G, **kw):
    jaxpr = jax.make_jaxpr(lambda a: ops.mamba3_siso_scan_projected(
        *[a[k] for k in NAMES], ngroups=G, A_floor=1e-4, norm_eps=1e-5, initial_state=state,
        tuning=Mamba3ScanTuning(chunk_size=16, pallas_config=kw.pop("config", FUSED)), **kw))(args)
    return "mamba3_siso_fwd_projection" in str(jaxpr)


def test_the_kernels_run_only_where_they_apply():
    args, state, G = make((1, 16, 2, 1, 16, 8, 8), jnp.float32)
    assert runs_the_kernels(args, state, G, implementation="pallas")
    assert not runs_the_kernels(args, state, G)      # automatic on a CPU: "xla"
    assert runs_the_kernels(args, state, G, implementation="pallas", config=None)       # on by default
    assert not runs_the_kernels(args, state, G, implementation="pallas", config=UNFUSED)
    assert not runs_the_kernels(args, state, G, implementation="xla")
    assert not runs_the_kernels(args, state, G, implementation="reference")
    odd, odd_state, _ = make((1, 16, 2, 1, 16, 8, 3), jnp.float32)
    assert not runs_the_kernels(odd, odd_state, G, implementation="pallas")      # S = 3
    wide = Mamba3ScanConfig(fuse_projection=True, min_width=32)                  # N = 16 < min_width: no raise
    assert not runs_the_kernels(args, state, G, implementation="pallas", config=wide)
    with pytest.raises(NotImplementedError, match="reset"):                       # as the scan op
        runs_the_kernels(args, state, G, implementation="pallas", reset=jnp.zeros((1, 16), bool))


def test_reset_masks_run_through_the_composition():
    """With reset masks (which the Pallas scan refuses) the op is the composition: "xla" equals the
    sequential reference through it, states and every cotangent included."""
    args, state, G = make((2, 24, 2, 1, 16, 8, 8), jnp.float32)
    reset = jnp.asarray(np.arange(24)[None, :] == np.array([[5], [17]]))
    compare(run(args, state, G, impl="xla", reset=reset), run(args, state, G, impl="reference", reset=reset), 5e-5)


@pytest.mark.parametrize("change,error,words", [
    (dict(rest=jnp.zeros((1, 8, 200))), ValueError, "rest must have shape"),
    (dict(dt_bias=jnp.zeros(3)), ValueError, "dt_bias must have shape"),
    (dict(C_norm_weight=jnp.zeros(8)), ValueError, "C_norm_weight must have shape"),
    (dict(ngroups=3), ValueError, "ngroups must be a positive int dividing"),
    (dict(norm_eps=0.0), ValueError, "norm_eps must be > 0"),
    (dict(rest=jnp.zeros((1, 8, 2 * 16 + 6 + 8), jnp.int32)), TypeError, "rest"),
    (dict(D=jnp.zeros(1)), ValueError, "D must have shape"),
    (dict(z=jnp.zeros((1, 8, 2, 5))), ValueError, "z must have shape"),
    (dict(B_bias=jnp.zeros(16)), ValueError, "B_bias must have shape"),
    (dict(C_bias=jnp.zeros((2, 8))), ValueError, "C_bias must have shape"),
])
@pytest.mark.parametrize("config", [None, FUSED], ids=["composition", "fused"])
def test_bad_arguments_are_named(change, error, words, config):
    args, _, G = make((1, 8, 2, 1, 16, 4, 8), jnp.float32, with_state=False)
    kw = dict(ngroups=G, A_floor=1e-4, norm_eps=1e-5, implementation="pallas",
              tuning=Mamba3ScanTuning(chunk_size=16, pallas_config=config))
    for k, v in change.items():
        (kw if k in kw else args)[k] = v
    with pytest.raises(error, match=words):
        ops.mamba3_siso_scan_projected(*[args[k] for k in NAMES], **kw)


@pytest.mark.parametrize("shape", [(8, 2048, 24, 1, 128, 64, 32), (2, 256, 16, 1, 64, 32, 0)],
                         ids=["benchmark-layer", "heads-a-power-of-two"])
def test_kernels_lower_for_h200(shape):
    """Forward + backward lowered for an abstract H200: the projection's two kernels beside the scan's
    seven (keys and queries in one launch, the default) (and none of the norms' separate ones). At the benchmark layer the heads' window is masked
    (H = 24 in 32 columns); with H = 16 it is the plain one."""
    bsz, T, H, G, N, P, S = shape
    s = jax.ShapeDtypeStruct
    specs = dict(rest=s((bsz, T, 2 * G * N + 3 * H + S), jnp.bfloat16), V=s((bsz, T, H, P), jnp.bfloat16),
                 z=s((bsz, T, H, P), jnp.bfloat16), dt_bias=s((H,), jnp.float32), B_norm_weight=s((N,), jnp.float32),
                 C_norm_weight=s((N,), jnp.float32), B_bias=s((H, N), jnp.float32), C_bias=s((H, N), jnp.float32),
                 D=s((H,), jnp.float32))

    def loss(a):
        out = ops.mamba3_siso_scan_projected(*[a[k] for k in NAMES], ngroups=G, A_floor=1e-4, norm_eps=1e-5,
                                             implementation="pallas",
                                             tuning=Mamba3ScanTuning(chunk_size=64, pallas_config=FUSED))
        return jnp.sum(out.astype(jnp.float32))

    text = lowered_for_h200(jax.grad(loss), specs, glue_modules=(pallas_glue,))
    assert text.count("__gpu$xla.gpu.triton") == 9
    assert "mamba3_siso_fwd_projection" in text and "mamba3_siso_bwd_projection" in text
    assert "mamba3_siso_fwd_qk_norm" not in text and "mamba3_siso_bwd_qk_norm" not in text


@pytest.mark.gpu
# the second shape: trap's masked [L, 8] head window reaches past rest's last column (R = 2GN + 3H)
@pytest.mark.parametrize("shape", [(2, 2048, 24, 1, 128, 64, 32), (2, 200, 6, 3, 16, 8, 0)],
                         ids=["benchmark-layer", "six-heads-S0-odd-T"])
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-4)])
def test_gpu_fused_matches_the_unfused_pallas_path(shape, dtype, tol):
    args, state, G = make(shape, dtype)
    got, again = run(args, state, G), run(args, state, G)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))          # deterministic
    compare(got, run(args, state, G, config=UNFUSED), tol)


def test_a_mamba3_mixer_with_the_kernels_matches_the_xla_mixer():
    """The mixer's window (output, final state and every parameter gradient) with the projection kernels
    on (interpreted) against the same mixer on the XLA implementation."""
    from flax import nnx

    from jmamba.mamba3 import Mamba3Config
    from jmamba.mamba3.mixer import Mamba3Mixer

    mixer = Mamba3Mixer(Mamba3Config(d_model=16, n_layers=1, d_state=32, headdim=8), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 20, 16)), jnp.float32)
    graph, params = nnx.split(mixer)

    def loss(params, x):
        out, final = nnx.merge(graph, params)(x)
        return jnp.sum(jnp.sin(out)) + sum(jnp.sum(jnp.cos(s)) for s in final)

    got = {}
    for impl, config in (("pallas", FUSED), ("xla", None)):
        with ops.dispatch.prefer("mamba3_siso_scan", impl), \
                ops.tuning("mamba3_siso_scan", Mamba3ScanTuning(chunk_size=16, pallas_config=config)):
            got[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
            if impl == "pallas":
                assert "mamba3_siso_fwd_projection" in str(jax.make_jaxpr(loss)(params, x))
    compare(got["pallas"], got["xla"], 5e-5)
