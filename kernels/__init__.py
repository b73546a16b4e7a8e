"""Numba CPU kernels (and their numpy references) for llamatune.

Threading: the kernels run between BLAS matmuls. numba's default OpenMP layer
spin-waits after each parallel region and fights OpenBLAS's threads for the
cores (measured: attention forward 660 ms vs 18 ms at B=8, T=256 on 2 cores).
The `workqueue` layer does not spin, so it is the default here (set before numba
is first imported; a user's own NUMBA_THREADING_LAYER wins).
"""
import os

os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
