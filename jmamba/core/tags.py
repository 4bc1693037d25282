"""Parameter metadata that the training layer reads without knowing the architecture.

A parameter that belongs to a no-weight-decay group carries `no_decay=(mode, ...)` as NNX
metadata (`nnx.Param(value, no_decay=("reference",))`): the modes of `jmamba.no_decay_mask` in
which it is left undecayed. A parameter without the tag is decayed in every mode.
"""

NO_DECAY = "no_decay"                 # the metadata key
REFERENCE = "reference"               # the mamba-rs `reference_no_decay` groups
OFFICIAL = "official"                 # the official implementation's `_no_weight_decay` markers
DECAY_MODES = (REFERENCE, OFFICIAL, "none")
