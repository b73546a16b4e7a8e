"""Checks on a file's tensors before anything computes with them: the type can be
dequantized (numba kernel, or the gguf package's slower one with a notice), and every
value is finite (quantized blocks scanned without dequantizing, kernels/finite.py).
Each failure is one error naming the file and the tensor."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from ..console import notice
from ..errors import LlamatuneError
from ..kernels import dequant, finite
from .gguf_io import GGUFFile, Tensor


def check_type(f: GGUFFile, t: Tensor) -> None:
    """Numba kernels cover the common types; anything else the gguf package can
    dequantize is used through it (slower) with a notice; the rest is an error."""
    if t.qtype in dequant.NUMBA_TYPES:
        return
    try:
        gguf.quants.dequantize(t.raw_rows()[:1], t.qtype)
    except (NotImplementedError, ValueError, KeyError, TypeError):
        raise LlamatuneError(f"{f.path}: tensor '{t.name}' has type {t.qtype.name}, which cannot be dequantized") from None
    notice(f"{f.path.name}: tensor type {t.qtype.name} ({t.name}) has no fast kernel; using the gguf package's dequantizer")


class NonFiniteError(LlamatuneError):
    """Weights holding inf or nan; the message names the file and the tensor."""


def _nonfinite_where(t: Tensor) -> str | None:
    """None when every value of `t` is finite, else which rows are not (for a message).
    Quantized tensors are scanned without dequantizing (kernels/finite.py)."""
    bad = finite.nonfinite_rows(t.raw_rows(), t.qtype, t.n_cols)
    if not bad.any():
        return None
    return f"{int(bad.sum())} of {len(bad)} rows, first row {int(np.argmax(bad))}"


def check_finite(path: Path, tensors, allow: bool = False) -> None:
    """Raise NonFiniteError for the first (name, Tensor) holding inf/nan; with `allow`,
    print one notice naming them instead."""
    bad = []
    for name, t in tensors:
        where = _nonfinite_where(t)
        if where is not None:
            if not allow:
                raise NonFiniteError(f"{path}: tensor '{name}' holds non-finite values (inf or nan) in {where}")
            bad.append(name)
    if bad:
        notice(f"{path.name}: {len(bad)} tensors hold non-finite values (inf or nan): {', '.join(bad[:4])}"
               + (", ..." if len(bad) > 4 else "") + "; results may be nan")


def float_array(path: Path, t: Tensor) -> np.ndarray:
    """An F32/F16 tensor (checkpoints, 2023 files, adapters read without a base) as a new
    finite f32 array in numpy shape; any other type or an inf/nan is an error naming it."""
    if t.qtype not in (QType.F32, QType.F16):
        raise LlamatuneError(f"{path}: tensor '{t.name}' has type {t.qtype.name}, expected F32 or F16")
    check_finite(path, [(t.name, t)])
    return np.array(t.data, np.float32).reshape(t.shape)
