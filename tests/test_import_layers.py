"""The layers of docs/architecture.md, enforced: a lower layer never imports a higher one, models
reach the ops only through the public names of `jmamba.ops`, and there are no import cycles.

The import graph is read statically (every `import` statement, also inside functions), so a lazy
import cannot hide a wrong edge.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# layer -> module prefixes (longest prefix wins)
LAYERS = {
    "kernels": ["pallas_kernels"],
    "core": ["jmamba.core", "jmamba.dtypes"],
    "ops": ["jmamba.ops"],
    "parallel": ["jmamba.parallel"],
    "data": ["jmamba.data"],
    "models": ["jmamba.layers", "jmamba.mamba1", "jmamba.mamba3", "jmamba.backbone", "jmamba.lm",
               "jmamba.architectures", "jmamba.configs", "jmamba.generate", "jmamba.sampling"],
    "io": ["jmamba.io", "jmamba.interop"],
    "optim": ["jmamba.optim"],
    "training": ["jmamba.training"],
    "jobs": ["jmamba.train_char_lm", "jmamba.sample"],
    "facade": ["jmamba"],            # jmamba/__init__.py: the public names, re-exported
}
# who may import whom (besides itself)
ALLOWED = {
    "kernels": set(),
    "core": set(),
    "ops": {"core", "kernels"},
    "parallel": {"core"},
    "data": {"core"},
    "models": {"core", "ops"},
    "io": {"core", "models"},
    "optim": {"core", "ops"},
    "training": {"core", "ops", "models", "optim", "parallel"},
    "jobs": {"core", "ops", "models", "io", "optim", "training", "parallel", "data", "facade"},
    "facade": set(LAYERS) - {"facade"},
}
# layers that may use `jmamba.ops` only through its public names (`from jmamba import ops`,
# `from jmamba.ops import <public name>`)
OPS_PUBLIC_ONLY = {"models", "optim", "training", "jobs", "io", "facade"}


def _module_files():
    for top in ("jmamba", "pallas_kernels"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield (rel[:-len(".__init__")] if rel.endswith(".__init__") else rel), path


MODULES = dict(_module_files())


def layer_of(module):
    best = None
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > len(best[1]):
                    best = (layer, p)
    return None if best is None else best[0]


def _resolve(module, node):
    """(target module, imported names or None) for each project-internal import in `node`."""
    out = []
    if isinstance(node, ast.Import):
        for a in node.names:
            out.append((a.name, None))
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            pkg = module if os.path.basename(MODULES[module]) == "__init__.py" else ".".join(base[:-1])
            parts = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
            target = ".".join(parts + ([node.module] if node.module else []))
        else:
            target = node.module
        for a in node.names:
            sub = f"{target}.{a.name}"
            out.append((sub, None) if sub in MODULES else (target, a.name))
    return [(t, n) for t, n in out if t.split(".")[0] in ("jmamba", "pallas_kernels")]


def import_edges():
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, name in _resolve(module, node):
                    edges.append((module, target, name, node.lineno))
    return edges


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_no_layer_imports_a_higher_or_forbidden_one():
    bad = []
    for src, dst, _, line in import_edges():
        a, b = layer_of(src), layer_of(dst)
        if a != b and b not in ALLOWED[a]:
            bad.append(f"{MODULES[src]}:{line}: {a} module {src} imports {b} module {dst}")
    assert bad == []


def test_models_and_training_use_only_public_op_names():
    import jmamba.ops as ops

    bad = []
    for src, dst, name, line in import_edges():
        if layer_of(src) not in OPS_PUBLIC_ONLY or layer_of(dst) != "ops":
            continue
        if dst == "jmamba.ops" and (name is None or name in ops.__all__):
            continue
        bad.append(f"{MODULES[src]}:{line}: {src} imports {dst}{'' if name is None else '.' + name}")
    assert bad == []


def test_there_are_no_import_cycles():
    graph = {m: set() for m in MODULES}
    for src, dst, _, _ in import_edges():
        if dst in graph and dst != src and dst != "jmamba":   # the facade re-exports everything
            graph[src].add(dst)
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def strongconnect(v):   # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strongconnect(v)
    assert cycles == []


def test_the_checker_sees_a_wrong_edge(tmp_path, monkeypatch):
    """The rules can fail: a kernel module importing jmamba is reported."""
    fake = tmp_path / "bad_kernel.py"
    fake.write_text("from jmamba.ops import dispatch\n")
    monkeypatch.setitem(MODULES, "pallas_kernels.bad_kernel", str(fake))
    bad = [(s, d) for s, d, _, _ in import_edges() if s == "pallas_kernels.bad_kernel"]
    assert bad == [("pallas_kernels.bad_kernel", "jmamba.ops.dispatch")]
    assert layer_of("jmamba.ops.dispatch") not in ALLOWED[layer_of("pallas_kernels.bad_kernel")]


def test_import_jmamba_loads_no_pallas_backend():
    code = ("import sys, jmamba, jmamba.optim, jmamba.ops; "
            "bad = sorted(m for m in sys.modules if m.startswith(('jax.experimental.pallas', "
            "'jax._src.pallas.triton', 'jax._src.pallas.mosaic_gpu.core')) or (m.startswith('pallas_kernels') "
            "and not m.endswith(('.config', 'common', '.dtypes', '.sizes', '.lazy', 'pallas_kernels', "
            "'selective_scan', 'mamba3_siso', 'fused_adamw', 'rms_norm', 'log_sum_exp', 'sum_of_squares', 'finite_rows')))); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
