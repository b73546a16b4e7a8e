"""llamatune: LoRA finetuning of GGUF llama-family models.

Threading policy, set before numpy or numba load (a user's own settings win):
- OPENBLAS_THREAD_TIMEOUT=4: OpenBLAS worker threads otherwise keep spinning for a
  long while after each large GEMM and starve the numba kernels that run between
  matmuls. Measured on 2 cores: attention right after a (2048x512x1536) GEMM took
  2760 ms instead of 38 ms, and the GEMM itself 37 ms instead of 16 ms.
- numba's threading layer: OpenMP first (NUMBA_THREADING_LAYER_PRIORITY), with
  GOMP_SPINCOUNT=2000: with its default spin (up to 300000 iterations) GNU OpenMP's
  idle workers starve OpenBLAS the same way (attention forward 660 ms vs 18 ms); with
  a short one a parallel kernel starts in about 1 us, against 80-100 us for the
  workqueue layer (a step of the bench shape launches ~400 kernels: 1.96 s a step vs
  2.06 s). Workqueue, the fallback, is used where OpenMP is not available.
- Under an MPI launcher with several ranks on this machine, OPENBLAS_NUM_THREADS and
  NUMBA_NUM_THREADS default to the machine's cores divided among them
  (distributed.share_cores), so the ranks do not oversubscribe the cores.

numba's disk cache of compiled kernels goes to one folder per version of the kernels'
sources (NUMBA_CACHE_DIR = ~/.cache/llamatune/numba-<hash of kernels/*.py>): numba
checks a cached kernel against its own file only, so a kernel whose helpers in another
file changed (vecmath's expf, say) would otherwise keep running the old compiled code
after an upgrade or an edit.
"""
import hashlib
import os
from importlib.util import find_spec
from pathlib import Path


def kernel_cache_dir() -> Path | None:
    """~/.cache/llamatune/numba-<16 hex digits of the hash of every kernels/*.py>
    (XDG_CACHE_HOME respected), created; None when it cannot be made."""
    spec = find_spec("llamatune.kernels")
    if spec is None or not spec.submodule_search_locations:
        return None
    digest = hashlib.sha256()
    for root in spec.submodule_search_locations:
        for f in sorted(Path(root).rglob("*.py")):
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(home) / "llamatune" / f"numba-{digest.hexdigest()[:16]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", "omp workqueue tbb")
os.environ.setdefault("GOMP_SPINCOUNT", "2000")
if "NUMBA_CACHE_DIR" not in os.environ and (_cache := kernel_cache_dir()) is not None:
    os.environ["NUMBA_CACHE_DIR"] = str(_cache)

from .train.distributed import share_cores  # noqa: E402  (imports nothing heavy)

share_cores()

__version__ = "0.1.0"
