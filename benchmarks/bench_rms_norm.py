"""The add + RMSNorm op (`jmamba.ops.add_rms_norm`): the Pallas kernels against the XLA composition,
forward and forward + backward, at a 130m-class layer's shape.

    python3 benchmarks/bench_rms_norm.py            # GPU: [8, 2048, 768], bf16 x, float32 stream
    python3 benchmarks/bench_rms_norm.py --tiny     # CPU smoke run (interpreted)

Rows: "xla" (h = residual + x, then `rms_norm` with its custom VJP), then one row per Pallas block
config (`--configs block_rows,num_warps;...`). "fwd" is (y, h); "fwd+bwd" also takes the cotangents
of x, the residual and the weight under cotangents of both outputs (what a layer of the train step
runs). Times are medians (min–max) of `--iters` jitted calls, with the HBM traffic floor beside.
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
from jmamba.ops import RMSNormTuning, add_rms_norm  # noqa: E402
from pallas_kernels.rms_norm import NormBlockConfig  # noqa: E402


def make(shape):
    r = np.random.default_rng(0)
    return (jnp.asarray(r.normal(size=shape), jnp.bfloat16), jnp.asarray(3 * r.normal(size=shape), jnp.float32),
            jnp.ones(shape[-1:], jnp.float32), jnp.asarray(r.normal(size=shape), jnp.bfloat16),
            jnp.asarray(r.normal(size=shape), jnp.float32))


def pair(impl, cfg):
    tuning = RMSNormTuning(cfg) if cfg else None

    def f(x, res, w):
        return add_rms_norm(x, res, w, eps=1e-5, out_dtype=jnp.bfloat16, implementation=impl, tuning=tuning)

    def fb(x, res, w, dy, dh):
        (y, h), vjp = jax.vjp(f, x, res, w)
        return y, h, vjp((dy, dh))

    return jax.jit(f), jax.jit(fb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--configs", default="8,4;4,4;16,4;16,8;32,8;2,2;4,2;1,1")
    a = p.parse_args(argv)
    shape = (2, 8, 48) if a.tiny else (8, 2048, 768)
    iters = 2 if a.tiny else a.iters
    args = make(shape)
    n = int(np.prod(shape))
    fwd_mb, all_mb = n * (2 + 4 + 4 + 2) / 1e6, n * (2 + 4 + 4 + 2 + 4 + 2 + 4 + 4 + 2) / 1e6
    print(f"# add + RMSNorm, x {list(shape)} bf16, stream float32, y bf16 | jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}\n# bytes at one pass each: fwd {fwd_mb:.0f} MB, fwd+bwd {all_mb:.0f} MB\n")
    print("| variant | fwd ms | fwd+bwd ms |\n|---|---|---|")
    rows = []

    def report(name, impl, cfg=None):
        f, fb = pair(impl, cfg)
        tf, _ = timed(f, args[:3], iters)
        tb, _ = timed(fb, args, iters)
        print(f"| {name} | {fmt_time(tf)} | {fmt_time(tb)} |", flush=True)
        rows.append({"variant": name, "seconds": {"fwd": tf[0], "fwd+bwd": tb[0]}})

    report("xla", "xla")
    for spec in a.configs.split(";"):
        rows_, warps = (int(v) for v in spec.split(","))
        report(f"pallas r{rows_} w{warps}", "pallas", NormBlockConfig(block_rows=rows_, num_warps=warps))
        if a.tiny:
            break
    return rows


if __name__ == "__main__":
    main()
