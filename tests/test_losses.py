"""`jmamba.training.losses`: the cross entropy and its hand-written backward against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.training.losses import next_token_loss, per_token_loss


def numpy_cross_entropy(logits, targets):
    """(ce [..], d ce.sum() / d logits [.., V]) in float64: log-sum-exp minus the target's logit."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]
    ce = lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]
    grad = np.exp(x - lse[..., None])
    np.put_along_axis(grad, targets[..., None], np.take_along_axis(grad, targets[..., None], -1) - 1.0, -1)
    return ce, grad


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
@pytest.mark.parametrize("shape", [(2, 5, 7), (1, 3, 300), (4, 1, 17)])
def test_values_and_logit_gradient_match_float64(dtype, tol, shape):
    rng = np.random.default_rng(sum(shape))
    logits = jnp.asarray(rng.normal(size=shape) * 4.0, dtype)
    targets = rng.integers(0, shape[-1], shape[:-1])
    weights = rng.uniform(0.5, 2.0, shape[:-1])
    want_ce, want_grad = numpy_cross_entropy(logits.astype(jnp.float32), targets)

    def total(x):
        return jnp.sum(per_token_loss(x, jnp.asarray(targets)) * jnp.asarray(weights, jnp.float32))

    ce = jax.jit(per_token_loss)(logits, jnp.asarray(targets))
    grad = jax.jit(jax.grad(total))(logits)
    assert ce.dtype == jnp.float32 and ce.shape == shape[:-1]
    assert grad.dtype == dtype and grad.shape == shape
    np.testing.assert_allclose(np.asarray(ce), want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad * weights[..., None], rtol=tol, atol=tol)


def test_large_logits_stay_finite():
    logits = jnp.asarray([[[1e4, -1e4, 0.0], [88.0, 90.0, -3.0]]], jnp.float32)
    targets = jnp.asarray([[1, 0]])
    ce = per_token_loss(logits, targets)
    grad = jax.grad(lambda x: per_token_loss(x, targets).sum())(logits)
    np.testing.assert_allclose(np.asarray(ce), numpy_cross_entropy(logits, np.asarray(targets))[0], rtol=1e-5)
    assert np.isfinite(np.asarray(grad)).all()


def test_values_and_gradient_with_the_log_sum_exp_kernel():
    """The cross entropy with `log_sum_exp`'s Pallas kernel (interpreted) as its normalizer."""
    from jmamba.ops import dispatch

    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(2, 3, 300)) * 4.0, jnp.bfloat16)
    targets = rng.integers(0, 300, (2, 3))
    want_ce, want_grad = numpy_cross_entropy(logits.astype(jnp.float32), targets)
    with dispatch.prefer("log_sum_exp", "pallas"):
        grad = jax.grad(lambda x: per_token_loss(x, jnp.asarray(targets)).sum())(logits)
        ce = per_token_loss(logits, jnp.asarray(targets))
    np.testing.assert_allclose(np.asarray(ce), want_ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=1e-2, atol=1e-2)


def test_out_of_range_targets_give_nan_loss():
    logits = jnp.zeros((1, 2, 4), jnp.float32)
    ce = per_token_loss(logits, jnp.asarray([[4, -1]]))
    assert np.isnan(np.asarray(ce)).all()


def test_masked_mean_and_its_gradient_match_float64():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, 6, 11)), jnp.float32)
    targets = rng.integers(0, 11, (2, 6))
    mask = rng.uniform(size=(2, 6)) > 0.4
    batch = {"targets": jnp.asarray(targets), "loss_mask": jnp.asarray(mask)}
    want_ce, want_grad = numpy_cross_entropy(logits, targets)
    loss, grad = jax.value_and_grad(next_token_loss)(logits, batch)
    np.testing.assert_allclose(float(loss), (want_ce * mask).sum() / mask.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad * mask[..., None] / mask.sum(), rtol=1e-5, atol=1e-7)


def test_bad_arguments_are_named():
    logits = jnp.zeros((2, 3, 5), jnp.float32)
    with pytest.raises(ValueError, match="targets must have shape"):
        per_token_loss(logits, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="targets must be an integer"):
        per_token_loss(logits, jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(TypeError, match="logits must be a float"):
        per_token_loss(jnp.zeros((2, 3, 5), jnp.int32), jnp.zeros((2, 3), jnp.int32))
