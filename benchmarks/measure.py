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


def scan_config(text, arch="mamba1"):
    """The Pallas scan config of `arch` from "field=value,...": a
    `pallas_kernels.selective_scan.ScanBlockConfig` (mamba1), a `pallas_kernels.mamba3_siso.Mamba3ScanConfig`
    (mamba3), a `pallas_kernels.causal_conv.ConvBlockConfig` (conv) or a
    `pallas_kernels.rms_norm.NormBlockConfig` (norm); values as `key_values` parses them."""
    if arch == "mamba1":
        from pallas_kernels.selective_scan import ScanBlockConfig as config_type
    elif arch == "mamba3":
        from pallas_kernels.mamba3_siso import Mamba3ScanConfig as config_type
    elif arch == "conv":
        from pallas_kernels.causal_conv import ConvBlockConfig as config_type
    elif arch == "norm":
        from pallas_kernels.rms_norm import NormBlockConfig as config_type
    else:
        raise ValueError(f"arch must be 'mamba1', 'mamba3', 'conv' or 'norm', got {arch!r}")
    return config_type(**key_values(text, f"the {arch} config")).validate()


def key_values(text, what):
    """"name=value,..." -> {name: value}: true / false / none (any case) as True / False / None, then ints,
    then floats, else the string. `what` names the setting in the error for an item without "="."""
    words = {"true": True, "false": False, "none": None}
    out = {}
    for item in text.split(","):
        name, sep, v = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {item!r}")
        if v.lower() in words:
            out[name] = words[v.lower()]
            continue
        for kind in (int, float):
            try:
                out[name] = kind(v)
                break
            except ValueError:
                pass
        else:
            out[name] = v
    return out


def fmt_time(t):
    """'median (min–max)' in ms from a (median, min, max) tuple of seconds."""
    med, lo, hi = t
    return f"{med * 1e3:.3f} ({lo * 1e3:.3f}–{hi * 1e3:.3f})"
