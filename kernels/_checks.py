"""Argument checks shared by the CPU kernel wrappers (the kernels themselves check nothing)."""
import numpy as np


def check_array(op: str, name: str, a, shape, dtype) -> None:
    """Raise ValueError unless `a` is a C-contiguous numpy array of this shape and dtype."""
    if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
            and a.flags.c_contiguous):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{op}: {name} must be a C-contiguous {np.dtype(dtype)} "
                         f"array of shape {shape}, got {got}")


_STORED = ("g", "u", "g16", "u16")     # a gate's operands that may be bf16 bits


def check_gate(op: str, arrays: dict) -> None:
    """The operands of an elementwise gate (swiglu, geglu): every array (name -> array)
    C-contiguous, 2-D (N, F) like arrays["g"], of one float dtype (float32 or float64).
    With float32, g and u may instead be bf16 bits (uint16: the saved activations of bf16
    training); g16 and u16, the forward's optional uint16 buffers for keeping float32 g and
    u rounded, go together or not at all."""
    g = arrays["g"]
    if not isinstance(g, np.ndarray) or g.ndim != 2 or g.dtype not in (np.float32, np.float64, np.uint16):
        raise ValueError(f"{op}: g must be a 2-D float32, float64 or uint16 (bf16) array (N, F)")
    kept = [arrays.get("g16"), arrays.get("u16")]
    if (kept[0] is None) != (kept[1] is None) or (kept[0] is not None and g.dtype != np.float32):
        raise ValueError(f"{op}: g16 and u16 go together, with float32 g and u")
    dtype = next((a.dtype for k, a in arrays.items() if k not in _STORED and isinstance(a, np.ndarray)),
                 np.dtype(np.float32))
    for name, a in arrays.items():
        if name in ("g16", "u16"):
            if a is not None:
                check_array(op, name, a, g.shape, np.uint16)
            continue
        bits = name in ("g", "u") and isinstance(a, np.ndarray) and a.dtype == np.uint16 and dtype == np.float32
        check_array(op, name, a, g.shape, np.uint16 if bits else dtype)
