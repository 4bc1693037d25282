"""`causal_conv1d`'s custom VJP: the forward is bit-identical to the plain formula, every cotangent
matches autodiff of that formula (and float64 finite differences), and the gradient's jaxpr hands no
[Bt, T, E] tap (concatenation, or its masked select) to more than one consumer."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, assert_directional_gradients
from jmamba.core.dtypes import accum_dtype
from jmamba.ops import causal_conv1d

BT, E = 2, 3


def old_conv(x, conv_state, kernel, bias, reset=None):
    """`causal_conv1d` before its custom VJP (plain autodiff), verbatim."""
    f32 = accum_dtype(x.dtype, kernel.dtype)
    k_size = kernel.shape[0]
    seqlen = x.shape[1]
    state, xf, w = conv_state.astype(f32), x.astype(f32), kernel.astype(f32)

    def tap_input(k):
        j = k_size - 1 - k
        if j == 0:
            return xf
        if j >= seqlen:
            return state[:, k:k + seqlen]
        return jnp.concatenate([state[:, k:], xf[:, :seqlen - j]], axis=1)

    if k_size == 1:
        new_state = state
    elif seqlen >= k_size - 1:
        new_state = xf[:, seqlen - (k_size - 1):]
    else:
        new_state = jnp.concatenate([state[:, seqlen:], xf], axis=1)
    if reset is None:
        c = sum(w[k] * tap_input(k) for k in range(k_size))
    else:
        seg_x = jnp.cumsum(reset.astype(jnp.int32), axis=1)
        seg = jnp.concatenate([jnp.zeros((x.shape[0], k_size - 1), jnp.int32), seg_x], axis=1)
        c = sum(w[k] * jnp.where((seg[:, k:k + seqlen] == seg_x)[..., None], tap_input(k), 0.0)
                for k in range(k_size))
        keep = (seg[:, seqlen:] == seg_x[:, -1:])[..., None]
        new_state = jnp.where(keep, new_state, 0.0)
    return (c if bias is None else c + bias.astype(f32)), new_state


def _inputs(rng, t, k, dtype, with_reset, with_bias=True, f=jnp.float32):
    x = jnp.asarray(rng.normal(size=(BT, t, E)), dtype)
    state = jnp.asarray(rng.normal(size=(BT, k - 1, E)), f)
    kernel = jnp.asarray(rng.normal(size=(k, E)), f)
    bias = jnp.asarray(rng.normal(size=(E,)), f) if with_bias else None
    reset = jnp.asarray(rng.random((BT, t)) < 0.3) if with_reset else None
    return x, state, kernel, bias, reset


def _value_and_vjp(conv, **jit_kw):
    """jit: (c, new_state) and the cotangents of (x, state, kernel, bias) for cotangents (dc, dn)."""
    @functools.partial(jax.jit, **jit_kw)
    def run(x, state, kernel, bias, reset, cts):
        out, vjp = jax.vjp(lambda *a: conv(*a, reset), x, state, kernel, bias)
        return out, vjp(cts)
    return run


NEW = _value_and_vjp(causal_conv1d)
# The reference gradient only needs to be accurate: compiled without XLA's backend optimizations (2x faster).
OLD = _value_and_vjp(old_conv, compiler_options={"xla_backend_optimization_level": 0,
                                                 "xla_llvm_disable_expensive_passes": True})
OLD_FORWARD = jax.jit(old_conv)   # (the plain formula's value in a vjp program may differ by fusion/FMA)
CASES = list(itertools.product([1, 2, 3, 5, 20], [1, 2, 4], [False, True], [jnp.float32, jnp.bfloat16]))


@pytest.mark.parametrize("t,k,with_reset,dtype", CASES)
def test_values_and_cotangents_match_old_formula(t, k, with_reset, dtype):
    rng = np.random.default_rng(100 * t + 10 * k + with_reset)
    args = _inputs(rng, t, k, dtype, with_reset, with_bias=(t + k) % 2 == 0 or with_reset)
    cts = (jnp.asarray(rng.normal(size=(BT, t, E)), jnp.float32),
           jnp.asarray(rng.normal(size=(BT, k - 1, E)), jnp.float32))
    (c, n), grads = NEW(*args, cts)
    _, grads0 = OLD(*args, cts)
    c0, n0 = OLD_FORWARD(*args)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(c0))      # bit-identical forward
    np.testing.assert_array_equal(np.asarray(n), np.asarray(n0))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for name, g, g0, a in zip(("x", "conv_state", "kernel", "bias"), grads, grads0, args):
        if a is None:
            assert g is None and g0 is None
            continue
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close(f"d{name} (T={t}, K={k})", g, g0, tol)


def test_eager_forward_and_empty_sequence():
    rng = np.random.default_rng(1)
    args = _inputs(rng, 5, 4, jnp.float32, True)
    for got, want in zip(causal_conv1d(*args), old_conv(*args)):       # eager (no jit)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(jax.jit(causal_conv1d)(*args), OLD_FORWARD(*args)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for k in (1, 4):                                                    # T = 0 (no reset)
        args = _inputs(rng, 0, k, jnp.float32, False)
        cts = (jnp.zeros((BT, 0, E)), jnp.asarray(rng.normal(size=(BT, k - 1, E)), jnp.float32))
        (c, n), grads = NEW(*args, cts)
        (c0, n0), grads0 = OLD(*args, cts)
        assert c.shape == c0.shape == (BT, 0, E)
        np.testing.assert_array_equal(np.asarray(n), np.asarray(n0))
        for g, g0 in zip(grads, grads0):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))


@pytest.mark.parametrize("t", [2, 7])
def test_float64_finite_differences(t):
    with jax.enable_x64(True):
        rng = np.random.default_rng(t)
        x, state, kernel, bias, reset = _inputs(rng, t, 4, jnp.float64, True, f=jnp.float64)
        rc, rn = rng.normal(size=(BT, t, E)), rng.normal(size=(BT, 3, E))

        def loss(x, state, kernel, bias):
            c, n = causal_conv1d(x, state, kernel, bias, reset)
            return jnp.sum(jnp.sin(c) * rc) + jnp.sum(n * n * rn)

        assert causal_conv1d(x, state, kernel, bias, reset)[0].dtype == jnp.float64
        assert assert_directional_gradients(loss, (x, state, kernel, bias), rng) == 8


def _shared_taps(jaxpr, shape):
    """[(primitive, consumers)] for every `shape` value made by a concatenate or a select_n (jnp.where,
    seen through its jit wrapper) that more than one equation (or output) of its jaxpr reads, in
    `jaxpr` and every jaxpr nested in it: a tap that XLA would have to write to memory."""
    def sub_jaxprs(eqn):
        for p in eqn.params.values():
            for q in (p if isinstance(p, (tuple, list)) else (p,)):
                if hasattr(q, "eqns"):
                    yield q
                elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
                    yield q.jaxpr

    def producer(eqn, i):
        if eqn.primitive.name in ("jit", "pjit"):
            inner = eqn.params["jaxpr"].jaxpr
            made = {o: e for e in inner.eqns for o in e.outvars}
            v = inner.outvars[i]
            return producer(made[v], made[v].outvars.index(v)) if v in made else None
        return eqn.primitive.name

    found = []

    def walk(jx):
        uses = {}
        for eqn in jx.eqns:
            for v in {v for v in eqn.invars if not hasattr(v, "val")}:
                uses[v] = uses.get(v, 0) + 1
        for v in jx.outvars:
            if not hasattr(v, "val"):
                uses[v] = uses.get(v, 0) + 1
        for eqn in jx.eqns:
            for i, v in enumerate(eqn.outvars):
                if (tuple(v.aval.shape) == shape and jnp.issubdtype(v.aval.dtype, jnp.floating)
                        and producer(eqn, i) in ("concatenate", "select_n") and uses.get(v, 0) > 1):
                    found.append((producer(eqn, i), uses[v]))
            for sub in sub_jaxprs(eqn):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


def _count_concats(jaxpr, shape):
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "concatenate" and tuple(eqn.outvars[0].aval.shape) == shape
        for p in eqn.params.values():
            q = getattr(p, "jaxpr", p)
            n += _count_concats(q, shape) if hasattr(q, "eqns") else 0
    return n


@pytest.mark.parametrize("with_reset", [False, True])
def test_gradient_shares_no_tap(with_reset):
    t, k = 8, 4
    args = _inputs(np.random.default_rng(3), t, k, jnp.float32, with_reset)

    def grad_jaxpr(conv):
        def loss(x, state, kernel, bias, reset):
            c, n = conv(x, state, kernel, bias, reset)
            return jnp.sum(c * c) + jnp.sum(n * n)
        return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    new, old = grad_jaxpr(causal_conv1d), grad_jaxpr(old_conv)
    assert _shared_taps(old, (BT, t, E)), "the check must catch the plain formula's shared taps"
    assert _shared_taps(new, (BT, t, E)) == []
    # The only [Bt, T, E] concatenations are the forward's K-1 taps: the backward builds none.
    assert _count_concats(new.jaxpr, (BT, t, E)) == k - 1
