"""`split_dense`: one dense layer's output as column blocks computed by separate matmuls."""

from jmamba.ops.projections.api import split_dense

__all__ = ["split_dense"]
