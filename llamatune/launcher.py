"""What an MPI launcher tells a process through its environment: whether it was
started by one, how many ranks share its machine and which of them it is. Read by
the package's start-up (threads per rank: share_cores), train/distributed.py and the
CUDA backend (a GPU per rank); imports nothing.
"""
from __future__ import annotations

import os

# Variables an MPI launcher sets in each process: Open MPI, MPICH/Intel MPI (hydra), PMIx (srun --mpi=pmix)
LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
# Ranks on this machine (to share its cores): Open MPI, MPICH hydra, Slurm
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
# This rank's index among them (to pick its GPU)
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def launched_by_mpi(environ=os.environ) -> bool:
    return any(k in environ for k in LAUNCH_VARS)


def _launcher_int(environ, names, least: int) -> int:
    """The first of the launcher's variables `names` that holds an integer (at least
    `least`); `least` when not launched by MPI or none does."""
    if launched_by_mpi(environ):
        for k in names:
            try:
                return max(least, int(environ[k]))
            except (KeyError, ValueError):
                continue
    return least


def local_ranks(environ=os.environ) -> int:
    """Ranks the launcher placed on this machine (1 when not launched by MPI)."""
    return _launcher_int(environ, LOCAL_SIZE_VARS, 1)


def local_rank(environ=os.environ) -> int:
    """This rank's index among the ranks on its machine (0 when not launched by MPI)."""
    return _launcher_int(environ, LOCAL_RANK_VARS, 0)


def share_cores(environ=os.environ) -> None:
    """Before numpy and numba load: ranks on one machine split its cores between them
    (OpenBLAS and numba threads), unless the user set the thread counts. Run by the
    package's __init__."""
    n = local_ranks(environ)
    if n > 1:
        per_rank = str(max(1, (os.cpu_count() or 1) // n))
        for k in ("OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
            environ.setdefault(k, per_rank)
