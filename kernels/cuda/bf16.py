"""bf16 products of the frozen base on the GPU: tensor cores through cuBLAS, float32 sums
(the GPU's side of ``--compute-dtype bf16``; the CPU's is llamatune.kernels.bf16).

    to_bf16(out, x)     float32 (N, K), any strides -> bf16 bits (uint16, C order): round to
                        nearest even, NaN kept quiet (as the CPU's to_bf16, bit for bit)
    CudaBf16Products    the products object a graph multiplies its base weights with
                        (models/products.py has the CPU's, with the same methods): the
                        weight comes dequantized straight to bf16 (dequant.dequantize_into
                        into uint16), the activation is rounded once per product (once per
                        shared input: q, k, v of one normed input; gate and up), and
                        blas.gemm_bf16 multiplies them (cublasGemmEx, CUDA_R_16BF operands,
                        CUBLAS_COMPUTE_32F, a float32 out, scale and add in its epilogue).

Everything else stays float32, as with the CPU's bf16 products: the adapters' rank-r
products (plain float32 cuBLAS: lora.py), norms, softmax, the loss, every gradient and
the optimizer. Attention keeps its float32 kernels (their products follow CuPy's compute
type: TF32 with bf16 products, backend.set_tf32). Under numba's CUDA simulator to_bf16
runs as a simulated kernel and the products in numpy on the rounded operands (blas.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ._common import bf16_bits, cdiv, check, check_ndim, cuda, row_threads
from .blas import gemm_bf16

__all__ = ["to_bf16", "gemm_bf16", "CudaBf16Products"]   # gemm_bf16: blas.py's, here for the backend's ops

MAX_GRID_Y = 65535     # CUDA's limit on gridDim.y: more rows loop


@cuda.jit
def _to_bf16_kernel(out, x):
    # grid (cdiv(K, threads), min(N, MAX_GRID_Y)), block threads: column c of rows
    # blockIdx.y, + gridDim.y, ...; out (N, K) uint16, x (N, K) float32, any strides
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c >= x.shape[1]:
        return
    r = cuda.blockIdx.y
    while r < x.shape[0]:
        out[r, c] = bf16_bits(x[r, c])
        r += cuda.gridDim.y


def to_bf16(out, x) -> None:
    """out (N, K) uint16, C-contiguous = the bf16 bits of x (N, K) float32 (any strides)."""
    shape = check_ndim("bf16", "x", x, 2, np.float32)
    check("bf16", "out", out, shape, np.uint16)
    if shape[0] and shape[1]:
        threads = row_threads(shape[1])            # a warp at least, 256 at most
        _to_bf16_kernel[(cdiv(shape[1], threads), min(shape[0], MAX_GRID_Y)), threads](out, x)


class CudaBf16Products:
    """The frozen base's products in bf16 on a GPU (module docstring): the interface of
    models.products.Products (__call__, add, shared_input, bf16_for, lora_ops,
    attention_ops) over the backend's arrays. `xp`: CuPy (numpy in the simulator);
    `ops`: the backend's bf16 kernel module (this one, wrapped by the simulator's
    backend)."""

    dtype = "bf16"

    def __init__(self, xp, ops):
        self.xp, self.ops = xp, ops
        self._flat = {k: xp.empty(0, np.uint16) for k in ("a", "w", "x")}
        self._held = self._held_bf16 = None

    def bf16_for(self, rows: int) -> bool:
        """Every product multiplies in bf16 (a GPU multiplies one row as cheaply in bf16)."""
        return True

    def __call__(self, out, a, W, trans_b: bool):
        """out = a @ W^T (trans_b) or a @ W: W (n_out, n_in) bf16 bits (uint16, as the
        base hands it out: FrozenBase.matrix_rows_bf16) or float32 (rounded here), `a`
        float32 (rounded here, or the shared input's copy) or bf16 bits; out float32, C
        order or a column block of a wider array (the head's logits)."""
        self._product(out, a, W, trans_b, 0.0)
        return out

    def add(self, out, a, W, trans_b: bool, scratch=None) -> None:
        """out += a @ W^T (trans_b) or a @ W, the add in the product's epilogue (no scratch)."""
        self._product(out, a, W, trans_b, 1.0)

    def adapted(self, *args, **kwargs):
        raise NotImplementedError("adapters in the products' K axis are the CPU's (oneDNN)")

    def lora_ops(self, ops_lora):
        return ops_lora

    def attention_ops(self, ops_attention):
        return ops_attention

    @contextmanager
    def shared_input(self, x, extension: int = 0):
        """Products inside take `x` rounded to bf16 once; x must not change inside."""
        self._held, self._held_bf16 = x, self._round(x, "x")
        try:
            yield
        finally:
            self._held = self._held_bf16 = None

    def _product(self, out, a, W, trans_b: bool, beta: float) -> None:
        if a.dtype == np.uint16:
            a16 = a
        else:
            a16 = self._held_bf16 if a is self._held else self._round(a, "a")
        w16 = W if W.dtype == np.uint16 else self._round(W, "w")
        self.ops.gemm_bf16(out, a16, w16.T if trans_b else w16, 1.0, beta)

    def _round(self, x, key: str):
        size = x.shape[0] * x.shape[1]
        flat = self._flat[key]
        if flat.size < size:
            flat = self._flat[key] = self.xp.empty(size, np.uint16)
        buf = flat[:size].reshape(x.shape)
        self.ops.to_bf16(buf, x)
        return buf

