"""llamatune: LoRA finetuning of GGUF llama-family models.

Importing the package does one thing: it sets the threading policy's environment
defaults, which must be in place before numpy and numba load (OpenBLAS and numba read
them when they start), and which a user's own settings override:
- OPENBLAS_THREAD_TIMEOUT=4: OpenBLAS worker threads otherwise keep spinning for a
  long while after each large GEMM and starve the numba kernels that run between
  matmuls. Measured on 2 cores: attention right after a (2048x512x1536) GEMM took
  2760 ms instead of 38 ms, and the GEMM itself 37 ms instead of 16 ms.
- numba's threading layer: OpenMP first (NUMBA_THREADING_LAYER_PRIORITY), with
  GOMP_SPINCOUNT=2000: with its default spin (up to 300000 iterations) GNU OpenMP's
  idle workers starve OpenBLAS the same way (attention forward 660 ms vs 18 ms); with
  a short one a parallel kernel starts in about 1 us, against 80-100 us for the
  workqueue layer (a step of the bench shape launches ~400 kernels: 1.96 s a step vs
  2.06 s). Workqueue, the fallback, is used where OpenMP is not available. A command
  whose products will likely be oneDNN's bf16 ones (which run on the same OpenMP
  workers) raises the spin before OpenMP starts: `precision.prepare_threads`.
- Under an MPI launcher with several ranks on this machine, OPENBLAS_NUM_THREADS and
  NUMBA_NUM_THREADS default to the machine's cores divided among them
  (launcher.share_cores), so the ranks do not oversubscribe the cores.

Nothing else happens at import: no file is read or created and no module patched.
numba's disk cache folder is chosen when the kernels are first imported
(`llamatune.kernels.kernel_cache_dir`), and the CUDA kernels' NumPy alias is added
when the first CUDA kernel module loads (`llamatune.kernels.cuda.numpy_compat`).
"""
import os

from .launcher import share_cores

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp workqueue tbb")
SPIN = "2000"                   # GOMP_SPINCOUNT's default here (precision.prepare_threads may raise it)
os.environ.setdefault("GOMP_SPINCOUNT", SPIN)
share_cores()

__version__ = "0.1.0"
