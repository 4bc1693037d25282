"""Where a synchronised call of our op spends its time *inside the anchors' op timing process*.

    python3 benchmarks/probe_anchor_op.py ANCHORS_DIR BUILD_DIR [--shapes b32t512,b8t2048]

The anchors' `side_by_side.py` (measurement only, not part of this project; ANCHORS_DIR is the copy
the device call carries, e.g. .anchors, BUILD_DIR where its build put the CUDA extensions) times our
Mamba-3 op at ~0.45 ms above our own profiled wall. This script imports that file, wraps its jax timer
and, right after each of its timings of our jitted forward and forward+backward, measures the same
function in the same process and state: the anchors' median, then `bench_dispatch.split_times`
(blocked / dispatch / wait / pipelined), then a profiler trace of 10 blocked calls (kernel sum, the
idle gaps between kernels, the largest kernels). The anchors' own result line prints as usual.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("anchors_dir")
    p.add_argument("build_dir")
    p.add_argument("--shapes", default="b32t512,b8t2048")
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.argv = ["side_by_side.py", a.build_dir, "none"]
    sys.path.insert(0, str(Path(a.anchors_dir).resolve()))
    import side_by_side as s  # noqa: E402  (the anchors' file, measurement only)

    from benchmarks import bench_dispatch, profile_kernels  # noqa: E402

    original = s.t_jax
    calls = []

    def probed(fn, *args, reps=20):
        median = original(fn, *args, reps=reps)
        which = "fwd" if len(calls) % 2 == 0 else "fwd+bwd"
        calls.append(which)
        s.burn()
        split = bench_dispatch.split_times(fn, list(args), 20)
        intervals = []
        totals, wall = profile_kernels.kernel_times(fn, args, a.iters, intervals)
        ksum = sum(t for t, _ in totals.values()) / a.iters / 1e6
        print(f"\n## probe: our {which}: anchors' median {median * 1e3:.3f} ms | blocked {split['blocked'] * 1e3:.3f}"
              f" dispatch {split['dispatch'] * 1e3:.3f} wait {split['wait'] * 1e3:.3f} pipelined "
              f"{split['pipelined'] * 1e3:.3f} ms | traced wall {wall / a.iters * 1e3:.3f} ms/call, kernel sum "
              f"{ksum:.3f} ms, {sum(n for _, n in totals.values()) / a.iters:g} kernels per call", flush=True)
        profile_kernels.gap_report(intervals, a.iters)
        profile_kernels.report(totals, a.iters, top=14)
        return median

    s.t_jax = probed
    for shape in a.shapes.split(","):
        b, t = shape[1:].split("t")
        s.m3_op(b=int(b), l=int(t))


if __name__ == "__main__":
    main()
