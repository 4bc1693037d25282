"""Independent float64 numpy implementation of Mamba-1, written from docs/mamba1.md (no JAX).

* `scan_forward` / `scan_backward`: the selective scan of §3.4 and its hand-written adjoint of §5.2
  (with groups, D, z, delta_bias, softplus threshold 20, initial state, final-state cotangent, and
  the jmamba reset mask, under which h_{t-1} is replaced by 0 at a reset position).
* `backbone_forward`: the backbone of §3.2/§3.3 with torch conventions (cross-correlation conv with
  K-1 left context, x_proj split order dt, B, C), from a jmamba parameter dict.
"""

from __future__ import annotations

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def dsilu(x):
    s = sigmoid(x)
    return s * (1 + x * (1 - s))


def softplus_thr(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def _groups(x, d):
    """[Bt, T, g, n] -> [Bt, T, d, n]."""
    return np.repeat(x, d // x.shape[2], axis=2)


def scan_forward(u, delta, A, B, C, D=None, z=None, delta_bias=None, softplus=False, h0=None, reset=None):
    """Returns (out [Bt,T,d], h_last [Bt,d,n], cache). B, C: [Bt, T, g, n]. All float64."""
    u, delta, A, B, C = (np.asarray(a, np.float64) for a in (u, delta, A, B, C))
    bsz, T, d = u.shape
    n = A.shape[1]
    raw = delta + (0 if delta_bias is None else np.asarray(delta_bias, np.float64))
    dl = softplus_thr(raw) if softplus else raw
    Be, Ce = _groups(B, d), _groups(C, d)
    keep = np.ones((bsz, T)) if reset is None else 1.0 - np.asarray(reset, np.float64)
    abar = np.exp(dl[..., None] * A) * keep[:, :, None, None]          # effective decay, 0 at a reset
    h = np.zeros((bsz, d, n)) if h0 is None else np.asarray(h0, np.float64).copy()
    hprev, hs = [], []
    for t in range(T):
        hprev.append(h)
        h = abar[:, t] * h + (dl[:, t] * u[:, t])[..., None] * Be[:, t]
        hs.append(h)
    hs, hprev = np.stack(hs, 1), np.stack(hprev, 1)
    y = (hs * Ce).sum(-1)
    if D is not None:
        y = y + np.asarray(D, np.float64) * u
    out = y if z is None else y * silu(np.asarray(z, np.float64))
    cache = dict(u=u, dl=dl, raw=raw, A=A, Be=Be, Ce=Ce, abar=abar, hs=hs, hprev=hprev, y=y,
                 D=D, z=z, softplus=softplus, g=B.shape[2], has_bias=delta_bias is not None)
    return out, h, cache


def scan_backward(cache, gout, glast=None):
    """Adjoints of `scan_forward` (spec §5.2). Returns a dict of gradients (float64)."""
    c = cache
    u, dl, A, Be, Ce, abar, hs, hprev, y = (c[k] for k in ("u", "dl", "A", "Be", "Ce", "abar", "hs", "hprev", "y"))
    bsz, T, d = u.shape
    g = {}
    gout = np.asarray(gout, np.float64)
    if c["z"] is not None:
        z = np.asarray(c["z"], np.float64)
        gy = gout * silu(z)
        g["z"] = gout * y * dsilu(z)
    else:
        gy = gout
    dh = np.zeros_like(hs)
    cur = np.zeros_like(hs[:, 0]) if glast is None else np.asarray(glast, np.float64).copy()
    for t in range(T - 1, -1, -1):
        cur = gy[:, t, :, None] * Ce[:, t] + cur
        dh[:, t] = cur
        cur = abar[:, t] * cur
    g["h0"] = cur
    gsize = d // c["g"]
    dC_e = (gy[..., None] * hs)
    dB_e = dh * (dl * u)[..., None]
    g["C"] = dC_e.reshape(bsz, T, c["g"], gsize, -1).sum(3)
    g["B"] = dB_e.reshape(bsz, T, c["g"], gsize, -1).sum(3)
    du = dl * (dh * Be).sum(-1)
    if c["D"] is not None:
        du = du + np.asarray(c["D"], np.float64) * gy
        g["D"] = (gy * u).sum((0, 1))
    g["u"] = du
    ddl = (dh * (Be * u[..., None] + A * abar * hprev)).sum(-1)
    g["A"] = (dh * dl[..., None] * abar * hprev).sum((0, 1))
    draw = ddl * np.where(c["raw"] <= 20, sigmoid(c["raw"]), 1.0) if c["softplus"] else ddl
    g["delta"] = draw
    if c["has_bias"]:
        g["delta_bias"] = draw.sum((0, 1))
    return g


# ------------------------------------------------------------------------------------------ backbone
def rmsnorm(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def mixer_forward(p, x, cfg, conv_state=None, ssm_state=None):
    """One Mamba-1 mixer (spec §3.3) on [Bt, T, D]; p holds jmamba-layout params as numpy float64."""
    E, N, K, R = cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.resolved_dt_rank
    bsz, T, _ = x.shape
    xz = x @ p["in_proj"]["kernel"]
    xs, z = xz[..., :E], xz[..., E:]
    Sc = np.zeros((bsz, K - 1, E)) if conv_state is None else conv_state
    xt = np.concatenate([Sc, xs], 1)
    w = p["conv1d"]["kernel"]                      # [K, E]: w[k] = torch weight[:, 0, k]
    cb = p["conv1d"]["bias"] if "bias" in p["conv1d"] else 0.0
    conv = cb + sum(w[k] * xt[:, k:k + T] for k in range(K))
    u = silu(conv)
    x_dbl = u @ p["x_proj"]["kernel"]
    dt_in, Bt, Ct = x_dbl[..., :R], x_dbl[..., R:R + N], x_dbl[..., R + N:]
    delta = dt_in @ p["dt_proj"]["kernel"]
    A = -np.exp(p["A_log"])
    y, h, _ = scan_forward(u, delta, A, Bt[:, :, None], Ct[:, :, None], p["D"], z, p["dt_proj"]["bias"],
                           True, ssm_state)
    return y @ p["out_proj"]["kernel"], xt[:, T:], h


def backbone_forward(params, x, cfg, state=None):
    """Full backbone (spec §3.2): returns (y [Bt,T,D], [(conv, ssm) per layer])."""
    params = _to_np(params)
    h = np.asarray(x, np.float64)
    if cfg.input_dim is not None:
        h = h @ params["input_proj"]["kernel"] + params["input_proj"]["bias"]
    new_state = []
    for i in range(cfg.n_layers):
        lp = params["layers"][i]
        cs, ss = (None, None) if state is None else state[i]
        out, cs, ss = mixer_forward(lp["mixer"], rmsnorm(h, lp["norm"]["weight"], cfg.norm_eps), cfg, cs, ss)
        h = h + out
        new_state.append((cs, ss))
    return rmsnorm(h, params["norm_f"]["weight"], cfg.norm_eps), new_state


def _to_np(tree):
    if isinstance(tree, dict):
        return {k: _to_np(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)
