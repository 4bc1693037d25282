"""Shared builders for the tests (one copy instead of one per test module).

* random op inputs: `mamba1_scan_inputs` / `mamba3_scan_inputs` (the scans, their Pallas kernels and
  the decode steps all draw their arguments here) and `at_time` (one token of a window, for the steps);
* tiny models and batches: `TINY_MAMBA1` / `TINY_MAMBA3`, `tiny_backbone`, `d_out_batch`,
  `delayed_copy_batch`, `gradient_capture`, `gradient_recorder`;
* `abstract_params`: a module's parameters as shapes only (no init compute).

Random values are numpy draws: eager `jax.random` calls compile one program per shape, which is slow
on CPU. Activations are in the requested dtype; parameters and recurrent states stay float32, as in
the models.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmamba
from jmamba.ops import Mamba3ScanState, SelectiveScanState

f32 = jnp.float32

# ------------------------------------------------------------------------------- Mamba-1 scan / step
MAMBA1_ARRAYS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
MAMBA1_TIME_ARRAYS = ("u", "delta", "B", "C", "z")      # the ones with a time axis (sliced by at_time)
_MAMBA1_F32 = ("A", "D", "delta_bias")                  # parameters: float32 whatever the activations


def mamba1_scan_inputs(shape, dtype=f32, *, with_D=True, with_z=True, with_bias=True, with_h0=True,
                       reset_prob=0.0, forced_resets=(), grouped=True, seed=0):
    """Random `selective_scan` arguments.

    Args:
      shape: (Bt, T, d, n, g); B and C are [Bt, T, g, n] (or [Bt, T, n] when `grouped=False` and g = 1).
      dtype: of the activations u, delta, B, C, z.
      with_*: draw D, z, delta_bias, the initial state (else None).
      reset_prob: probability of a reset at each (row, position); `forced_resets` adds (row, t) pairs.
        No reset at all gives reset None.

    Returns:
      (kwargs, reset): kwargs keyed by the op's argument names (`MAMBA1_ARRAYS` and `initial_state`,
      a `SelectiveScanState` or None), reset a [Bt, T] bool array or None.
    """
    bsz, T, d, n, g = shape
    r = np.random.default_rng(seed)
    raw = dict(u=r.normal(size=(bsz, T, d)), delta=r.normal(size=(bsz, T, d)) * 0.5 - 0.5,
               A=-np.exp(r.normal(size=(d, n)) * 0.5), B=r.normal(size=(bsz, T, g, n)),
               C=r.normal(size=(bsz, T, g, n)), D=r.normal(size=(d,)) if with_D else None,
               z=r.normal(size=(bsz, T, d)) if with_z else None,
               delta_bias=r.normal(size=(d,)) * 0.3 if with_bias else None)
    h0 = r.normal(size=(bsz, d, n)) if with_h0 else None
    if not grouped:
        assert g == 1, "ungrouped B, C need g = 1"
        raw["B"], raw["C"] = raw["B"][:, :, 0], raw["C"][:, :, 0]
    kwargs = {k: None if v is None else jnp.asarray(v, f32 if k in _MAMBA1_F32 else dtype) for k, v in raw.items()}
    kwargs["initial_state"] = None if h0 is None else SelectiveScanState(jnp.asarray(h0, f32))
    mask = r.random((bsz, T)) < reset_prob
    for b, t in forced_resets:
        mask[b, t] = True
    return kwargs, (jnp.asarray(mask) if mask.any() else None)


def mamba1_numpy_window(kwargs, reset, softplus=True):
    """The float64 numpy model (tests/numpy_mamba1.py) on `mamba1_scan_inputs` kwargs (activations as
    the op sees them, i.e. after rounding to their dtype): (out, final h, cache for scan_backward)."""
    import numpy_mamba1 as npm
    a = {k: None if kwargs[k] is None else np.asarray(kwargs[k].astype(f32), np.float64) for k in MAMBA1_ARRAYS}
    B, C = a["B"], a["C"]
    if B.ndim == 3:
        B, C = B[:, :, None], C[:, :, None]
    state = kwargs.get("initial_state")
    h0 = None if state is None else np.asarray(state.ssm, np.float64)
    return npm.scan_forward(a["u"], a["delta"], a["A"], B, C, a["D"], a["z"], a["delta_bias"], softplus, h0,
                            None if reset is None else np.asarray(reset))


def mamba1_implementation_args(kwargs):
    """The positional arrays of the implementation contract (u, delta, A, B [.., g, n], C, D, z,
    delta_bias, h0 array or None) from `mamba1_scan_inputs` kwargs."""
    out = [kwargs[k] for k in MAMBA1_ARRAYS]
    for i in (3, 4):
        if out[i].ndim == 3:
            out[i] = out[i][:, :, None]
    state = kwargs.get("initial_state")
    return tuple(out) + (None if state is None else state.ssm,)


# ------------------------------------------------------------------------------- Mamba-3 scan / step
MAMBA3_ARRAYS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "z")
MAMBA3_TIME_ARRAYS = ("Q", "K", "V", "ADT", "DT", "Trap", "Angles", "z")
_MAMBA3_LOW = ("Q", "K", "V", "z", "Trap")              # activations; the rest float32 as in the mixer


def mamba3_scan_inputs(shape, dtype=f32, *, per_head_angles=True, with_z=True, with_D=True, with_states=True,
                       seed=0):
    """Random `mamba3_siso_scan` arguments like a Mamba-3 layer's.

    Args:
      shape: (Bt, T, H, G, N, P, S).
      dtype: of the activations Q, K, V, z, Trap (ADT, DT, biases, Angles, D float32).
      per_head_angles: Angles [Bt, T, H, S] (else shared by the heads, [Bt, T, S]).
      with_z, with_D, with_states: draw z, D, the four initial states (else None).

    Returns:
      (arrays, initial_state): arrays keyed by `MAMBA3_ARRAYS`; a `Mamba3ScanState` (float32) or None.
    """
    bsz, T, H, G, N, P, S = shape
    r = np.random.default_rng(seed)
    dt = np.exp(r.uniform(np.log(1e-3), np.log(0.5), (bsz, T, H)))
    raw = dict(Q=r.normal(size=(bsz, T, G, N)), K=r.normal(size=(bsz, T, G, N)), V=r.normal(size=(bsz, T, H, P)),
               ADT=-r.uniform(1, 4, (bsz, T, H)) * dt, DT=dt, Trap=r.normal(size=(bsz, T, H)),
               Q_bias=r.normal(size=(H, N)), K_bias=r.normal(size=(H, N)),
               Angles=r.normal(size=(bsz, T, H, S) if per_head_angles else (bsz, T, S)),
               D=r.normal(size=(H,)) if with_D else None, z=r.normal(size=(bsz, T, H, P)) if with_z else None)
    arrays = {k: None if v is None else jnp.asarray(v, dtype if k in _MAMBA3_LOW else f32) for k, v in raw.items()}
    state = None
    if with_states:
        state = Mamba3ScanState(jnp.asarray(r.uniform(0, 2 * np.pi, (bsz, H, S)), f32),
                                jnp.asarray(r.normal(size=(bsz, H, P, N)), f32),
                                jnp.asarray(r.normal(size=(bsz, H, N)), f32),
                                jnp.asarray(r.normal(size=(bsz, H, P)), f32))
    return arrays, state


def mamba3_numpy_window(arrays, state, reset):
    """The float64 numpy model (tests/numpy_mamba3.py) on `mamba3_scan_inputs` arrays (as the op sees
    them): (out, final (angle, ssm, k, v), cache for scan_backward). Shared angles are broadcast."""
    import numpy_mamba3 as npm
    a = {k: None if v is None else np.asarray(v.astype(f32), np.float64) for k, v in arrays.items()}
    H = a["V"].shape[2]
    ang = a["Angles"]
    if ang.ndim == a["V"].ndim - 1:
        ang = np.broadcast_to(ang[..., None, :], ang.shape[:-1] + (H, ang.shape[-1]))
    init = None if state is None else [np.asarray(s, np.float64) for s in state]
    return npm.scan_forward(a["Q"], a["K"], a["V"], a["ADT"], a["DT"], a["Trap"], a["Q_bias"], a["K_bias"], ang,
                            a["D"], a["z"], init, None if reset is None else np.asarray(reset))


def mamba3_state_shapes(shape):
    """Shapes of the four states (angle, ssm, k, v) for shape = (Bt, T, H, G, N, P, S)."""
    bsz, _, H, _, N, P, S = shape
    return (bsz, H, S), (bsz, H, P, N), (bsz, H, N), (bsz, H, P)


def at_time(arrays, t, time_names):
    """One token of a window: the arrays named in `time_names` sliced at position t (the rest as is)."""
    return {k: (v[:, t] if k in time_names and v is not None else v) for k, v in arrays.items()}


# ------------------------------------------------------------------------------- tiny models, batches
TINY_MAMBA1 = jmamba.Mamba1Config(d_model=16, n_layers=2, d_state=4, input_dim=3)
TINY_MAMBA3 = jmamba.Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8, input_dim=3)
TINY = {"mamba1": TINY_MAMBA1, "mamba3": TINY_MAMBA3}
# A chunk shorter than the tiny windows, so the Mamba-3 tests run several chunks (set it with
# `jmamba.ops.tuning("mamba3_siso_scan", chunk_size=TINY_CHUNK)` or `set_default_tuning`).
TINY_CHUNK = 4


def tiny_backbone(arch="mamba1", seed=0, cfg=None):
    """A 2-layer backbone of `TINY[arch]` (input_dim 3, d_model 16) with nnx.Rngs(seed)."""
    cfg = TINY[arch] if cfg is None else cfg
    return jmamba.get_architecture(cfg).backbone_cls(cfg, rngs=nnx.Rngs(seed))


def d_out_batch(seed, bsz=4, T=10, input_dim=3, d_model=16):
    """{"inputs": [bsz, T, input_dim], "d_out": [bsz, T, d_model]} float32 normal draws."""
    r = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(r.normal(size=(bsz, T, input_dim)), f32),
            "d_out": jnp.asarray(r.normal(size=(bsz, T, d_model)), f32)}


def delayed_copy_batch(rng, bsz=8, T=16, delay=2, features=3):
    """Target: the first input feature `delay` steps ago (needs memory; learnable by a Mamba)."""
    x = rng.normal(size=(bsz, T, features)).astype(np.float32)
    target = np.zeros((bsz, T), np.float32)
    target[:, delay:] = x[:, :-delay, 0]
    return {"inputs": jnp.asarray(x), "targets": jnp.asarray(target)}


def mse_first_feature(y, batch):
    return jnp.mean((y[..., 0] - batch["targets"]) ** 2)


def gradient_capture():
    """An "optimizer" whose state is the gradient it received (updates are zero): exposes the exact
    gradients a train step hands to its optimizer."""
    import jax
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def gradient_recorder(opt):
    """`opt` behind a stage whose state is the gradient it received (passed on unchanged), i.e.
    `optax.chain(record, opt)`: one run of a train step gives both the exact gradients the step hands
    its optimizer (`state.opt_state[0]`) and the parameters `opt` trains (one compile, not two)."""
    import jax
    record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
    return optax.chain(record, opt)


def abstract_params(make):
    """nnx.State of the params of the module `make()` builds, as shapes only (no compile, no init)."""
    return nnx.state(nnx.eval_shape(make), nnx.Param)


# ------------------------------------------------------------------------------- multi-device workers
def max_rel(a_tree, b_tree):
    """Largest max|a - b| / max|b| over the leaves of two pytrees (float64)."""
    import jax
    worst = 0.0
    for a, b in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b), initial=0), 1e-30)))
    return worst


def worker_results(worker, tmp_dir, timeout=1200):
    """Runs tests/<worker> (a script that sets its own device count) writing JSON into tmp_dir; the results."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_dir / "results.json"
    res = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), worker), str(out)],
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())
