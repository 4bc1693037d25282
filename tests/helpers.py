"""Test helpers: scale-aware comparisons with messages that say which quantity failed."""

from __future__ import annotations

import numpy as np


def rel_err(got, want):
    """max |got − want| / max(|want|, tiny): error relative to the tensor's scale."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1e-12))


def assert_close(name, got, want, tol):
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def perturbed(module, seed=0, scale=0.2):
    """`module` with every parameter moved away from its init (so D != 1, norms != 1, ...).

    numpy draws: eager jax.random calls compile one program per shape, which is slow on CPU."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, params = nnx.split(module)
    rng = np.random.default_rng(seed + 100)
    params = jax.tree.map(lambda p: jnp.asarray(np.asarray(p) + scale * rng.normal(size=p.shape), p.dtype), params)
    return nnx.merge(graphdef, params)


def assert_directional_gradients(loss, args, rng, *, directions=2, h=1e-6, tol=1e-6):
    """Central differences of `loss(*args)` along random directions of every leaf vs `jax.grad`.

    Run under `jax.enable_x64(True)` with float64 leaves. Returns the number of checks made."""
    import jax
    import jax.numpy as jnp

    loss_j = jax.jit(loss)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    flat_args, argdef = jax.tree_util.tree_flatten_with_path(tuple(args))
    flat_grads = jax.tree.leaves(grads)
    assert all(g.dtype == jnp.float64 for g in flat_grads), "run the check in float64"
    checked = 0
    for i, ((path, leaf), g) in enumerate(zip(flat_args, flat_grads)):
        for _ in range(directions):
            v = jnp.asarray(rng.normal(size=leaf.shape))

            def at(s):
                leaves = [a for _, a in flat_args]
                leaves[i] = leaf + s * v
                return loss_j(*jax.tree.unflatten(argdef, leaves))

            num = (at(h) - at(-h)) / (2 * h)
            ana = float(jnp.sum(g * v))
            assert abs(num - ana) <= tol * max(1.0, abs(ana)), \
                f"{jax.tree_util.keystr(path)}: finite difference {num:.9g} vs grad {ana:.9g}"
            checked += 1
    return checked


def lowered_for_h200(fn, *specs, glue_modules=()):
    """The StableHLO text of `jax.jit(fn)` traced on `specs` and lowered for an abstract H200 on this CPU
    (the Pallas kernels go through the Triton lowering, so an op it does not support fails here). Each
    module in `glue_modules` gets `interpret_mode` patched to False (the ops' glue then compiles the
    kernels instead of interpreting them)."""
    import contextlib
    import warnings
    from unittest import mock

    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with contextlib.ExitStack() as stack:
        for module in glue_modules:
            stack.enter_context(mock.patch.object(module, "interpret_mode", return_value=False))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", DeprecationWarning)   # "the Pallas Triton backend is deprecated"
        stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
