"""`Mamba1Config`: sizes and init rules of a Mamba-1 backbone (defaults = the official `Mamba`).

Derived sizes (docs/mamba1.md §1.2): d_inner E = expand·d_model, dt_rank R = ceil(d_model/16)
when "auto", x_proj width R + 2N (order dt, B, C), in_proj width 2E (order x, z).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union


@dataclasses.dataclass(frozen=True)
class Mamba1Config:
    """Mamba-1 backbone configuration.

    Attributes:
      d_model: residual width D.
      n_layers: number of residual blocks.
      d_state: SSM state size N per channel.
      d_conv: causal conv kernel size K.
      expand: d_inner = expand · d_model.
      dt_rank: rank R of the Δ projection; "auto" = ceil(d_model / 16).
      input_dim: width of the backbone input; None = identity (the input already has d_model
        features, e.g. embeddings). Otherwise a Linear(input_dim → d_model) with bias.
      norm_eps: RMSNorm epsilon (every block norm and the final norm).
      dt_min, dt_max, dt_init_floor, dt_scale, dt_init: Δ initialisation (official rules).
      conv_bias: causal conv has a bias.
      rescale_out_proj: divide out_proj's init by √n_layers (official `rescale_prenorm_residual`).
    """

    d_model: int = 768
    n_layers: int = 24
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: Union[int, Literal["auto"]] = "auto"
    input_dim: Optional[int] = None
    norm_eps: float = 1e-5
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    dt_scale: float = 1.0
    dt_init: Literal["random", "constant"] = "random"
    conv_bias: bool = True
    rescale_out_proj: bool = True

    arch = "mamba1"

    @property
    def d_inner(self) -> int:
        return int(self.expand * self.d_model)

    @property
    def resolved_dt_rank(self) -> int:
        return math.ceil(self.d_model / 16) if self.dt_rank == "auto" else int(self.dt_rank)

    @property
    def backbone_input_dim(self) -> int:
        """Feature width the backbone's `__call__` expects."""
        return self.d_model if self.input_dim is None else self.input_dim

    def validate(self) -> "Mamba1Config":
        """Raises ValueError naming the first invalid field; returns self."""
        for name in ("d_model", "n_layers", "d_state", "d_conv", "expand"):
            _positive_int(name, getattr(self, name))
        if self.dt_rank != "auto":
            _positive_int("dt_rank", self.dt_rank)
        if self.input_dim is not None:
            _positive_int("input_dim", self.input_dim)
        if self.d_conv > 8:
            raise ValueError(f"d_conv must be <= 8 (causal conv kernel), got {self.d_conv}")
        for name in ("norm_eps", "dt_min", "dt_max", "dt_scale"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        v = self.dt_init_floor
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)):
            raise ValueError(f"dt_init_floor must be a finite number >= 0, got {v!r}")
        if self.dt_min > self.dt_max:
            raise ValueError(f"dt_min ({self.dt_min}) must be <= dt_max ({self.dt_max})")
        if self.dt_init not in ("random", "constant"):
            raise ValueError(f"dt_init must be 'random' or 'constant', got {self.dt_init!r}")
        for name in ("conv_bias", "rescale_out_proj"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        return self


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
