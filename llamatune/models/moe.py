"""The mixture-of-experts feed-forward of a layer (qwen3moe), forward: llama.cpp's
build_moe_ffn with softmax gating, as src/models/qwen3moe.cpp calls it.

For the normed input xn (N, C) of layer i:

    z = xn W_router^T                  (N, E)   `ffn_gate_inp`, a plain linear (adapters apply)
    p = softmax(z); idx = top k of p;  w = p[idx] / sum p[idx]   (Arch.expert_norm)
    out[t] = sum_j w[t, j] * SwiGLU_e(xn[t]),  e = idx[t, j]
    SwiGLU_e(x) = (silu(x G_e^T) * (x U_e^T)) D_e^T

with G, U (E, F_exp, C) = `ffn_gate_exps`, `ffn_up_exps` and D (E, C, F_exp) =
`ffn_down_exps` (kernels/moe.py: pairs grouped by expert as ggml_mul_mat_id). The
expert tensors stay as stored; only the experts a batch chose are dequantized, one at a
time, into the dequantizer's one scratch right before their products (`ExpertWeights`),
and multiplied as the run's products are (`expert_products`: bf16 weights through
oneDNN with bf16 products, else float32). Adapters on the experts are per
expert, A (E, r, n_in) and B (E, n_out, r), applied to each expert's rows as llama.cpp's
build_lora_mm_id does (`expert_adapters`). What the backward reads is kept in a
`MoeActs` (train/moe.py runs the backward); a training graph plans its arrays and the
experts' scratch (`Forward.expert_buffers`), inference allocates them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import moe as kmoe
from ..kernels import swiglu_oai


class ExpertWeights:
    """One 3-D expert tensor of a layer as the expert kernels read it: `w[e]` is expert
    e's (n_out, n_in) float32 matrix, dequantized when asked (valid until the next
    dequantization); `shape` is (E, n_out, n_in)."""

    def __init__(self, weights, name: str, bf16: bool = False):
        self.weights, self.name, self.bf16 = weights, name, bf16
        self.shape = weights.expert_shape(name)

    def __getitem__(self, e: int) -> np.ndarray:
        if self.bf16:                               # bf16 bits (uint16), for bf16 products
            return self.weights.expert_matrix_bf16(self.name, int(e))
        return self.weights.expert_matrix(self.name, int(e))


@dataclass
class MoeActs:
    """One layer's mixture-of-experts activations, what its backward reads."""
    probs: np.ndarray               # (N, E) softmax of the router logits
    idx: np.ndarray                 # (N, k) int64 experts chosen, largest first
    w: np.ndarray                   # (N, k) their weights
    rows: kmoe.ExpertRows           # the grouped pairs and their SwiGLU activations
    prob_sum: np.ndarray            # (E,) probs summed over the tokens (the load-balancing loss)


PROJECTIONS = (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps"))


def expert_adapters(fw, i: int) -> dict[str, kmoe.ExpertLora]:
    """The adapters on layer i's expert tensors, {"gate" | "up" | "down": ExpertLora}, from
    `fw.linears.pairs` (per expert A (E, r, n_in), B (E, n_out, r)); several on one tensor
    (run-time --lora files) are joined along r: sum_j s_j (x A_j^T) B_j^T = (x [A_j]^T) [s_j B_j]^T."""
    out = {}
    for proj, kind in PROJECTIONS:
        pairs = list(fw.linears.pairs(f"blk.{i}.{kind}.weight"))
        if len(pairs) == 1:
            out[proj] = kmoe.ExpertLora(*pairs[0])
        elif pairs:
            out[proj] = kmoe.ExpertLora(np.concatenate([a for a, _, _ in pairs], axis=1),
                                        np.concatenate([s * b for _, b, s in pairs], axis=2), 1.0)
    return out


def experts_of(weights, i: int, bf16: bool = False) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
    """Layer i's gate, up and down expert tensors (dequantized to bf16 bits with `bf16`)."""
    return tuple(ExpertWeights(weights, f"blk.{i}.{k}.weight", bf16)
                 for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))


def expert_products(fwd, N: int):
    """(bf16, mm) of a mixture of experts over N tokens: whether its experts come
    dequantized to bf16, and the per-expert product mm(out, a, W, trans_b): the run's
    bf16 products (fwd.products: oneDNN, the dense layers' path) where the run multiplies
    N rows in bf16 (over rows padded as kernels/moe.row_padded pads them, each
    projection's rows rounded to bf16 once: Products.rounded), else
    kernels/moe.expert_matmul (float32)."""
    if fwd.products.dtype == "bf16" and fwd.products.bf16_for(N):
        return True, kmoe.row_padded(fwd.products, operand=fwd.products.rounded)
    return False, kmoe.expert_matmul


def route(logits: np.ndarray, k: int, normalize: bool, w: np.ndarray | None = None,
          probs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(idx (N, k), w (N, k), probs (N, E)) of router logits (N, E): the numba router in
    float32, the reference in float64 (the gradient tests); w, probs written where given."""
    N, E = logits.shape
    idx = np.empty((N, k), np.int64)
    w = np.empty((N, k), logits.dtype) if w is None else w
    probs = np.empty((N, E), logits.dtype) if probs is None else probs
    if logits.dtype == np.float32:
        kmoe.router_forward(idx, w, probs, logits, normalize)
    else:
        kmoe.router_forward_ref(idx, w, probs, logits, normalize)
    return idx, w, probs


def expert_gate(cfg):
    """The experts' gate kernels (forward, backward): None for SwiGLU, gpt-oss's clamped
    SwiGLU where the architecture declares it (Arch.activation "swiglu_oai")."""
    if cfg.spec.activation != "swiglu_oai":
        return None
    return swiglu_oai.swiglu_oai_forward, swiglu_oai.swiglu_oai_backward


def expert_biases(weights, i: int, dtype) -> dict[str, np.ndarray]:
    """Layer i's expert biases {"gate" | "up" | "down": (E, n_out)} (gpt-oss; none elsewhere)."""
    out = {}
    for proj, kind in PROJECTIONS:
        b = weights.vector(f"blk.{i}.{kind}.bias")
        if b is not None:
            out[proj] = b.astype(dtype, copy=False)
    return out


def moe_forward(fwd, out: np.ndarray, xn: np.ndarray, i: int, kept: dict | None = None) -> MoeActs:
    """out (N, C) = layer i's mixture of experts of xn (N, C) (overwritten), through the
    Forward `fwd` (its `linear` runs the router, with its bias where it has one; its base
    hands out the experts and their biases, its expert_buffers(i) the planned scratch).
    While `fwd.recomputing` (a training step's recompute, whose output nobody reads) out
    is zeroed and the down experts are neither dequantized nor multiplied.
    kept: the part's planned probs (N, E), w (N, k), g and u (N k, F), or None (allocated here)."""
    cfg = fwd.cfg
    kept = kept or {}
    logits = np.empty((xn.shape[0], cfg.n_expert), xn.dtype)
    fwd.linear(logits, xn, f"blk.{i}.ffn_gate_inp.weight")
    idx, w, probs = route(logits, cfg.n_expert_used, cfg.spec.expert_norm, kept.get("w"), kept.get("probs"))
    bf16, mm = expert_products(fwd, xn.shape[0])
    buffers = fwd.expert_buffers(i) | {k: kept.get(k) for k in ("g", "u")}
    rows = kmoe.moe_ffn_forward(out, xn, idx, w, *experts_of(fwd.weights, i, bf16), lora=expert_adapters(fwd, i),
                                buffers=buffers, mm=mm, bias=expert_biases(fwd.weights, i, xn.dtype),
                                gate=expert_gate(cfg), output=not fwd.recomputing)
    return MoeActs(probs, idx, w, rows, probs.sum(axis=0))
