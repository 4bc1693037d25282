"""Lazy exports for the kernel packages (PEP 562 module `__getattr__`).

Why: `import jmamba` imports the kernel packages' configuration types (their dataclasses are part
of jmamba's public API), and must not load a Pallas backend until a kernel first runs. A package
therefore imports its config module eagerly and its kernel entry points on first attribute access:

    __getattr__, __dir__ = lazy_exports(__name__, {"selective_scan_pallas": "scan"})
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """The (`__getattr__`, `__dir__`) of `package` for names imported on first use.

    Args:
      package: the package's `__name__`.
      exports: public name -> the submodule of `package` that defines it.

    Returns:
      `__getattr__(name)`: imports `package.<exports[name]>`, caches the value as a module attribute
      (later lookups do not come back here) and returns it; any other name raises AttributeError, so
      `from package import submodule` still falls back to importing the submodule.
      `__dir__()`: the module's attributes plus the lazy names.
    """
    exports = dict(exports)

    def __getattr__(name):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
