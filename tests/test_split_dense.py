"""`jmamba.ops.split_dense`: both implementations against float64 numpy (values, dx and dw for every
block, leading shapes [], [n], [b, t], odd block widths, f32 / f64 / bf16), against each other, the
structure of the "xla" backward (dx summed right to left with no barrier between the products and the
sums, the weight gradients on separate copies of x), and bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba import ops

IMPLS = ["reference", "xla"]
SIZES = (3, 5, 1)


def case(lead, d_in=7, seed=0):
    rng = np.random.default_rng(seed + len(lead))
    x = rng.normal(size=lead + (d_in,))
    w = rng.normal(size=(d_in, sum(SIZES)))
    cts = [rng.normal(size=lead + (s,)) for s in SIZES]
    return x, w, cts


def column_blocks_of(w):
    """[w[:, :3], w[:, 3:8], w[:, 8:9]]: the SIZES column blocks of w (numpy or jax)."""
    edges = np.cumsum((0,) + SIZES)
    return [w[:, a:b] for a, b in zip(edges[:-1], edges[1:])]


def numpy_oracle(x, w, cts):
    """Blocks, dx and dw by float64 numpy from the definition: y_i = x·w_i, dx = Σ dy_i·w_iᵀ,
    dw = [xᵀ·dy_0 | xᵀ·dy_1 | ...] (the leading axes flattened)."""
    blocks = column_blocks_of(w)
    ys = [x @ b for b in blocks]
    dx = sum(c @ b.T for c, b in zip(cts, blocks))
    x2 = x.reshape(-1, x.shape[-1])
    dw = np.concatenate([x2.T @ c.reshape(-1, c.shape[-1]) for c in cts], axis=1)
    return ys, dx, dw


def rounded(a, dtype):
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)


def run(impl, x, w, cts, dtype):
    f = jax.jit(lambda x, w: ops.split_dense(x, w, SIZES, implementation=impl))
    ys, vjp = jax.vjp(f, jnp.asarray(x, dtype), jnp.asarray(w, dtype))
    dx, dw = vjp(tuple(jnp.asarray(c, dtype) for c in cts))
    return ys, dx, dw


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead", [(), (4,), (2, 3)], ids=["vector", "rows", "batch-time"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 2e-5), (jnp.bfloat16, 4e-2)],
                         ids=["f64", "f32", "bf16"])
def test_values_and_cotangents_match_float64_numpy(impl, lead, dtype, tol):
    with jax.enable_x64(dtype == jnp.float64):
        x, w, cts = case(lead)
        if dtype == jnp.bfloat16:   # the oracle on the bf16-rounded inputs
            x, w = rounded(x, dtype), rounded(w, dtype)
            cts = [rounded(c, dtype) for c in cts]
        ys, dx, dw = run(impl, x, w, cts, dtype)
        want_ys, want_dx, want_dw = numpy_oracle(x, w, cts)
        assert len(ys) == len(SIZES)
        for y, want, s in zip(ys, want_ys, SIZES):
            assert y.shape == lead + (s,) and y.dtype == dtype
            np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * 4)
        assert dx.shape == x.shape and dx.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
        np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=tol, atol=tol * 4)
        np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_implementations_differ_only_in_the_order_of_dxs_sum_on_cpu(dtype):
    """Same products: the blocks and dw agree bit for bit; dx is the products g_i = dy_i·w_iᵀ (each
    rounded to the dtype) summed in each one's order, (g0 + g1) + g2 for "reference" (JAX's transpose)
    and g0 + (g1 + g2) for "xla". Each g_i is read from the same compiled backward with only cotangent i
    nonzero (adding zeros is exact), not from a separate eager matmul, whose rounding in float32 can
    differ from the jitted one's on some CPUs (it did on an AVX-512 host)."""
    x, w, cts = case((3, 4), d_in=16, seed=3)
    got = {impl: run(impl, x, w, cts, dtype) for impl in IMPLS}
    f32 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32))
    same = lambda a, b: np.testing.assert_array_equal(f32(a), f32(b))
    for a, b in zip(jax.tree.leaves((got["reference"][0], got["reference"][2])),
                    jax.tree.leaves((got["xla"][0], got["xla"][2]))):
        same(a, b)
    only = lambda i: [c if j == i else np.zeros_like(c) for j, c in enumerate(cts)]
    g = {impl: [run(impl, x, w, only(i), dtype)[1] for i in range(len(cts))] for impl in IMPLS}
    for a, b in zip(g["reference"], g["xla"]):   # the products themselves are the same in both programs
        same(a, b)
    g = g["reference"]
    left, right = (g[0] + g[1]) + g[2], g[0] + (g[1] + g[2])
    assert not np.array_equal(f32(left), f32(right)), "the data must tell the two orders apart"
    same(got["reference"][1], left)
    same(got["xla"][1], right)


def backward_jaxpr(impl):
    x = jnp.zeros((2, 5, 8), jnp.bfloat16)
    w = jnp.zeros((8, sum(SIZES)), jnp.bfloat16)
    ys, vjp = jax.vjp(lambda x, w: ops.split_dense(x, w, SIZES, implementation=impl), x, w)
    return jax.make_jaxpr(vjp)(tuple(jnp.zeros_like(y) for y in ys)).jaxpr


def producers(jaxpr):
    return {v: e for e in jaxpr.eqns for v in e.outvars}


@pytest.mark.parametrize("impl", list(IMPLS) + [None])
def test_how_dx_is_summed(impl):
    """"xla": dx's adds take matmul outputs directly (what the GPU GEMM rewriter was meant to fold into
    the next matmul); "reference" and the automatic choice (None; "xla" measured slower on a GPU): JAX's
    transpose of the barrier sits between them. All: three separate weight-gradient matmuls (no merged
    matmul over a concatenated cotangent)."""
    jaxpr = backward_jaxpr(impl)
    made_by = producers(jaxpr)
    dx = jaxpr.outvars[0]
    adds = []
    pending = [dx]
    while pending:   # the tree of adds that forms dx
        e = made_by.get(pending.pop())
        if e is not None and e.primitive.name in ("add", "add_any"):
            adds.append(e)
            pending.extend(e.invars)
    assert len(adds) == len(SIZES) - 1
    leaves = [made_by[v].primitive.name for e in adds for v in e.invars if made_by[v] not in adds]
    want = "dot_general" if impl == "xla" else "optimization_barrier"
    assert leaves == [want] * len(SIZES), leaves
    if impl == "xla":   # right to left: the outer add's second operand is the inner add
        outer = made_by[dx]
        assert [made_by[v] in adds for v in outer.invars] == [False, True]
    weight_dots = [e.outvars[0].aval.shape for e in jaxpr.eqns
                   if e.primitive.name == "dot_general" and e.outvars[0].aval.ndim == 2]   # [s_i, d_in]
    assert sorted(weight_dots) == sorted((s, 8) for s in SIZES)


def test_a_mamba3_mixer_differentiates_the_same_through_both():
    from jmamba.mamba3 import Mamba3Config
    from jmamba.mamba3.mixer import Mamba3Mixer
    from flax import nnx

    cfg = Mamba3Config(d_model=32, n_layers=1, d_state=16, headdim=8)
    mixer = Mamba3Mixer(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 32), jnp.float32)
    graph, params = nnx.split(mixer)

    def loss(params, x):
        out, _ = nnx.merge(graph, params)(x)
        return jnp.sum(out * jnp.cos(out))

    got = []
    for impl in IMPLS:
        with ops.dispatch.prefer("split_dense", impl):
            got.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(sizes=(3, 5)), ValueError, "sizes must sum to"),
    (dict(sizes=(3, 0, 6)), ValueError, "positive ints"),
    (dict(sizes=()), ValueError, "non-empty"),
    (dict(sizes=(3.0, 6)), ValueError, "positive ints"),
    (dict(w=np.zeros((6, 9), np.float32)), ValueError, "w must have shape [d_in, d_out]"),
    (dict(w=np.zeros((7, 9), np.float16)), TypeError, "w must have x's dtype"),
    (dict(x=np.zeros((2, 7), np.int32)), TypeError, "x"),
])
def test_bad_arguments_are_named(kwargs, error, words):
    args = dict(x=np.zeros((2, 7), np.float32), w=np.zeros((7, 9), np.float32), sizes=(3, 5, 1))
    args.update(kwargs)
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        ops.split_dense(jnp.asarray(args["x"]), jnp.asarray(args["w"]), args["sizes"])
