"""One run per output set: a lock on each output, held for the run's whole life.

Two runs that would write the same files (a double launch, a batch job requeued while
the first still runs) would otherwise both succeed and leave a mix of two trajectories:
each file is written atomically, but chk-N, chk-LATEST, the adapters and one metrics
log would come from either run. So every writing command first takes, for each of its
outputs, an exclusive `flock` on a lock file beside it, named after the output's stem:

    runs/chk-ITERATION.gguf   ->  runs/.chk-ITERATION.lock   (the template: chk-1, chk-2, ...)
                                  runs/.chk-LATEST.lock      (its --fn-latest form)
    runs/metrics.jsonl        ->  runs/.metrics.lock         (metrics.png shares the stem)

A run that finds one of them held stops before loading anything, with one line naming
the holder (pid, host, start time and command, which the holder writes into the file).
Runs with other outputs in the same folder take other lock files and run side by side.

The kernel drops a `flock` when its process ends, however it ends: a lock left by a
run killed with `kill -9` is never an obstacle, the file is merely reused.
Lock files are removed when their run ends, by their holder, while it still holds the
lock. That is safe because every taker checks, once it has the lock, that the file it
locked is still the one at that path (same st_dev and st_ino) and starts over when it
is not: a run can lock a file that its holder unlinked a moment before, and without
the check two runs would then each hold a lock, one on the old file and one on a new
one. Nothing else ever deletes a lock file, so no run loses a lock it holds.
`flock` works on local file systems and, on Linux, on NFS (emulated with fcntl byte-range
locks); where a file system refuses locks, a notice says that runs sharing those
outputs cannot be detected and the run goes on.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .console import notice
from .errors import LlamatuneError
from .outputs import ITERATION, Out, check_new_run, check_training_paths, training_paths

NOT_SUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def lock_paths(out: Out) -> list[Path]:
    """The lock files of one output: `.STEM.lock` beside it, for the path as given and,
    for an ITERATION template, for its LATEST form too (another run may name that file
    directly)."""
    folder = out.concrete().parent.expanduser().resolve()     # symlinked folders: one lock
    stems = {out.path.stem, out.concrete().stem} if ITERATION in out.path.name else {out.path.stem}
    return [folder / f".{stem}.lock" for stem in sorted(stems)]


def holder_line(command: str) -> str:
    """What a holder writes into its lock files: who it is, for the run it blocks."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"pid {os.getpid()} on host {socket.gethostname()}, started {started}: llamatune {command}"


class Held(LlamatuneError):
    """Another run holds the lock of one of this run's outputs."""


class OutputLocks:
    """The locks of one run (see the module docstring); `release` ends them."""

    def __init__(self, command: str):
        self.line = holder_line(command)
        self.fds: dict[Path, int] = {}           # lock file -> open descriptor holding its flock
        self.made: list[Path] = []               # directories created for lock files, outermost first

    def take(self, outputs: Iterable[Out]) -> None:
        """Lock every output's lock files, in path order: of two runs that want some of the
        same locks, one gets all it wants and the other stops (never both)."""
        wanted: dict[Path, Out] = {}
        for out in outputs:
            for path in lock_paths(out):
                wanted.setdefault(path, out)     # two outputs may share a stem (metrics.jsonl, .png)
        for path in sorted(wanted):
            fd = self._lock(path, wanted[path])
            if fd is not None:
                self.fds[path] = fd

    def _lock(self, path: Path, out: Out) -> int | None:
        """An open descriptor of `path` holding its flock (None: the file system has no locks)."""
        while True:
            fd = self._open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = read_holder(fd)
                os.close(fd)
                raise Held(f"{out.label} {out.path}: another run writes these outputs ({other}): wait for it "
                           f"to end or choose other output names (lock {path})") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in NOT_SUPPORTED:
                    raise LlamatuneError(f"{path}: cannot lock ({e.strerror})") from None
                notice(f"{path.parent} does not support file locks: another run writing {out.path} "
                       "would not be detected")
                return None
            if _same_file(fd, path):             # not unlinked by its previous holder in between
                line = (self.line + "\n").encode()
                os.pwrite(fd, line, 0)           # over what a killed holder left, then cut to length
                os.ftruncate(fd, len(line))
                return fd
            os.close(fd)                         # locked a file no longer at `path`: start over

    def _open(self, path: Path) -> int:
        for _ in range(100):                     # a directory made here may be removed by a run
            try:                                 # that ends at this moment (release): make it again
                self._make_dirs(path.parent)
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise LlamatuneError(f"{path}: cannot create the lock file ({e.strerror})") from None
        raise LlamatuneError(f"{path}: cannot create the lock file (its directory keeps disappearing)")

    def _make_dirs(self, folder: Path) -> None:
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        for d in reversed(missing):
            try:
                d.mkdir()
                self.made.append(d)
            except FileExistsError:
                pass

    def release(self) -> None:
        """Remove each lock file while still holding it, then drop the lock; then remove the
        directories made for them if nothing else went in."""
        for path, fd in self.fds.items():
            try:
                if _same_file(fd, path):
                    path.unlink()
            except OSError:
                pass                             # a lock file left behind is harmless
            os.close(fd)
        self.fds.clear()
        for d in reversed(self.made):
            try:
                d.rmdir()
            except OSError:
                pass                             # not empty: the run (or another) wrote there
        self.made.clear()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def read_holder(fd: int, wait: float = 1.0) -> str:
    """The holder's line from a lock file it holds; it writes the line just after taking
    the lock, so an empty file is read again for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip().splitlines()
        if text or time.monotonic() > deadline:
            return text[0] if text else "a run that is just starting"
        time.sleep(0.02)


@contextmanager
def hold(outputs: Iterable[Out], command: str, enabled: bool = True) -> Iterator[None]:
    """Hold the locks of `outputs` for the body of the `with` (all or none: a run that
    finds one held releases those it took and raises `Held`). `command` names the run in
    its lock files; `enabled=False` (MPI ranks other than 0, which write nothing) takes none."""
    if not enabled:
        yield
        return
    locks = OutputLocks(command)
    try:
        locks.take(o for o in outputs if o.path is not None)
        yield
    finally:
        locks.release()


@contextmanager
def hold_training(opts, command: str, enabled: bool = True) -> Iterator[None]:
    """`hold` for a training command's outputs (outputs.training_paths), after
    check_training_paths, so that a path that cannot be written is reported as such;
    then, holding them (another run that holds them is named first), check_new_run.
    A --dry-run writes nothing and takes no lock."""
    if not enabled or opts.dry_run:
        yield
        return
    check_training_paths(opts)
    with hold(training_paths(opts)[1], command):
        check_new_run(opts)
        yield
