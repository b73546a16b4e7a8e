"""Training: the flat parameter buffer, LoRA, the hand-written forward/backward graph,
optimizer, data and datasets, validation, the shared training loop, checkpoints,
metrics, memory estimate and MPI data parallelism. Imports models/ and formats/."""
