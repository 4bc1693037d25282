"""Choosing an implementation of an op: `"reference" | "xla" | "pallas"` or automatic.

Every op (`selective_scan`, `selective_scan_step`, `mamba1_mixer_core`, `mamba3_siso_scan`,
`mamba3_siso_step`, `adamw_update`) registers its implementations here with a `supported(**arrays) -> str | None`
predicate that explains, in words, why an implementation cannot handle a call. The rules
(docs/api.md):

* an explicitly requested implementation that cannot run raises `NotImplementedError` with the reason;
* `implementation=None` walks the backend's preference list, takes the first that supports the call,
  and warns once per (op, implementation, reason) when it had to skip a better one. An op that has
  no implementation of some name (e.g. no Pallas kernel for a decode step) simply does not take
  part in that name's turn: nothing better was skipped, so nothing is said.

The model layer only ever calls the op; it never names an implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Optional

import jax

IMPLEMENTATIONS = ("reference", "xla", "pallas")

# Preference order of the automatic choice, per JAX backend platform.
_AUTO_ORDER = {
    "gpu": ("pallas", "xla"),
    "cuda": ("pallas", "xla"),
    "rocm": ("xla",),
    "cpu": ("xla",),
    "tpu": ("xla",),
}


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    Attributes:
      fn: the implementation, called with the op's normalized arguments.
      supported: returns None when `fn` can handle the call, else a sentence saying why not.
    """

    fn: Callable
    supported: Callable[..., Optional[str]]


_REGISTRY: dict[str, dict[str, Callable[[], Implementation]]] = {}
_WARNED: set[tuple] = set()
_PREFERRED: dict[str, str] = {}


@contextlib.contextmanager
def prefer(op: str, implementation: str):
    """Within the block, calls of `op` with `implementation=None` use `implementation` (it must be able
    to run them, else they raise). Read at trace time: a function already traced and cached by
    `jax.jit` keeps its choice, so build (or re-jit) the function inside the block.

    Example (benchmarks compare kernels without touching the model):
        with dispatch.prefer("selective_scan", "xla"):
            step = make_train_step(...); step(state, batch)
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    old = _PREFERRED.get(op)
    _PREFERRED[op] = implementation
    try:
        yield
    finally:
        if old is None:
            _PREFERRED.pop(op, None)
        else:
            _PREFERRED[op] = old


def preferred(op: str) -> str | None:
    """The implementation preferred for `op` by an enclosing `prefer` block, or None."""
    return _PREFERRED.get(op)


def register(op: str, name: str, loader: Callable[[], Implementation]) -> None:
    """Registers `loader` (called lazily, so heavy imports happen on first use) for `op`."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation name must be one of {IMPLEMENTATIONS}, got {name!r}")
    _REGISTRY.setdefault(op, {})[name] = loader


def _load(op: str, name: str) -> Implementation | str:
    loader = _REGISTRY.get(op, {}).get(name)
    if loader is None:
        return f"no {name!r} implementation of {op} is registered"
    try:
        return loader()
    except ImportError as e:  # e.g. a kernel module whose backend is not installed
        return f"{name!r} implementation of {op} could not be imported: {e}"


def default_platform() -> str:
    return jax.default_backend()


def registered(op: str) -> tuple[str, ...]:
    """Names of the implementations registered for `op` (in IMPLEMENTATIONS order)."""
    return tuple(n for n in IMPLEMENTATIONS if n in _REGISTRY.get(op, {}))


def choose(op: str, implementation: str | None, platform: str | None = None, **call) -> Implementation:
    """Returns the implementation of `op` to run for this call.

    Args:
      op: op name, e.g. "selective_scan".
      implementation: None (automatic) or one of IMPLEMENTATIONS.
      platform: JAX platform to choose for (defaults to the default backend).
      **call: the op's normalized arguments, passed to each `supported` predicate.
    """
    if implementation is None:
        implementation = _PREFERRED.get(op)
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
        impl = _load(op, implementation)
        if isinstance(impl, str):
            raise NotImplementedError(impl)
        reason = impl.supported(platform=platform or default_platform(), **call)
        if reason is not None:
            raise NotImplementedError(f"{op}: implementation={implementation!r} cannot run: {reason}")
        return impl

    platform = platform or default_platform()
    skipped = []
    for name in _AUTO_ORDER.get(platform, ("xla",)):
        if name not in _REGISTRY.get(op, {}):
            continue
        impl = _load(op, name)
        reason = impl if isinstance(impl, str) else impl.supported(platform=platform, **call)
        if reason is None:
            for skipped_name, why in skipped:
                key = (op, skipped_name, why)
                if key not in _WARNED:
                    _WARNED.add(key)
                    warnings.warn(f"{op}: using {name!r} instead of {skipped_name!r}: {why}", stacklevel=3)
            return impl
        skipped.append((name, reason))
    raise NotImplementedError(f"{op}: no implementation can run this call: {skipped}")
