"""Every benchmark script runs at tiny shapes on the CPU (`--tiny`), so none of them can rot."""

import glob
import importlib.util
import os

import pytest

SCRIPTS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_*.py"))
                 + glob.glob(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "profile_*.py")))


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_benchmark_runs_tiny(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny"])
