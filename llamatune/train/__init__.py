"""Training: the flat parameter buffer, LoRA, the hand-written forward/backward graph,
optimizer, validation, the shared training loop and its objectives, checkpoints,
metrics, memory estimate and MPI data parallelism. Imports data/, models/ and formats/."""
