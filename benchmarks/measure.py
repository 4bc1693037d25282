"""Timing and error helpers shared by the benchmark scripts (docs/performance.md §2: warm-up runs, then the
median and min–max of timed runs, each bracketed by `jax.block_until_ready`)."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np


def timed(fn, args, iters, warmup=2):
    """(median, min, max) seconds of `fn(*args)` and its last result."""
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return (statistics.median(times), min(times), max(times)), out


def rel(a, b):
    """max |a − b| / max |b| in float64 (0 for empty arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-30))


def scan_config(text):
    """A `pallas_kernels.selective_scan.ScanBlockConfig` from "field=value,..." (ints; True / False)."""
    from pallas_kernels.selective_scan import ScanBlockConfig
    fields = dict(kv.split("=") for kv in text.split(","))
    return ScanBlockConfig(**{k: (v == "True") if v in ("True", "False") else int(v)
                              for k, v in fields.items()}).validate()


def fmt_time(t):
    """'median (min–max)' in ms from a (median, min, max) tuple of seconds."""
    med, lo, hi = t
    return f"{med * 1e3:.3f} ({lo * 1e3:.3f}–{hi * 1e3:.3f})"
