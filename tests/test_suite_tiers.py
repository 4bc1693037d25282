"""The slow tier's list (conftest.SLOW_TESTS) names tests that exist: a renamed test or case would
otherwise drop out of the tier silently and run in the default one (or a typo would mark nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import conftest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def collected_ids():
    """Every test id of the suite, from `pytest --collect-only` in a subprocess."""
    files = sorted({path for path, _, _ in conftest.SLOW_TESTS})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *(os.path.join("tests", f) for f in files)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def test_every_slow_entry_names_collected_tests():
    nodes = []
    for node in collected_ids():
        file, _, rest = node.partition("::")
        name, _, param = rest.partition("[")
        nodes.append((os.path.basename(file), name, param.rstrip("]")))
    missing = [entry for entry in conftest.SLOW_TESTS
               if not any(conftest.slow_entry_matches(entry, *node) for node in nodes)]
    assert missing == []


def test_the_tiers_split_the_suite_and_ci_runs_both():
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    assert '-m "not slow"' in makefile and "-m slow" in makefile
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert "make test;" in ci and "make test-slow;" in ci
