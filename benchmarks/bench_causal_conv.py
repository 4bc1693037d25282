"""The Pallas causal conv + SiLU kernels against the XLA conv (`jmamba.ops.causal_conv1d` + SiLU, its
own custom_vjp), forward and backward, at a Mamba-1 130m layer's shape.

    python3 benchmarks/bench_causal_conv.py            # H200: Bt=8 T=2048 E=1536 K=4, bf16, packed xz
    python3 benchmarks/bench_causal_conv.py --tiny     # CPU smoke run (interpreted)

Rows: "xla" (the conv of the op's short-window path: u, then its vjp with du = du_a + du_b, dx and
dz joined into one [Bt, T, 2E] cotangent as the mixer needs), then one row per Pallas block config
(`--configs block_t,block_e,num_warps[,flags];...`; flags: `f` fast_math and fused_multiply_add on,
`l` loop_rows on; without `f` both are off). Times are medians (min–max) of `--iters` jitted calls.
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
from jmamba.ops import causal_conv1d  # noqa: E402
from pallas_kernels.causal_conv import ConvBlockConfig, conv_silu_backward, conv_silu_forward  # noqa: E402


def make(bt, seqlen, e, k, dtype):
    r = np.random.default_rng(0)
    f = lambda *s, dt=jnp.float32: jnp.asarray(r.normal(size=s), dt)
    return (f(bt, seqlen, 2 * e, dt=dtype), f(bt, k - 1, e), 0.5 * f(k, e), 0.2 * f(e),
            f(bt, seqlen, e, dt=dtype), f(bt, seqlen, e, dt=dtype), f(bt, seqlen, e, dt=dtype))


def xla_pair(e):
    def fwd(src, st, w, b):
        c, _ = causal_conv1d(src[..., :e], st, w, b)
        return jax.nn.silu(c).astype(src.dtype)

    def bwd(src, st, w, b, du_a, du_b, dz):
        u, vjp = jax.vjp(lambda x, st, w, b: jax.nn.silu(causal_conv1d(x, st, w, b)[0]).astype(x.dtype),
                         src[..., :e], st, w, b)
        dx, dst, dw, db = vjp((du_a + du_b).astype(u.dtype))
        return jnp.concatenate([dx, dz], axis=-1), dst, dw, db

    return jax.jit(fwd), jax.jit(bwd)


def pallas_pair(cfg, interpret):
    fwd = jax.jit(lambda src, st, w, b: conv_silu_forward(src, st, w, b, None, config=cfg, interpret=interpret))
    bwd = jax.jit(lambda src, st, w, b, du_a, du_b, dz: conv_silu_backward(
        src, st, w, b, None, du_a, du_b, dz, config=cfg, interpret=interpret))
    return fwd, bwd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", default="32,64,1,f;32,64,1,fl;64,64,1,fl;64,128,1,fl;128,128,1,fl;64,256,2,fl;"
                                        "128,64,1,fl;32,64,1")
    a = p.parse_args(argv)
    shape = (1, 24, 8, 4) if a.tiny else (8, 2048, 1536, 4)
    interpret = jax.default_backend() == "cpu"
    iters = 2 if a.tiny else a.iters
    args = make(*shape, jnp.bfloat16)
    e = shape[2]
    print(f"# causal conv + SiLU, Bt={shape[0]} T={shape[1]} E={e} K={shape[3]} bf16, packed xz | "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}\n")
    print("| variant | fwd ms | bwd ms |\n|---|---|---|")
    rows = []

    def report(name, f, b):
        tf, _ = timed(f, args[:4], iters)
        tb, _ = timed(b, args, iters)
        print(f"| {name} | {fmt_time(tf)} | {fmt_time(tb)} |")
        rows.append({"variant": name, "seconds": {"fwd": tf[0], "bwd": tb[0]}})

    report("xla", *xla_pair(e))
    for spec in a.configs.split(";"):
        fields = spec.split(",")
        bt_, be_, w_ = (int(v) for v in fields[:3])
        flags = fields[3] if len(fields) > 3 else ""
        fast, loop = "f" in flags, "l" in flags
        cfg = ConvBlockConfig(block_t=bt_, block_e=be_, num_warps=w_, fast_math=fast, fused_multiply_add=fast,
                              loop_rows=loop)
        report(f"pallas t{bt_} e{be_} w{w_}{' fast fma' if fast else ''}{' loop' if loop else ''}",
               *pallas_pair(cfg, interpret))
        if a.tiny:
            break
    return rows


if __name__ == "__main__":
    main()
