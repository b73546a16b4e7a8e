"""llamatune: LoRA finetuning of GGUF llama-family models.

Threading policy, set before numpy or numba load (a user's own settings win):
- OPENBLAS_THREAD_TIMEOUT=4: OpenBLAS worker threads otherwise keep spinning for a
  long while after each large GEMM and starve the numba kernels that run between
  matmuls. Measured on 2 cores: attention right after a (2048x512x1536) GEMM took
  2760 ms instead of 38 ms, and the GEMM itself 37 ms instead of 16 ms.
- NUMBA_THREADING_LAYER=workqueue: numba's OpenMP layer spin-waits the same way
  (attention forward 660 ms vs 18 ms).
- Under an MPI launcher with several ranks on this machine, OPENBLAS_NUM_THREADS and
  NUMBA_NUM_THREADS default to the machine's cores divided among them
  (distributed.share_cores), so the ranks do not oversubscribe the cores.
"""
import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

from .train.distributed import share_cores  # noqa: E402  (imports nothing heavy)

share_cores()

__version__ = "0.1.0"
