"""Argument checks shared by the CPU kernel wrappers (the kernels themselves check nothing)."""
import numpy as np


def check_array(op: str, name: str, a, shape, dtype) -> None:
    """Raise ValueError unless `a` is a C-contiguous numpy array of this shape and dtype."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
            and a.flags.c_contiguous):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{op}: {name} must be a C-contiguous {np.dtype(dtype)} "
                         f"array of shape {shape}, got {got}")
