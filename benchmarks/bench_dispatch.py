"""Where a synchronised op call's wall time goes besides the kernels: host dispatch, the wait for the
result, and the floor set by a trivial jit with the same arguments.

The anchors time jmamba's ops as `perf_counter` around `jax.block_until_ready(f(*args))`, one call at a
time, so every call pays jax's dispatch and the host's wake-up after the last kernel on top of the
kernels themselves. This script splits that wall time, for the fwd+bwd of the Mamba-3 and Mamba-1 scan
ops at the benchmark shapes (the gradient of a fixed output cotangent, as the anchors do it):

- `blocked`: one call then block, the anchors' measurement;
- `dispatch`: the time until `f(*args)` returns (the host's enqueue; blocked afterwards, untimed);
- `wait`: from that return to the end of `block_until_ready`;
- `pipelined`: `--iters` calls back to back, one block at the end, per call (≈ the device time when the
  host keeps ahead of the GPU);
- `blocked, cotangent as argument`: the cotangent passed instead of closed over;
- `trivial` baselines: a jit returning every argument + 1 (same arguments and output count) and a jit of
  one scalar add, both blocked: what any synchronised jax call costs on this machine.

    python3 benchmarks/bench_dispatch.py [--arch mamba3,mamba1] [--shape b8t2048] [--iters 50]

`--torch` reproduces the anchors' process: torch imported and holding GPU memory, and the clocks
warmed by torch matmuls (as side_by_side.py's burn does) before each measurement instead of by jax.

Run it once per XLA_FLAGS setting (e.g. `XLA_FLAGS=--xla_gpu_enable_command_buffer=`) to see what the
command buffers cost or save. `--tiny` runs tiny shapes in interpret mode on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_mamba3_scan as m3  # noqa: E402
from benchmarks import bench_selective_scan as m1  # noqa: E402
from jmamba.ops import Mamba3ScanTuning, mamba3_siso_scan, selective_scan  # noqa: E402

M1_SHAPES = {"b8t2048": (8, 2048, 1536, 16), "b32t256": (32, 256, 1536, 16), "b2t8192": (2, 8192, 1536, 16)}


def op_and_args(arch, shape, tiny, per_head_angles=False):
    """(fn(*args) -> out, args list, cotangent) for one op at one shape, through the public jmamba.ops."""
    if arch == "mamba3":
        if tiny:
            (bsz, T), dims, chunk = m3.TINY["shape"], m3.TINY["dims"], m3.TINY["chunk"]
        else:
            (bsz, T), dims, chunk = m3.SHAPES[shape], m3.DIMS, 64
        a = m3.make_args(bsz, T, dims, per_head_angles=per_head_angles)
        names = list(a)
        impl = "xla" if tiny else "pallas"
        tuning = Mamba3ScanTuning(chunk_size=chunk)

        def fn(*v):
            out = mamba3_siso_scan(**dict(zip(names, v)), implementation=impl, tuning=tuning)
            return out[0] if isinstance(out, tuple) else out
    elif arch == "mamba1":
        a = m1.make_args((1, 24, 8, 4) if tiny else M1_SHAPES[shape])
        names = list(a)
        impl = "xla" if tiny else "pallas"

        def fn(*v):
            out = selective_scan(**dict(zip(names, v)), delta_softplus=True, implementation=impl)
            return out[0] if isinstance(out, tuple) else out
    else:
        raise ValueError(f"arch must be 'mamba3' or 'mamba1', got {arch!r}")
    args = [a[k] for k in names]
    out = jax.eval_shape(fn, *args)
    d_out = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), out.dtype)
    return fn, args, d_out


def _median(xs):
    return statistics.median(xs)


def split_times(f, args, iters):
    """{blocked, dispatch, wait, pipelined}: medians in seconds (pipelined: mean per call)."""
    for _ in range(3):
        jax.block_until_ready(f(*args))
    blocked, dispatch, wait = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        blocked.append(time.perf_counter() - t0)
    for _ in range(iters):
        t0 = time.perf_counter()
        out = f(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        wait.append(t2 - t1)
    pipelined = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        pipelined.append((time.perf_counter() - t0) / iters)
        del outs
    return dict(blocked=_median(blocked), dispatch=_median(dispatch), wait=_median(wait),
                pipelined=min(pipelined))


def burn(seconds):
    """Keep the device busy so that its clocks are up (an idle GPU starts slow)."""
    a = jnp.ones((2048, 2048), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        jax.block_until_ready([mm(a) for _ in range(10)])


def torch_burn(seconds):
    """The anchors' clock warm-up: torch bf16 matmuls on the GPU (a no-op without torch or a GPU)."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def measure(arch, shape, iters, tiny, with_torch=False, per_head_angles=False):
    fn, args, d_out = op_and_args(arch, shape, tiny, per_head_angles)
    warm = (lambda: torch_burn(0.5)) if with_torch else (lambda: None)
    closed = jax.jit(lambda *a: jax.vjp(fn, *a)[1](d_out))
    as_arg = jax.jit(lambda g, *a: jax.vjp(fn, *a)[1](g))
    echo = jax.jit(lambda *a: [x + 1 for x in a])
    scalar = jax.jit(lambda x: x + 1)
    one = jnp.float32(1)
    burn(0.1 if tiny else 1.0)
    rows = []
    label = (f"{arch} {'tiny' if tiny else shape}" + (" per-head angles" if per_head_angles and arch == "mamba3" else "")
             + (" (torch)" if with_torch else ""))
    for variant, f, a in (("fwd+bwd, cotangent closed over", closed, args),
                          ("fwd+bwd, cotangent as argument", as_arg, [d_out] + args),
                          ("trivial: every argument + 1", echo, args)):
        warm()
        rows.append(dict(variant=variant, what=label, seconds=split_times(f, a, iters)))
    warm()
    rows.append(dict(variant="trivial: one scalar add", what="", seconds=split_times(scalar, [one], iters)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="mamba3,mamba1")
    p.add_argument("--shape", default="b8t2048", help="b8t2048, b32t512 (mamba3) / b32t256 (mamba1), b2t8192")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, xla implementation (CPU smoke run)")
    p.add_argument("--torch", action="store_true",
                   help="as in the anchors' process: torch holding GPU memory, clocks warmed by torch matmuls")
    p.add_argument("--per-head-angles", action="store_true", help="Mamba-3 Angles [Bt, T, H, S] (the anchors')")
    a = p.parse_args(argv)
    if a.torch:
        torch_burn(0.1)
    iters = 5 if a.tiny else a.iters
    env = __import__("os").environ
    print(f"# synchronised call split, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"XLA_FLAGS={env.get('XLA_FLAGS', '')!r}, XLA_PYTHON_CLIENT_PREALLOCATE="
          f"{env.get('XLA_PYTHON_CLIENT_PREALLOCATE', '')!r}, torch={a.torch}")
    print("| op | variant | blocked ms | dispatch ms | wait ms | pipelined ms/call |")
    print("|---|---|---|---|---|---|")
    rows = []
    for arch in a.arch.split(","):
        shape = a.shape if arch == "mamba3" or a.shape in M1_SHAPES else "b32t256"
        for r in measure(arch, shape, iters, a.tiny, with_torch=a.torch, per_head_angles=a.per_head_angles):
            s = r["seconds"]
            print(f"| {r['what']} | {r['variant']} | {s['blocked'] * 1e3:.3f} | {s['dispatch'] * 1e3:.3f} | "
                  f"{s['wait'] * 1e3:.3f} | {s['pipelined'] * 1e3:.3f} |", flush=True)
            rows.append(r)
    return rows


if __name__ == "__main__":
    main()
