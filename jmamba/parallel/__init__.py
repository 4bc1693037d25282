"""Data-parallel, FSDP-style and sequence-parallel training over a device mesh with JAX's own SPMD machinery."""

from jmamba.parallel.mesh import (DATA_AXIS, SEQ_AXIS, batch_shardings, batch_spec, make_data_mesh, make_mesh,
                                  shard_batch, shard_state, state_shardings)

__all__ = ["DATA_AXIS", "SEQ_AXIS", "batch_shardings", "batch_spec", "make_data_mesh", "make_mesh", "shard_batch",
           "shard_state", "state_shardings"]
