"""Input statistics of the frozen base weights, collected by the training forward:
what llama-imatrix collects (formats/imatrix.py), so that export-lora and
llama-quantize --imatrix can weight a merge's rounding by the data it was trained on.

Per base weight W seen by a block linear (models/forward.py `Forward.linear` calls
`observer(name, x)`; the loss head's output.weight is left out, as llama-imatrix
without --process-output):

    sums[W]   += sum over the micro-batch's counted tokens of x^2, per input column
    counts[W] += the number of counted tokens

What counts: in each row, the tokens up to its last loss target -- every token that
bears on the loss (a chat prompt too). The tokens after it (padding, a trailing
unmasked turn) change nothing and are left out. Weights fed the same array (q, k, v;
gate and up) share one sum, as calibration.InputStats.

What is seen: the forward of each training micro-batch, once. Backward's recompute
(--checkpointing layer) and evaluations run with the observer off (step.py). A step's
sums are kept apart until the guard accepts the step: the trainer then adds them
(`commit`) or drops them (`discard`: a skipped step's activations may not be finite).
A save made while a step is pending holds the sums of the steps before it, so every
save matches the parameters it is saved with.

Precision: each micro-batch's sums in float64 (on the step's device), the running
totals in float32, as llama.cpp's imatrix keeps them and as the checkpoint stores
them: a resumed run goes on from the same bits and writes the same file as one that
was not interrupted. Under MPI each rank's step sums are gathered and added in rank
order (`commit`), so every rank holds the same totals and rank 0 writes them.

Cost per linear: one pass over x (N, n_in) in float64 sums, against the matmul's
2 N n_in n_out flops; q/k/v and gate/up share theirs.
"""
from __future__ import annotations

import json

import numpy as np

from ..errors import LlamatuneError
from ..formats.gguf_io import KV, TensorOut, kv, tensor_out
from ..formats.imatrix import SUMS, IMatrix

PREFIX = "imatrix."                     # checkpoint tensors: imatrix.<weight>.in_sum2
KV_COUNTS = "llamatune.imatrix"         # checkpoint KV: {"rows": R, "counts": {weight: tokens}}


class TrainingStats:
    """Running imatrix statistics of a training run; see the module docstring."""

    def __init__(self, xp=np, dataset: str = "", chunk_size: int = 0):
        self.xp, self.dataset, self.chunk_size = xp, dataset, chunk_size
        self.key: dict[str, str] = {}                # weight name -> the first weight reading the same input
        self.sums: dict[str, np.ndarray] = {}        # key -> (n_in,) float32 running total (host)
        self.counts: dict[str, int] = {}             # key -> tokens counted
        self.rows = 0                                # training rows with a counted token (imatrix.chunk_count)
        self._step: dict[str, object] = {}           # key -> (n_in,) float64 of the pending step (device)
        self._step_counts: dict[str, int] = {}
        self._step_rows = 0
        self._real = None                            # (B, T) bool: counted tokens of the current micro-batch
        self._picks: dict[int, tuple[object, int]] = {}   # N -> (row indices or None, count)
        self._prev: tuple[object, str] | None = None
        self._restored: dict[str, tuple[np.ndarray, int]] = {}   # name -> totals from a checkpoint

    # ------------------------------------------------------------------ collection
    @staticmethod
    def counted(targets: np.ndarray) -> np.ndarray:
        """(B, T) bool: the tokens of each row up to its last target (>= 0)."""
        t = np.asarray(targets).reshape(np.shape(targets)[0], -1)
        has = t >= 0
        last = np.where(has.any(axis=1), t.shape[1] - 1 - np.argmax(has[:, ::-1], axis=1), -1)
        return np.arange(t.shape[1])[None, :] <= last[:, None]

    def batch(self, targets: np.ndarray) -> None:
        """The next micro-batch's targets (B, T): which of its tokens count."""
        self._real = self.counted(targets)
        self._picks.clear()
        self._prev = None
        self._step_rows += int(self._real.any(axis=1).sum())

    def _pick(self, N: int):
        """(row indices on the device or None for all, count) for an input of N rows: the
        micro-batch's first N // B columns (a trimmed graph runs the leading columns)."""
        if N not in self._picks:
            B = self._real.shape[0]
            real = self._real[:, : N // B].reshape(-1)
            if real.size != N:
                raise ValueError(f"statistics: an input of {N} rows in a micro-batch of {B} rows")
            idx = None if real.all() else self.xp.asarray(np.flatnonzero(real))
            self._picks[N] = (idx, int(real.sum()))
        return self._picks[N]

    def __call__(self, name: str, x) -> None:
        """Forward's observer: x (N, n_in) is the input of weight `name`."""
        if self._real is None:
            raise ValueError("statistics: batch(targets) must be given before the forward")
        prev_x, prev_key = self._prev if self._prev is not None else (None, None)
        if name not in self.key:
            self.key[name] = prev_key if x is prev_x else name
            if name in self._restored and self.key[name] == name:      # a resumed run goes on from its totals
                self.sums[name], self.counts[name] = self._restored[name]
            self._restored.pop(name, None)
        key = self.key[name]
        self._prev = (x, key)
        if x is prev_x and key == prev_key:
            return                                           # the same input, already counted
        idx, n = self._pick(x.shape[0])
        if n == 0:
            return
        xs = x if idx is None else x[idx]
        sq = self.xp.einsum("ij,ij->j", xs, xs, dtype=np.float64)
        if key in self._step:
            self._step[key] += sq
        else:
            self._step[key] = sq
        self._step_counts[key] = self._step_counts.get(key, 0) + n

    def discard(self) -> None:
        """Forget the pending step (skipped by the guard, or a forward that is no step), and
        the last input seen: a view of the step's buffers, which it would keep alive."""
        self._step.clear()
        self._step_counts.clear()
        self._step_rows = 0
        self._real = None
        self._prev = None

    def commit(self, world=None) -> None:
        """Add the pending step to the totals (under MPI: every rank's, in rank order)."""
        mine = ({k: (v.get() if hasattr(v, "get") else np.asarray(v)) for k, v in self._step.items()},
                dict(self._step_counts), self._step_rows)
        every = [mine] if world is None or world.size == 1 else world.allgather(mine, "imatrix statistics")
        step_sums: dict[str, np.ndarray] = {}                 # the ranks' sums in float64, in rank order,
        for step, counts, rows in every:                      # as one process's micro-batches add up
            for k, s in step.items():
                step_sums[k] = s if k not in step_sums else step_sums[k] + s
                self.counts[k] = self.counts.get(k, 0) + counts[k]
            self.rows += rows
        for k, s in step_sums.items():                        # then rounded to float32 once a step
            total = self.sums.get(k)
            self.sums[k] = s.astype(np.float32) if total is None else (total + s).astype(np.float32)
        self.discard()

    # ------------------------------------------------------------------ outputs and checkpoints
    def _totals(self) -> dict[str, tuple[np.ndarray, int]]:
        """Per weight name: (float32 sums, count); restored ones not yet seen again included."""
        out = dict(self._restored)
        for name, key in self.key.items():
            if key in self.sums:
                out[name] = (self.sums[key], self.counts[key])
        return out

    def imatrix(self) -> IMatrix:
        """The totals per weight name, as llama.cpp's imatrix holds them."""
        m = IMatrix(datasets=[self.dataset] if self.dataset else [], chunk_count=self.rows,
                    chunk_size=self.chunk_size)
        for name, (sums, count) in sorted(self._totals().items()):
            m.sums[name], m.counts[name] = sums.astype(np.float64), count
        return m

    def checkpoint(self) -> tuple[list[KV], list[TensorOut]]:
        """What a checkpoint keeps: `imatrix.<weight>.in_sum2` (float32, exactly the
        totals) and one KV with the counts (JSON: integers beyond float32's range)."""
        totals = sorted(self._totals().items())
        counts = {"rows": self.rows, "counts": {name: c for name, (_, c) in totals}}
        return ([kv(KV_COUNTS, json.dumps(counts))],
                [tensor_out(PREFIX + name + SUMS, sums) for name, (sums, _) in totals])

    def restore(self, file) -> bool:
        """Take the totals a checkpoint (GGUFFile) holds; False when it holds none (a
        checkpoint written without them)."""
        raw = file.get(KV_COUNTS)
        if raw is None:
            return False
        try:
            counts = json.loads(raw)
            self.rows = int(counts["rows"])
            for name, c in counts["counts"].items():
                sums = np.asarray(file.tensors[PREFIX + name + SUMS].data, np.float32).reshape(-1)
                self._restored[name] = (sums.copy(), int(c))
        except (ValueError, KeyError, TypeError):
            raise LlamatuneError(f"{file.path}: the checkpoint's imatrix statistics are damaged") from None
        return True
