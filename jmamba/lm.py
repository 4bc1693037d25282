"""`MambaLM`: token embedding → Mamba backbone → LM head (tied to the embedding or separate).

    h      = Embed(input_ids)                     [B, T, D]   float32 table, N(0, 0.02) init
    y      = backbone(h)                          [B, T, D]   float32 (post final norm)
    logits = y · Embᵀ  (tied)  or  y · W_head     [B, T, V]   float32
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmamba.architectures import get_architecture
from jmamba.backbone import take_compute_dtype
from jmamba.core.dtypes import accum_dtype
from jmamba.core.precision import as_precision
from jmamba.core.validation import shape_of
from jmamba.layers.dense import Dense

f32 = jnp.float32

# save_pretrained / from_pretrained are implemented by jmamba.io.pretrained (the io layer reads models;
# models do not import io), which registers them here when jmamba.io is imported.
_PRETRAINED_IO: dict = {}


def register_pretrained_io(save, load) -> None:
    _PRETRAINED_IO.update(save=save, load=load)


def _pretrained_io(name):
    if not _PRETRAINED_IO:   # `import jmamba` (and any jmamba submodule import) registers them
        raise RuntimeError("jmamba.io is not imported: import jmamba first")
    return _PRETRAINED_IO[name]


@dataclasses.dataclass(frozen=True)
class MambaLMConfig:
    """What builds a `MambaLM`: the backbone config, the vocabulary size and the head tying."""

    backbone: Any
    vocab_size: int
    tie_embeddings: bool = True

    arch = "lm"

    def validate(self) -> "MambaLMConfig":
        get_architecture(self.backbone)   # TypeError for anything but a registered backbone config
        self.backbone.validate()
        if self.backbone.input_dim is not None:
            raise ValueError(f"backbone_cfg.input_dim must be None for an LM (the embedding feeds the "
                             f"backbone), got {self.backbone.input_dim}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {self.vocab_size!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        return self


class MambaLM(nnx.Module):
    """Language model around a Mamba-1 or Mamba-3 backbone.

    Parameters: `embedding [V, D]`, `backbone.*`, and `lm_head.kernel [D, V]` when untied.
    """

    def __init__(self, backbone_cfg, vocab_size: int, *, tie_embeddings: bool = True,
                 initializer_range: float = 0.02, rngs: nnx.Rngs):
        self.config = MambaLMConfig(backbone_cfg, vocab_size, tie_embeddings).validate()
        D = backbone_cfg.d_model
        self.embedding = nnx.Param(initializer_range * jax.random.normal(rngs.params(), (vocab_size, D), f32))
        self.backbone = get_architecture(backbone_cfg).backbone_cls(backbone_cfg, rngs=rngs)
        self.lm_head = None if tie_embeddings else Dense(D, vocab_size, rngs=rngs)

    def init_state(self, batch: int):
        return self.backbone.init_state(batch)

    def save_pretrained(self, directory) -> str:
        """Writes config.json + model.safetensors (float32 masters) into `directory`; returns its path."""
        return _pretrained_io("save")(directory, self)

    @classmethod
    def from_pretrained(cls, directory, *, step=None, rngs=None) -> "MambaLM":
        """A MambaLM from a `save_pretrained` directory, or from a training-checkpoint directory (its
        newest step, or `step`). Strict: every weight must be there, with its shape and dtype."""
        return _pretrained_io("load")(directory, step=step, rngs=rngs)

    def _check_ids(self, ids, ndim, name="input_ids"):
        s = shape_of(ids)
        if len(s) != ndim or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
            what = "[batch, seqlen]" if ndim == 2 else "[batch]"
            raise ValueError(f"{name} must be an integer array of shape {what}, got shape {s} "
                             f"dtype {jnp.result_type(ids)}")
        if not isinstance(ids, jax.core.Tracer):    # concrete ids: say which one is wrong
            ids_np = np.asarray(ids)
            bad = np.argwhere((ids_np < 0) | (ids_np >= self.config.vocab_size))
            if len(bad):
                pos = tuple(int(i) for i in bad[0])
                raise ValueError(f"{name}{list(pos)} = {int(ids_np[pos])} is not a token id in "
                                 f"[0, {self.config.vocab_size}) ({len(bad)} such ids)")

    def _embed(self, ids):
        """Embedding rows [..., D]; an id outside [0, vocab) (only possible under jit) embeds as NaN,
        never as another token (no wrap-around of negative ids), so the train step's guard skips it."""
        V = self.config.vocab_size
        ids = jnp.where(ids < 0, V, ids)
        return jnp.take(self.embedding[...], ids, axis=0, mode="fill", fill_value=jnp.nan)

    def _logits(self, y, cdt, widen=True):
        if self.lm_head is None:
            w = self.embedding[...].astype(cdt)
            logits = jnp.einsum("...d,vd->...v", y.astype(cdt), w)
        else:
            logits = self.lm_head(y.astype(cdt))
        return logits.astype(accum_dtype(logits.dtype)) if widen else logits

    def __call__(self, input_ids, state=None, *, reset=None, precision=None, truncate_bptt=True, remat=None,
                 widen_logits=True, **deprecated):
        """input_ids [B, T] int -> (logits [B, T, V] float32, new_state).

        `precision` ("f32", "bf16", "f16" or a `jmamba.Precision`; the old `compute_dtype=` still
        works) is the compute precision of the matmuls; see `ResidualBackbone.__call__`.
        `widen_logits=False` returns the logits in the compute dtype the head's matmul rounded them
        to (float32 accumulation inside the matmul); the default widens that value to float32, which
        is exact. The train step uses False so that the [B, T, V] tensor it keeps between the forward
        and the loss is half the size; it widens after (same numbers).
        """
        self._check_ids(input_ids, 2)
        p = as_precision(take_compute_dtype(deprecated, precision, "MambaLM.__call__"))
        h = self._embed(input_ids)
        y, state = self.backbone(h, state, reset=reset, precision=p, truncate_bptt=truncate_bptt, remat=remat)
        return self._logits(y, p.compute_dtype, widen=widen_logits), state

    def step(self, token_ids, state, *, precision=None, **deprecated):
        """token_ids [B] int -> (logits [B, V] float32, new_state)."""
        self._check_ids(token_ids, 1, "token_ids")
        p = as_precision(take_compute_dtype(deprecated, precision, "MambaLM.step"))
        h = self._embed(token_ids)
        y, state = self.backbone.step(h, state, precision=p)
        return self._logits(y, p.compute_dtype), state


def __getattr__(name):
    if name == "BACKBONES":   # the old table; the architecture registry replaces it
        import warnings

        from jmamba.architectures import architecture_names

        warnings.warn("jmamba.lm.BACKBONES is deprecated; use jmamba.get_architecture(cfg).backbone_cls",
                      DeprecationWarning, stacklevel=2)
        return {get_architecture(n).config_cls: get_architecture(n).backbone_cls for n in architecture_names()}
    raise AttributeError(f"module 'jmamba.lm' has no attribute {name!r}")
