"""The trainable side of a linear: LoRA in factored form, and the backward of a linear.

    y = x W^T (+ bias) + s (drop(x) A^T) B^T        s = alpha / r
    dx = dy W + s (dy B) A,  dB += s dy^T (x A^T),  dA += (s dy B)^T x   (dW += dy^T x when W trains)

No full-size gradient of a frozen W ever exists. `x A^T` is kept for backward (the
graph's `xa` buffers). Where a step's N tokens outnumber both sides of a dequantized
matrix (and no dropout), the adapter is added into that copy (`W + s B A`) and the
product runs once, instead of the factored terms' (N, n_out) and (N, n_in) shares.
With bf16 products (where that merge would round the adapter's share away) the adapter
rides in the base product's K axis instead, its float32 factors as bf16 parts
(`in_product`, models/products.py `Products.adapted`): the same single product,
the share kept to float32 accuracy. Dropout masks are regenerated from (weight name, step key) in backward. Norm weights
with an adapter are used as `w + s (B A)[0]`.

Merge-aware training (`ComputePolicy.merge_aware`, --merge-aware): an adapted matrix stored
quantized is used as the plain merge will write it,

    W_q = deq(Q(deq(W) + s B A))        Q: kernels.quantize to the tensor's own type

(the same f32 arithmetic as export-lora's plain merge, so the same bytes), with a
straight-through gradient: dx = dy W_q, and dA, dB as if Q were the identity (the
adapter's share counts as merged into W_q). Each use builds W_q on the host: a
full-size f32 matrix and its quantization per adapted matrix, in forward and again in
backward (and in the recompute of --checkpointing layer).
`LoraLinears` is the training graph's `Forward.linears` (models/forward.Linears'
methods, the backward beside them); it uses the graph's scratch and products.
"""
from __future__ import annotations

import zlib

import numpy as np

from ..kernels.bf16 import split_into, split_rows_into
from ..kernels.dequant import dequantize
from ..kernels.quantize import QUANTIZABLE, quantize
from ..models.forward import Linears
from ..models.products import adapter_extension
from .lora import Lora


def requantizable(qtype) -> bool:
    """A block-quantized type the plain merge rounds to (F32/F16/BF16 merges are exact;
    types kernels.quantize cannot produce are left as W + s B A)."""
    return qtype in QUANTIZABLE and qtype.name not in ("F32", "F16", "BF16")


class LoraLinears(Linears):
    """The linears of a training graph `fw` (train.step.StepExecutor): `lora` its Lora per adapted
    weight (shared with the graph's trimmed twins), `xa` the (N, r) x A^T each keeps for
    backward, `dropout` on the adapters' input (masks drawn from the weight's name and
    `step_key`), the graph's scratch (tmp, head_tmp), products and policy."""

    def __init__(self, fw, lora: dict[str, Lora], xa: dict[str, np.ndarray], dropout: float):
        super().__init__(fw)
        self.lora, self.xa, self.dropout, self.step_key = lora, xa, dropout, (0,)

    @property
    def xp(self):
        return self.fw.xp

    @property
    def weights(self):
        return self.fw.weights

    @property
    def policy(self):
        return self.fw.policy

    # ---------------------------------------------------------------- the forward's side
    def adapter(self, name: str) -> Lora | None:
        """The adapter of weight `name`, None where it has none or it is disabled."""
        t = self.lora.get(name)
        return None if t is None or t.disabled else t

    def pairs(self, name: str) -> list:
        t = self.adapter(name)
        return [] if t is None else [(t.a, t.b, t.scale)]

    def scratch(self, rows: int, cols: int) -> np.ndarray:
        return self.fw.tmp[: rows * cols].reshape(rows, cols)

    def norm_weight(self, name: str) -> np.ndarray:
        """Effective norm weight: base (or parameter) + s·(B A)[0] when it has an adapter."""
        w = self.weights.vector(name).astype(self.fw.tmp.dtype, copy=False)
        t = self.adapter(name)
        if t is None:
            return w
        return w + t.scale * (t.b @ t.a)[0]

    def matrix(self, name: str, N: int) -> tuple[np.ndarray, bool]:
        """The base matrix W (n_out, n_in) of a linear over N tokens, and whether its
        adapter was merged into it: W + s B A, when the matrix is a dequantized copy
        (a scratch of the step's dtype), the adapter sees x without dropout, and
        N > max(n_out, n_in), where adding (r-factored) B A to W costs less than adding
        the adapter's (N, n_out) share to the product (and, in backward, its (N, n_in)
        share to dx). Either way the product is the same up to float rounding."""
        t = self.adapter(name)
        if t is not None and self.policy.merge_aware and self.requantizes(name):      # f32 W, whatever the products
            return self.requantized(self.weights.matrix(name), name, t), True
        W = self.fw.weight(name, N)
        merge = (t is not None and self.policy.merge_adapters and self.dropout <= 0 and N > max(W.shape)
                 and W.dtype == self.fw.tmp.dtype and self.weights.is_scratch(name))
        if merge:
            W += self.xp.matmul(t.scale * t.b, t.a, out=self.scratch(*W.shape))
        return W, merge

    def add_adapters(self, y: np.ndarray, x: np.ndarray, name: str, merged: bool) -> None:
        """y += s (drop(x) A^T) B^T, keeping x A^T for the backward."""
        t = self.adapter(name)
        if t is None:
            return
        mask = self.dropout_mask(name, x.shape)
        xa = self.xa[name]
        self.xp.matmul(x if mask is None else x * mask, t.a.T, out=xa)
        if not merged:
            self.fw.lora_ops.lora_forward(y, xa, t.b, t.scale, self.scratch(*y.shape))

    # ---------------------------------------------------------------- the adapter in the product
    def in_product(self, name: str, N: int) -> bool:
        """Whether the adapter of `name` rides in the K axis of the base product
        (products.Products.adapted): the policy's choice (bf16 products of a frozen base,
        not merge-aware), a product over N tokens that runs in bf16, and no dropout (its
        mask multiplies the adapter's share of dx, which the product cannot)."""
        return (self.policy.adapters_in_products and self.adapter(name) is not None and self.policy.bf16_for(N)
                and self.dropout <= 0)

    def shared_extension(self, names: list[str], N: int) -> int:
        return max((adapter_extension(self.lora[n].rank) for n in names if self.in_product(n, N)),
                   default=0)

    def adapted_forward(self, y: np.ndarray, x: np.ndarray, name: str) -> None:
        """y = [bf16(x) | parts of s x A^T] [bf16(W) | parts of B]^T, keeping x A^T."""
        t = self.lora[name]
        xa = self.xa[name]
        self.fw.lora_ops.lora_xa(xa, x, t.a)
        W = self.weights.matrix_bf16_extended(name, cols=adapter_extension(t.rank))
        split_into(W, t.b, x.shape[1], "b")
        self.fw.products.adapted(y, x, W, np.multiply(xa, np.float32(t.scale), dtype=np.float32), trans_b=True)

    def adapted_backward(self, dx: np.ndarray, dy: np.ndarray, x: np.ndarray, name: str,
                         accumulate: bool) -> None:
        """dA, dB +=; dx (=, or +=) [bf16(dy) | parts of s dy B] [bf16(W) ; parts of A]."""
        t = self.lora[name]
        dxa = self.fw.lora_ops.lora_grads(t.da, t.db, dy, x, self.xa[name], t.b, t.scale)
        W = self.weights.matrix_bf16_extended(name, rows=adapter_extension(t.rank))
        split_rows_into(W, t.a, dy.shape[1], "b")
        self.fw.products.adapted(dx, dy, W, dxa, trans_b=False, accumulate=accumulate)

    def requantizes(self, name: str) -> bool:
        """Whether merge-aware training requantizes weight `name` (see `requantizable`)."""
        t = self.weights.tensors.get(name)
        return t is not None and requantizable(t.qtype)

    def requantized(self, W: np.ndarray, name: str, t: Lora) -> np.ndarray:
        """deq(Q(W + s B A)) in the graph's dtype (into W itself when it is the float32
        scratch): export-lora's plain merge of the adapter as it stands."""
        host = self.fw.backend.to_host
        qtype = self.weights.tensors[name].qtype
        merged = np.array(host(W), np.float32)                      # deq(W), as export-lora's _merge
        merged += np.float32(t.scale) * (host(t.b).astype(np.float32) @ host(t.a).astype(np.float32))
        Wq = dequantize(quantize(merged, qtype), qtype, merged.shape[1])
        if W.dtype == self.fw.tmp.dtype:
            W[...] = self.fw.backend.to_device(Wq)
            return W
        return self.fw.backend.to_device(Wq.astype(self.fw.tmp.dtype))

    # ---------------------------------------------------------------- training only
    def dropout_mask(self, name: str, shape) -> np.ndarray | None:
        """Inverted-dropout mask for an adapter input; regenerated identically in backward."""
        if self.dropout <= 0:
            return None
        key = [zlib.crc32(name.encode()), *self.step_key]
        keep = np.random.default_rng(key).random(shape, dtype=np.float32) >= self.dropout
        return self.fw.backend.to_device(keep.astype(self.fw.tmp.dtype) / self.fw.tmp.dtype.type(1.0 - self.dropout))

    def weight_grad(self, name: str):
        """The gradient of a trained base weight (dense or full training); None when frozen."""
        return self.weights.grad(name) if self.weights.trainable else None

    def weight_grad_to_write(self, name: str):
        """(gradient of a trained base weight, whether a product may write it whole), or
        None when frozen (full finetuning clears its gradients lazily: params.zero_grad)."""
        return self.weights.grad_to_write(name) if self.weights.trainable else None

    def norm_grad(self, name: str, dw: np.ndarray) -> None:
        """Route a norm weight's gradient to its parameter or its adapter."""
        g = self.weight_grad(name)
        if g is not None:
            g[...] += dw
        t = self.adapter(name)
        if t is not None:
            t.da[...] += t.scale * self.xp.outer(t.b[0], dw)
            t.db[...] += t.scale * (t.a @ dw)[None, :]

    def backward(self, dx: np.ndarray | None, dy: np.ndarray, x: np.ndarray, name: str,
                        accumulate: bool) -> None:
        """dx (=, or += when accumulate) = dy W + s (dy B) A; parameter grads +=."""
        if dx is not None and self.in_product(name, dy.shape[0]):
            self.adapted_backward(dx, dy, x, name, accumulate)  # a frozen base: no dW, no bias gradient
            return
        W, merged = self.matrix(name, dy.shape[0])
        if dx is not None:
            if accumulate:
                self.fw.products.add(dx, dy, W, False, self.scratch(*dx.shape))
            else:
                self.fw.products(dx, dy, W, trans_b=False)
        target = self.weight_grad_to_write(name)
        if target is not None:
            dW, fresh = target
            if fresh:                                              # the first product: written whole
                self.xp.matmul(dy.T, x, out=dW)
            else:
                dW += self.xp.matmul(dy.T, x, out=self.head_scratch(*dW.shape))
        bias = name.replace(".weight", ".bias")
        db = self.weight_grad(bias) if self.weights.vector(bias) is not None else None
        if db is not None:                                         # qwen2's q/k/v biases
            db[...] += dy.sum(axis=0)
        t = self.adapter(name)
        if t is not None:
            mask = self.dropout_mask(name, x.shape)
            self.lora_backward(t, dy, x if mask is None else x * mask, self.xa[name], None if merged else dx, mask)

    def lora_backward(self, t: Lora, dy, xd, xa, dx, mask=None) -> None:
        """The adapter's share of a linear's backward, y += s (xd A^T) B^T with xa = xd A^T:
        dB += s dy^T xa, dA += (s dy B)^T xd, and dx += (s dy B) A (times the dropout mask;
        dx None: the adapter was merged into the W of dy W, which gave that share)."""
        self.fw.lora_ops.lora_backward(t.da, t.db, dx, dy, xd, xa, t.a, t.b, t.scale, self.scratch(*xd.shape), mask)

    def head_scratch(self, rows: int, cols: int) -> np.ndarray:
        return self.fw.head_tmp[: rows * cols].reshape(rows, cols)
