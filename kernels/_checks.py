"""Argument checks shared by the CPU kernel wrappers (the kernels themselves check nothing)."""
import numpy as np


def check_array(op: str, name: str, a, shape, dtype) -> None:
    """Raise ValueError unless `a` is a C-contiguous numpy array of this shape and dtype."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
            and a.flags.c_contiguous):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{op}: {name} must be a C-contiguous {np.dtype(dtype)} "
                         f"array of shape {shape}, got {got}")


def check_gate(op: str, arrays: dict, stored=("g", "u")) -> None:
    """The operands of an elementwise gate (swiglu, geglu): every array (name -> array)
    C-contiguous, 2-D (N, F) like arrays["g"], of one float dtype (float32 or float64);
    with float32, the `stored` operands may instead be bf16 bits (uint16: the saved
    activations of bf16 training), and optional ones may be None."""
    g = arrays["g"]
    if not isinstance(g, np.ndarray) or g.ndim != 2 or g.dtype not in (np.float32, np.float64, np.uint16):
        raise ValueError(f"{op}: g must be a 2-D float32, float64 or uint16 (bf16) array (N, F)")
    floats = [a.dtype for k, a in arrays.items() if k not in stored and isinstance(a, np.ndarray)]
    dtype = floats[0] if floats else np.dtype(np.float32)
    for name, a in arrays.items():
        if a is None and name in stored:
            continue
        want = np.uint16 if (name in stored and isinstance(a, np.ndarray) and a.dtype == np.uint16
                             and dtype == np.float32) else dtype
        check_array(op, name, a, g.shape, want)
