"""The fused Mamba-1 mixer core op (`jmamba.ops.mamba1_mixer_core`) against the unfused composition.

    python3 benchmarks/bench_mamba1_mixer.py                 # H200: B=8 T=2048 E=1536 N=16 R=48 K=4, bf16
    python3 benchmarks/bench_mamba1_mixer.py --tiny          # CPU smoke run (Pallas interpreted)

Variants, each jitted, forward and forward+backward (gradients of every input and both states):
  fused-pallas  the op's "pallas" implementation (one custom_vjp; the backward recomputes c, u and Δ)
  unfused       scan_operands + the Pallas selective scan, differentiated by autodiff (what the mixer
                did before the fused op)
  xla           the op's "xla" implementation (the same composition with the XLA scan)
Reports medians (min–max) of `--iters` calls and the activation memory each keeps from its forward
for its backward (the residuals autodiff / the custom_vjp save, summed over arrays, inputs excluded).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import fmt_time, timed  # noqa: E402
from jmamba import ops  # noqa: E402
from jmamba.ops.mamba1_mixer.common import scan_operands  # noqa: E402

SHAPE = dict(bsz=8, seqlen=2048, e=1536, n=16, rank=48, k=4)
TINY = dict(bsz=1, seqlen=16, e=16, n=4, rank=2, k=4)
NAMES = ("x", "z", "conv_kernel", "conv_bias", "x_proj_kernel", "dt_proj_kernel", "dt_bias", "A", "D")


def make_args(bsz, seqlen, e, n, rank, k, dtype=jnp.bfloat16, seed=0):
    """Inputs like a Mamba-1 layer's (official-like scales; dt bias = inverse softplus of [1e-3, 1e-1])."""
    r = np.random.default_rng(seed)
    dt = np.exp(r.uniform(np.log(1e-3), np.log(1e-1), size=e))
    args = dict(
        x=jnp.asarray(r.normal(size=(bsz, seqlen, e)), dtype), z=jnp.asarray(r.normal(size=(bsz, seqlen, e)), dtype),
        conv_kernel=jnp.asarray(r.uniform(-0.5, 0.5, size=(k, e)), jnp.float32),
        conv_bias=jnp.asarray(r.uniform(-0.5, 0.5, size=(e,)), jnp.float32),
        x_proj_kernel=jnp.asarray(r.normal(size=(e, rank + 2 * n)) * e ** -0.5, jnp.float32),
        dt_proj_kernel=jnp.asarray(r.uniform(-1, 1, size=(rank, e)) * rank ** -0.5, jnp.float32),
        dt_bias=jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),
        A=-jnp.asarray(np.broadcast_to(np.arange(1, n + 1, dtype=np.float32), (e, n))),
        D=jnp.ones((e,), jnp.float32))
    state = ops.Mamba1CoreState(conv=jnp.zeros((bsz, k - 1, e), jnp.float32),
                                ssm=jnp.zeros((bsz, e, n), jnp.float32))
    return args, state


def variant(name):
    """f(args dict, state) -> (y, Mamba1CoreState)."""
    if name == "unfused":
        def f(a, st):
            u, delta, Bm, Cm, conv = scan_operands(a["x"], st.conv, a["conv_kernel"], a["conv_bias"],
                                                   a["x_proj_kernel"], a["dt_proj_kernel"], None)
            y, h = ops.selective_scan(u, delta, a["A"], Bm, Cm, a["D"], a["z"], a["dt_bias"], delta_softplus=True,
                                      initial_state=ops.SelectiveScanState(st.ssm), return_final_state=True,
                                      implementation="pallas")
            return y, ops.Mamba1CoreState(conv, h.ssm)
        return f
    impl = {"fused-pallas": "pallas", "xla": "xla"}[name]

    def f(a, st):
        return ops.mamba1_mixer_core(*(a[k] for k in NAMES), initial_state=st, return_final_state=True,
                                     implementation=impl)
    return f


def forward_and_backward(f):
    def fb(a, st, d_y):
        (y, s2), pull = jax.vjp(f, a, st)
        return pull((d_y, jax.tree.map(jnp.zeros_like, s2)))
    return fb


def saved_mb(f, args, state):
    """MB of the arrays f's forward keeps for its backward, not counting its own inputs (traced only)."""
    from jax._src.ad_checkpoint import saved_residuals   # the public print_saved_residuals only prints
    res = saved_residuals(lambda a, st: f(a, st)[0], args, state)
    return sum(aval.size * aval.dtype.itemsize for aval, why in res if not why.startswith("from the argument")) / 1e6


def main(argv=None):
    """Runs the benchmark (argv as on the command line); returns one row per variant with `seconds`
    ({"fwd": median, "fwd+bwd": median}) and the MB it saves for its backward."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (Pallas interpreted)")
    p.add_argument("--variants", default="fused-pallas,unfused,xla")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    shape = TINY if a.tiny else SHAPE
    iters = 1 if a.tiny else a.iters
    args, state = make_args(**shape)
    d_y = jnp.asarray(np.random.default_rng(7).normal(size=args["x"].shape), args["x"].dtype)
    print(f"# mamba1_mixer_core {shape} bf16 | jax {jax.__version__} on {jax.devices()[0].device_kind}\n")
    print("| variant | fwd ms (min–max) | fwd+bwd ms (min–max) | saved for the backward, MB |")
    print("|---|---|---|---|")
    rows = []
    for name in a.variants.split(","):
        f = variant(name)
        fwd = jax.jit(f)
        fb = jax.jit(forward_and_backward(f))
        warmup = 1 if a.tiny else 2
        t_f, _ = timed(fwd, (args, state), iters, warmup)
        t_fb, _ = timed(fb, (args, state, d_y), iters, warmup)
        saved = saved_mb(f, args, state)
        print(f"| {name} | {fmt_time(t_f)} | {fmt_time(t_fb)} | {saved:.1f} |", flush=True)
        rows.append({"variant": name, "saved_mb": saved, "seconds": {"fwd": t_f[0], "fwd+bwd": t_fb[0]}})
    return rows


if __name__ == "__main__":
    main()
