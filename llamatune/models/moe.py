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
time, right before their products (`ExpertWeights`). Adapters on the experts are per
expert, A (E, r, n_in) and B (E, n_out, r), applied to each expert's rows as llama.cpp's
build_lora_mm_id does (`expert_adapters`). What the backward reads is kept in a
`MoeActs` (train/moe.py runs the backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import moe as kmoe


class ExpertWeights:
    """One 3-D expert tensor of a layer as the expert kernels read it: `w[e]` is expert
    e's (n_out, n_in) float32 matrix, dequantized when asked (valid until the next
    dequantization); `shape` is (E, n_out, n_in)."""

    def __init__(self, weights, name: str):
        self.weights, self.name = weights, name
        self.shape = weights.expert_shape(name)

    def __getitem__(self, e: int) -> np.ndarray:
        return self.weights.expert_matrix(self.name, int(e))


@dataclass
class MoeActs:
    """One layer's mixture-of-experts activations, what its backward reads."""
    probs: np.ndarray               # (N, E) softmax of the router logits
    idx: np.ndarray                 # (N, k) int64 experts chosen, largest first
    w: np.ndarray                   # (N, k) their weights
    rows: kmoe.ExpertRows           # the grouped pairs and their SwiGLU activations


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


def experts_of(weights, i: int) -> tuple[ExpertWeights, ExpertWeights, ExpertWeights]:
    """Layer i's gate, up and down expert tensors."""
    return tuple(ExpertWeights(weights, f"blk.{i}.{k}.weight") for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))


def route(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(idx (N, k), w (N, k), probs (N, E)) of router logits (N, E): the numba router in
    float32, the reference in float64 (the gradient tests)."""
    N, E = logits.shape
    idx, w, probs = np.empty((N, k), np.int64), np.empty((N, k), logits.dtype), np.empty((N, E), logits.dtype)
    if logits.dtype == np.float32:
        kmoe.router_forward(idx, w, probs, logits, normalize)
    else:
        kmoe.router_forward_ref(idx, w, probs, logits, normalize)
    return idx, w, probs


def moe_forward(fwd, out: np.ndarray, xn: np.ndarray, i: int) -> MoeActs:
    """out (N, C) = layer i's mixture of experts of xn (N, C) (overwritten), through the
    Forward `fwd` (its `linear` runs the router, its base hands out the experts)."""
    cfg = fwd.cfg
    logits = np.empty((xn.shape[0], cfg.n_expert), xn.dtype)
    fwd.linear(logits, xn, f"blk.{i}.ffn_gate_inp.weight")
    idx, w, probs = route(logits, cfg.n_expert_used, cfg.spec.expert_norm)
    rows = kmoe.moe_ffn_forward(out, xn, idx, w, *experts_of(fwd.weights, i), lora=expert_adapters(fwd, i))
    return MoeActs(probs, idx, w, rows)
