"""`Mamba3Config`: sizes and init rules of a Mamba-3 SISO backbone (defaults = the official `Mamba3`).

Derived sizes (docs/mamba3_siso.md §1): d_inner Di = expand·d_model, nheads H = Di / headdim,
num_rope_angles S = ⌊⌊d_state·rope_fraction⌋_even / 2⌋ (official: split = int(N·rf), minus 1 if
odd, then // 2), in_proj width 2·Di + 2·G·N + 3·H + S in the order [z, x, B, C, dd_dt, dd_A, trap,
angles].
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Mamba3Config:
    """Mamba-3 SISO backbone configuration.

    Attributes:
      d_model: residual width Dm (the official module has no default; 768 is the 130m-class example).
      n_layers: number of residual blocks (official `MambaConfig.n_layer` = 64).
      d_state: N, the key/query size (official "headdim_qk"); even.
      expand: Di = expand · d_model.
      headdim: P, channels per head; must divide Di.
      ngroups: G, groups of B/C shared by H/G contiguous heads; must divide nheads.
      rope_fraction: 0.5 (the first N/2 dims are rotated) or 1.0 (all N dims).
      input_dim: width of the backbone input; None = identity (the input already has d_model
        features, e.g. embeddings). Otherwise a Linear(input_dim → d_model) with bias.
      norm_eps: RMSNorm epsilon (block norms, final norm, B/C norms, gated output norm).
      dt_min, dt_max, dt_init_floor: dt_bias initialisation (log-uniform dt, floored, inverse softplus).
      A_floor: A = min(−φ(dd_A), −A_floor), so every head decays at least this fast (>= 0).
      is_outproj_norm: gated RMSNorm (group = headdim, norm before gate) before out_proj; otherwise
        the output is y·silu(z).
      rescale_out_proj: divide out_proj's init by √n_layers (official `rescale_prenorm_residual`).
      chunk_size: DEPRECATED. The scan's chunk length is a tuning knob of the op
        (`jmamba.ops.tuning("mamba3_siso_scan", chunk_size=...)`), not model config. When given it
        still sets the chunk length of this model's scans (with a DeprecationWarning); it is not
        stored with the config and does not take part in config comparisons.
    """

    d_model: int = 768
    n_layers: int = 64
    d_state: int = 128
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    rope_fraction: float = 0.5
    input_dim: Optional[int] = None
    norm_eps: float = 1e-5
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    A_floor: float = 1e-4
    is_outproj_norm: bool = False
    rescale_out_proj: bool = True
    chunk_size: Optional[int] = dataclasses.field(default=None, compare=False, repr=False)

    arch = "mamba3"
    # fields kept only so old code and old checkpoints load; never serialised
    deprecated_fields = ("chunk_size",)

    def __post_init__(self):
        if self.chunk_size is not None:
            warnings.warn("Mamba3Config(chunk_size=...) is deprecated: the chunk length is a tuning knob of the "
                          "scan op; use jmamba.ops.tuning('mamba3_siso_scan', chunk_size=...)",
                          DeprecationWarning, stacklevel=3)

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def num_rope_angles(self) -> int:
        split = int(self.d_state * self.rope_fraction)
        split -= split % 2
        return split // 2

    @property
    def in_proj_dim(self) -> int:
        return 2 * self.d_inner + 2 * self.ngroups * self.d_state + 3 * self.nheads + self.num_rope_angles

    @property
    def backbone_input_dim(self) -> int:
        """Feature width the backbone's `__call__` expects."""
        return self.d_model if self.input_dim is None else self.input_dim

    def validate(self) -> "Mamba3Config":
        """Raises ValueError naming the first invalid field; returns self."""
        for name in ("d_model", "n_layers", "d_state", "expand", "headdim", "ngroups"):
            _positive_int(name, getattr(self, name))
        if self.chunk_size is not None:
            _positive_int("chunk_size", self.chunk_size)
        if self.input_dim is not None:
            _positive_int("input_dim", self.input_dim)
        if self.d_state % 2:
            raise ValueError(f"d_state must be even (RoPE rotates pairs), got {self.d_state}")
        if self.d_inner % self.headdim:
            raise ValueError(f"headdim ({self.headdim}) must divide d_inner = expand·d_model ({self.d_inner})")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups ({self.ngroups}) must divide nheads = d_inner/headdim ({self.nheads})")
        if isinstance(self.rope_fraction, bool) or self.rope_fraction not in (0.5, 1.0):
            raise ValueError(f"rope_fraction must be 0.5 or 1.0, got {self.rope_fraction!r}")
        if self.num_rope_angles < 1:
            raise ValueError(f"d_state ({self.d_state}) is too small for rope_fraction {self.rope_fraction}: "
                             "no RoPE angle is left (need d_state·rope_fraction >= 2)")
        for name in ("norm_eps", "dt_min", "dt_max"):
            _positive_float(name, getattr(self, name))
        for name in ("dt_init_floor", "A_floor"):
            v = getattr(self, name)
            if not (_is_number(v) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.dt_min > self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must be <= dt_max ({self.dt_max})")
        for name in ("is_outproj_norm", "rescale_out_proj"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        return self


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _positive_float(name, v):
    if not (_is_number(v) and v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
