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
against a per-token loop.

The numba side (`router_forward` / `router_backward`, `expert_order`, `moe_ffn_forward` /
`moe_ffn_backward`, tests/test_op_moe_numba.py) meets the same contracts, with LoRA on
the experts (`ExpertLora`: per-expert A (E, r, n_in) and B (E, n_out, r), llama.cpp's
build_lora_mm_id layout). bench/moe.py times it against a dense SwiGLU of the same
active size. qwen3moe's feed-forward part runs them (models/moe.py, train/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba import njit, prange

from .swiglu import swiglu_backward, swiglu_backward_ref, swiglu_forward, swiglu_forward_ref
from .vecmath import FASTMATH

__all__ = ["ExpertGroup", "ExpertLora", "ExpertRows", "SCRATCH", "expert_groups", "expert_matmul", "expert_order",
           "row_padded", "scratch_shapes", "moe_ffn_backward",
           "moe_ffn_backward_ref", "moe_ffn_forward", "moe_ffn_forward_ref", "router_backward",
           "router_backward_ref", "router_forward", "router_forward_ref"]


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


# ================================================================== numba kernels
# The router runs per token (a prange over tokens, float32 softmax, the top k by
# repeated selection: k passes over E, ties to the lower expert as the reference's
# stable sort). The experts run on all (token, slot) pairs sorted by expert at once
# (`expert_order`, a counting sort: the reference's stable order, exactly), once per
# layer and micro-batch (the backward reuses the order): one gather of the sorted rows,
# per-expert products on contiguous slices (`expert_matmul`: oneDNN's float32 matmul,
# or the run's bf16 products), one SwiGLU over all rows, and a per-token sum over the
# token's k rows weighted by the router (no two threads write one token; slot order,
# not the reference's expert order, so the sums agree to float32 rounding). The
# forward keeps the sorted order and the gate inputs g, u; the backward gathers its
# inputs again and recomputes h = silu(g) u into the shared scratch.

@njit(cache=True, parallel=True)
def _router_forward(idx, w, probs, logits, normalize):
    N, E = logits.shape
    k = idx.shape[1]
    for n in prange(N):
        m = logits[n, 0]
        for e in range(1, E):
            m = max(m, logits[n, e])
        s = np.float32(0)
        for e in range(E):
            p = np.exp(logits[n, e] - m)
            probs[n, e] = p
            s += p
        for e in range(E):
            probs[n, e] /= s
        top = np.float32(0)
        for j in range(k):
            best = -1
            for e in range(E):
                taken = False
                for i in range(j):
                    taken = taken or idx[n, i] == e
                if not taken and (best < 0 or probs[n, e] > probs[n, best]):
                    best = e
            idx[n, j] = best
            w[n, j] = probs[n, best]
            top += probs[n, best]
        if normalize:
            for j in range(k):
                w[n, j] /= top


@njit(cache=True, parallel=True)
def _router_backward(dlogits, dw, idx, w, probs, normalize):
    N, E = probs.shape
    k = idx.shape[1]
    for n in prange(N):
        s = np.float32(0)
        c = np.float32(0)
        for j in range(k):
            s += probs[n, idx[n, j]]
            c += dw[n, j] * w[n, j]
        pdp = np.float32(0)                       # sum(p * dp) over the top k
        for j in range(k):
            dtop = (dw[n, j] - c) / s if normalize else dw[n, j]
            pdp += probs[n, idx[n, j]] * dtop
        for e in range(E):
            dlogits[n, e] = -probs[n, e] * pdp
        for j in range(k):
            e = idx[n, j]
            dtop = (dw[n, j] - c) / s if normalize else dw[n, j]
            dlogits[n, e] += probs[n, e] * dtop


def router_forward(idx, w, probs, logits, normalize=True):
    """router_forward_ref's contract, float32 (N, E) logits and probs, (N, k) w."""
    _router_forward(idx, w, probs, logits, normalize)


def router_backward(dlogits, dw, idx, w, probs, normalize=True):
    """router_backward_ref's contract (dlogits overwritten)."""
    _router_backward(dlogits, dw, idx, w, probs, normalize)


@njit(cache=True)
def _counting_sort(order, offsets, pos, flat):
    # offsets[e] = rows before expert e; order[r] = pair of sorted row r; pos its inverse
    offsets[:] = 0
    for p in range(flat.shape[0]):
        offsets[flat[p] + 1] += 1
    for e in range(1, offsets.shape[0]):
        offsets[e] += offsets[e - 1]
    fill = offsets[:-1].copy()
    for p in range(flat.shape[0]):
        r = fill[flat[p]]
        order[r] = p
        pos[p] = r
        fill[flat[p]] = r + 1


def expert_order(idx, n_expert):
    """expert_groups by a counting sort: (order (N*k,), offsets (E + 1,), pos (N*k,)),
    pos[p] the sorted row of pair p = k t + s. order and offsets equal expert_groups'."""
    flat = np.ascontiguousarray(idx, np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"expert index out of range [0, {n_expert})")
    order, pos = np.empty(flat.size, np.int64), np.empty(flat.size, np.int64)
    offsets = np.empty(n_expert + 1, np.int64)
    _counting_sort(order, offsets, pos, flat)
    return order, offsets, pos


@njit(cache=True, parallel=True)
def _gather_pairs(xs, x, order, k):
    # xs[r] = x[token of sorted row r]
    for r in prange(order.shape[0]):
        xs[r] = x[order[r] // k]


@njit(cache=True, parallel=True)
def _combine(out, ys, w, pos):
    # out[t] = sum_s w[t, s] * ys[pos[k t + s]]   (overwritten; w None: unweighted)
    k = pos.shape[0] // out.shape[0]
    for t in prange(out.shape[0]):
        out[t] = 0
        for s in range(k):
            r = pos[k * t + s]
            ws = w[t, s] if w is not None else np.float32(1)
            for c in range(out.shape[1]):
                out[t, c] += ws * ys[r, c]


@njit(cache=True, parallel=True)
def _weighted_rows(dw, dh, q, h, w, order, k):
    # dw[t, s] = q[r] . h[r];  dh[r] = w[t, s] * q[r]   for sorted row r of (t, s) (dh may be q)
    for r in prange(order.shape[0]):
        t, s = order[r] // k, order[r] % k
        acc = q[r, 0] * 0
        for f in range(q.shape[1]):
            acc += q[r, f] * h[r, f]
        dw[t, s] = acc
        for f in range(q.shape[1]):
            dh[r, f] = w[t, s] * q[r, f]


@dataclass
class ExpertLora:
    """LoRA on one expert projection in llama.cpp's build_lora_mm_id layout: per expert
    A (r, n_in) and B (n_out, r), stored as 3-D tensors (GGUF ne [n_in, r, E] and
    [r, n_out, E]); for the rows X_e of expert e

        Y = X_e W[e]^T + scale * (X_e A[e]^T) B[e]^T,   scale = user_scale * alpha / r

    Backward (dY): dX = dY W[e] + scale (dY B[e]) A[e];  dB[e] += scale dY^T (X_e A[e]^T);
    dA[e] += scale (dY B[e])^T X_e. da, db: accumulated gradients, or None (frozen)."""
    a: np.ndarray                       # (E, r, n_in)
    b: np.ndarray                       # (E, n_out, r)
    scale: float
    da: np.ndarray | None = None        # (E, r, n_in)
    db: np.ndarray | None = None        # (E, n_out, r)


SCRATCH = ("xs", "ys", "h", "dh", "dg", "du")     # the rows' buffers every layer reuses


def scratch_shapes(P: int, C: int, F: int) -> dict[str, tuple[int, int]]:
    """The experts' scratch for P = N k rows, by name: xs (P, C) gathered inputs; ys (P, C)
    the down products (backward: the gathered output gradient, then dL/dxs); h (P, F) the
    SwiGLU output; dh, dg, du (P, F) its backward."""
    return {"xs": (P, C), "ys": (P, C), "h": (P, F), "dh": (P, F), "dg": (P, F), "du": (P, F)}


def _buffers(buffers, P, C, F, dtype, names):
    """{name: array} of `names` from `buffers` (planned: train/buffers.py), the missing
    ones allocated (inference, tests)."""
    shapes = scratch_shapes(P, C, F) | {"g": (P, F), "u": (P, F)}
    have = buffers or {}
    return {n: have[n] if have.get(n) is not None else np.empty(shapes[n], dtype) for n in names}


@dataclass
class ExpertRows:
    """What moe_ffn_forward keeps for its backward: the (token, slot) pairs sorted by
    expert (rows offsets[e]:offsets[e+1] are expert e's) and their gate inputs; the
    scratch (ys, h, ...) is shared with the next layers and the backward recomputes
    what it needs there (h = silu(g) u, xs gathered again)."""
    order: np.ndarray       # (P,) int64, P = N k: pair k t + s of each sorted row
    offsets: np.ndarray     # (E + 1,) int64
    pos: np.ndarray         # (P,) int64: sorted row of each pair
    g: np.ndarray           # (P, F) X_e W_gate[e]^T
    u: np.ndarray           # (P, F) X_e W_up[e]^T
    lora_in: dict           # projection -> (P, r) X_e A[e]^T of its LoRA
    scratch: dict           # SCRATCH name -> array (planned, or allocated by the forward)


def _used(offsets):
    return [(e, int(offsets[e]), int(offsets[e + 1])) for e in range(offsets.shape[0] - 1)
            if offsets[e + 1] > offsets[e]]


ROW_STEP = 16    # oneDNN's products over an expert's rows padded to a multiple of this


def row_padded(mm, step: int = ROW_STEP, operand=None):
    """mm(out, a, W, trans_b) over a's rows padded with zeros to a multiple of `step`:
    oneDNN builds (and keeps) a primitive per product shape, 0.6 MB each, and the
    experts' row counts are all different (80 shapes of (n, 2048) x (2048, 768) took 47
    MB); padded, a layer's products take a handful of shapes. operand(x): x (all the
    rows of a projection) as mm takes its `a` (bf16 products: rounded to bf16 once, not
    once per expert), kept as the product's `operand` (`_operand`)."""
    def padded(out, a, W, trans_b):
        M = a.shape[0]
        Mp = -(-M // step) * step
        if Mp == M:
            return mm(out, a, W, trans_b)
        ap = np.zeros((Mp, a.shape[1]), a.dtype)
        ap[:M] = a
        op = np.empty((Mp, out.shape[1]), out.dtype)
        mm(op, ap, W, trans_b)
        out[...] = op[:M]
        return out
    padded.operand = operand
    return padded


def _operand(mm, x):
    """x as the per-expert product mm takes its left operand: mm.operand(x) where mm has
    one (row_padded), else x."""
    prepare = getattr(mm, "operand", None)
    return x if prepare is None else prepare(x)


def _onednn_f32(out, a, W, trans_b):
    from . import bf16
    bf16.gemm(out, a, W, trans_b=trans_b)
    return out


_onednn_padded = row_padded(_onednn_f32)


def expert_matmul(out, a, W, trans_b):
    """out = a @ W^T (trans_b) or a @ W: one expert's rows (a few dozen) times its
    (n_out, n_in) matrix. float32 through oneDNN's float32 matmul where it loaded
    (kernels/bf16.py gemm; rows padded, `row_padded`), else numpy in the orientation
    OpenBLAS runs fast for few rows, (W a^T)^T: OpenBLAS 0.3.31 multiplies (32, 2048) x
    (2048, 768) as a @ W^T at about 2 GFLOP/s, as W a^T at about 20, oneDNN at 30-60
    (2 cores, bench/moe.py); float64 (the tests): numpy as written."""
    if a.dtype == np.float32 and W.dtype == np.float32:
        from . import bf16
        if bf16.available():
            _onednn_padded(out, a, W, trans_b)
        else:
            out[...] = (W @ a.T).T if trans_b else (W.T @ a.T).T
        return out
    return np.matmul(a, W.T if trans_b else W, out=out)


# The adapters' rank-r products over all rows at once, each row with its expert's A or B
# (offsets: expert e's rows offsets[e]:offsets[e+1]), in parallel over the experts: one
# call per projection where a product per expert cost more in calls than in flops.
@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _lora_in(xa, xs, A, offsets):
    # xa[r] = xs[r] A[e]^T                       A (E, R, K)
    for e in prange(offsets.shape[0] - 1):
        for r in range(offsets[e], offsets[e + 1]):
            for j in range(A.shape[1]):
                acc = xs[r, 0] * 0
                for c in range(A.shape[2]):
                    acc += xs[r, c] * A[e, j, c]
                xa[r, j] = acc


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _lora_out(out, xa, B, scale, offsets):
    # out[r] += scale * xa[r] B[e]^T             B (E, n_out, R)
    for e in prange(offsets.shape[0] - 1):
        for r in range(offsets[e], offsets[e + 1]):
            for o in range(B.shape[1]):
                acc = xa[r, 0] * 0
                for j in range(B.shape[2]):
                    acc += xa[r, j] * B[e, o, j]
                out[r, o] += scale * acc


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _lora_back(d, dyb, dy, A, B, scale, offsets):
    # dyb[r] = scale * dy[r] B[e];  d[r] += dyb[r] A[e]
    R = A.shape[1]
    for e in prange(offsets.shape[0] - 1):
        for r in range(offsets[e], offsets[e + 1]):
            for j in range(R):
                dyb[r, j] = 0
            for o in range(B.shape[1]):
                v = dy[r, o]
                for j in range(R):
                    dyb[r, j] += v * B[e, o, j]
            for j in range(R):
                dyb[r, j] *= scale
            for c in range(A.shape[2]):
                acc = dyb[r, 0] * 0
                for j in range(R):
                    acc += dyb[r, j] * A[e, j, c]
                d[r, c] += acc


@njit(cache=True, parallel=True, fastmath=FASTMATH)
def _lora_grads(da, db, dyb, dy, xs, xa, row_w, scale, offsets):
    # da[e] += sum_r w_r dyb[r]^T xs[r];  db[e] += scale sum_r w_r dy[r]^T xa[r]   (rows of e)
    R = da.shape[1]
    for e in prange(offsets.shape[0] - 1):
        for r in range(offsets[e], offsets[e + 1]):
            wr = row_w[r]
            for j in range(R):
                f = wr * dyb[r, j]
                for c in range(da.shape[2]):
                    da[e, j, c] += f * xs[r, c]
            for o in range(db.shape[1]):
                f = scale * wr * dy[r, o]
                for j in range(R):
                    db[e, o, j] += f * xa[r, j]


def _project(out, xs, w, lora, xa, used, mm, offsets, bias=None, xs_mm=None):
    """out[a:b] = xs[a:b] w[e]^T (+ the LoRA's scale (xs A[e]^T) B[e]^T, xs A^T kept in xa)
    (+ bias[e], the expert's bias (E, n_out): gpt-oss). xs_mm: xs as mm takes it
    (`_operand`; None: made here)."""
    xs_mm = _operand(mm, xs) if xs_mm is None else xs_mm
    for e, a, b in used:
        mm(out[a:b], xs_mm[a:b], w[e], True)
    if lora is not None:
        _lora_in(xa, xs, lora.a, offsets)
        _lora_out(out, xa, lora.b, out.dtype.type(lora.scale), offsets)
    if bias is not None:
        for e, a, b in used:
            out[a:b] += bias[e]


def _project_backward(dxs, dy, xs, w, lora, xa, used, mm, offsets, dw=None, row_w=None, accumulate=False):
    """dxs[a:b] (=, or += when accumulate) dy w[e] (+ scale (dy B[e]) A[e]); the weight
    gradients take dy's rows times row_w (None: 1): dw[e] += dy^T xs where dw is given,
    the LoRA's da, db likewise."""
    dy_mm = _operand(mm, dy)
    for e, a, b in used:
        if accumulate:
            dxs[a:b] += mm(np.empty((b - a, dxs.shape[1]), dxs.dtype), dy_mm[a:b], w[e], False)
        else:
            mm(dxs[a:b], dy_mm[a:b], w[e], False)
        if dw is not None:
            dw[e] += (dy[a:b] if row_w is None else dy[a:b] * row_w[a:b, None]).T @ xs[a:b]
    if lora is None:
        return
    scale = dxs.dtype.type(lora.scale)
    dyb = np.empty((dy.shape[0], lora.a.shape[1]), dy.dtype)
    _lora_back(dxs, dyb, dy, lora.a, lora.b, scale, offsets)
    if lora.da is not None or lora.db is not None:
        da = lora.da if lora.da is not None else np.zeros_like(lora.a)
        db = lora.db if lora.db is not None else np.zeros_like(lora.b)
        rw = row_w if row_w is not None else np.ones(dy.shape[0], dy.dtype)
        _lora_grads(da, db, dyb, dy, xs, xa, rw, scale, offsets)


def moe_ffn_forward(out, x, idx, w, w_gate, w_up, w_down, lora=None, buffers=None, mm=expert_matmul, bias=None,
                    gate=None, output=True):
    """moe_ffn_forward_ref's contract (float32, or float64 throughout); returns the
    ExpertRows backward reads. w_gate, w_up (E, F, C), w_down (E, C, F): only the experts
    chosen are read (each could be dequantized on demand). lora: {"gate" | "up" | "down":
    ExpertLora} on those projections, or None. buffers: {name: array} for the kept g, u
    (P, F), the LoRAs' "xa.<projection>" (P, r) and the SCRATCH, P = N k (missing ones
    are allocated). mm(out, a, W, trans_b): the per-expert product (expert_matmul, or
    the run's bf16 products with bf16 weights). gpt-oss's experts: bias {"gate" | "up" |
    "down": (E, n_out)} added to each projection (frozen), and gate = (forward, backward)
    kernels of another gate than SwiGLU (kernels/swiglu_oai.py), the same in the backward.
    output False (a recompute whose output nobody reads): what the backward reads alone,
    without the down products (the down LoRA's x A^T only) and with out zeroed: w_down
    is not read."""
    lora, bias = lora or {}, bias or {}
    gate_forward = swiglu_forward if gate is None else gate[0]
    N, k = idx.shape
    order, offsets, pos = expert_order(idx, w_gate.shape[0])
    P, F, C, dt = order.shape[0], w_gate.shape[1], x.shape[1], x.dtype
    b = _buffers(buffers, P, C, F, dt, ("g", "u") + SCRATCH)
    have = buffers or {}
    xa = {name: have.get(f"xa.{name}") if have.get(f"xa.{name}") is not None
          else np.empty((P, lo.a.shape[1]), dt) for name, lo in lora.items()}
    used = _used(offsets)
    _gather_pairs(b["xs"], x, order, k)
    xs_mm = _operand(mm, b["xs"])                               # the gate's and the up's operand
    _project(b["g"], b["xs"], w_gate, lora.get("gate"), xa.get("gate"), used, mm, offsets, bias.get("gate"), xs_mm)
    _project(b["u"], b["xs"], w_up, lora.get("up"), xa.get("up"), used, mm, offsets, bias.get("up"), xs_mm)
    gate_forward(b["h"], b["g"], b["u"])
    if output:
        _project(b["ys"], b["h"], w_down, lora.get("down"), xa.get("down"), used, mm, offsets, bias.get("down"))
        _combine(out, b["ys"], w, pos)
    else:
        if "down" in lora:
            _lora_in(xa["down"], b["h"], lora["down"].a, offsets)
        out[...] = 0
    return ExpertRows(order, offsets, pos, b["g"], b["u"], xa, {n: b[n] for n in SCRATCH})


def moe_ffn_backward(dx, dw, dw_gate, dw_up, dw_down, dout, x, w, w_gate, w_up, w_down, rows, lora=None,
                     mm=expert_matmul, bias=None, gate=None):
    """moe_ffn_backward_ref's contract with moe_ffn_forward's ExpertRows (x: the forward's
    input, gathered again); the LoRA's gradients accumulate into its da, db. The router
    weight's gradient without the down products kept: with q = dout[t] W_down[e] (+ its
    LoRA's scale (dout[t] B[e]) A[e]), dout[t] . y = q . h (+ dout[t] . bias_down[e]), and
    dL/dh = w[t, s] q. bias, gate as in the forward (the frozen biases take no gradient)."""
    lora, bias = lora or {}, bias or {}
    gate_forward, gate_backward = (swiglu_forward, swiglu_backward) if gate is None else gate
    k = w.shape[1]
    sc = rows.scratch
    xs, ys, h, dh, dg, du = (sc[n] for n in SCRATCH)
    used = _used(rows.offsets)
    row_w = w.reshape(-1)[rows.order]                           # router weight of each sorted row
    _gather_pairs(ys, dout, rows.order, k)                      # dout of each row, unweighted
    gate_forward(h, rows.g, rows.u)
    o = rows.offsets
    _project_backward(dh, ys, h, w_down, lora.get("down"), rows.lora_in.get("down"), used, mm, o, dw_down, row_w)
    _weighted_rows(dw, dh, dh, h, w, rows.order, k)
    if bias.get("down") is not None:                            # dout[t] . bias_down[e] of each row
        bd = np.empty(rows.order.shape[0], dw.dtype)
        for e, a, b in used:
            bd[a:b] = ys[a:b] @ bias["down"][e]
        dw[rows.order // k, rows.order % k] += bd
    gate_backward(dg, du, dh, rows.g, rows.u)
    _gather_pairs(xs, x, rows.order, k)
    _project_backward(ys, dg, xs, w_gate, lora.get("gate"), rows.lora_in.get("gate"), used, mm, o, dw_gate)
    _project_backward(ys, du, xs, w_up, lora.get("up"), rows.lora_in.get("up"), used, mm, o, dw_up,
                      accumulate=True)
    _combine(dx, ys, None, rows.pos)
