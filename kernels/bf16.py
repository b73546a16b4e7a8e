"""bfloat16 conversions and bf16 x bf16 -> f32 products (oneDNN's matmul primitive).

bf16 arrays are held as ``np.uint16`` (the upper half of a float32's bits): numpy has
no bfloat16 dtype, and the only operations here are bit conversions and a library
product, so a dtype package would add nothing but a dependency.

- ``to_bf16(out, x)``: float32 -> bf16, round to nearest, ties to even; NaN stays a
  (quiet) NaN with its sign, as oneDNN's ``bfloat16_t`` and PyTorch convert;
  infinities and subnormals are kept, finite values past the largest bf16 round to
  infinity. ``from_bf16(out, x)``: exact (bits << 16).
- ``dequantize_into(data, qtype, out)``: a GGUF tensor's rows straight into a bf16
  buffer (half the bytes of a float32 expansion): ``kernels/dequant.py``'s kernels
  round each value as they store it, bit for bit ``to_bf16(dequant_f32(...))``.
- ``gemm(out, a, b, trans_b, accumulate)``: ``out (M, N) [+]= a (M, K) @ b`` with
  ``b (K, N)``, or ``b (N, K)`` used as ``b^T`` when ``trans_b`` (x @ W^T in the
  forward, dy @ W in the backward, W never transposed in memory). Inputs bf16,
  products accumulated in float32 by oneDNN's matmul primitive (AMX or AVX512_BF16
  brgemm kernels); or inputs float32 (its avx512 kernels), for the adapters' `+=`.
  oneDNN's BLAS-like ``dnnl_gemm_bf16bf16f32`` measured slower on the training shapes
  of a Sapphire Rapids CPU (1.3-2.3x at K = 512 and 896; its verbose line names no
  kernel) and level only at (2048, 4096) x (4096, 4096) (bench/bf16_gemm.py --api),
  hence the primitive.

The library: ``libdnnl.so.3`` from the PyPI package ``onednn-cpu-gomp`` (the
``cpu-bf16`` extra), found once, lazily, at the first use; ``available()`` says
whether it loaded and ``unavailable_reason()`` why not. That build runs its threads
on GNU OpenMP, the runtime numba's OpenMP threading layer uses (both link the
system's libgomp.so.1, loaded once per process): one pool of workers for both, with
the same short spin (GOMP_SPINCOUNT, llamatune/__init__.py). Each product first sets
OpenMP's thread count for the calling thread to ``numba.get_num_threads()`` when it
differs, so oneDNN runs on exactly the threads numba's kernels run on.

A primitive is built (and JIT-compiled by oneDNN) once per (M, N, K, trans_b,
accumulate, threads, strides, input type) and kept; a training step repeats a handful
of shapes.
"""
from __future__ import annotations

import ctypes
import threading
from importlib import metadata
from pathlib import Path

import numpy as np
from numba import njit, prange

from . import dequant
from .dequant import _bits_to_f32, _f32_to_bf16
from ._checks import check_array
from .cpuinfo import cpu_bf16_flags

__all__ = ["to_bf16", "to_bf16_rows", "split_into", "split_rows_into", "split_ref", "from_bf16",
           "to_bf16_ref", "from_bf16_ref", "dequantize_into", "gemm", "batched", "gemm_ref", "available", "unavailable_reason", "Unavailable",
           "library_version", "implementation", "cpu_bf16_flags"]


# ---------------------------------------------------------------- conversions
# the rounding itself is dequant._f32_to_bf16 (one rule for conversions and for the
# dequantization kernels' bf16 stores)
@njit(cache=True, parallel=True)
def _to_bf16(out, x):
    for i in prange(x.shape[0]):
        out[i] = _f32_to_bf16(x[i])


@njit(cache=True, parallel=True)
def _to_bf16_rows(out, x):
    # 2-D, rows contiguous but apart (a column slice such as the head's logits[:, lo:hi]);
    # out's rows may be wider than x's (their first columns written)
    n = x.shape[1]
    for i in prange(x.shape[0]):
        o = out[i, :n]
        for j in range(n):
            o[j] = _f32_to_bf16(x[i, j])


@njit(cache=True, parallel=True)
def _split_into(out, v, col, order):
    # out[i, col + p r + j] = part order[p] of v[i, j] (0: hi = bf16(v), 1: lo = bf16(v - hi)),
    # and out[i, col + len(order) r:] = 0
    R, r = v.shape
    end = col + len(order) * r
    for i in prange(R):
        for j in range(r):
            x = v[i, j]
            hi = _f32_to_bf16(x)
            lo = _f32_to_bf16(x - _bits_to_f32(np.uint32(hi) << np.uint32(16)))
            for p in range(len(order)):
                out[i, col + p * r + j] = hi if order[p] == 0 else lo
        for c in range(end, out.shape[1]):
            out[i, c] = 0


@njit(cache=True, parallel=True)
def _to_bf16_transposed(out, x):
    # out (n, N) = rounded x (N, n) transposed, in 64 x 64 tiles (column strips in parallel)
    N, n = x.shape
    for jb in prange((n + 63) // 64):
        j1 = min(n, jb * 64 + 64)
        for i0 in range(0, N, 64):
            i1 = min(N, i0 + 64)
            for j in range(jb * 64, j1):
                for i in range(i0, i1):
                    out[j, i] = _f32_to_bf16(x[i, j])


@njit(cache=True, parallel=True)
def _from_bf16(out_bits, x):
    for i in prange(x.shape[0]):
        out_bits[i] = np.uint32(x[i]) << np.uint32(16)


def _flat(op: str, out, x, out_dtype, x_dtype):
    if not (isinstance(x, np.ndarray) and x.dtype == x_dtype and x.flags.c_contiguous):
        raise ValueError(f"{op}: x must be a C-contiguous {np.dtype(x_dtype)} array"
                         + (" (or 2-D with contiguous rows)" if op == "to_bf16" else ""))
    check_array(op, "out", out, x.shape, out_dtype)
    if not out.flags.writeable:
        raise ValueError(f"{op}: out must be writeable")
    return out.reshape(-1), x.reshape(-1)


def to_bf16(out: np.ndarray, x: np.ndarray) -> None:
    """out (uint16, bf16 bits) = x (float32) rounded to nearest even; any shape, C order,
    or x 2-D with contiguous rows (a column slice: rounded in place of a copy)."""
    if (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2
            and not x.flags.c_contiguous and _rows_contiguous(x)):
        check_array("to_bf16", "out", out, x.shape, np.uint16)
        if not out.flags.writeable:
            raise ValueError("to_bf16: out must be writeable")
        _to_bf16_rows(out, x)
        return
    out, x = _flat("to_bf16", out, x, np.uint16, np.float32)
    _to_bf16(out, x)


def to_bf16_rows(out: np.ndarray, x: np.ndarray) -> None:
    """out[:, :n] (uint16, bf16 bits) = x (R, n) float32 rounded to nearest even, out a
    C-contiguous (R, >= n) array whose other columns are left as they are (the product
    operand whose K axis carries an adapter's parts: `split_into`); x's rows contiguous."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and _rows_contiguous(x)):
        raise ValueError("to_bf16_rows: x must be a 2-D float32 array with contiguous rows")
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.ndim == 2 and out.flags.c_contiguous
            and out.flags.writeable and out.shape[0] == x.shape[0] and out.shape[1] >= x.shape[1]):
        raise ValueError(f"to_bf16_rows: out must be a writeable C-contiguous uint16 array of {x.shape[0]} rows "
                         f"at least {x.shape[1]} wide")
    _to_bf16_rows(out, x)


SPLIT_ORDERS = {"a": (0, 0, 1), "b": (0, 1, 0)}
"""The parts of a float32 operand v = hi + lo (hi = bf16(v), lo = bf16(v - hi)) in the
K axis of a bf16 product: [a_hi a_hi a_lo] against [b_hi b_lo b_hi] gives
a_hi b_hi + a_hi b_lo + a_lo b_hi, the product to about 2^-16 (a_lo b_lo dropped), each
bf16 x bf16 term exact in the float32 accumulation."""


def split_into(out: np.ndarray, v: np.ndarray, col: int, side: str) -> None:
    """out[:, col:] = v (R, r) float32 as its three bf16 parts (SPLIT_ORDERS[side]: "a"
    for the left operand, "b" for the right), r columns each, then zeros to the end of
    out's rows (its padding). out: C-contiguous uint16 (R, >= col + 3 r)."""
    if not (isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim == 2):
        raise ValueError("split_into: v must be a 2-D float32 array")
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.ndim == 2 and out.flags.c_contiguous
            and out.flags.writeable and out.shape[0] == v.shape[0] and 0 <= col
            and col + 3 * v.shape[1] <= out.shape[1]):
        raise ValueError(f"split_into: out must be a writeable C-contiguous uint16 array of {v.shape[0]} rows "
                         f"with room for 3 x {v.shape[1]} columns from column {col}")
    _split_into(out, v, col, SPLIT_ORDERS[side])


def split_rows_into(out: np.ndarray, v: np.ndarray, row: int, side: str) -> None:
    """out[row:] = v (r, n) float32 as its three bf16 parts stacked as rows
    (SPLIT_ORDERS[side]), then zero rows to the end of out: the parts on the K axis of a
    right operand stored (K, n), the rows of A under W's in dx = [dy | ...] [W ; ...]."""
    if not (isinstance(v, np.ndarray) and v.dtype == np.float32 and v.ndim == 2):
        raise ValueError("split_rows_into: v must be a 2-D float32 array")
    r, n = v.shape
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.ndim == 2 and out.flags.c_contiguous
            and out.flags.writeable and out.shape[1] == n and 0 <= row and row + 3 * r <= out.shape[0]):
        raise ValueError(f"split_rows_into: out must be a writeable C-contiguous uint16 array {n} wide "
                         f"with room for 3 x {r} rows from row {row}")
    _split_into(out.T, v.T, row, SPLIT_ORDERS[side])      # split_into's kernel on the transposed views


def split_ref(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Numpy reference of the parts: (hi, lo) bf16 bits of v."""
    hi = to_bf16_ref(v)
    lo = to_bf16_ref(np.asarray(v, np.float32) - from_bf16_ref(hi))
    return hi, lo


def to_bf16_transposed(out: np.ndarray, x: np.ndarray) -> None:
    """out (n, N) uint16 = to_bf16 of x (N, n) float32 (C order), transposed: x^T as the
    left operand of a product over tokens (x^T x), without a strided copy."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous):
        raise ValueError("to_bf16_transposed: x must be a 2-D C-contiguous float32 array")
    check_array("to_bf16_transposed", "out", out, x.shape[::-1], np.uint16)
    if not out.flags.writeable:
        raise ValueError("to_bf16_transposed: out must be writeable")
    _to_bf16_transposed(out, x)


def from_bf16(out: np.ndarray, x: np.ndarray) -> None:
    """out (float32) = x (uint16 bf16 bits), exact; any shape, C order."""
    out, x = _flat("from_bf16", out, x, np.float32, np.uint16)
    _from_bf16(out.view(np.uint32), x)


def to_bf16_ref(x: np.ndarray) -> np.ndarray:
    """Numpy reference of to_bf16 (new array)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def from_bf16_ref(x: np.ndarray) -> np.ndarray:
    """Numpy reference of from_bf16 (new array)."""
    return (np.asarray(x, np.uint16).astype(np.uint32) << 16).view(np.float32)


# ------------------------------------------------------ dequantization to bf16
def dequantize_into(data: np.ndarray, qtype: int, out: np.ndarray, n_cols: int | None = None) -> None:
    """out (n_rows, n_cols) uint16 = to_bf16(dequant(data)): the types of
    kernels/dequant.py (``dequant.NUMBA_TYPES``), bit for bit. The dequantization
    kernels round each value to bf16 as they store it (their uint16 specialization), so
    no float32 expansion is written: a Q4_K block of 1536 x 512 in 0.07 ms against 0.24
    through a float32 scratch and a rounding pass. With n_cols, out's rows may be wider:
    out[:, :n_cols] is written, the rest left as it is."""
    data = np.asarray(data)
    if not (isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.ndim == 2
            and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("dequantize_into: out must be a writeable C-contiguous 2-D uint16 array")
    n_rows = out.shape[0]
    if data.ndim != 2 or data.shape[0] != n_rows:
        raise ValueError(f"dequantize_into: data must be 2-D with {n_rows} rows, got shape {data.shape}")
    dequant.dequantize_into(data, qtype, out, n_cols)


# ---------------------------------------------------------------- the library
_BF16, _F32 = 2, 3                                  # dnnl_data_type_t
_ARG_SRC, _ARG_WEIGHTS, _ARG_DST, _ARG_SCRATCHPAD = 1, 33, 17, 80   # DNNL_ARG_*
_SCRATCHPAD_USER = 1                                # dnnl_scratchpad_mode_user
_QUERY_SCRATCHPAD_MD = 136                          # dnnl_query_scratchpad_md
_RUNTIME_OMP, _RUNTIME_SEQ = 2, 1                   # DNNL_RUNTIME_*
_QUERY_IMPL_INFO_STR = 8                            # dnnl_query_impl_info_str
_VP = ctypes.c_void_p
_DIMS = ctypes.c_int64 * 12                         # dnnl_dims_t


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _VP)]


class Unavailable(Exception):
    """The library cannot be used here; the message says why (one line)."""


def _library_paths() -> list[str]:
    """Where libdnnl.so.3 may be: the onednn-cpu-gomp package's own copy, then the
    system's loader path."""
    paths = []
    try:
        for f in metadata.files("onednn-cpu-gomp") or []:
            if f.name == "libdnnl.so.3":
                paths.append(str(Path(f.locate()).resolve()))
    except metadata.PackageNotFoundError:
        pass
    return paths + ["libdnnl.so.3"]


def _load_library() -> ctypes.CDLL:
    """The first libdnnl.so.3 that loads; Unavailable when none does."""
    errors = []
    for path in _library_paths():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(str(e).split(":")[-1].strip())
    raise Unavailable("oneDNN (libdnnl.so.3) is not installed: pip install 'llamatune[cpu-bf16]'"
                      + (f" ({errors[-1]})" if errors else ""))


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN {call} failed with status {status}")


class _Library:
    """libdnnl loaded: a CPU engine and stream, and the matmul primitives built so far."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        if v.major < 3:
            raise Unavailable(f"oneDNN {self.version} is too old (3.x needed)")
        if v.cpu_runtime not in (_RUNTIME_OMP, _RUNTIME_SEQ):
            raise Unavailable(f"oneDNN {self.version} is not an OpenMP build (runtime "
                              f"{v.cpu_runtime}): pip install onednn-cpu-gomp")
        for name in ("dnnl_engine_create", "dnnl_stream_create", "dnnl_stream_wait",
                     "dnnl_memory_desc_create_with_strides", "dnnl_matmul_primitive_desc_create",
                     "dnnl_primitive_desc_query", "dnnl_primitive_create", "dnnl_memory_create",
                     "dnnl_memory_set_data_handle", "dnnl_primitive_execute",
                     "dnnl_primitive_attr_create", "dnnl_post_ops_create",
                     "dnnl_post_ops_append_sum", "dnnl_primitive_attr_set_post_ops",
                     "dnnl_primitive_attr_set_scratchpad_mode"):
            getattr(lib, name).restype = ctypes.c_int
        lib.dnnl_engine_create.argtypes = [ctypes.POINTER(_VP), ctypes.c_int, ctypes.c_size_t]
        lib.dnnl_stream_create.argtypes = [ctypes.POINTER(_VP), _VP, ctypes.c_uint]
        lib.dnnl_memory_desc_create_with_strides.argtypes = [ctypes.POINTER(_VP), ctypes.c_int,
                                                             _DIMS, ctypes.c_int, _DIMS]
        lib.dnnl_memory_set_data_handle.argtypes = [_VP, _VP]
        for name in ("dnnl_memory_desc_destroy", "dnnl_post_ops_destroy", "dnnl_primitive_attr_destroy",
                     "dnnl_primitive_desc_destroy", "dnnl_memory_destroy", "dnnl_primitive_destroy"):
            getattr(lib, name).argtypes = [_VP]
        lib.dnnl_post_ops_append_sum.argtypes = [_VP, ctypes.c_float, ctypes.c_int32, ctypes.c_int]
        lib.dnnl_primitive_attr_set_scratchpad_mode.argtypes = [_VP, ctypes.c_int]
        lib.dnnl_primitive_desc_query_md.restype = _VP
        lib.dnnl_primitive_desc_query_md.argtypes = [_VP, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [_VP]
        lib.dnnl_primitive_execute.argtypes = [_VP, _VP, ctypes.c_int, ctypes.POINTER(_ExecArg)]
        self.engine, self.stream = _VP(), _VP()
        _check(lib.dnnl_engine_create(ctypes.byref(self.engine), 1, 0), "engine_create")  # dnnl_cpu
        _check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, 1), "stream_create")
        # OpenMP's per-thread thread count: the libgomp that libdnnl (and numba) loaded
        self.gomp = ctypes.CDLL("libgomp.so.1") if v.cpu_runtime == _RUNTIME_OMP else None
        self.primitives: dict[tuple, tuple] = {}
        self.lock = threading.Lock()

    def _desc(self, dims, strides, dtype) -> _VP:
        md = _VP()
        _check(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(dims), _DIMS(*dims), dtype, _DIMS(*strides)), "memory_desc_create")
        return md

    def primitive(self, M: int, N: int, K: int, trans_b: bool, accumulate: bool, threads: int,
                  lda: int = 0, ldb: int = 0, ldc: int = 0, f32: bool = False, trans_a: bool = False,
                  out_bf16: bool = False):
        """(primitive, [src, weights, dst memories], exec args, implementation name);
        ld*: the row strides in elements (0: the row length); f32: float32 inputs;
        trans_a: a held as (K, M); out_bf16: the float32 result stored rounded to bf16."""
        lda, ldb, ldc = lda or (M if trans_a else K), ldb or (K if trans_b else N), ldc or N
        key = (M, N, K, trans_b, accumulate, threads, lda, ldb, ldc, f32, trans_a, out_bf16)
        if key in self.primitives:
            return self.primitives[key]
        a = self._desc((M, K), (1, lda) if trans_a else (lda, 1), _F32 if f32 else _BF16)
        b = self._desc((K, N), (1, ldb) if trans_b else (ldb, 1), _F32 if f32 else _BF16)
        c = self._desc((M, N), (ldc, 1), _BF16 if out_bf16 else _F32)
        self.primitives[key] = self.build((a, b, c), accumulate, f"{M}x{K} @ {K}x{N}")[:4]
        return self.primitives[key]

    def build(self, mds, accumulate: bool, what: str, scratchpad: bool = False):
        """(primitive, [src, weights, dst memories], exec args, implementation name, scratchpad
        buffer or None) of the matmul on memory descriptors `mds` (destroyed here: the
        primitive and memories keep copies); `accumulate`: out += a @ b (a sum post-op);
        `scratchpad`: the primitive's own scratchpad (user mode, its buffer returned to be
        kept) instead of the library's shared one."""
        lib = self.lib
        attr = post_ops = None
        if accumulate or scratchpad:
            attr = _VP()
            _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "primitive_attr_create")
        if scratchpad:
            _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _SCRATCHPAD_USER), "attr_set_scratchpad_mode")
        if accumulate:
            post_ops = _VP()
            _check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post_ops_create")
            _check(lib.dnnl_post_ops_append_sum(post_ops, 1.0, 0, 0), "post_ops_append_sum")
            _check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "attr_set_post_ops")
        pd, prim = _VP(), _VP()
        _check(lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), self.engine, *mds[:2], None, mds[2], attr),
               f"matmul_primitive_desc_create ({what})")
        impl = ctypes.c_char_p()
        _check(lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO_STR, 0, ctypes.byref(impl)),
               "primitive_desc_query")
        _check(lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive_create")
        mems = []
        for md in mds:
            mem = _VP()
            _check(lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, None), "memory_create")
            mems.append(mem)
            lib.dnnl_memory_desc_destroy(md)
        args = [_ExecArg(_ARG_SRC, mems[0]), _ExecArg(_ARG_WEIGHTS, mems[1]), _ExecArg(_ARG_DST, mems[2])]
        buffer = None
        if scratchpad:
            md = _VP(lib.dnnl_primitive_desc_query_md(pd, _QUERY_SCRATCHPAD_MD, 0))
            buffer = np.empty(lib.dnnl_memory_desc_get_size(md) + 64, np.uint8)
            if buffer.size > 64:
                mem = _VP()
                _check(lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine,
                                              _VP(-(-buffer.ctypes.data // 64) * 64)), "memory_create")
                args.append(_ExecArg(_ARG_SCRATCHPAD, mem))
        if post_ops is not None:
            lib.dnnl_post_ops_destroy(post_ops)
        if attr is not None:
            lib.dnnl_primitive_attr_destroy(attr)
        lib.dnnl_primitive_desc_destroy(pd)
        return prim, mems, (_ExecArg * len(args))(*args), (impl.value or b"?").decode(), buffer

    def threads(self) -> int:
        """numba's thread count, made OpenMP's for this thread (oneDNN reads it)."""
        import numba
        n = numba.get_num_threads()
        if self.gomp is not None and self.gomp.omp_get_max_threads() != n:
            self.gomp.omp_set_num_threads(n)
        return n if self.gomp is not None else 1

    def matmul(self, out, a, b, trans_b: bool, accumulate: bool, trans_a: bool = False) -> None:
        M, K = a.shape[::-1] if trans_a else a.shape
        N = out.shape[1]
        ld = [arr.strides[0] // arr.itemsize for arr in (a, b, out)]
        with self.lock:  # the memories' data handles are shared per primitive
            prim, mems, args, _ = self.primitive(M, N, K, trans_b, accumulate, self.threads(), *ld,
                                                 f32=a.dtype == np.float32, trans_a=trans_a,
                                                 out_bf16=out.dtype == np.uint16)
            for mem, ptr in zip(mems, _pointers(a, b, out)):
                _check(self.lib.dnnl_memory_set_data_handle(mem, ptr), "memory_set_data_handle")
            _check(self.lib.dnnl_primitive_execute(prim, self.stream, 3, args), "primitive_execute")
            _check(self.lib.dnnl_stream_wait(self.stream), "stream_wait")


BATCHED_KEPT = 64  # batched primitives kept per thread


class _Serial(threading.local):
    """A thread's own oneDNN stream and batched primitives (with their memories): what
    `batched` runs on, so workers of a pool multiply at once without sharing a handle."""
    stream = None
    primitives: dict


_SERIAL = _Serial()


def _serial(lib: _Library) -> _Serial:
    local = _SERIAL
    if local.stream is None:
        local.stream, local.primitives = _VP(), {}
        _check(lib.lib.dnnl_stream_create(ctypes.byref(local.stream), lib.engine, 1), "stream_create")
    return local


def _batched_primitive(lib: _Library, local: _Serial, key: tuple, arrays, accumulate: bool):
    """(primitive, memories, exec args, implementation, scratchpad) for `batched` on these
    arrays' shapes and strides, built on first use in this thread (with OpenMP at one
    thread: oneDNN blocks for it) and kept, the BATCHED_KEPT most recent per thread (a
    chat's prompts each bring new widths). The scratchpad is the primitive's own (user
    mode): a build without DNNL_ENABLE_CONCURRENT_EXEC, as this one, shares one library
    scratchpad among primitives, which oneDNN documents as unsafe for distinct primitives
    run at once."""
    c = lib.lib
    while len(local.primitives) >= max(1, BATCHED_KEPT):  # the oldest go (dicts keep insertion order)
        prim, mems, args, _, _ = local.primitives.pop(next(iter(local.primitives)))
        for i in range(len(args)):
            c.dnnl_memory_destroy(_VP(args[i].memory))
        c.dnnl_primitive_destroy(prim)
    mds = [lib._desc(x.shape, [s // x.itemsize for s in x.strides], _F32 if x.dtype == np.float32 else _BF16)
           for x in arrays]
    local.primitives[key] = lib.build(mds, accumulate, f"batched {arrays[0].shape} @ {arrays[1].shape}",
                                      scratchpad=True)
    return local.primitives[key]


_U16, _F32_DTYPE = np.dtype(np.uint16), np.dtype(np.float32)


def _operand(x, dtype) -> bool:
    return type(x) is np.ndarray and x.ndim == 3 and x.dtype == dtype and min(x.strides) >= 0


@njit(cache=True)
def _pointers(a, b, out):
    return a.ctypes.data, b.ctypes.data, out.ctypes.data


def batched(out: np.ndarray, a: np.ndarray, b: np.ndarray, accumulate: bool = False) -> str:
    """out[i] (M, N) float32 = a[i] (M, K) @ b[i] (K, N) for each i of n, or += when
    accumulate; a and b both bf16 (uint16) or both float32 (oneDNN's float32 kernels:
    attention's scores), any non-negative strides (a transposed operand is a transposed
    view), out's too. Runs on the calling thread alone (OpenMP at one thread
    for the call), on that thread's own stream and primitives: for kernels that deal
    their work to the threads of a pool (kernels/attention_bf16.py). oneDNN picks its AMX
    brgemm kernels where each matrix has a unit inner stride (either axis) and the batch a
    stride of its own. Returns the implementation oneDNN picked. The Python around the
    product is kept short (about 10 us a call; the attention of a bench-shape step makes
    900 calls, two threads sharing the interpreter): one compiled call for the three data
    pointers, the primitive found by shapes and strides."""
    inputs = _F32_DTYPE if type(a) is np.ndarray and a.dtype == _F32_DTYPE else _U16
    if not (_operand(a, inputs) and _operand(b, inputs) and _operand(out, _F32_DTYPE)):
        for name, x, want in (("a", a, inputs), ("b", b, inputs), ("out", out, _F32_DTYPE)):
            if not _operand(x, want):
                raise ValueError(f"batched: {name} must be a 3-D {want} array with non-negative strides"
                                 f" (a and b both uint16 or both float32)")
    n, M, K = a.shape
    if b.shape[:2] != (n, K) or out.shape != (n, M, b.shape[2]) or not out.flags.writeable:
        raise ValueError(f"batched: shapes {a.shape} @ {b.shape} -> {out.shape} do not match")
    if out.size == 0:
        return ""
    if K == 0:
        if not accumulate:
            out[...] = 0
        return ""
    lib = _STATE.get("lib") or _library()
    local = _serial(lib)
    key = (inputs, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, accumulate)
    entry = local.primitives.get(key)
    gomp, threads = lib.gomp, 1
    if gomp is not None:
        threads = gomp.omp_get_max_threads()
        gomp.omp_set_num_threads(1)
    try:
        if entry is None:
            entry = _batched_primitive(lib, local, key, (a, b, out), accumulate)
        prim, mems, args, impl, _ = entry
        c = lib.lib
        for mem, ptr in zip(mems, _pointers(a, b, out)):
            _check(c.dnnl_memory_set_data_handle(mem, ptr), "memory_set_data_handle")
        _check(c.dnnl_primitive_execute(prim, local.stream, len(args), args), "primitive_execute")
        _check(c.dnnl_stream_wait(local.stream), "stream_wait")
    finally:
        if gomp is not None:
            gomp.omp_set_num_threads(threads)
    return impl


_STATE: dict = {}  # "lib": _Library, or "reason": why not
_LOADING = threading.Lock()


def _library() -> _Library:
    """The loaded library (found once, by one thread: threads of a pool may ask first
    together); Unavailable with the reason otherwise."""
    with _LOADING:
        if "lib" not in _STATE and "reason" not in _STATE:
            try:
                _STATE["lib"] = _Library(_load_library())
            except Unavailable as e:
                _STATE["reason"] = str(e)
    if "reason" in _STATE:
        raise Unavailable(_STATE["reason"])
    return _STATE["lib"]


def available() -> bool:
    """True when oneDNN loaded (the CPU's bf16 support is a separate question:
    cpu_bf16_flags)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the library cannot be used (one line), or None when it can."""
    try:
        _library()
    except Unavailable as e:
        return str(e)
    return None


def library_version() -> str:
    """oneDNN's version, e.g. "3.2.0" (Unavailable when it is not loaded)."""
    return _library().version


def implementation(M: int, N: int, K: int, trans_b: bool = False, accumulate: bool = False) -> str:
    """The kernel oneDNN picked for this product, e.g. "brg:avx512_core_amx"."""
    lib = _library()
    return lib.primitive(M, N, K, trans_b, accumulate, lib.threads())[3]


# ---------------------------------------------------------------- products
def _rows_contiguous(a: np.ndarray) -> bool:
    """Unit stride along rows, rows at a positive stride no shorter than a row."""
    if a.size == 0:
        return True
    s0, s1 = a.strides
    return (s1 == a.itemsize or a.shape[1] == 1) and s0 >= a.shape[1] * a.itemsize \
        and s0 % a.itemsize == 0
def gemm(out: np.ndarray, a: np.ndarray, b: np.ndarray, trans_b: bool = False,
         accumulate: bool = False, trans_a: bool = False) -> None:
    """out (M, N) float32 = A @ B, or out += A @ B when accumulate, where A = a (M, K),
    or a (K, M) transposed when trans_a (the adapters' dy^T xa), and B = b (K, N), or
    b (N, K) transposed when trans_b. a and b bf16 (uint16 bits),
    float32 accumulation; or a and b both float32 (oneDNN's f32 kernels: an adapter's
    rank-r `out += xa @ B^T` in one pass over out, 3x numpy's product-then-add). Each
    array's rows contiguous (unit inner stride, rows in order and apart: a column slice
    of a wider array, say the head's logits). With bf16 operands `out` may be uint16
    (not accumulated): the float32 result rounded to bf16 as it is stored (to nearest
    even, bit for bit `to_bf16` of the float32 out: half the bytes written)."""
    f32 = isinstance(a, np.ndarray) and a.dtype == np.float32
    dtype = np.float32 if f32 else np.uint16
    for name, arr in (("a", a), ("b", b)):
        if not (isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.ndim == 2
                and _rows_contiguous(arr)):
            raise ValueError(f"gemm: {name} must be a 2-D uint16 (bf16) array with contiguous rows"
                             f"{', or both float32' if name == 'a' else ' (float32 when a is)'}")
    M, K = a.shape[::-1] if trans_a else a.shape
    if (b.shape[1] if trans_b else b.shape[0]) != K:
        raise ValueError(f"gemm: a is {a.shape}{' (transposed)' if trans_a else ''} but b is "
                         f"{b.shape}{' (transposed)' if trans_b else ''}")
    N = b.shape[0] if trans_b else b.shape[1]
    out_types = (np.float32,) if f32 or accumulate else (np.float32, np.uint16)
    if not (isinstance(out, np.ndarray) and out.dtype in out_types and out.shape == (M, N)
            and _rows_contiguous(out) and out.flags.writeable):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"gemm: out must be a writeable float32 array of shape {(M, N)} "
                         f"with contiguous rows (or uint16 for a bf16 product not accumulated), got {got}")
    if M == 0 or N == 0:
        return
    if K == 0:
        if not accumulate:
            out[...] = 0
        return
    _library().matmul(out, a, b, trans_b, accumulate, trans_a)


def gemm_ref(a: np.ndarray, b: np.ndarray, trans_b: bool = False) -> np.ndarray:
    """Numpy reference of gemm: the bf16 inputs widened to float64, multiplied exactly
    enough (float64), returned as float64."""
    A = from_bf16_ref(a).astype(np.float64)
    B = from_bf16_ref(b).astype(np.float64)
    return A @ (B.T if trans_b else B)
