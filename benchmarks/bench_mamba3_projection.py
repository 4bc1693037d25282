"""The Mamba-3 scan fed from in_proj's rest block (`jmamba.ops.mamba3_siso_scan_projected`): its per-position
work as the two Pallas kernels (pallas_kernels/mamba3_siso/projection.py) against the XLA ops around the
same Pallas scan, with and without the qk_norm kernels, forward and forward + backward, at one layer of
the 130m-class model.

    python3 benchmarks/bench_mamba3_projection.py            # GPU: B=8 T=2048 H=24 P=64 N=128 S=32, bf16
    python3 benchmarks/bench_mamba3_projection.py --tiny     # CPU smoke run (interpreted)

Rows: "xla ops" (fuse_projection=False, fuse_qk_norm=False: the session-28 path), "qk_norm kernels"
(fuse_qk_norm=True), "projection kernels" (fuse_projection=True with one program per chunk; then with 2,
the default since session 31, and 4 programs per chunk, `projection_row_splits`). "fwd+bwd" takes the cotangents of rest,
V, z, dt_bias, both norm weights, both biases and D under a cotangent of the output (what a layer of the
train step runs). Medians (min–max) of `--iters` jitted calls; the last column is the largest relative
difference of the fwd+bwd results from the first row's.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import fmt_time, rel, timed  # noqa: E402
from jmamba.ops import Mamba3ScanTuning, mamba3_siso_scan_projected  # noqa: E402
from pallas_kernels.mamba3_siso import Mamba3ScanConfig  # noqa: E402

NAMES = ("rest", "V", "z", "dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D")
VARIANTS = (("xla ops", dict(fuse_projection=False, fuse_qk_norm=False)),
            ("qk_norm kernels", dict(fuse_projection=False, fuse_qk_norm=True)),
            ("projection kernels", dict(fuse_projection=True, projection_row_splits=1)),
            ("projection kernels, 2 row blocks", dict(fuse_projection=True, projection_row_splits=2)),
            ("projection kernels, 4 row blocks, 2/4 warps", dict(fuse_projection=True, projection_row_splits=4,
                                                              num_warps_projection=2, num_warps_projection_grad=4)))


def make(bsz, T, H, G, N, P, S):
    r = np.random.default_rng(0)
    f = lambda *s, scale=1.0, dt=jnp.float32: jnp.asarray(scale * r.normal(size=s), dt)
    args = (f(bsz, T, 2 * G * N + 3 * H + S, dt=jnp.bfloat16), f(bsz, T, H, P, dt=jnp.bfloat16),
            f(bsz, T, H, P, dt=jnp.bfloat16), f(H) - 3.0, 1 + f(N, scale=0.1), 1 + f(N, scale=0.1),
            1 + f(H, N, scale=0.1), 1 + f(H, N, scale=0.1), f(H))
    return args, f(bsz, T, H, P, dt=jnp.bfloat16)


def pair(G, chunk, fields):
    tuning = Mamba3ScanTuning(chunk_size=chunk, pallas_config=Mamba3ScanConfig(**fields))

    def f(*a):
        return mamba3_siso_scan_projected(*a, ngroups=G, A_floor=1e-4, norm_eps=1e-5, implementation="pallas",
                                          tuning=tuning)

    def fb(dy, *a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(dy)

    return jax.jit(f), jax.jit(fb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    shape = (1, 32, 2, 1, 32, 8, 8) if a.tiny else (8, 2048, 24, 1, 128, 64, 32)
    chunk = 16 if a.tiny else 64
    iters = 2 if a.tiny else a.iters
    args, dy = make(*shape)
    print(f"# mamba3_siso_scan_projected, (B, T, H, G, N, P, S) = {shape}, bf16 | jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}\n")
    print("| variant | fwd ms | fwd+bwd ms | rel. diff |\n|---|---|---|---|")
    rows, first = [], None
    for name, fields in VARIANTS[:3] if a.tiny else VARIANTS:   # the smoke run: one per kind of path
        f, fb = pair(shape[3], chunk, fields)
        tf, _ = timed(f, args, iters)
        tb, out = timed(fb, (dy,) + args, iters)
        leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(out)]
        first = first or leaves
        diff = max(rel(x, y) for x, y in zip(leaves, first))
        print(f"| {name} | {fmt_time(tf)} | {fmt_time(tb)} | {diff:.1e} |", flush=True)
        rows.append({"variant": name, "seconds": {"fwd": tf[0], "fwd+bwd": tb[0]}, "rel_diff": diff})
    return rows


if __name__ == "__main__":
    main()
