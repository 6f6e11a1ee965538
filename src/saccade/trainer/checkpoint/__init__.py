"""Checkpoint I/O: a run's checkpoints (`saving`: save, load, resume; `dcp`: sharded under
torchrun; `folder`: the folder, its manifest, pruning; `model_state`: what of the model is
saved), and the weights an engine or an export gets (`engine_weights`)."""
