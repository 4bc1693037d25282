"""Functional training: `TrainState` and the jitted `make_train_step`."""
