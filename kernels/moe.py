"""Mixture-of-experts feed-forward, forward and backward: numpy references (`*_ref`)
of the router and of the grouped expert SwiGLU, the contract a kernel will meet.

Router (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, llama.cpp's build_moe_ffn with softmax
gating): for each token's router logits z (E,),

    p = softmax(z);   idx = the k experts of largest p;   w_j = p_idx[j]  (j < k)
    normalize (norm_topk_prob):  w_j = p_idx[j] / sum_i p_idx[i]

Normalized, w is also the softmax of the k largest logits alone, gpt-oss's router
(softmax after top-k): one function serves both. Backward flows into z through w with
the choice idx held fixed (as autograd does through torch.topk's values):

    normalized:  dp_idx[j] = (dw_j - sum_i dw_i w_i) / S,   S = sum_i p_idx[i]
    plain:       dp_idx[j] = dw_j;   dp = 0 off the top k
    dz = p * (dp - sum(p * dp))                                   (softmax backward)

Experts (llama.cpp's ggml_mul_mat_id over `ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`, numpy shapes (E, F, C), (E, F, C), (E, C, F)): the N*k (token, slot)
pairs are grouped by expert (`expert_groups`: a stable sort of idx, rows of one
expert contiguous), and each expert e with rows r_e (tokens t, slots s):

    X_e = x[t]                                         gather        (n_e, C)
    G = X_e W_gate[e]^T,  U = X_e W_up[e]^T,  H = silu(G) * U       (n_e, F)
    Y = H W_down[e]^T                                                (n_e, C)
    out[t] += w[t, s] * Y                              scatter-add

Experts no token chose are not touched (a kernel dequantizes only those). Backward:

    dw[t, s] = dout[t] . Y;   dY = w[t, s] * dout[t]
    dW_down[e] += dY^T H;   dH = dY W_down[e];   (dG, dU) = swiglu backward
    dW_gate[e] += dG^T X_e;  dW_up[e] += dU^T X_e;  dx[t] += dG W_gate[e] + dU W_up[e]

Proven by float64 finite differences (tests/test_op_moe.py), and the grouped forward
against a per-token loop. Not used by the model yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .swiglu import swiglu_backward_ref, swiglu_forward_ref

__all__ = ["ExpertGroup", "expert_groups", "router_forward_ref", "router_backward_ref",
           "moe_ffn_forward_ref", "moe_ffn_backward_ref"]


# ------------------------------------------------------------------ router
def router_forward_ref(idx, w, probs, logits, normalize=True):
    """idx (N, k) int64 = the k experts of largest probability per token, largest first
    (ties: the lower expert); w (N, k) their weights, normalized to sum 1 when `normalize`;
    probs (N, E) = softmax(logits) (saved for backward). logits (N, E)."""
    k = idx.shape[1]
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    probs[:] = e / e.sum(axis=1, keepdims=True)
    idx[:] = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(probs, idx, axis=1)
    w[:] = top / top.sum(axis=1, keepdims=True) if normalize else top


def router_backward_ref(dlogits, dw, idx, w, probs, normalize=True):
    """dlogits (N, E) = dL/dlogits (overwritten) from dw (N, k) = dL/dw, through the
    weights of the experts chosen (idx held fixed); idx, w, probs as the forward made them."""
    dtop = dw
    if normalize:
        s = np.take_along_axis(probs, idx, axis=1).sum(axis=1, keepdims=True)
        dtop = (dw - (dw * w).sum(axis=1, keepdims=True)) / s
    dp = np.zeros_like(probs)
    np.put_along_axis(dp, idx, dtop, axis=1)
    dlogits[:] = probs * (dp - (probs * dp).sum(axis=1, keepdims=True))


# ------------------------------------------------------------------ experts
@dataclass
class ExpertGroup:
    """The rows one expert computes, and what its backward reads."""
    expert: int
    tokens: np.ndarray      # (n_e,) int64: token of each row
    slots: np.ndarray       # (n_e,) int64: which of the token's k choices it is
    g: np.ndarray           # (n_e, F) X_e W_gate[e]^T
    u: np.ndarray           # (n_e, F) X_e W_up[e]^T
    h: np.ndarray           # (n_e, F) silu(g) * u
    y: np.ndarray           # (n_e, C) h W_down[e]^T, before the router weight


def expert_groups(idx, n_expert):
    """(order, offsets): the flat (token, slot) pairs p = k t + s sorted by expert,
    stably (order (N*k,) int64), and expert e's rows order[offsets[e]:offsets[e+1]]
    (offsets (E + 1,) int64), as ggml_mul_mat_id groups its rows."""
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_expert))]).astype(np.int64)
    return order, offsets


def moe_ffn_forward_ref(out, x, idx, w, w_gate, w_up, w_down):
    """out (N, C) = sum over each token's k choices of w * expert(x) (overwritten).
    x (N, C); idx (N, k) int64 and w (N, k) from the router; w_gate, w_up (E, F, C),
    w_down (E, C, F). Returns the ExpertGroups of the experts used (backward's input)."""
    k = idx.shape[1]
    order, offsets = expert_groups(idx, w_gate.shape[0])
    out[:] = 0
    groups = []
    for e in range(w_gate.shape[0]):
        rows = order[offsets[e]:offsets[e + 1]]
        if rows.size == 0:
            continue                                            # an expert no token chose
        t, s = rows // k, rows % k
        xe = x[t]                                               # gather
        g, u = xe @ w_gate[e].T, xe @ w_up[e].T
        h = np.empty_like(g)
        swiglu_forward_ref(h, g, u)
        y = h @ w_down[e].T
        out[t] += w[t, s][:, None] * y          # scatter with the router weights (the top k are
        #                                         distinct experts: a token is once in a group)
        groups.append(ExpertGroup(e, t, s, g, u, h, y))
    return groups


def moe_ffn_backward_ref(dx, dw, dw_gate, dw_up, dw_down, dout, x, w, w_gate, w_up, w_down, groups):
    """dx (N, C) and dw (N, k) = dL/dx, dL/dw (overwritten); dw_gate, dw_up, dw_down =
    dL/dW accumulated (+=) for the experts used, or None (frozen weights); dout (N, C);
    the forward's inputs and its groups."""
    dx[:] = 0
    dw[:] = 0
    for grp in groups:
        e, t, s = grp.expert, grp.tokens, grp.slots
        xe = x[t]
        dw[t, s] = (dout[t] * grp.y).sum(axis=1)                # each (t, s) pair is one row
        dy = w[t, s][:, None] * dout[t]
        dh = dy @ w_down[e]
        dg, du = np.empty_like(grp.g), np.empty_like(grp.u)
        swiglu_backward_ref(dg, du, dh, grp.g, grp.u)
        dx[t] += dg @ w_gate[e] + du @ w_up[e]                  # a token's k experts add up
        if dw_down is not None:
            dw_down[e] += dy.T @ grp.h
        if dw_gate is not None:
            dw_gate[e] += dg.T @ xe
        if dw_up is not None:
            dw_up[e] += du.T @ xe
