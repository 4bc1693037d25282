"""Names of the device-mesh axes jmamba shards over (shared by the ops, `jmamba.parallel` and training)."""

DATA_AXIS = "data"   # batch rows are split over this axis (data parallel / FSDP)
SEQ_AXIS = "seq"     # the time axis of one sequence is split over this axis (sequence parallel)
