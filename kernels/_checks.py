"""Argument checks shared by the CPU kernel wrappers (the kernels themselves check nothing)."""
import numpy as np


def check_array(op: str, name: str, a, shape, dtype) -> None:
    """Raise ValueError unless `a` is a C-contiguous numpy array of this shape and dtype."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
            and a.flags.c_contiguous):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{op}: {name} must be a C-contiguous {np.dtype(dtype)} "
                         f"array of shape {shape}, got {got}")


def check_gate(op: str, arrays: dict) -> None:
    """The operands of an elementwise gate (swiglu, geglu): arrays["g"] a 2-D float32
    or float64 array (N, F), every array (name -> array) C-contiguous of its dtype
    and shape."""
    g = arrays["g"]
    if not isinstance(g, np.ndarray) or g.ndim != 2 or g.dtype not in (np.float32, np.float64):
        raise ValueError(f"{op}: g must be a 2-D float32 or float64 array (N, F)")
    for name, a in arrays.items():
        check_array(op, name, a, g.shape, g.dtype)
