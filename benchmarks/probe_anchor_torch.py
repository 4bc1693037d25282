"""Where the anchors' PyTorch time goes, inside their own process: host-bound or not, and per kernel.

    python3 benchmarks/probe_anchor_torch.py ANCHORS_DIR BUILD_DIR train [--models Mamba3,Mamba1]
    python3 benchmarks/probe_anchor_torch.py ANCHORS_DIR BUILD_DIR ops

The anchors' `side_by_side.py` (measurement only, not part of this project; ANCHORS_DIR is the copy
the device call carries, e.g. .anchors, BUILD_DIR where its build put the CUDA extensions) timed the
same Mamba-3 PyTorch train step at 98–190 ms/step on different machines while our step moved by ~5%.
This script imports that file and wraps its PyTorch timer: right after each of the anchors' own
medians (of the train step, or of an official op's forward / forward+backward) it measures the same
function, in the same state,
- the host time to issue one step (the Python call returning, no synchronisation) against the
  synchronised step: when they are equal the GPU waits for the host;
- a torch.profiler trace (GPU activity only) of 3 steps: the sum of the GPU kernel times and the union of
  their intervals (GPU busy time) per step, and the largest kernels (µs per call): the official
  kernels' breakdown to set beside `profile_kernels.py`'s of ours.
So a step of ~165 ms with ~95 ms of kernels is host-bound on that machine. The anchors' result line
prints as usual.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def busy_union_us(intervals):
    """Total length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def probe(fn, torch, steps=3):
    """Host issue time, synchronised wall, kernel sum and GPU busy time per step of fn (ms)."""
    torch.cuda.synchronize()
    issue, wall = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append(t1 - t0)
        wall.append(t2 - t0)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:   # kernels only: a CPU trace of an eager step is slow
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA") and e.time_range.elapsed_us() > 0]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    per_name = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
    ksum = sum(b - a for a, b in spans) / steps / 1e3
    busy = busy_union_us(spans) / steps / 1e3
    issue.sort()
    wall.sort()
    return {"issue_ms": issue[len(issue) // 2] * 1e3, "wall_ms": wall[len(wall) // 2] * 1e3,
            "kernel_sum_ms": ksum, "gpu_busy_ms": busy, "kernels_per_step": len(kernels) / steps,
            "top": sorted(per_name.items(), key=lambda kv: -kv[1])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("anchors_dir")
    p.add_argument("build_dir")
    p.add_argument("what", choices=["train", "ops"])
    p.add_argument("--models", default="Mamba3,Mamba1", help="train: the anchors' models to run")
    p.add_argument("--top", type=int, default=12, help="largest kernels to print per timing")
    a = p.parse_args(argv)
    sys.argv = ["side_by_side.py", a.build_dir, a.what]
    sys.path.insert(0, str(Path(a.anchors_dir).resolve()))
    import side_by_side as s  # noqa: E402  (the anchors' file, measurement only)
    torch = s.torch
    original = s.t_torch

    def t_torch(fn, reps=20):
        t = original(fn, reps)
        print(f"[probe] anchors' median {t * 1e3:.1f} ms (probing...)", flush=True)
        try:
            r = probe(fn, torch)
        except Exception as e:   # the anchors' own figure above stands; say why the probe has none
            print(f"[probe] failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return t
        print(f"[probe] synchronised step {r['wall_ms']:.1f} ms, host "
              f"issue {r['issue_ms']:.1f} ms | kernel sum {r['kernel_sum_ms']:.1f} ms, GPU busy "
              f"{r['gpu_busy_ms']:.1f} ms, {r['kernels_per_step']:.0f} kernels per call", flush=True)
        for name, us in r["top"][:a.top]:
            print(f"[probe]   {us:9.1f} µs  {name[:110]}", flush=True)
        return t

    s.t_torch = t_torch
    print("[env]", torch.__version__, torch.cuda.get_device_name(0), os.cpu_count(), "CPUs", flush=True)
    if a.what == "train":
        for model in a.models.split(","):
            s.train(layer=model)
    else:
        root = str(Path(__file__).resolve().parents[1])
        sys.path.insert(0, root)
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        for fn, kw in [(s.m1_op, dict(b=8, l=2048)), (s.m3_op, dict(b=8, l=2048)), (s.m3_op, dict(b=32, l=512))]:
            print(f"[probe] {fn.__name__} {kw}", flush=True)
            fn(**kw)


if __name__ == "__main__":
    main()
