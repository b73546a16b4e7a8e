"""The products with the frozen base's weights, in the compute dtype chosen once.

    f32   numpy's (or CuPy's) matmul, float32 throughout: the bit-exact paths.
    bf16  both operands rounded to bf16 (round to nearest even), the product through
          oneDNN with float32 accumulation (kernels/bf16.py): on CPUs that multiply
          bf16 natively (AVX512_BF16, AMX) about twice the float32 rate or more.
precision.policy resolves --compute-dtype into a ComputePolicy; this object applies it. Every base
product of the forward (x W^T), of the backward (dy W) and of the output head goes
through one `Products`; the adapters' rank-r products, norms, softmax, the loss and
every accumulation stay float32 (with bf16 products the adapters' products run through
oneDNN's float32 kernels: `ComputePolicy.lora`). Attention's T x S products follow the compute
dtype too (`ComputePolicy.attention`), but for its scores q k^T, which stay float32 as its softmax.

An adapter's share in the base product (`adapted`, training with bf16 products): the
up-projection of a linear's adapter, y += (s xa) B^T, and its backward twin, dx +=
(s dy B) A, ride in the K axis of the base product instead of a second pass over y or
dx. Each float32 factor is split into two bf16 parts, v = hi + lo (hi = bf16(v), lo =
bf16(v - hi), exact to 2^-17 of v), and the three products that matter are appended:

    y  = [bf16(x)  | xs_hi  xs_hi  xs_lo  0] [bf16(W)  | B_hi B_lo B_hi 0]^T      xs = s xa
    dx = [bf16(dy) | dxa_hi dxa_hi dxa_lo 0] [bf16(W) ; A_hi ; A_lo ; A_hi ; 0]   dxa = s dy B

Each bf16 x bf16 term is exact in the float32 accumulation, so the adapter's share
keeps float32's accuracy (2.2e-5 of its largest element at the bench shape, the same as
the float32 pass: bench/lora_in_gemm.py) while the product costs what the base product
alone costs. K grows by `adapter_extension(r)` (3 r, padded with zeros to AMX's 32).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..precision import F32, ComputePolicy


def adapter_extension(rank: int) -> int:
    """Columns an adapter of rank r adds to a bf16 product's K axis: its three bf16 parts,
    padded with zeros to a multiple of 32 (the depth of an AMX bf16 tile)."""
    return -(-3 * rank // 32) * 32


class Products:
    def __init__(self, xp, policy: ComputePolicy = F32):
        if policy.dtype == "bf16" and xp is not np:
            raise ValueError("bf16 products run on the CPU (numpy arrays)")
        self.xp, self.policy = xp, policy
        self.dtype = "bf16" if policy.dtype == "bf16" else "f32"   # tf32: float32 products (CuPy's compute type)
        # kept buffers, grown as needed: the operands' bf16 copies, and a contiguous product
        # for a strided `out`
        self._flat = {k: np.empty(0, np.uint16) for k in ("a", "w", "x")} | {"out": np.empty(0, np.float32)}
        self._held = self._held_bf16 = None     # shared_input's x and its bf16 copy
        self._held_wide = None                  # that copy's (N, K + extension) buffer

    def bf16_for(self, rows: int) -> bool:
        """Whether a product over `rows` tokens runs in bf16 (and wants its weight in bf16)."""
        return self.policy.bf16_for(rows)

    def __call__(self, out: np.ndarray, a: np.ndarray, W: np.ndarray, trans_b: bool) -> np.ndarray:
        """out = a @ W^T (trans_b) or a @ W; W (n_out, n_in) as the weights hand it out:
        float32, or with bf16 products already bf16 bits (uint16: dequantized straight to
        bf16, `Forward.weight`); `a` float32, or with bf16 products bf16 bits made by its
        producer (the head's logit gradient). With bf16 products, fewer than policy.bf16_min_rows rows of an
        f32 weight multiply in f32."""
        if self._f32(a, W):
            return self.xp.matmul(a, W.T if trans_b else W, out=out)
        self._bf16(out, a, W, trans_b, accumulate=False)
        return out

    def add(self, out: np.ndarray, a: np.ndarray, W: np.ndarray, trans_b: bool, scratch: np.ndarray) -> None:
        """out += a @ W^T (trans_b) or a @ W, W as in __call__. f32 products: the product
        into `scratch` (out's shape) and an add, numpy's bits; bf16: oneDNN adds it in its
        one pass over out (a sum post-op)."""
        if self._f32(a, W):
            out += self.xp.matmul(a, W.T if trans_b else W, out=scratch)
        else:
            self._bf16(out, a, W, trans_b, accumulate=True)

    def adapted(self, out: np.ndarray, a: np.ndarray, W: np.ndarray, v: np.ndarray, trans_b: bool,
                accumulate: bool = False) -> None:
        """out = [bf16(a) | parts of v] [W]^T (trans_b) or [bf16(a) | parts of v] [W], or +=
        with accumulate: a base product with an adapter's share in its K axis (module
        docstring). a (N, K) float32; v (N, r) float32, the adapter's operand on a's side
        (s xa, or s dy B); W the extended bf16 weight, (n_out, K + E) with B's parts in
        its last E columns (trans_b) or (K + E, n_in) with A's parts in its last E rows
        (kernels/bf16.py `split_into`, `split_rows_into`)."""
        from ..kernels import bf16
        K = a.shape[1]
        width = W.shape[1] if trans_b else W.shape[0]
        if a is self._held and self._held_wide is not None and self._held_wide.shape[1] >= width:
            full = self._held_wide              # the shared input, rounded once, parts written per adapter
        else:
            full = self._round(a, "a", width - K)
        bf16.split_into(full, v, K, "a")
        bf16.gemm(out, full[:, :width], W, trans_b=trans_b, accumulate=accumulate)

    def rounded(self, x: np.ndarray) -> np.ndarray:
        """x rounded to bf16 bits into the kept operand buffer, for products that take it
        as is (a uint16 `a`): the rows of a mixture of experts' projection, rounded once
        and multiplied expert by expert (kernels/moe.py). Valid until the next product
        that rounds its operand."""
        return self._round(x, "a")

    def _f32(self, a: np.ndarray, W: np.ndarray) -> bool:
        return self.dtype == "f32" or (W.dtype != np.uint16 and a.dtype != np.uint16
                                       and not self.bf16_for(a.shape[0]))

    def _bf16(self, out, a, W, trans_b: bool, accumulate: bool) -> None:
        from ..kernels import bf16
        if a.dtype == np.uint16:                         # already bf16 (the head's logit gradient)
            a16 = a
        else:
            a16 = self._held_bf16 if a is self._held else self._round(a, "a")
        w16 = W if W.dtype == np.uint16 else self._round(W, "w")
        if out.dtype == np.uint16 and (accumulate or not out.flags.c_contiguous):
            raise ValueError("a product stored as bf16 bits takes a C-contiguous out and no accumulation")
        if out.flags.c_contiguous:
            bf16.gemm(out, a16, w16, trans_b=trans_b, accumulate=accumulate)
            return
        # a column block of a wider array (the head's logits): oneDNN writes rows far apart
        # at 0.4-0.5x its rate (bench shape's head, 2048 x 512 x 32000 in blocks of 4096
        # rows: 273 ms, against 133 ms through a contiguous block and a copy)
        tmp = self._buffer("out", out.shape)
        bf16.gemm(tmp, a16, w16, trans_b=trans_b)
        if accumulate:
            out += tmp
        else:
            out[...] = tmp

    @contextmanager
    def shared_input(self, x: np.ndarray, extension: int = 0):
        """Products inside take `x` rounded to bf16 once (q, k and v of one normed input;
        gate and up), not once each; with `extension`, into rows that many columns wider,
        where `adapted` products write their adapter's parts. x must not change inside."""
        if self.dtype != "bf16":
            yield
            return
        wide = self._round(x, "x", extension)
        self._held, self._held_bf16 = x, wide[:, : x.shape[1]]
        self._held_wide = wide if extension else None
        try:
            yield
        finally:
            self._held = self._held_bf16 = self._held_wide = None

    def _buffer(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The first prod(shape) elements of kept buffer `key`, grown as needed."""
        size = int(np.prod(shape))
        flat = self._flat[key]
        if flat.size < size:
            flat = self._flat[key] = np.empty(size, flat.dtype)
        return flat[:size].reshape(shape)

    def _round(self, x: np.ndarray, operand: str, extension: int = 0) -> np.ndarray:
        """x rounded to bf16 into the operand's kept buffer; with `extension`, into the
        first columns of rows that many columns wider (x 2-D), the rest left as it is."""
        from ..kernels import bf16
        if x.strides[-1] != x.itemsize:
            x = np.ascontiguousarray(x)
        if extension:
            buf = self._buffer(operand, (x.shape[0], x.shape[1] + extension))
            bf16.to_bf16_rows(buf, x)
            return buf
        buf = self._buffer(operand, x.shape)
        bf16.to_bf16(buf, x)
        return buf


def make_products(backend, policy: ComputePolicy = F32):
    """The products of a graph on `backend` under `policy`: a GPU's bf16 ones through
    cuBLAS (kernels/cuda/bf16.py CudaBf16Products, the same methods), or Products; tf32
    is float32 here (CuPy's compute type: backend.set_tf32)."""
    if policy.dtype == "bf16" and backend.name == "cuda":
        from ..kernels.cuda.bf16 import CudaBf16Products
        return CudaBf16Products(backend.xp, backend.ops.bf16)
    return Products(backend.xp, policy)


def bf16_bytes(cfg, N: int, head_rows: int, chunk: int, blocked_head: bool, extension: int = 0) -> int:
    """Bytes of the bf16 copies a training step of N tokens keeps (Products' buffers at
    their largest): an activation (N x the widest input, or the head's chunk x rows of
    logit gradient, or a mixture of experts' N k rows of its widest projection input:
    `rounded`) and a shared input (N x the widest normed input), each `extension`
    columns wider where adapters ride in the products (`adapted`); and, where the head
    is not multiplied in column blocks (train/head.py `blocked_head`), the f32 block
    (chunk x rows) its logits are multiplied into before their copy. The weights come
    dequantized straight to bf16 (model.Dequantizer.nbytes_bf16, in place of the f32
    scratch)."""
    from .arch import layer_matrix_shapes
    mats = layer_matrix_shapes(cfg)
    widest = N * (max(cfg.n_embd, cfg.n_ff, cfg.n_embd_q, *(i for _, i in mats), *(o for o, _ in mats)) + extension)
    if cfg.n_expert:                                  # a mixture of experts' rows, rounded whole (`rounded`)
        widest = max(widest, N * cfg.n_expert_used * max(cfg.n_embd, cfg.n_ff_exp))
    shared = N * (cfg.n_embd + extension)
    if blocked_head:                                  # the head's gradient comes as bf16, its logits in place
        return 2 * (widest + shared)
    return 2 * (max(widest, chunk * head_rows) + shared) + 4 * chunk * head_rows
