"""The LoRA adapter's products on the GPU (CPU twin and references:
``llamatune.kernels.lora``, whose docstring has the maths).

Each product is one cuBLAS float32 product (``blas.gemm``: cublasGemmEx), whose epilogue
applies the scale and the accumulation, out = alpha op(a) op(b) + beta out: the
forward's y += s xa B^T is one launch (a product, a scale and an add before), the
backward four (eleven before: each `grad[...] += s * (a @ b)` was a product, a scale,
an add and a copy). The products are plain float32 whatever CuPy's matmul compute type
(--tf32 and bf16 products leave the rank-r products exact, as the CPU's). The arguments
may be any device arrays (CuPy, numba's); under numba's CUDA simulator `gemm` computes
the same in numpy, after the same checks of kind and layout as on a GPU.
"""
from __future__ import annotations

from ._common import array_of
from .blas import gemm_arrays as gemm     # on the arrays _arrays took (and views of them)

__all__ = ["lora_forward", "lora_backward", "gemm"]


def _arrays(*named):
    """The library arrays (CuPy, or the simulator's numpy) of named device arrays."""
    return [array_of("lora", n, a) for n, a in named]


def lora_forward(y, xa, B, scale, scratch) -> None:
    """y (N, n_out) += scale * xa (N, r) B^T, in one launch (scratch unused)."""
    y, xa, B = _arrays(("y", y), ("xa", xa), ("B", B))
    gemm(y, xa, B.T, scale, 1.0)


def lora_backward(dA, dB, dx, dy, xd, xa, A, B, scale, scratch, mask=None) -> None:
    """dB += s dy^T xa, dxa = s dy B, dA += dxa^T xd, dx += (dxa A) (* mask): four launches
    (five with a dropout mask: scratch gets dxa A, then dx += scratch * mask)."""
    dA, dB, dy, xd, xa, A, B = _arrays(("dA", dA), ("dB", dB), ("dy", dy), ("xd", xd), ("xa", xa), ("A", A),
                                       ("B", B))
    gemm(dB, dy.T, xa, scale, 1.0)
    dxa = gemm(None, dy, B, scale)                                 # (N, r)
    gemm(dA.T, xd.T, dxa, 1.0, 1.0)                                # dA^T (n_in, r) += xd^T dxa
    if dx is None:
        return
    dx, = _arrays(("dx", dx))
    if mask is None:
        gemm(dx, dxa, A, 1.0, 1.0)
    else:
        scratch, mask = _arrays(("scratch", scratch), ("mask", mask))
        dx += gemm(scratch, dxa, A) * mask
