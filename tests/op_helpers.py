"""Helpers of the per-op kernel tests (tests/test_op_*.py): random inputs, the
tolerances, the (numba, reference) parametrization of the finite-difference tests,
and the two backends every op is checked on.

    cases(cpu=[...], cuda=[...])   ->  pytest params (backend, *case)

gives one parametrization over backends: the CPU cases run the numba kernels
(llamatune.kernels.<op>), the CUDA cases run the CUDA kernels
(llamatune.kernels.cuda.<op>, on a GPU or under numba's simulator) and carry the
`cuda` marker, so `-m cuda` / `-m "not cuda"` select them as before. The CUDA
backend imports numba.cuda only when a CUDA case runs, and skips that case where
numba.cuda cannot run (conftest_cuda.cuda_or_skip)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

F32, F64 = np.float32, np.float64
TOL32 = dict(rtol=1e-5, atol=1e-6)   # kernel vs numpy reference in float32
FD_TOL = dict(rtol=1e-6, atol=1e-8)  # finite differences in float64
# attention: different summation orders; float32 gradients that should be 0 (a token
# alone in its window) come out as the rounding of dP - rowsum(P dP), ~1e-6
TOL_ATT = dict(rtol=1e-5, atol=2e-6)


def randn(rng, *shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def zeros32(*shape):
    return np.zeros(shape, F32)


def impls(module, *names):
    """(numba wrapper, numpy reference) pairs, one pytest param per implementation."""
    return [pytest.param(tuple(getattr(module, n + sfx) for n in names), id=tag)
            for sfx, tag in (("", "numba"), ("_ref", "ref"))]


class Backend:
    """The kernels of one backend and its arrays: `k.<op>` is the op's module,
    `to(a)` copies a host array onto the backend, `nan(shape)` is a fresh
    NaN-filled array there, `get(a)` brings an array back as numpy."""

    def __init__(self, name: str):
        self.name = name
        self._k = None

    def __repr__(self):
        return self.name

    @property
    def cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def k(self):
        if self._k is None:
            if self.cuda:
                from conftest_cuda import cuda_or_skip
                cuda_or_skip()  # a skip of this case where numba.cuda cannot run
            self._k = importlib.import_module("llamatune.kernels.cuda" if self.cuda
                                              else "llamatune.kernels")
        return self._k

    def to(self, a):
        if self.cuda:
            from numba import cuda
            self.k  # noqa: B018  (numba.cuda usable, or a skip)
            return cuda.to_device(np.ascontiguousarray(a))
        return np.array(a)

    def nan(self, shape, dtype=F32):
        return self.to(np.full(shape, np.nan, dtype))

    def get(self, a):
        return a.copy_to_host() if self.cuda else np.asarray(a)


CPU, CUDA = Backend("cpu"), Backend("cuda")


def _case_id(backend, case):
    """cpu-3-5, cuda-Q4_K, cuda-2x300: names, numbers, strings and tuples of a case
    (arrays and lambdas leave no trace)."""
    parts = []
    for c in case:
        if isinstance(c, tuple):
            parts.append("x".join(map(str, c)))
        elif isinstance(c, dict):
            parts.append("-".join(f"{k}{v}" for k, v in c.items()))
        elif hasattr(c, "name") or isinstance(c, (int, float, str)):
            parts.append(str(getattr(c, "name", c)))
        elif getattr(c, "__name__", "<lambda>") != "<lambda>":
            parts.append(c.__name__)
    return "-".join([backend.name, *parts])


def cases(cpu=((),), cuda=((),)):
    """pytest params (backend, *case): each cpu case on the CPU kernels, each cuda
    case on the CUDA kernels, marked `cuda`. A case is a tuple of the test's other
    arguments (() when it has none)."""
    return ([pytest.param(CPU, *c, id=_case_id(CPU, c)) for c in cpu]
            + [pytest.param(CUDA, *c, id=_case_id(CUDA, c), marks=pytest.mark.cuda) for c in cuda])


# ------------------------------------------------------------------ attention inputs

def qkv_cache(rng, B, T, NH, NKV, HS, n_past=0, dtype=F32):
    """q (B, T, NH, HS) and k, v caches (B, S + 3, NKV, HS) longer than S = n_past + T."""
    S = n_past + T
    q = randn(rng, B, T, NH, HS, dtype=dtype)
    k_cache = randn(rng, B, S + 3, NKV, HS, dtype=dtype)
    v_cache = randn(rng, B, S + 3, NKV, HS, dtype=dtype)
    return q, k_cache, v_cache, S


def qkv(rng, B, T, NH, NKV, HS, n_past=0, dtype=F32):
    """q and the [:, :S] slices (strided views) of longer k, v caches."""
    q, k_cache, v_cache, S = qkv_cache(rng, B, T, NH, NKV, HS, n_past, dtype)
    return q, k_cache[:, :S], v_cache[:, :S]


def random_segments(rng, B, T):
    """(B, T) int32 sample ids of packed rows: random runs (some of one token), the
    ids not in order, and in row 0 a padding run at the end with its own id."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), size=min(T - 1, 3), replace=False))
        ids = rng.permutation(10)[: len(cuts) + 1] * (b + 1)
        for n, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, T])):
            seg[b, lo:hi] = ids[n]
    seg[0, -2:] = -1  # padding
    return seg


# ------------------------------------------------------------------ quantized inputs

# byte offsets of the f16 scale fields (d / dmin / m) inside one block
SCALE_OFFSETS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q5_0: [0], T.Q4_1: [0, 2], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}
E8M0_OFFSETS = {T.MXFP4: 0}  # byte offset of the power-of-two scale byte (2^(e-128))
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
ALL_TYPES = FLOAT_TYPES + list(SCALE_OFFSETS) + list(E8M0_OFFSETS)


def random_tensor(qtype, n_rows, n_cols, seed=0):
    """Random bytes (n_rows, row_bytes); for quants the f16 scale fields get finite
    values, including a few subnormals and signed zeros; MXFP4's scale bytes those of
    a model's weights (2^-28 to 2^6) and the subnormal and smallest normal scales (0, 1, 2)."""
    rng = np.random.default_rng(seed + int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_cols // block_size
    data = rng.integers(0, 256, size=(n_rows, n_blocks, type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS.get(qtype, []):
        scales = (rng.standard_normal((n_rows, n_blocks)) * 0.05).astype(np.float16)
        flat = scales.reshape(-1)
        flat[:4] = np.array([0.0, -0.0, 6e-8, -3e-6], dtype=np.float16)  # zeros, subnormals
        data[:, :, off:off + 2] = scales.view(np.uint8).reshape(n_rows, n_blocks, 2)
    if qtype in E8M0_OFFSETS:
        e = rng.integers(100, 135, size=(n_rows, n_blocks), dtype=np.uint8)
        e.reshape(-1)[:3] = [0, 1, 2]
        data[:, :, E8M0_OFFSETS[qtype]] = e
    return data.reshape(n_rows, n_blocks * type_size)


# ------------------------------------------------------------------ gated activations

def check_gate(b, name, N, F, seed):
    """An elementwise gate h = act(g) * u (swiglu, geglu: the same calling convention)
    on backend b against its numpy reference, whole tensors: the forward, the
    backward (dg, du overwritten: NaN prefill), and both in place (h over g; dg over
    g and du over u) giving the same bits."""
    cpu = importlib.import_module(f"llamatune.kernels.{name}")
    mod = getattr(b.k, name)
    forward, backward = getattr(mod, name + "_forward"), getattr(mod, name + "_backward")
    rng = np.random.default_rng(seed)
    g, u, dh = 4 * randn(rng, N, F), randn(rng, N, F), randn(rng, N, F)
    want = np.zeros((N, F), F32)
    getattr(cpu, name + "_forward_ref")(want, g, u)
    h = b.nan((N, F))
    forward(h, b.to(g), b.to(u))
    np.testing.assert_allclose(b.get(h), want, **TOL32)
    dg_ref, du_ref = np.zeros((N, F), F32), np.zeros((N, F), F32)
    getattr(cpu, name + "_backward_ref")(dg_ref, du_ref, dh, g, u)
    dg, du = b.nan((N, F)), b.nan((N, F))
    backward(dg, du, b.to(dh), b.to(g), b.to(u))
    np.testing.assert_allclose(b.get(dg), dg_ref, **TOL32)
    np.testing.assert_allclose(b.get(du), du_ref, **TOL32)
    gi = b.to(g)  # in place: h over g
    forward(gi, gi, b.to(u))
    np.testing.assert_array_equal(b.get(gi), b.get(h))
    gi, ui = b.to(g), b.to(u)  # in place: dg over g, du over u
    backward(gi, ui, b.to(dh), gi, ui)
    np.testing.assert_array_equal(b.get(gi), b.get(dg))
    np.testing.assert_array_equal(b.get(ui), b.get(du))
