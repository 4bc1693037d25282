"""Data-parallel (and FSDP-style) training over a device mesh with JAX's own SPMD machinery."""

from jmamba.parallel.mesh import (DATA_AXIS, batch_shardings, make_data_mesh, shard_batch, shard_state,
                                  state_shardings)

__all__ = ["DATA_AXIS", "batch_shardings", "make_data_mesh", "shard_batch", "shard_state", "state_shardings"]
