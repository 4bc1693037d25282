"""Test helpers: scale-aware comparisons with messages that say which quantity failed."""

from __future__ import annotations

import numpy as np


def rel_err(got, want):
    """max |got − want| / max(|want|, tiny): error relative to the tensor's scale."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want), initial=0.0) / max(np.max(np.abs(want), initial=0.0), 1e-12))


def assert_close(name, got, want, tol):
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
