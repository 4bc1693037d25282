"""Independent float64 numpy implementation of Mamba-3 SISO, written from docs/mamba3_siso.md (no JAX).

* `scan_forward` / `scan_backward`: the sequential recurrence of §6.1 (all heads, groups, D, Z,
  the four initial states, the jmamba reset mask) and its hand-written adjoint (backprop through
  the recurrence step by step; checked against finite differences in the tests).
* `mixer_forward`: one `Mamba3` mixer (§3.2 steps 1-13) straight from an OFFICIAL state_dict
  (official names, torch [out, in] layouts, B/C_bias (H, 1, N)).
* `backbone_forward`: the pre-norm residual backbone (§3.1) from a jmamba parameter dict.
"""

from __future__ import annotations

import numpy as np

from numpy_mamba1 import dsilu, sigmoid, silu, softplus_thr  # noqa: F401  (shared scalar helpers)

TWO_PI = 2 * np.pi


def rot(x, th):
    """Rotate adjacent pairs (2a, 2a+1) of x [..., N] by +th [..., S]; dims 2S.. unchanged."""
    y = x.copy()
    for a in range(th.shape[-1]):
        c, s = np.cos(th[..., a]), np.sin(th[..., a])
        y[..., 2 * a] = c * x[..., 2 * a] - s * x[..., 2 * a + 1]
        y[..., 2 * a + 1] = s * x[..., 2 * a] + c * x[..., 2 * a + 1]
    return y


def rot_transpose(d, th):
    """R(θ)ᵀ d = R(−θ) d."""
    return rot(d, -th)


def drot_dtheta(d, x, th):
    """Σ over the pair of d · ∂(R(θ)x)/∂θ_a, for every a: [..., S]."""
    out = np.zeros(th.shape)
    for a in range(th.shape[-1]):
        c, s = np.cos(th[..., a]), np.sin(th[..., a])
        x0, x1 = x[..., 2 * a], x[..., 2 * a + 1]
        out[..., a] = d[..., 2 * a] * (-s * x0 - c * x1) + d[..., 2 * a + 1] * (c * x0 - s * x1)
    return out


def _f64(x):
    return None if x is None else np.asarray(x, np.float64)


def scan_forward(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D=None, Z=None, init=None, reset=None):
    """Sequential Mamba-3 SISO scan.

    Q, K [Bt,T,G,N]; V [Bt,T,H,P]; ADT, DT, Trap [Bt,T,H]; Qb, Kb [H,N]; Ang [Bt,T,H,S];
    D [H]; Z [Bt,T,H,P]; init = (angle [Bt,H,S], ssm [Bt,H,P,N], k [Bt,H,N], v [Bt,H,P]);
    reset [Bt,T] bool (True: the four states entering t are zero).
    Returns (out [Bt,T,H,P], (angle, ssm, k, v), cache).
    """
    Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z = map(_f64, (Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z))
    bsz, T, H, P = V.shape
    G, N = Q.shape[2:]
    S = Ang.shape[-1]
    grp = np.arange(H) // (H // G)
    qbar, kbar = Q[:, :, grp] + Qb, K[:, :, grp] + Kb
    if init is None:
        th, h, kp, vp = np.zeros((bsz, H, S)), np.zeros((bsz, H, P, N)), np.zeros((bsz, H, N)), np.zeros((bsz, H, P))
    else:
        th, h, kp, vp = (np.array(s, np.float64) for s in init)
    keep = np.ones((bsz, T)) if reset is None else 1.0 - np.asarray(reset, np.float64)
    out = np.zeros((bsz, T, H, P))
    steps = []
    for t in range(T):
        kk = keep[:, t]
        th, h, kp, vp = kk[:, None, None] * th, kk[:, None, None, None] * h, kk[:, None, None] * kp, kk[:, None, None] * vp
        th_new = np.mod(th + np.pi * np.tanh(Ang[:, t]) * DT[:, t, :, None], TWO_PI)
        q, k = rot(qbar[:, t], th_new), rot(kbar[:, t], th_new)
        lam = sigmoid(Trap[:, t])
        al = np.exp(ADT[:, t])
        be, ga = (1 - lam) * DT[:, t] * al, lam * DT[:, t]
        v = V[:, t]
        h_new = (al[..., None, None] * h + be[..., None, None] * vp[..., :, None] * kp[..., None, :]
                 + ga[..., None, None] * v[..., :, None] * k[..., None, :])
        y = np.einsum("bhpn,bhn->bhp", h_new, q)
        if D is not None:
            y = y + D[:, None] * v
        out[:, t] = y if Z is None else y * silu(Z[:, t])
        steps.append(dict(h=h, kp=kp, vp=vp, th=th_new, q=q, k=k, lam=lam, al=al, be=be, ga=ga, h_new=h_new, y=y))
        th, h, kp, vp = th_new, h_new, k, v
    cache = dict(Q=Q, V=V, DT=DT, Ang=Ang, D=D, Z=Z, qbar=qbar, kbar=kbar, keep=keep, steps=steps, G=G)
    return out, (th, h, kp, vp), cache


def scan_backward(cache, dout, dfinal=None):
    """Adjoint of `scan_forward`. dfinal = cotangents of (angle, ssm, k, v) or None.

    Returns gradients for Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z, angle, ssm, k, v (initial states).
    """
    c = cache
    V, DT, Ang, D, Z, qbar, kbar, keep = (c[k] for k in ("V", "DT", "Ang", "D", "Z", "qbar", "kbar", "keep"))
    bsz, T, H, P = V.shape
    G = c["G"]
    N = qbar.shape[-1]
    dout = np.asarray(dout, np.float64)
    if dfinal is None:
        dth, dh, dkp, dvp = (np.zeros(s.shape) for s in (c["steps"][-1]["th"], c["steps"][-1]["h_new"],
                                                          c["steps"][-1]["k"], V[:, -1]))
    else:
        dth, dh, dkp, dvp = (np.array(s, np.float64) for s in dfinal)
    g = {k: np.zeros_like(v) for k, v in (("V", V), ("ADT", DT), ("DT", DT), ("Trap", DT), ("Ang", Ang))}
    dqbar, dkbar = np.zeros_like(qbar), np.zeros_like(kbar)
    dD = np.zeros(H)
    dZ = None if Z is None else np.zeros_like(Z)
    for t in range(T - 1, -1, -1):
        s = c["steps"][t]
        v = V[:, t]
        if Z is not None:
            dZ[:, t] = dout[:, t] * s["y"] * dsilu(Z[:, t])
            dy = dout[:, t] * silu(Z[:, t])
        else:
            dy = dout[:, t]
        dH = dh + dy[..., :, None] * s["q"][..., None, :]                 # [Bt,H,P,N]
        dq = np.einsum("bhpn,bhp->bhn", s["h_new"], dy)
        dv = dvp.copy()
        if D is not None:
            dv += D[:, None] * dy
            dD += np.einsum("bhp,bhp->h", dy, v)
        dal = np.einsum("bhpn,bhpn->bh", dH, s["h"])
        dbe = np.einsum("bhpn,bhp,bhn->bh", dH, s["vp"], s["kp"])
        dga = np.einsum("bhpn,bhp,bhn->bh", dH, v, s["k"])
        dh_prev = s["al"][..., None, None] * dH
        dvp_prev = s["be"][..., None] * np.einsum("bhpn,bhn->bhp", dH, s["kp"])
        dkp_prev = s["be"][..., None] * np.einsum("bhpn,bhp->bhn", dH, s["vp"])
        dv += s["ga"][..., None] * np.einsum("bhpn,bhn->bhp", dH, s["k"])
        dk = dkp + s["ga"][..., None] * np.einsum("bhpn,bhp->bhn", dH, v)
        lam, al, dt = s["lam"], s["al"], DT[:, t]
        g["ADT"][:, t] = dal * al + dbe * s["be"]                      # β is proportional to α
        ddt = dbe * (1 - lam) * al + dga * lam
        dlam = -dbe * dt * al + dga * dt
        g["Trap"][:, t] = dlam * lam * (1 - lam)
        dqbar[:, t] = rot_transpose(dq, s["th"])
        dkbar[:, t] = rot_transpose(dk, s["th"])
        dtheta = dth + drot_dtheta(dq, qbar[:, t], s["th"]) + drot_dtheta(dk, kbar[:, t], s["th"])
        tanh = np.tanh(Ang[:, t])
        g["Ang"][:, t] = dtheta * np.pi * (1 - tanh ** 2) * dt[..., None]
        ddt += np.sum(dtheta * np.pi * tanh, axis=-1)
        g["DT"][:, t] = ddt
        g["V"][:, t] = dv
        kk = keep[:, t]
        dth = kk[:, None, None] * dtheta
        dh = kk[:, None, None, None] * dh_prev
        dkp = kk[:, None, None] * dkp_prev
        dvp = kk[:, None, None] * dvp_prev
    g["Q"] = dqbar.reshape(bsz, T, G, H // G, N).sum(3)
    g["K"] = dkbar.reshape(bsz, T, G, H // G, N).sum(3)
    g["Qb"], g["Kb"] = dqbar.sum((0, 1)), dkbar.sum((0, 1))
    if D is not None:
        g["D"] = dD
    if Z is not None:
        g["Z"] = dZ
    g["angle"], g["ssm"], g["k"], g["v"] = dth, dh, dkp, dvp
    return g


# --------------------------------------------------------------------------------------- mixer
def rmsnorm(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def num_rope_angles(d_state, rope_fraction):
    split = int(d_state * rope_fraction)
    split -= split % 2
    return split // 2


def heavy_tail(x):
    """φ(x) = 1 + x (x >= 0), 1 / (1 - x) (x < 0)."""
    return np.where(x >= 0, 1 + x, 1 / (1 - np.minimum(x, 0)))


def mixer_forward(sd, u, kw, init=None, reset=None, eps=1e-5):
    """One official `Mamba3` (SISO) forward, spec §3.2 steps 1-13, on u [Bt, T, d_model].

    sd: official state_dict (names and torch layouts); kw: constructor kwargs (d_model, d_state,
    expand, headdim, ngroups, rope_fraction, A_floor, is_outproj_norm).
    Returns (out [Bt, T, d_model], final states (angle, ssm, k, v)).
    """
    sd = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    u = np.asarray(u, np.float64)
    bsz, T, _ = u.shape
    N, G, P = kw["d_state"], kw["ngroups"], kw["headdim"]
    Di = int(kw["expand"] * kw["d_model"])
    H = Di // P
    S = num_rope_angles(N, kw["rope_fraction"])
    proj = u @ sd["in_proj.weight"].T
    sizes = [Di, Di, G * N, G * N, H, H, H, S]
    z, x, B, C, dd_dt, dd_A, trap, ang = np.split(proj, np.cumsum(sizes)[:-1], axis=-1)
    A = np.minimum(-heavy_tail(dd_A), -kw["A_floor"])
    DT = softplus_thr(dd_dt + sd["dt_bias"])
    Bn = rmsnorm(B.reshape(bsz, T, G, N), sd["B_norm.weight"], eps)
    Cn = rmsnorm(C.reshape(bsz, T, G, N), sd["C_norm.weight"], eps)
    Ang = np.broadcast_to(ang[:, :, None, :], (bsz, T, H, S))
    x = x.reshape(bsz, T, H, P)
    z = z.reshape(bsz, T, H, P)
    norm = kw["is_outproj_norm"]
    y, final, _ = scan_forward(Cn, Bn, x, A * DT, DT, trap, sd["C_bias"][:, 0], sd["B_bias"][:, 0], Ang,
                               sd["D"], None if norm else z, init, reset)
    if norm:   # gated RMSNorm: per head (group = headdim), norm before the gate
        w = sd["norm.weight"].reshape(H, P)
        y = rmsnorm(y, w, eps) * silu(z)
    return y.reshape(bsz, T, Di) @ sd["out_proj.weight"].T, final


def official_from_jmamba(p):
    """jmamba mixer params (nested dict) -> an official state_dict (written here independently)."""
    sd = {"in_proj.weight": np.asarray(p["in_proj"]["kernel"]).T, "dt_bias": p["dt_bias"],
          "B_bias": np.asarray(p["B_bias"])[:, None, :], "C_bias": np.asarray(p["C_bias"])[:, None, :],
          "B_norm.weight": p["B_norm"]["weight"], "C_norm.weight": p["C_norm"]["weight"], "D": p["D"],
          "out_proj.weight": np.asarray(p["out_proj"]["kernel"]).T}
    if p.get("norm") is not None:
        sd["norm.weight"] = p["norm"]["weight"]
    return {k: np.asarray(v, np.float64) for k, v in sd.items()}


def backbone_forward(params, x, cfg, state=None, reset=None):
    """Backbone of §3.1 (input_proj with bias when cfg.input_dim is set): (y, [states per layer])."""
    h = np.asarray(x, np.float64)
    if cfg.input_dim is not None:
        h = h @ np.asarray(params["input_proj"]["kernel"], np.float64) + np.asarray(params["input_proj"]["bias"], np.float64)
    kw = dict(d_model=cfg.d_model, d_state=cfg.d_state, expand=cfg.expand, headdim=cfg.headdim, ngroups=cfg.ngroups,
              rope_fraction=cfg.rope_fraction, A_floor=cfg.A_floor, is_outproj_norm=cfg.is_outproj_norm)
    new_state = []
    for i in range(cfg.n_layers):
        lp = params["layers"][i]
        hn = rmsnorm(h, np.asarray(lp["norm"]["weight"], np.float64), cfg.norm_eps)
        out, st = mixer_forward(official_from_jmamba(lp["mixer"]), hn, kw, None if state is None else state[i],
                                reset, cfg.norm_eps)
        h = h + out
        new_state.append(st)
    return rmsnorm(h, np.asarray(params["norm_f"]["weight"], np.float64), cfg.norm_eps), new_state
