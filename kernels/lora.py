"""The LoRA adapter's products, forward and backward (numpy: on the CPU these are the
reference too). The GPU twin (``llamatune.kernels.cuda.lora``) folds the scale and
the accumulation into cuBLAS's epilogue (out = alpha op(a) op(b) + beta out), one
launch per product instead of a product, a scale, an add and a copy.

    forward    y += s (xd A^T) B^T                       xa = xd A^T kept by the caller
    backward   dB += s dy^T xa,   dxa = s dy B,   dA += dxa^T xd,   dx += (dxa A) * mask

A (r, n_in), B (n_out, r), s = alpha / r; xd = the (dropped-out) input (N, n_in),
xa (N, r), dy (N, n_out). dx is None where the adapter was merged into the base
matrix (its share of dx came with the base product). `scratch` (N, n_out) forward,
(N, n_in) backward: room for the product before it is added.

`lora_forward_onednn` and `lora_backward_onednn` (and `lora_xa_onednn`, xa itself) are the same products in float32
through oneDNN (kernels.bf16.gemm), what a step with bf16 base products uses: the adds
ride on the products (a sum post-op), the transposed operands are read in place, and
oneDNN's kernels keep their rate on these skinny shapes where OpenBLAS's drop (one
layer of the bench shape, N = 2048, r = 8: 9-11 ms against numpy's 16-18). Not bit for
bit numpy's sums: the f32 compute path keeps the numpy functions.
"""
import numpy as np

from . import bf16


def lora_forward(y, xa, B, scale, scratch):
    """y (N, n_out) += scale * xa (N, r) B^T."""
    y += np.matmul(scale * xa, B.T, out=scratch)


def lora_backward(dA, dB, dx, dy, xd, xa, A, B, scale, scratch, mask=None):
    """dA (r, n_in), dB (n_out, r) +=; dx (N, n_in) += the adapter's share (None: none)."""
    dB += scale * (dy.T @ xa)
    dxa = scale * (dy @ B)                                         # (N, r)
    dA += (xd.T @ dxa).T          # not dxa.T @ xd: BLAS takes up to 50x longer with the
    #                               r-row transposed operand on the left
    if dx is not None:
        dxd = np.matmul(dxa, A, out=scratch)
        dx += dxd if mask is None else dxd * mask


def lora_forward_onednn(y, xa, B, scale, scratch):
    """lora_forward through oneDNN: y += (scale xa) B^T in its one pass over y."""
    xs = np.multiply(xa, np.float32(scale), dtype=np.float32)                  # (N, r)
    if not (y.flags.c_contiguous and y.dtype == np.float32):
        y += np.matmul(xs, B.T, out=scratch)
        return
    bf16.gemm(y, xs, np.ascontiguousarray(B, np.float32), trans_b=True, accumulate=True)


def lora_xa_onednn(xa, xd, A):
    """xa (N, r) = xd (N, n_in) A^T through oneDNN's float32 kernels: 1.5-2x numpy's
    OpenBLAS on these skinny products (N = 2048, r = 8: 0.19 against 0.30 ms at n_in 512,
    0.48 against 0.94-1.0 at 1536)."""
    bf16.gemm(xa, xd, np.ascontiguousarray(A, np.float32), trans_b=True)


def lora_grads_onednn(dA, dB, dy, xd, xa, B, scale):
    """The factors' gradients through oneDNN, dB += s dy^T xa and dA += dxa^T xd, and
    dxa = s dy B (N, r), returned: the operand of dx's share (lora_backward_onednn, or
    the base product that carries it: models/products.py `Products.adapted`). dB^T =
    xa^T (s dy) runs as an (r, n_out) product (its transposed operand the thin one: 1.7x
    dy^T xa's rate)."""
    f32 = np.float32
    dy, xd, xa = (np.ascontiguousarray(v, f32) for v in (dy, xd, xa))
    N, r = xa.shape
    s = f32(scale)
    dBt = np.empty((r, dy.shape[1]), f32)
    bf16.gemm(dBt, np.multiply(xa, s, dtype=f32), dy, trans_a=True)
    dB += dBt.T
    dxa = np.empty((N, r), f32)
    bf16.gemm(dxa, dy, np.multiply(B, s, dtype=f32))
    dAt = np.empty((r, xd.shape[1]), f32) if not (dA.flags.c_contiguous and dA.dtype == f32) else None
    bf16.gemm(dA if dAt is None else dAt, dxa, xd, trans_a=True, accumulate=dAt is None)
    if dAt is not None:
        dA += dAt
    return dxa


def lora_backward_onednn(dA, dB, dx, dy, xd, xa, A, B, scale, scratch, mask=None):
    """lora_backward through oneDNN: lora_grads_onednn, then dx += dxa A (times the mask:
    then through scratch)."""
    f32 = np.float32
    dxa = lora_grads_onednn(dA, dB, dy, xd, xa, B, scale)
    if dx is None:
        return
    A32 = np.ascontiguousarray(A, f32)
    if mask is None and dx.flags.c_contiguous and dx.dtype == f32:
        bf16.gemm(dx, dxa, A32, accumulate=True)
        return
    bf16.gemm(scratch, dxa, A32)
    dx += scratch if mask is None else scratch * mask


# the references: the same maths with every product in float64 (what the tests compare with)
def lora_forward_ref(y, xa, B, scale, scratch):
    y[:] = y + scale * (xa.astype(np.float64) @ B.T)


def lora_backward_ref(dA, dB, dx, dy, xd, xa, A, B, scale, scratch, mask=None):
    dy64 = dy.astype(np.float64)
    dB[:] = dB + scale * (dy64.T @ xa)
    dxa = scale * (dy64 @ B)
    dA[:] = dA + dxa.T @ xd
    if dx is not None:
        dx[:] = dx + (dxa @ A) * (1.0 if mask is None else mask)
