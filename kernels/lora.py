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
"""
import numpy as np


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
