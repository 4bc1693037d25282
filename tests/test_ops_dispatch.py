"""jmamba.ops.dispatch: the rules of choosing an implementation (docs/api.md), on a fake op registered
for the test only, and the real ops' registrations (the decode steps have no Pallas kernel)."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

from jmamba.ops import dispatch

OP = "fake_op_for_dispatch_tests"


def _impl(name, reason=None):
    """An implementation returning its name; `reason(**call)` says why it cannot run (None: it can)."""
    return lambda: dispatch.Implementation(lambda: name, reason or (lambda **_: None))


def _refuses_f16(*, platform, x, **_):
    return "float16 is not supported here" if x.dtype == jnp.float16 else None


def _gpu_even_only(*, platform, x, **_):
    if platform not in ("gpu", "cuda"):
        return f"platform {platform!r} is not a GPU"
    return None if x.shape[0] % 2 == 0 else f"odd length {x.shape[0]}"


def _broken():
    raise ImportError("the kernel's backend is not installed")


@pytest.fixture
def fake_op(monkeypatch):
    """OP with "reference" (always), "xla" (not for float16) and "pallas" (GPU, even lengths), removed
    after the test; the warn-once memory starts empty."""
    monkeypatch.setattr(dispatch, "_WARNED", set())
    monkeypatch.setitem(dispatch._REGISTRY, OP, {})
    dispatch.register(OP, "reference", _impl("reference"))
    dispatch.register(OP, "xla", _impl("xla", _refuses_f16))
    dispatch.register(OP, "pallas", _impl("pallas", _gpu_even_only))
    return OP


def choose(implementation=None, platform="gpu", n=4, dtype=jnp.float32):
    return dispatch.choose(OP, implementation, platform=platform, x=jnp.ones((n,), dtype)).fn()


def test_explicit_choice_runs_it_or_raises_with_the_reason(fake_op):
    assert choose("reference") == "reference" and choose("xla") == "xla" and choose("pallas") == "pallas"
    with pytest.raises(NotImplementedError, match=f"{OP}: implementation='pallas' cannot run: odd length 3"):
        choose("pallas", n=3)
    with pytest.raises(NotImplementedError, match="platform 'cpu' is not a GPU"):
        choose("pallas", platform="cpu")
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        choose("triton")


def test_explicit_choice_of_a_missing_or_unimportable_implementation_raises(fake_op, monkeypatch):
    del dispatch._REGISTRY[OP]["pallas"]
    with pytest.raises(NotImplementedError, match=f"no 'pallas' implementation of {OP} is registered"):
        choose("pallas")
    dispatch.register(OP, "pallas", _broken)
    with pytest.raises(NotImplementedError, match="could not be imported: the kernel's backend is not installed"):
        choose("pallas")


def test_automatic_choice_walks_the_platform_order_and_warns_once_per_reason(fake_op):
    assert choose(platform="gpu") == "pallas"
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # the CPU order has no pallas: nothing skipped, nothing said
        assert choose(platform="cpu") == "xla"
        assert choose(platform="tpu") == "xla"
    with pytest.warns(UserWarning, match=f"{OP}: using 'xla' instead of 'pallas': odd length 3"):
        assert choose(platform="gpu", n=3) == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # the same reason again: silent
        assert choose(platform="gpu", n=3) == "xla"
    with pytest.warns(UserWarning, match="odd length 5"):   # another reason: said once more
        choose(platform="gpu", n=5)
    # the automatic choice never falls back to "reference": nothing left to run is an error
    with pytest.raises(NotImplementedError, match="no implementation can run this call.*float16"):
        choose(platform="cpu", dtype=jnp.float16)


def test_automatic_choice_skips_names_the_op_does_not_have_and_broken_loaders(fake_op):
    del dispatch._REGISTRY[OP]["pallas"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # no pallas at all: nothing better was skipped
        assert choose(platform="gpu", n=3) == "xla"
    dispatch.register(OP, "pallas", _broken)
    with pytest.warns(UserWarning, match="instead of 'pallas'.*could not be imported"):
        assert choose(platform="gpu") == "xla"
    assert dispatch.registered(OP) == ("reference", "xla", "pallas")


def test_prefer_applies_to_automatic_calls_only_and_nests(fake_op):
    with dispatch.prefer(OP, "reference"):
        assert choose() == "reference"
        assert choose("xla") == "xla"              # an explicit choice still wins
        with dispatch.prefer(OP, "xla"):
            assert choose() == "xla"
        assert choose() == "reference"
        with dispatch.prefer(OP, "pallas"), pytest.raises(NotImplementedError, match="odd length"):
            choose(n=3)                            # a preferred implementation that cannot run raises
    assert choose() == "pallas"
    with pytest.raises(ValueError, match="implementation must be one of"):
        with dispatch.prefer(OP, "fast"):
            pass


def test_register_refuses_an_unknown_implementation_name(fake_op):
    with pytest.raises(ValueError, match="implementation name must be one of"):
        dispatch.register(OP, "cuda", _impl("cuda"))


@pytest.mark.parametrize("op,call", [
    ("selective_scan_step", dict(u=jnp.ones((2, 4)), A=jnp.ones((4, 3)))),
    ("mamba3_siso_step", dict(Q=jnp.ones((2, 1, 8)), V=jnp.ones((2, 2, 4)))),
])
def test_decode_steps_have_no_pallas_and_choose_xla_silently_on_gpu(op, call):
    assert dispatch.registered(op) == ("reference", "xla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        impl = dispatch.choose(op, None, platform="gpu", **call)
    assert impl is not None
    with pytest.raises(NotImplementedError, match=f"no 'pallas' implementation of {op}"):
        dispatch.choose(op, "pallas", platform="gpu", **call)


def test_every_op_registers_reference_and_xla():
    for op in ("selective_scan", "mamba3_siso_scan", "adamw_update"):
        assert dispatch.registered(op) == ("reference", "xla", "pallas"), op
