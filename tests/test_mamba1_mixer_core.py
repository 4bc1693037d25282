"""`jmamba.ops.mamba1_mixer_core`, the fused Mamba-1 mixer core: every implementation against a float64
numpy oracle (values) and the "reference" composition (values and every cotangent, both states
included), dtypes, odd sizes, resets, the forward equal to the unfused composition bit for bit, what the
Pallas backward saves, decode agreeing with the full forward, bad input, and the H200 runs."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_mamba1 as npm
from helpers import assert_close
from jmamba import ops
from jmamba.ops import Mamba1CoreState, dispatch, mamba1_mixer_core
from jmamba.ops.mamba1_mixer.common import scan_operands

ARG_NAMES = ("x", "z", "conv_kernel", "conv_bias", "x_proj_kernel", "dt_proj_kernel", "dt_bias", "A", "D")


def make_inputs(bsz, seqlen, e, n, rank, k, dtype, *, seed=0, with_z=True, with_D=True, with_conv_bias=True,
                with_dt_bias=True, with_state=True, reset=None):
    """(args dict, initial_state or None, reset or None); x, z in `dtype`, parameters float32."""
    rng = np.random.default_rng(seed)

    def f(*s, scale=1.0, dt=jnp.float32):
        return jnp.asarray(scale * rng.normal(size=s), dt)

    args = dict(x=f(bsz, seqlen, e, dt=dtype), z=f(bsz, seqlen, e, dt=dtype) if with_z else None,
                conv_kernel=f(k, e, scale=0.5), conv_bias=f(e, scale=0.2) if with_conv_bias else None,
                x_proj_kernel=f(e, rank + 2 * n, scale=e ** -0.5), dt_proj_kernel=f(rank, e, scale=rank ** -0.5),
                dt_bias=f(e, scale=0.3) - 1.0 if with_dt_bias else None,
                A=-jnp.exp(f(e, n, scale=0.5)), D=f(e) if with_D else None)
    state = (Mamba1CoreState(conv=f(bsz, k - 1, e), ssm=f(bsz, e, n, scale=0.3)) if with_state else None)
    if reset == "rows":
        reset = jnp.asarray(np.arange(bsz) % 2 == 1)
    elif reset == "positions":
        reset = jnp.asarray(rng.random((bsz, seqlen)) < 0.08)
    return args, state, reset


def run(impl, args, state, reset):
    return mamba1_mixer_core(*(args[k] for k in ARG_NAMES), initial_state=state, return_final_state=True,
                             reset=reset, implementation=impl)


# ------------------------------------------------------------------------------------------ numpy oracle
def numpy_oracle(args, state, reset):
    """Float64 numpy: the conv with carried context and resets (written out per position here), SiLU,
    the projections, then the S6 recurrence of tests/numpy_mamba1.py."""
    a = {k: None if v is None else np.asarray(v, np.float64) for k, v in args.items()}
    x, w = a["x"], a["conv_kernel"]
    bsz, seqlen, e = x.shape
    k = w.shape[0]
    n = a["A"].shape[1]
    rank = a["dt_proj_kernel"].shape[0]
    conv = np.zeros((bsz, k - 1, e)) if state is None else np.asarray(state.conv, np.float64).copy()
    rs = np.zeros((bsz, seqlen), bool) if reset is None else np.asarray(reset)
    if rs.ndim == 1:
        rs = np.concatenate([rs[:, None], np.zeros((bsz, seqlen - 1), bool)], axis=1)
    c = np.zeros((bsz, seqlen, e))
    for b in range(bsz):
        hist = list(conv[b])                 # the last K-1 inputs, oldest first
        for t in range(seqlen):
            if rs[b, t]:
                hist = [np.zeros(e)] * (k - 1)
            win = hist + [x[b, t]]
            c[b, t] = sum(w[i] * win[i] for i in range(k))
            hist = win[1:]
        conv[b] = np.stack(hist) if k > 1 else conv[b]
    if a["conv_bias"] is not None:
        c = c + a["conv_bias"]
    u = npm.silu(c)
    xd = u @ a["x_proj_kernel"]
    Bm, Cm = xd[..., None, rank:rank + n], xd[..., None, rank + n:]
    y, h, _ = npm.scan_forward(u, xd[..., :rank] @ a["dt_proj_kernel"], a["A"], Bm, Cm, a["D"], a["z"],
                               a["dt_bias"], True, None if state is None else state.ssm, rs)
    return y, conv, h


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_values_match_numpy_oracle(impl):
    args, state, reset = make_inputs(2, 29, 16, 4, 3, 4, jnp.float32, reset="positions")
    y, st = run(impl, args, state, reset)
    want_y, want_conv, want_h = numpy_oracle(args, state, reset)
    assert y.dtype == jnp.float32 and st.conv.dtype == jnp.float32 and st.ssm.dtype == jnp.float32
    assert_close("y", y, want_y, 2e-5)
    assert_close("conv state", st.conv, want_conv, 1e-6)
    assert_close("ssm state", st.ssm, want_h, 2e-5)


# ------------------------------------------------------------------------- every cotangent vs reference
CASES = [
    # (bsz, T, E, N, R, K), dtype, options, tolerance
    ((2, 37, 32, 5, 4, 4), jnp.float32, dict(reset="positions"), 3e-5),
    ((3, 45, 24, 3, 2, 3), jnp.bfloat16, dict(reset="rows", with_z=False, with_D=False, with_conv_bias=False), 4e-2),
    ((2, 33, 16, 4, 3, 4), jnp.float16, dict(with_state=False, with_dt_bias=False), 1e-2),
    ((1, 20, 8, 2, 1, 1), jnp.float32, dict(reset="rows"), 3e-5),                      # K = 1: no conv state
]


def _loss_and_grads(impl, args, state, reset):
    present = tuple(k for k in ARG_NAMES if args[k] is not None)

    def loss(vals, st):
        full = dict(args, **dict(zip(present, vals)))
        y, s2 = run(impl, full, st, reset)
        yf = y.astype(jnp.float32)
        return jnp.sum(yf * jnp.cos(yf)) + 0.7 * jnp.sum(jnp.sin(s2.conv)) + jnp.sum(jnp.tanh(s2.ssm))

    vals = tuple(args[k] for k in present)
    value, (g_vals, g_state) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(vals, state)
    return value, dict(zip(present, g_vals)), g_state


_REFERENCE = {}   # {case index: the reference's (loss, cotangents, state cotangents)}, shared by both impls


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("case", range(len(CASES)), ids=["f32-resets", "bf16-rows-bare", "f16-no-state", "k1-f32"])
def test_values_and_every_cotangent_match_reference(impl, case):
    shape, dtype, options, tol = CASES[case]
    args, state, reset = make_inputs(*shape, dtype, **options)
    if state is None:   # gradients into zero states are still checked: pass explicit zeros
        bsz, _, e, n, _, k = shape
        state = Mamba1CoreState(conv=jnp.zeros((bsz, k - 1, e)), ssm=jnp.zeros((bsz, e, n)))
    got_v, got, got_s = _loss_and_grads(impl, args, state, reset)
    if case not in _REFERENCE:   # the inputs are the same draws for both impls
        _REFERENCE[case] = _loss_and_grads("reference", args, state, reset)
    want_v, want, want_s = _REFERENCE[case]
    assert_close("loss", got_v, want_v, tol)
    for name in want:
        assert got[name].dtype == args[name].dtype, name
        assert_close(f"d{name}", got[name], want[name], tol)
    assert_close("d initial_state.conv", got_s.conv, want_s.conv, tol)
    assert_close("d initial_state.ssm", got_s.ssm, want_s.ssm, tol)


def test_pallas_cotangents_without_an_initial_state_match_reference():
    args, _, reset = make_inputs(2, 27, 16, 4, 3, 4, jnp.float32, with_state=False, reset="rows")
    present = tuple(k for k in ARG_NAMES if args[k] is not None)

    def grads(impl):
        def loss(vals):
            y = mamba1_mixer_core(*(dict(args, **dict(zip(present, vals)))[k] for k in ARG_NAMES), reset=reset,
                                  implementation=impl)
            return jnp.sum(y * jnp.cos(y))
        return jax.jit(jax.grad(loss))(tuple(args[k] for k in present))

    for name, got, want in zip(present, grads("pallas"), grads("reference")):
        assert_close(f"d{name}", got, want, 3e-5)


def _xz_loss(args, e, reset, impl):
    """(loss(xz, vals, state, packed, mode=None), xz, vals): a scalar of the op's outputs and both
    states, with x and z as one [B, T, 2E] array passed packed or as its two halves, the other
    arguments as `vals`, and (mode) the tuning's mixer_residuals; plus the arrays to call it with."""
    present = tuple(n_ for n_ in ARG_NAMES if args[n_] is not None and n_ not in ("x", "z"))

    def loss(xz, vals, st, packed, mode=None):
        full = dict(args, **dict(zip(present, vals)))
        full.update(x=xz, z=None) if packed else full.update(x=xz[..., :e], z=xz[..., e:])
        with ops.tuning("selective_scan", **({"mixer_residuals": mode} if mode else {})):
            y, s2 = mamba1_mixer_core(*(full[n_] for n_ in ARG_NAMES), initial_state=st, return_final_state=True,
                                      reset=reset, implementation=impl, xz_packed=packed)
        yf = y.astype(jnp.float32)
        return jnp.sum(yf * jnp.cos(yf)) + 0.7 * jnp.sum(jnp.sin(s2.conv)) + jnp.sum(jnp.tanh(s2.ssm))

    return loss, jnp.concatenate([args["x"], args["z"]], axis=-1), tuple(args[n_] for n_ in present)


@pytest.mark.parametrize("impl,shape,dtype,options", [
    ("pallas", (2, 37, 32, 5, 4, 4), jnp.float32, dict(reset="positions")),
    ("pallas", (2, 2, 16, 4, 3, 4), jnp.float32, dict()),     # T < K-1: the Pallas op's XLA-conv path
    ("xla", (3, 45, 24, 3, 2, 3), jnp.bfloat16, dict(reset="rows", with_D=False, with_conv_bias=False)),
], ids=["pallas-f32-resets", "pallas-short-window", "xla-bf16-rows-K3"])
def test_packed_xz_gives_the_values_and_cotangents_of_its_two_halves(impl, shape, dtype, options):
    """xz_packed=True with x = [x | z] is the same call: outputs, both states and every cotangent
    (dxz = [dx | dz]) equal to the unpacked call's, bit for bit."""
    bsz, seqlen, e, n, rank, k = shape
    args, state, reset = make_inputs(bsz, seqlen, e, n, rank, k, dtype, **options)
    loss, xz, vals = _xz_loss(args, e, reset, impl)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(xz, vals, state, True)
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(xz, vals, state, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("reset", [None, "rows", "positions"])
def test_an_empty_window_returns_the_state_unchanged(reset):
    args, state, _ = make_inputs(2, 0, 8, 2, 1, 4, jnp.float32)
    mask = {None: None, "rows": jnp.array([True, False]), "positions": jnp.zeros((2, 0), bool)}[reset]
    y, st = run("xla", args, state, mask)
    assert y.shape == (2, 0, 8)
    np.testing.assert_array_equal(np.asarray(st.conv), np.asarray(state.conv))
    np.testing.assert_array_equal(np.asarray(st.ssm), np.asarray(state.ssm))


@pytest.mark.parametrize("call,match,exc", [
    (lambda x, s, w, b: ops.causal_conv1d(x.astype(jnp.int32), s, w, b), "x must be a floating", TypeError),
    (lambda x, s, w, b: ops.causal_conv1d(x, s[:, :2], w, b), "conv_state must", ValueError),
    (lambda x, s, w, b: ops.causal_conv1d(x, s, w[:, :5], b), "x must", ValueError),
    (lambda x, s, w, b: ops.causal_conv1d(x, s, w, b[:3]), "bias must", ValueError),
    (lambda x, s, w, b: ops.causal_conv1d(x, s, w, b, reset=jnp.zeros((2, 7))), "reset must be a bool", TypeError),
    (lambda x, s, w, b: ops.causal_conv1d(x, s, w, b, reset=jnp.zeros((3,), bool)), "reset must have shape",
     ValueError),
    (lambda x, s, w, b: ops.causal_conv1d_step(x[:, 0], s[:, :1], w, b), "conv_state must", ValueError),
    (lambda x, s, w, b: ops.causal_conv1d_step(x, s, w, b), "x_t must", ValueError),
])
def test_the_public_conv_checks_its_arguments(call, match, exc):
    x, s = jnp.zeros((2, 7, 6)), jnp.zeros((2, 3, 6))
    w, b = jnp.zeros((4, 6)), jnp.zeros((6,))
    with pytest.raises(exc, match=match):
        call(x, s, w, b)


def test_the_public_conv_takes_a_row_reset_as_a_reset_at_t0():
    rng = np.random.default_rng(0)
    x, s = jnp.asarray(rng.normal(size=(2, 7, 6)), jnp.float32), jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32)
    w, b = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), jnp.zeros((6,))
    rows = jnp.array([True, False])
    got = ops.causal_conv1d(x, s, w, b, reset=rows)
    want = ops.causal_conv1d(x, s, w, b, reset=jnp.zeros((2, 7), bool).at[:, 0].set(rows))
    for a, c in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_forward_is_the_unfused_composition_bit_for_bit():
    """The op's forward is exactly scan_operands + selective_scan (what the mixer used to call)."""
    args, state, reset = make_inputs(2, 40, 16, 4, 3, 4, jnp.bfloat16, reset="positions")
    for impl in ("pallas", "xla"):
        y, st = run(impl, args, state, reset)
        u, delta, Bm, Cm, conv = scan_operands(args["x"], state.conv, args["conv_kernel"], args["conv_bias"],
                                               args["x_proj_kernel"], args["dt_proj_kernel"], reset)
        want_y, want_h = ops.selective_scan(u, delta, args["A"], Bm, Cm, args["D"], args["z"], args["dt_bias"],
                                            delta_softplus=True, initial_state=ops.SelectiveScanState(state.ssm),
                                            return_final_state=True, reset=reset, implementation=impl)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32), err_msg=impl)
        np.testing.assert_array_equal(np.asarray(st.ssm), np.asarray(want_h.ssm), err_msg=impl)
        np.testing.assert_array_equal(np.asarray(st.conv), np.asarray(conv), err_msg=impl)


def test_pallas_backward_saves_no_per_position_activation_but_x_and_z():
    """With mixer_residuals="inputs" the Pallas path keeps x and z ([Bt, T, E] in the compute dtype)
    and nothing else per position of width E: the conv output, u and delta are recomputed in the
    backward. The plain composition keeps several (this is what the fused op is for)."""
    from jax._src.ad_checkpoint import saved_residuals   # print_saved_residuals only prints

    bsz, seqlen, e = 2, 64, 16
    args, state, reset = make_inputs(bsz, seqlen, e, 4, 3, 4, jnp.bfloat16)
    present = tuple(k for k in ARG_NAMES if args[k] is not None)

    def per_position(impl):
        def f(*vals):
            with ops.tuning("selective_scan", mixer_residuals="inputs"):
                return run(impl, dict(args, **dict(zip(present, vals))), state, reset)[0]
        res = saved_residuals(f, *(args[k] for k in present))
        return [aval for aval, _ in res if tuple(aval.shape[:2]) == (bsz, seqlen) and aval.shape[-1] == e]

    fused = per_position("pallas")
    assert len(fused) == 2 and all(a.dtype == jnp.bfloat16 for a in fused), fused
    assert len(per_position("xla")) > 2


def test_pallas_kept_activations_save_u_delta_and_the_x_projection():
    """mixer_residuals="activations": the Pallas path keeps u and delta ([Bt, T, E], compute dtype) and
    the x projection ([Bt, T, R + 2N]) besides x and z; nothing else of width E per position."""
    from jax._src.ad_checkpoint import saved_residuals

    bsz, seqlen, e, n, rank = 2, 64, 16, 4, 3
    args, state, reset = make_inputs(bsz, seqlen, e, n, rank, 4, jnp.bfloat16)
    present = tuple(k for k in ARG_NAMES if args[k] is not None)

    def per_position(mode):
        def f(*vals):
            with ops.tuning("selective_scan", mixer_residuals=mode):
                return run("pallas", dict(args, **dict(zip(present, vals))), state, reset)[0]
        res = saved_residuals(f, *(args[k] for k in present))
        return sorted(a.shape[-1] for a, _ in res if tuple(a.shape[:2]) == (bsz, seqlen) and a.dtype == jnp.bfloat16)

    assert per_position("inputs") == [e, e]
    assert per_position("activations") == [rank + 2 * n, e, e, e, e]
    assert ops.SelectiveScanTuning().mixer_residuals == "activations"     # the default


# each dtype with one of the two input layouts (the four combinations compiled 8 interpreted programs)
@pytest.mark.parametrize("packed,dtype,options", [
    (False, jnp.float32, dict(reset="positions")),
    (True, jnp.bfloat16, dict(reset="rows", with_conv_bias=False, with_dt_bias=False)),
], ids=["f32-resets-x-z", "bf16-rows-bare-xz-packed"])
def test_pallas_kept_activations_give_the_same_values_and_cotangents_bit_for_bit(packed, dtype, options):
    """The backward's recomputation is deterministic, so keeping its results changes nothing: outputs,
    both states and every cotangent (both initial states included) equal to the default's, bit for bit."""
    bsz, seqlen, e, n, rank, k = 2, 37, 16, 4, 3, 4
    args, state, reset = make_inputs(bsz, seqlen, e, n, rank, k, dtype, **options)
    loss, xz, vals = _xz_loss(args, e, reset, "pallas")
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))
    got, want = grad(xz, vals, state, packed, "activations"), grad(xz, vals, state, packed, "inputs")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_mixer_residuals_and_conv_config_are_checked():
    with pytest.raises(ValueError, match="mixer_residuals must be one of"):
        ops.SelectiveScanTuning(mixer_residuals="all")
    with pytest.raises(TypeError, match="conv_config must be None or a pallas_kernels.causal_conv.ConvBlockConfig"):
        ops.SelectiveScanTuning(conv_config=dict(block_t=8))


def test_conv_config_tuning_reaches_the_fused_op():
    """The tuning's conv_config (here the fast sigmoid and fma forms, with kept activations) runs the
    op's conv kernels: values and every cotangent still match the reference."""
    from pallas_kernels.causal_conv import ConvBlockConfig
    args, state, reset = make_inputs(2, 37, 32, 5, 4, 4, jnp.float32, reset="positions")
    fast = ConvBlockConfig(fast_math=True, fused_multiply_add=True)
    with ops.tuning("selective_scan", conv_config=fast, mixer_residuals="activations"):
        got_v, got, got_s = _loss_and_grads("pallas", args, state, reset)
    want_v, want, want_s = _loss_and_grads("reference", args, state, reset)
    assert_close("loss", got_v, want_v, 3e-5)
    for name in want:
        assert_close(f"d{name}", got[name], want[name], 3e-5)
    assert_close("d initial_state.conv", got_s.conv, want_s.conv, 3e-5)
    assert_close("d initial_state.ssm", got_s.ssm, want_s.ssm, 3e-5)


def test_reruns_are_bit_identical():
    args, state, reset = make_inputs(1, 19, 8, 4, 3, 4, jnp.bfloat16, reset="positions")
    first = _loss_and_grads("pallas", args, state, reset)
    second = _loss_and_grads("pallas", args, state, reset)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ----------------------------------------------------------------------------- the model and dispatch
def _tiny_mixer():
    import jmamba
    from helpers import perturbed
    from jmamba.mamba1.mixer import Mamba1Mixer
    cfg = jmamba.Mamba1Config(d_model=16, n_layers=1, d_state=4, expand=2, d_conv=4)
    return perturbed(Mamba1Mixer(cfg, rngs=nnx.Rngs(0)), seed=3)


def test_mixer_decode_agrees_with_full_forward_through_the_fused_op():
    mixer = _tiny_mixer()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 13, 16)), jnp.float32)
    with dispatch.prefer("mamba1_mixer_core", "pallas"):
        full, st_full = mixer(x)
    st = mixer.init_state(2)
    outs = []
    for t in range(x.shape[1]):
        o, st = mixer.step(x[:, t], st)
        outs.append(o)
    assert_close("decode vs full forward", jnp.stack(outs, 1), full, 2e-5)
    assert_close("conv state", st.conv, st_full.conv, 1e-6)
    assert_close("ssm state", st.ssm, st_full.ssm, 2e-5)


def test_a_preference_for_selective_scan_steers_the_core_op(monkeypatch):
    chosen = []
    real = dispatch.choose

    def spy(op, implementation, *a, **k):
        chosen.append((op, implementation))
        return real(op, implementation, *a, **k)

    monkeypatch.setattr(dispatch, "choose", spy)
    args, state, reset = make_inputs(1, 8, 8, 2, 1, 4, jnp.float32)
    with dispatch.prefer("selective_scan", "reference"):
        run(None, args, state, reset)
    with dispatch.prefer("selective_scan", "reference"), dispatch.prefer("mamba1_mixer_core", "xla"):
        run(None, args, state, reset)
    assert chosen == [("mamba1_mixer_core", "reference"), ("mamba1_mixer_core", "xla")]


@pytest.mark.parametrize("change,match,exc", [
    (dict(x=jnp.zeros((2, 8), jnp.float32)), "x must", ValueError),
    (dict(x=jnp.zeros((2, 8, 16), jnp.int32)), "x must be a floating", TypeError),
    (dict(z=jnp.zeros((2, 9, 16))), "z must", ValueError),
    (dict(conv_kernel=jnp.zeros((4, 15))), "conv_kernel must", ValueError),
    (dict(conv_kernel=jnp.zeros((0, 16))), "conv_kernel must have at least one tap", ValueError),
    (dict(conv_bias=jnp.zeros((3,))), "conv_bias must", ValueError),
    (dict(x_proj_kernel=jnp.zeros((16, 7))), r"x_proj_kernel must .*\[16, 11\]", ValueError),
    (dict(dt_proj_kernel=jnp.zeros((3, 15))), "dt_proj_kernel must", ValueError),
    (dict(dt_bias=jnp.zeros((15,))), "dt_bias must", ValueError),
    (dict(A=jnp.zeros((15, 4))), "A must", ValueError),
    (dict(D=jnp.zeros((2,))), "D must", ValueError),
    (dict(initial_state=(jnp.zeros((2, 3, 16)), jnp.zeros((2, 16, 4)))), "initial_state must be a", TypeError),
    (dict(initial_state=Mamba1CoreState(jnp.zeros((2, 2, 16)), jnp.zeros((2, 16, 4)))), "initial_state.conv", ValueError),
    (dict(initial_state=Mamba1CoreState(jnp.zeros((2, 3, 16)), jnp.zeros((2, 16, 5)))), "initial_state.ssm", ValueError),
    (dict(reset=jnp.zeros((2, 8), jnp.float32)), "reset", TypeError),
    (dict(reset=jnp.zeros((3,), bool)), "reset", ValueError),
    (dict(implementation="fast"), "implementation must be", ValueError),
    (dict(xz_packed=1), "xz_packed must be a bool", TypeError),
    (dict(xz_packed=True, x=jnp.zeros((2, 8, 32))), "z must be None with xz_packed", ValueError),
    (dict(xz_packed=True, x=jnp.zeros((2, 8, 33)), z=None), "even number of channels", ValueError),
    (dict(xz_packed=True, x=jnp.zeros((2, 8, 30)), z=None), "conv_kernel must", ValueError),
])
def test_bad_input_raises_naming_the_argument(change, match, exc):
    args, _, _ = make_inputs(2, 8, 16, 4, 3, 4, jnp.float32, with_state=False)
    kw = {k: change.pop(k) for k in ("initial_state", "reset", "implementation", "xz_packed") if k in change}
    args.update(change)
    with pytest.raises(exc, match=match):
        mamba1_mixer_core(*(args[k] for k in ARG_NAMES), **kw)


# ------------------------------------------------------------------------ abstract H200 lowering (CPU)
@pytest.mark.parametrize("packed", [False, True], ids=["x-z", "xz-packed"])
def test_fused_op_lowers_to_triton_for_h200(packed):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    args, state, reset = make_inputs(2, 70, 48, 16, 3, 4, jnp.bfloat16, reset="positions")
    if packed:
        args = dict(args, x=jnp.concatenate([args["x"], args["z"]], axis=-1), z=None)
    present = tuple(k for k in ARG_NAMES if args[k] is not None)

    def loss(vals, st):
        y, s2 = mamba1_mixer_core(*(dict(args, **dict(zip(present, vals)))[k] for k in ARG_NAMES),
                                  initial_state=st, return_final_state=True, reset=reset, implementation="pallas",
                                  xz_packed=packed)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(s2.ssm) + jnp.sum(s2.conv)

    from jmamba.ops.mamba1_mixer import pallas as glue
    monkey = pytest.MonkeyPatch()
    monkey.setattr(glue, "interpret_mode", lambda: False)
    try:
        device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
        specs = (tuple(jax.ShapeDtypeStruct(args[k].shape, args[k].dtype) for k in present),
                 jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)
            text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*specs).lower(
                lowering_platforms=("cuda",)).as_text()
    finally:
        monkey.undo()
    # the scan's forward (summaries, combine, outputs) and backward (adjoints, combine, gradients), the
    # conv's forward (one jitted function: the backward's recomputation calls the same) and backward
    assert text.count("__gpu$xla.gpu.triton") == 8
    assert "causal_conv_silu_forward" in text and "causal_conv_silu_backward" in text


# --------------------------------------------------------------------------------------------- H200
@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,options,floor", [
    ((2, 2048, 1536, 16, 48, 4), jnp.bfloat16, dict(reset="positions"), 1e-2),
    ((2, 1000, 96, 16, 6, 4), jnp.float32, dict(reset="rows"), 3e-4),
    ((2, 777, 64, 5, 4, 3), jnp.float16, dict(with_state=False, with_conv_bias=False), 5e-3),
], ids=["perf-width-bf16", "f32-rows", "f16-odd"])
def test_gpu_values_and_every_cotangent_are_as_close_to_float32_as_the_reference(shape, dtype, options, floor):
    """At long lengths a low-precision run's cotangents drift from the float32 truth by up to ~1e-1
    (bf16, T=2048: the reference itself); so each Pallas cotangent must be within 1.5× the
    reference's own error in the same dtype, plus `floor` (float32: the truth is the reference
    itself, so the bound is `floor`). The references run on the CPU: XLA:GPU keeps excess precision
    inside fusions (it skips the rounding of u and delta to the compute dtype that the kernels'
    operands must have), so a GPU reference would not round as the op's definition does; the Pallas
    run uses "highest" matmul precision (XLA:GPU runs float32 dots as TF32 by default)."""
    from helpers import rel_err
    args, state, reset = make_inputs(*shape, dtype, **options)
    if state is None:
        bsz, _, e, n, _, k = shape
        state = Mamba1CoreState(conv=jnp.zeros((bsz, k - 1, e)), ssm=jnp.zeros((bsz, e, n)))
    truth_args = dict(args, x=args["x"].astype(jnp.float32),
                      z=None if args["z"] is None else args["z"].astype(jnp.float32))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        on_cpu = jax.device_put((truth_args, args, state, reset), cpu)
        _, truth, truth_s = _loss_and_grads("reference", on_cpu[0], on_cpu[2], on_cpu[3])
        _, same, same_s = _loss_and_grads("reference", *on_cpu[1:])
    with jax.default_matmul_precision("highest"):   # float32 dots on the GPU default to TF32
        _, got, got_s = _loss_and_grads("pallas", args, state, reset)
    pairs = [(f"d{k}", got[k], same[k], truth[k]) for k in truth]
    pairs += [("d initial_state.conv", got_s.conv, same_s.conv, truth_s.conv),
              ("d initial_state.ssm", got_s.ssm, same_s.ssm, truth_s.ssm)]
    for name, g, s, t in pairs:
        bound = 1.5 * rel_err(s, t) + floor
        assert rel_err(g, t) <= bound, f"{name}: {rel_err(g, t):.3e} from float32 > {bound:.3e}"


@pytest.mark.gpu
def test_gpu_packed_xz_matches_its_two_halves_at_the_benchmark_width():
    """The mixer's call (packed xz: the conv and the scan read the halves in place, dxz written packed)
    against the two-array call, on the H200: outputs, states and every cotangent."""
    from helpers import rel_err
    args, state, reset = make_inputs(2, 2048, 1536, 16, 48, 4, jnp.bfloat16, reset="positions")
    e = 1536
    loss, xz, vals = _xz_loss(args, e, reset, "pallas")
    run_ = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    for a, b in zip(jax.tree.leaves(run_(xz, vals, state, True)), jax.tree.leaves(run_(xz, vals, state, False))):
        assert rel_err(a, b) <= 1e-6, rel_err(a, b)


@pytest.mark.gpu
def test_gpu_reruns_are_bit_identical_at_the_benchmark_shape():
    args, state, reset = make_inputs(8, 2048, 1536, 16, 48, 4, jnp.bfloat16)
    first = _loss_and_grads("pallas", args, state, reset)
    second = _loss_and_grads("pallas", args, state, reset)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
def test_gpu_automatic_choice_is_pallas(monkeypatch):
    chosen = []
    real = dispatch.choose
    monkeypatch.setattr(dispatch, "choose", lambda op, impl, *a, **k: chosen.append(real(op, impl, *a, **k)) or chosen[-1])
    args, state, reset = make_inputs(1, 64, 32, 4, 2, 4, jnp.bfloat16)
    run(None, args, state, reset)
    from jmamba.ops.mamba1_mixer.pallas import mamba1_mixer_core_pallas
    assert chosen[-1].fn is mamba1_mixer_core_pallas
