"""pack_documents: the layout, and exactness: a packed window with resets (state carried from window to
window) gives the outputs and losses of running every document alone from a zero state."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmamba import Mamba1Config, Mamba3Config, MambaLM, TrainState, make_train_step, ops
from jmamba.data.packing import pack_documents
from jmamba.training.losses import next_token_loss, per_token_loss

V = 13
# one document spans three windows (T = 8), several span two, two are too short to predict anything
LENGTHS = [5, 19, 3, 10, 2, 7, 1, 12, 4, 9]


def docs_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).astype(np.int32) for n in lengths]


def streams(batches):
    """The batches' rows concatenated: {key: [B, n_windows * T]}."""
    return {k: np.concatenate([b[k] for b in batches], axis=1) for k in batches[0]}


def segments(s):
    """(row, start, length) of every document in the packed streams."""
    out = []
    for b in range(s["reset"].shape[0]):
        starts = list(np.flatnonzero(s["reset"][b])) + [int(s["loss_mask"][b].sum())]
        out += [(b, int(a), int(z - a)) for a, z in zip(starts[:-1], starts[1:])]
    return out


def test_layout_resets_masks_and_continuation():
    docs = docs_of(LENGTHS)
    batches = pack_documents(docs, window=8, batch_size=2)
    assert all(set(b) == {"inputs", "targets", "reset", "loss_mask"} for b in batches)
    assert all(b["inputs"].shape == (2, 8) and b["inputs"].dtype == np.int32 and b["reset"].dtype == bool
               and b["loss_mask"].dtype == bool for b in batches)
    s = streams(batches)
    segs = segments(s)
    found = sorted(tuple(s["inputs"][b, a:a + n]) + (-1,) + tuple(s["targets"][b, a:a + n]) for b, a, n in segs)
    want = sorted(tuple(d[:-1]) + (-1,) + tuple(d[1:]) for d in docs if len(d) >= 2)
    assert found == want   # every document of >= 2 tokens once, whole, in one row; nothing predicts across
    # the rows are a prefix of real positions then padding; the padding is masked and never reset
    for b in range(2):
        m = s["loss_mask"][b]
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any() and not s["reset"][b, n:].any()
        assert (s["inputs"][b, n:] == 0).all() and (s["targets"][b, n:] == 0).all()
    assert s["reset"][:, 0].all()
    # the two streams end within one document of each other
    ends = s["loss_mask"].sum(1)
    assert abs(int(ends[0]) - int(ends[1])) <= max(LENGTHS) - 1
    assert len(batches) == int(np.ceil(ends.max() / 8))
    # some document continues from one window into the next (no reset at the window's first position)
    assert any(b["loss_mask"][r, 0] and not b["reset"][r, 0] for b in batches[1:] for r in range(2))


def test_eos_is_appended_and_short_documents_are_left_out():
    docs = [np.array([3, 4, 5]), np.array([7]), np.array([], np.int32)]
    (b,) = pack_documents(docs, window=6, batch_size=1, eos_id=12, pad_id=11)
    # [3 4 5 EOS] -> 3 positions; [7 EOS] -> 1 position; [EOS] alone has nothing to predict
    np.testing.assert_array_equal(b["inputs"][0], [3, 4, 5, 7, 11, 11])
    np.testing.assert_array_equal(b["targets"][0], [4, 5, 12, 12, 11, 11])
    np.testing.assert_array_equal(b["reset"][0], [1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(b["loss_mask"][0], [1, 1, 1, 1, 0, 0])


@pytest.mark.parametrize("docs, kw, match", [
    ([np.array([1, 2])], {"window": 0, "batch_size": 1}, "window"),
    ([np.array([1, 2])], {"window": 4, "batch_size": 0}, "batch_size"),
    ([np.array([[1, 2]])], {"window": 4, "batch_size": 1}, r"docs\[0\]"),
    ([np.array([1.0, 2.0])], {"window": 4, "batch_size": 1}, r"docs\[0\]"),
    ([np.array([1, -2])], {"window": 4, "batch_size": 1}, "negative"),
    ([np.array([1])], {"window": 4, "batch_size": 1}, "2 or more tokens"),
    (np.array([1, 2, 3]), {"window": 4, "batch_size": 1}, "wrap a single document"),
    ([np.array([1, 2])], {"window": 4, "batch_size": 1, "eos_id": -1}, "eos_id"),
])
def test_bad_arguments_are_refused(docs, kw, match):
    with pytest.raises(ValueError, match=match):
        pack_documents(docs, **kw)


ARCHS = {
    # chunk sizes below the window put resets and document ends inside and across scan chunks
    "mamba1": (Mamba1Config(d_model=16, n_layers=2, d_state=4, d_conv=4), ("selective_scan", "xla_chunk_size")),
    "mamba3": (Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8), ("mamba3_siso_scan", "chunk_size")),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_windows_equal_separate_documents(arch):
    cfg, (op, field) = ARCHS[arch]
    lm = MambaLM(cfg, V, rngs=nnx.Rngs(1))
    docs = docs_of(LENGTHS, seed=2)
    T, B = 8, 2
    batches = pack_documents(docs, window=T, batch_size=B, eos_id=V - 1)
    run = nnx.jit(lambda model, x, st, r: model(x, st, reset=r))
    with ops.tuning(op, **{field: 4}):
        # packed: window after window, the recurrent state carried
        state, logits = lm.init_state(B), []
        for b in batches:
            out, state = run(lm, jnp.asarray(b["inputs"]), state, jnp.asarray(b["reset"]))
            logits.append(np.asarray(out))
        logits = np.concatenate(logits, axis=1)                     # [B, L, V]
        s = streams(batches)
        # separate: each document alone from a zero state, one per row (right padding cannot reach
        # the earlier, causal positions)
        segs = segments(s)
        n_max = max(n for _, _, n in segs)
        alone_in = np.zeros((len(segs), n_max), np.int32)
        for i, (r, a, n) in enumerate(segs):
            alone_in[i, :n] = s["inputs"][r, a:a + n]
        alone, _ = run(lm, jnp.asarray(alone_in), lm.init_state(len(segs)), None)
        want = np.zeros_like(logits)
        for i, (r, a, n) in enumerate(segs):
            want[r, a:a + n] = np.asarray(alone[i, :n])
    m = s["loss_mask"]
    assert n_max > 2 * T
    np.testing.assert_allclose(logits[m], want[m], rtol=1e-5, atol=1e-5)

    # per-token losses, and their mean over the packed batches = the mean over the separate runs
    ce_packed = np.asarray(per_token_loss(jnp.asarray(logits), jnp.asarray(s["targets"])))
    ce_alone = np.asarray(per_token_loss(jnp.asarray(want), jnp.asarray(s["targets"])))
    np.testing.assert_allclose(ce_packed[m], ce_alone[m], rtol=1e-5, atol=1e-6)
    sep = np.mean(np.concatenate([ce_alone[r, a:a + n] for r, a, n in segs]))
    total = sum(float(next_token_loss(jnp.asarray(logits[:, k * T:(k + 1) * T]), b)) * b["loss_mask"].sum()
                for k, b in enumerate(batches)) / m.sum()
    np.testing.assert_allclose(total, sep, rtol=1e-6)

    # the train step on the packed batches (lr 0: the parameters stay) reports the same window losses
    opt = optax.adamw(0.0)
    ts = TrainState.create(lm, opt, B)
    step = make_train_step(lm, opt, loss_fn=next_token_loss)
    with ops.tuning(op, **{field: 4}):
        for k, b in enumerate(batches):
            ts, metrics = step(ts, b)
            w = slice(k * T, (k + 1) * T)
            expect = (ce_alone[:, w] * m[:, w]).sum() / max(m[:, w].sum(), 1)
            np.testing.assert_allclose(float(metrics["loss"]), expect, rtol=1e-5, atol=1e-6)


def test_masked_loss_ignores_padding_and_survives_an_all_padding_window():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)), jnp.float32)
    targets = np.array([[1, 2, 3], [4, 0, 0]], np.int32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    ce = np.asarray(per_token_loss(logits, targets))
    got = float(next_token_loss(logits, {"targets": targets, "loss_mask": mask}))
    np.testing.assert_allclose(got, ce[mask].mean(), rtol=1e-6)
    assert float(next_token_loss(logits, {"targets": targets, "loss_mask": np.zeros((2, 3), bool)})) == 0.0
    np.testing.assert_allclose(float(next_token_loss(logits, {"targets": targets})), ce.mean(), rtol=1e-6)

