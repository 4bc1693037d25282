"""Per-kernel device times of one jitted function, from a jax.profiler trace (no TensorBoard needed).

    python3 benchmarks/profile_kernels.py mamba3 [--shape b8t2048] [--iters 10]   # Mamba-3 scan fwd+bwd
    python3 benchmarks/profile_kernels.py mamba3 --forward                         # forward only
    python3 benchmarks/profile_kernels.py mamba3 --scan-config qk_gradient_dtype=dot_operand   # another config
    python3 benchmarks/profile_kernels.py mamba3 --tiny      # CPU smoke run (interpret mode; no device events)
    python3 benchmarks/profile_kernels.py mamba1 --shape b8t2048 --scan-config bwd_prefetch_rows=True
                                                             # the Mamba-1 selective scan (fwd+bwd)

Runs the function `--iters` times inside `jax.profiler.trace`, reads the trace back with
`jax.profiler.ProfileData`, and prints, per kernel name (GPU events of the device plane), the total
time per call, the count per call and the share; the last row is the sum of kernel times per call
(less than the wall time by the gaps between kernels). Names of XLA fusions are XLA's; the Pallas
kernels carry their `name=` (e.g. mamba3_siso_bwd_chunk_gradients).
"""

from __future__ import annotations

import argparse
import collections
import glob
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_mamba3_scan as m3  # noqa: E402
from benchmarks import bench_selective_scan as m1  # noqa: E402


def kernel_times(fn, args, iters, intervals=None, host_events=None):
    """({kernel name: (total ns, count)}, wall seconds) over `iters` calls of fn(*args) (compiled and
    warmed up first); `intervals`, a list, also gets each kernel's (start, end) ns."""
    jax.block_until_ready(fn(*args))

    def run():
        for _ in range(iters):
            jax.block_until_ready(fn(*args))
    return traced_kernel_times(run, intervals, host_events)


def traced_kernel_times(run, intervals=None, host_events=None):
    """({kernel name: (total ns, count)}, wall seconds) of the GPU kernels that `run()` launches (a
    callable that does its own iterations and blocks on its results); `intervals`, a list, also gets
    each kernel's (start, end) ns, and `host_events` every host trace event as (thread, name, start,
    end) ns (for host_during_gaps)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            run()
            wall = time.perf_counter() - t0
        path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    totals = collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if host_events is not None and plane.name.startswith("/host:"):
            host_events.extend((line.name, ev.name, ev.start_ns, ev.end_ns) for line in plane.lines for ev in line.events)
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() and "kernel" not in line.name.lower():
                continue
            for ev in line.events:
                totals[ev.name][0] += ev.duration_ns
                totals[ev.name][1] += 1
                if intervals is not None:
                    intervals.append((ev.start_ns, ev.end_ns))
    return totals, wall


GAP_BUCKETS_US = (2, 5, 10, 20, 50, 100, 1000)


def long_gaps(intervals, min_gap_us=100):
    """(start, end) ns of the device's idle stretches of at least min_gap_us between kernels."""
    out, end = [], None
    for start, stop in sorted(intervals):
        if end is not None and start - end >= min_gap_us * 1e3:
            out.append((end, start))
        end = stop if end is None else max(end, stop)
    return out


def host_during_gaps(intervals, host_events, iters, min_gap_us=100, top=25):
    """Prints what the host was doing while the device sat idle for >= min_gap_us: per host trace
    event name (and thread), its time inside those idle stretches, per call (nested events are each
    counted)."""
    gaps = long_gaps(intervals, min_gap_us)
    if not gaps or not host_events:
        return
    inside = collections.Counter()
    for thread, name, start, stop in host_events:
        for g0, g1 in gaps:
            overlap = min(stop, g1) - max(start, g0)
            if overlap > 0:
                inside[(thread[:30], name[:80])] += overlap
    total = sum(g1 - g0 for g0, g1 in gaps)
    print(f"\n# host trace events inside the device's idle stretches >= {min_gap_us} µs "
          f"({len(gaps) / iters:g} per call, {total / iters / 1e3:.1f} µs per call)\n")
    print("| host thread | event | µs per call inside the gaps |\n|---|---|---|")
    for (thread, name), ns in inside.most_common(top):
        print(f"| {thread} | {name} | {ns / iters / 1e3:.1f} |")


def gap_report(intervals, iters):
    """Prints the device's idle time between consecutive kernels (all streams merged), bucketed by
    gap length, per call: what the wall time adds to the kernel sum on the device's timeline (short
    gaps: launch latency between dependent kernels; long ones: the host dispatching the next call)."""
    if not intervals:
        return
    buckets = collections.Counter()
    sums = collections.Counter()
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gap_us = (start - end) / 1e3
            b = next((x for x in GAP_BUCKETS_US if gap_us < x), "more")
            buckets[b] += 1
            sums[b] += gap_us
        end = stop if end is None else max(end, stop)
    print("\n| idle gap between kernels | gaps per call | µs per call |\n|---|---|---|")
    low = 0
    for b in GAP_BUCKETS_US + ("more",):
        if buckets[b]:
            label = f"{low}–{b} µs" if b != "more" else f">= {low} µs"
            print(f"| {label} | {buckets[b] / iters:g} | {sums[b] / iters:.1f} |")
        low = b if b != "more" else low
    print(f"| **all** | {sum(buckets.values()) / iters:g} | {sum(sums.values()) / iters:.1f} |", flush=True)


CATEGORIES = (   # (category, substrings of XLA / Pallas kernel names), first match wins
    ("selective-scan kernels", ("selective_scan",)),
    ("Mamba-3 per-position kernels", ("mamba3_siso_fwd_projection", "mamba3_siso_bwd_projection", "qk_norm")),
    ("Mamba-3 kernels", ("mamba3",)),
    ("fused AdamW", ("adamw",)),
    ("add + RMSNorm kernels", ("rms_norm",)),
    ("causal-conv kernels", ("causal_conv",)),
    ("log-sum-exp kernel", ("log_sum_exp",)),
    ("matmuls", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "dot")),
    ("transposes", ("transpose",)),
    ("reductions", ("reduce",)),
    ("convert fusions", ("convert",)),
    ("loop fusions", ("loop",)),
    ("copies / memsets", ("copy", "memset", "memcpy", "dynamic_update_slice", "concatenate")),
)


def category(name):
    """The category of a kernel name (CATEGORIES; "other" when none matches)."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def report_categories(totals, iters):
    """Prints the kernel time per call grouped by `category`, with launch counts."""
    groups = collections.defaultdict(lambda: [0, 0])
    for name, (t, n) in totals.items():
        g = groups[category(name)]
        g[0] += t
        g[1] += n
    total = sum(t for t, _ in groups.values())
    print("| category | ms per call | launches per call | share |\n|---|---|---|---|")
    for cat, (t, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"| {cat} | {t / iters / 1e6:.2f} | {n / iters:g} | {100 * t / max(total, 1):.1f}% |")
    print(f"| **sum of kernel times** | {total / iters / 1e6:.2f} | | |", flush=True)


def report(totals, iters, top=30):
    total = sum(t for t, _ in totals.values())
    print("| kernel | µs per call | launches per call | share |\n|---|---|---|---|")
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:90]} | {t / iters / 1e3:.1f} | {n / iters:g} | {100 * t / max(total, 1):.1f}% |")
    print(f"| **sum of kernel times** | {total / iters / 1e3:.1f} | | |", flush=True)


def main(argv=None):
    """Profiles the op (see the module docstring); argv as on the command line.

    Returns rows: {"kernel": name, "launches": per call, "seconds": {"per call": device seconds}} per
    kernel (none off the GPU: no device events there), then {"kernel": "wall", "seconds": {"per call":
    wall-clock seconds per call, profiling included}}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="mamba3", choices=["mamba3", "mamba1"])
    p.add_argument("--shape", default="b8t2048", choices=sorted(set(m3.SHAPES) | set(m1.SHAPES)))
    p.add_argument("--forward", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shape, interpret mode (CPU smoke run)")
    p.add_argument("--per-head-angles", action="store_true",
                   help="Angles [Bt, T, H, S] (as the anchors' op timing) instead of shared [Bt, T, S]")
    p.add_argument("--scan-config", default=None, metavar="K=V,...",
                   help="Mamba3ScanConfig fields to change from the default, e.g. qk_gradient_dtype=dot_operand")
    a = p.parse_args(argv)
    if a.what == "mamba1":
        fn, fargs = _mamba1_call(a)
    else:
        fn, fargs = _mamba3_call(a)
    f = jax.jit(fn)
    print(f"# {a.what} {'forward' if a.forward else 'forward+backward'} at {a.shape}"
          f"{', per-head angles' if a.per_head_angles else ''}, {a.iters} calls, "
          f"{jax.devices()[0].device_kind}\n")
    intervals, host = [], []
    totals, wall = kernel_times(f, fargs, a.iters, intervals, host)
    report(totals, a.iters)
    gap_report(intervals, a.iters)
    host_during_gaps(intervals, host, a.iters)
    rows = [{"kernel": name, "launches": n / a.iters, "seconds": {"per call": t / a.iters / 1e9}}
            for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    print(f"wall time per call (profiled): {wall / a.iters * 1e3:.3f} ms")
    return rows + [{"kernel": "wall", "launches": None, "seconds": {"per call": wall / a.iters}}]


def _mamba1_call(a):
    """(fn, args) of the Mamba-1 selective scan (the anchors' call: z, D, delta bias, softplus)."""
    from benchmarks.measure import scan_config
    if a.shape not in m1.SHAPES and not a.tiny:
        raise SystemExit(f"--shape for mamba1: one of {sorted(m1.SHAPES)}")
    shape = (2, 40, 64, 16) if a.tiny else m1.SHAPES[a.shape]
    if a.tiny:
        a.shape, a.iters = "tiny", 1
    config = scan_config(a.scan_config, "mamba1") if a.scan_config else None
    args = m1.make_args(shape)
    op = m1.implementation("pallas", config, interpret=a.tiny)
    names = list(args)
    if a.forward:
        return (lambda v: op(**v)), (args,)
    d_out = jnp.asarray(np.random.default_rng(7).normal(size=args["u"].shape), jnp.bfloat16)

    def fwd_bwd(v, g):
        out, vjp = jax.vjp(lambda *x: op(**dict(zip(names, x))), *[v[k] for k in names])
        return out, vjp(g)
    return fwd_bwd, (args, d_out)


def _mamba3_call(a):
    """(fn, args) of the Mamba-3 SISO scan."""
    if a.shape not in m3.SHAPES and not a.tiny:
        raise SystemExit(f"--shape for mamba3: one of {sorted(m3.SHAPES)}")
    if a.tiny:
        (bsz, T), dims, chunk, a.shape, a.iters = m3.TINY["shape"], m3.TINY["dims"], m3.TINY["chunk"], "tiny", 1
    else:
        (bsz, T), dims, chunk = m3.SHAPES[a.shape], m3.DIMS, 64
    args = m3.make_args(bsz, T, dims, per_head_angles=a.per_head_angles)
    config = m3.DEFAULT_CONFIG
    if a.scan_config:
        from benchmarks.measure import scan_config
        config = scan_config(a.scan_config, "mamba3")
    fn = m3.op_function("pallas", chunk, config)
    if a.forward:
        return fn, (args,)
    d_out = jnp.asarray(np.random.default_rng(7).normal(size=args["V"].shape), jnp.bfloat16)
    return m3.forward_and_backward(fn), (args, d_out)


if __name__ == "__main__":
    main()
