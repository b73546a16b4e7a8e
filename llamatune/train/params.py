"""All trainable parameters in one flat f32 buffer, llm.c style.

`ParamBuffer` owns four flat arrays of the same length: the parameters, their
gradients and the two AdamW moments (none for SGD: `moments=False`, half the
memory). Each named tensor is a view into them, so the optimizer runs over
contiguous memory and a checkpoint is four arrays (two without moments).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ParamSpec:
    name: str                 # e.g. "blk.0.attn_q.weight.lora_a" or "blk.0.attn_q.weight"
    shape: tuple[int, ...]    # numpy order

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class ParamBuffer:
    def __init__(self, specs: list[ParamSpec], dtype=np.float32, moments: bool = True, moments_bf16: bool = False):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate parameter names")
        self.specs = list(specs)
        self.by_name = {s.name: s for s in self.specs}
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for s in self.specs:
            self.offsets[s.name] = (off, off + s.size)
            off += s.size
        self.size = off
        # float64 only for finite-difference tests; training is float32
        self.data = np.zeros(off, dtype)          # (P,) parameters
        self.grad = np.zeros(off, dtype)          # (P,) gradients, accumulated by backward
        mdt = np.uint16 if moments_bf16 else dtype   # bf16 moments: their bits (kernels/bf16.py), 0 is +0.0
        self.m = np.zeros(off, mdt) if moments else None     # (P,) AdamW first moments (None: SGD)
        self.v = np.zeros(off, mdt) if moments else None     # (P,) AdamW second moments
        self.stale: set[str] = set()              # gradients cleared lazily (zero_grad(lazy=True))

    def _view(self, flat: np.ndarray, name: str) -> np.ndarray:
        lo, hi = self.offsets[name]
        return flat[lo:hi].reshape(self.spec(name).shape)

    def spec(self, name: str) -> ParamSpec:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.offsets

    def __getitem__(self, name: str) -> np.ndarray:
        return self._view(self.data, name)

    def grad_of(self, name: str) -> np.ndarray:
        return self._view(self.grad, name)

    def slices(self):
        """(spec, lo, hi) for every tensor, in buffer order."""
        for s in self.specs:
            lo, hi = self.offsets[s.name]
            yield s, lo, hi

    def zero_grad(self, lazy: bool = False) -> None:
        """Clear the gradients; `lazy` (large trained tensors: full finetuning) only marks
        them stale, and each is cleared when first added to (`grad_to_add`), or written
        without clearing by its first product (`grad_to_write`), or by `settle`: one pass
        over the gradient memory fewer per step, and no add pass for the first product."""
        if lazy:
            self.stale = set(self.offsets)
            return
        self.grad.fill(0.0)
        self.stale = set()

    def grad_to_add(self, name: str) -> np.ndarray:
        """The gradient of `name`, ready to be added to (cleared first if stale)."""
        g = self.grad_of(name)
        if name in self.stale:
            g.fill(0.0)
            self.stale.discard(name)
        return g

    def grad_to_write(self, name: str) -> tuple[np.ndarray, bool]:
        """(gradient of `name`, whether it is stale): a stale one is to be written whole
        (`=`), no longer stale afterwards; else added to."""
        fresh = name in self.stale
        self.stale.discard(name)
        return self.grad_of(name), fresh

    def settle(self) -> None:
        """Clear the gradients still stale (no product wrote them): every one is then valid."""
        for name in self.stale:
            self.grad_of(name).fill(0.0)
        self.stale = set()

    def to_device(self, backend) -> None:
        """Move the four flat arrays to the backend's device (initialize and load
        checkpoints on the host first; the optimizer then runs where they are)."""
        self.backend = backend
        for attr in ("data", "grad", "m", "v"):
            if getattr(self, attr) is not None:
                setattr(self, attr, backend.to_device(getattr(self, attr)))

    def host(self, flat) -> np.ndarray:
        """A host (numpy) copy or view of one of the flat arrays."""
        backend = getattr(self, "backend", None)
        return flat if backend is None else backend.to_host(flat)

    def host_views(self, flat) -> dict[str, np.ndarray]:
        """Named host views of a flat array's host copy (for writing files)."""
        h = self.host(flat)
        return {s.name: h[lo:hi].reshape(s.shape) for s, lo, hi in self.slices()}

    @property
    def has_moments(self) -> bool:
        return self.m is not None

    @property
    def nbytes(self) -> int:
        """Parameters, gradients and (AdamW) moments."""
        return (4 if self.has_moments else 2) * self.data.nbytes


class DenseWeights:
    """Every weight is a parameter (train-from-scratch); arrays live wherever params do."""
    trainable = True
    lazy_grads = False
    rope_freqs = rope_long = rope_short = None   # no rope factor vectors (models/rope.py)

    def __init__(self, params: ParamBuffer, tied: bool = False):
        self.params = params
        self.tied = tied
        self.tensors = {}                     # stored tensors: none, every weight is a parameter

    def _name(self, name: str) -> str:
        return "token_embd.weight" if self.tied and name == "output.weight" else name

    @property
    def head_rows(self) -> int:
        """The head is a parameter already in f32: one block."""
        return self.params.spec(self._name("output.weight")).shape[0]

    def matrix(self, name: str):
        return self.params[self._name(name)]

    def matrix_rows(self, name: str, lo: int, hi: int):
        return self.params[self._name(name)][lo:hi]

    def is_scratch(self, name: str) -> bool:
        return False                          # matrices are the parameters themselves

    def vector(self, name: str):
        return self.params[name] if name in self.params else None

    def embed(self, ids, out, name: str = "token_embd.weight") -> None:
        out[...] = self.params[name][ids]

    def grad(self, name: str):
        return self.params.grad_of(self._name(name))

    def grad_to_write(self, name: str) -> tuple[np.ndarray, bool]:
        return self.grad(name), False

    def is_kept_bf16(self, name: str) -> bool:
        return False                          # trained weights multiply in f32: no bf16 copies
