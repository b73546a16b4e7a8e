"""Data-parallel training across processes with MPI (mpi4py), exact by construction.

Launched by `mpiexec -n K llamatune finetune ...` (or `srun`), every rank loads the
base model (memory-mapped) and the data, runs the same deterministic Batcher over
the whole global batch of `K x grad_acc` micro-batches and keeps micro-batches
m = r, r+K, r+2K, ... for itself (rank r). Horovod / PyTorch DDP convention:
`--batch` is per rank and per micro-batch.

Why not MPI_Allreduce: its summation order is the implementation's, and float32
sums depend on the order. Here every micro-batch's gradient is computed into a
zeroed buffer; after each round of K micro-batches the ranks Allgather their
gradients (MPI only copies bytes, no arithmetic) and every rank adds them in
global micro-batch order:  acc = g_0; acc += g_1; ...; acc += g_{KA-1}.
One process with `--grad-acc K*A` does exactly the same additions, so K ranks
train the adapter one process trains, to the last bit, and all ranks hold the
same parameters after each step (verified by a checksum every
`--mpi-check-every` steps). The logged loss is summed the same way.

Nothing here imports mpi4py unless the process was started by an MPI launcher
(and `--no-mpi` was not given), and numpy is imported only inside functions, so
the command line can import this module to report errors. (The threads per rank
are set before numpy loads, by launcher.share_cores.) Only rank 0
prints and writes files; a rank that raises prints its error and aborts the whole
job (MPI_Abort); a rank that dies is reaped by the launcher, which ends the others.
See docs/distributed.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
import time
from dataclasses import dataclass, field

from ..errors import LlamatuneError
from ..launcher import launched_by_mpi


@dataclass
class World:
    """This process's place in the job. size 1 and comm None: a plain single process."""
    rank: int = 0
    size: int = 1
    comm: object = None                         # mpi4py.MPI.Comm when size > 1
    bytes_sent: int = 0                         # gradient bytes handed to MPI by this rank
    bytes_received: int = 0                     # gradient bytes received from the other ranks
    steps: int = 0                              # optimizer steps exchanged
    seconds: float = 0.0                        # spent in the exchange (waiting for other ranks included)
    timeout: float = 0.0                        # seconds a collective may wait for the others (0: forever)
    waiting: tuple | None = None                # (what, since) while inside a collective

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @contextlib.contextmanager
    def watch(self, what: str):
        """Mark a collective call, so the watchdog can end the job if another rank never arrives."""
        self.waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self.waiting = None

    def allgather(self, value, what: str = "start-up checks"):
        """Small Python objects from every rank, in rank order."""
        if self.comm is None:
            return [value]
        with self.watch(what):
            return self.comm.allgather(value)


_WORLD = World()


def current() -> World:
    """The world set up by the last `setup` (a single process before any)."""
    return _WORLD


def setup(opts) -> World:
    """Join the MPI job this process was launched in (once per process), or stay single.
    `opts`: the run's TrainOptions (--mpi, --mpi-timeout)."""
    global _WORLD
    if not opts.mpi or not launched_by_mpi():
        _WORLD = World()
        return _WORLD
    if _WORLD.comm is not None:
        return _WORLD
    try:
        from mpi4py import MPI
    except ImportError:
        raise LlamatuneError("started by an MPI launcher but mpi4py is not installed: pip install "
                             "'llamatune[mpi]' (or pass --no-mpi to train as independent processes)") from None
    comm = MPI.COMM_WORLD
    _WORLD = World(comm.Get_rank(), comm.Get_size(), comm if comm.Get_size() > 1 else None,
                   timeout=float(opts.mpi_timeout))
    if _WORLD.size > 1:
        sys.excepthook = _abort_on_uncaught
        if _WORLD.timeout > 0:
            threading.Thread(target=_watchdog, args=(_WORLD,), name="mpi-watchdog", daemon=True).start()
        if not _WORLD.is_root:                  # rank 0 alone prints; errors still reach stderr
            from ..console import err, out
            err.quiet = out.quiet = True
    return _WORLD


def abort_job(code: int = 1) -> None:
    """After this rank printed its error: end every rank of the job now (no hang)."""
    if _WORLD.comm is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        _WORLD.comm.Abort(code)


def error_prefix() -> str:
    return f"rank {_WORLD.rank}: " if _WORLD.comm is not None else ""


def _abort_on_uncaught(kind, value, tb) -> None:
    sys.__excepthook__(kind, value, tb)
    abort_job(1)


def _watchdog(world: World) -> None:
    """A rank that hangs without dying (stopped, stuck in I/O, deadlocked) is not noticed by
    the launcher; the others would wait in the next collective for ever. End the job instead."""
    while True:
        time.sleep(min(1.0, world.timeout / 4))
        waiting = world.waiting
        if waiting is not None and time.monotonic() - waiting[1] > world.timeout:
            print(f"error: rank {world.rank}: the other ranks did not join the {waiting[0]} within "
                  f"--mpi-timeout {world.timeout:g} s (a rank hung?): ending the job", file=sys.stderr)
            abort_job(1)


# --------------------------------------------------------------------------- start-up checks
def check_same_job(world: World, opts, samples_hash: int, base_fingerprint: str) -> None:
    """Refuse to start when ranks were given different data, base models or options."""
    if world.size == 1:
        return
    from .checkpoint import options_json
    mine = {"training data": samples_hash, "base models": base_fingerprint,
            "options": hashlib.blake2b(options_json(opts).encode(), digest_size=8).hexdigest()}
    every = world.allgather(mine)
    for what in mine:
        odd = [r for r, theirs in enumerate(every) if theirs[what] != every[0][what]]
        if odd:
            raise LlamatuneError(f"ranks were given different {what} (rank 0 vs rank(s) "
                                 f"{', '.join(map(str, odd))}): every rank must be given the same "
                                 f"{'files and ' if what != 'options' else ''}options")


def parameter_checksum(params) -> str:
    """A cheap digest of the parameters (blake2b over the flat f32 buffer)."""
    import numpy as np
    data = np.ascontiguousarray(params.host(params.data))
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=8).hexdigest()


def check_identical_parameters(world: World, params, iteration: int) -> None:
    if world.size == 1:
        return
    sums = world.allgather(parameter_checksum(params), "parameter checksum")
    odd = [r for r, s in enumerate(sums) if s != sums[0]]
    if odd:
        raise LlamatuneError(f"parameters differ between ranks after iteration {iteration} (rank 0 vs rank(s) "
                             f"{', '.join(map(str, odd))}): the ranks no longer train the same model")


def checksum_due(opts, iteration: int, done: bool) -> bool:
    every = opts.mpi_check_every
    return done or (every > 0 and iteration % every == 0)


# --------------------------------------------------------------------------- micro-batches and losses
def my_share(world: World, batches: list):
    """This rank's micro-batches of the global batch, with their global index m
    (m = rank, rank + K, ...: round j of the step computes m = j*K + rank)."""
    for m in range(world.rank, len(batches), world.size):
        yield m, batches[m]


def sum_losses(world: World, mine: list[float]) -> float:
    """The global batch's loss from each rank's micro-batch losses (in `my_share` order),
    added in global micro-batch order, as one process adds them: 0.0 + l_0 + l_1 + ..."""
    every = world.allgather(mine, "gradient exchange")
    loss = 0.0
    for j in range(len(mine)):
        for theirs in every:
            loss += theirs[j]
    return loss


# --------------------------------------------------------------------------- gradients
@dataclass
class GradientSum:
    """Sums the micro-batch gradients and losses of one optimizer step in global
    micro-batch order, identically in one process and in K ranks.

    Use:  for m, b in grads.mine(batches): grads.add(executor.step(..., key with m))
          loss = grads.finish()   # params.grad holds the global gradient
    """
    world: World
    params: object                               # params.ParamBuffer
    acc: object = None                           # (P,) running sum, on the parameters' device
    gathered: np.ndarray | None = None           # (K, P) host buffer for Allgather (the gradient's dtype)
    losses: list = field(default_factory=list)   # losses of this rank's micro-batches of this step
    n_micro: int = 0                             # micro-batches in the global batch of this step
    first: bool = True                           # no micro-batch folded into acc yet this step

    def mine(self, batches: list):
        """This rank's micro-batches of the global batch, with their global index m."""
        self.n_micro = len(batches)
        self.losses = []
        self.first = True
        self.params.zero_grad()
        yield from my_share(self.world, batches)

    def _device(self):
        from ..backend import cpu
        return getattr(self.params, "backend", None) or cpu()

    def _fold(self, g) -> None:
        """acc = g for the first micro-batch of the step, acc += g after it."""
        if self.acc is None:
            self.acc = self._device().xp.zeros_like(self.params.grad)
        if self.first:
            self.acc[...] = g
            self.first = False
        else:
            self.acc += g

    def add(self, loss: float) -> None:
        """params.grad holds this rank's gradient of its micro-batch of this round."""
        import numpy as np
        K, P = self.world.size, self.params.size
        self.losses.append(loss)
        if K == 1:
            if self.n_micro > 1:                   # a single micro-batch needs no second buffer
                self._fold(self.params.grad)
                self.params.zero_grad()
            return
        t = time.perf_counter()
        mine = np.ascontiguousarray(self.params.host(self.params.grad))
        if self.gathered is None:
            self.gathered = np.empty((K, P), mine.dtype)
        with self.world.watch("gradient exchange"):
            self.world.comm.Allgather(mine, self.gathered)
        self.world.seconds += time.perf_counter() - t
        self.world.bytes_sent += mine.nbytes
        self.world.bytes_received += (K - 1) * mine.nbytes
        to_device = self._device().to_device
        for g in self.gathered:                    # global order: m = round*K + rank
            self._fold(to_device(g))
        self.params.zero_grad()

    def finish(self) -> float:
        """The step's loss, summed in micro-batch order; the global gradient in params.grad."""
        if self.world.size > 1 or self.n_micro > 1:
            self.params.grad[...] = self.acc
        self.world.steps += 1
        return sum_losses(self.world, self.losses)


def summary(world: World, tokens_per_second: float) -> str:
    """One line for the end of a parallel run: per-rank and total speed, bytes exchanged."""
    per_step = world.bytes_sent / max(world.steps, 1)
    return (f"{world.size} MPI ranks: {tokens_per_second:,.0f} tokens/s in total, "
            f"{tokens_per_second / world.size:,.0f} per rank; each rank sent {per_step / 2**20:.2f} MiB "
            f"and received {world.bytes_received / max(world.steps, 1) / 2**20:.2f} MiB of gradients per step "
            f"({world.seconds / max(world.steps, 1) * 1e3:.1f} ms per step in the exchange, waits included)")


def exchange_bytes(world: World, n_params: int) -> int:
    """Host buffers of the gradient exchange: the running sum and the gathered gradients."""
    return 0 if world.size == 1 else (1 + world.size) * 4 * n_params


def memory_line(world: World, need: int, n_params: int) -> str:
    per_rank = need + exchange_bytes(world, n_params)
    return (f"MPI: {world.size} ranks, --batch samples per rank and micro-batch; memory estimate "
            f"{per_rank / 2**30:.2f} GiB per rank with the gradient exchange, {world.size * per_rank / 2**30:.2f} GiB "
            f"in total (ranks on one machine share the mapped base model's pages)")
