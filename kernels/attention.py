"""Causal grouped-query softmax attention, forward and backward (BLAS + numba + numpy refs).

    out_i = sum_j P_ij v_j,   P_ij = softmax_j(q_i . k_j * scale),   scale = 1/sqrt(HS)

over keys j <= n_past + i (query i sits at absolute position n_past + i). Query head
h reads kv head h // (NH // NKV), ggml's broadcast rule for GQA. This is what
llama.cpp builds in `llm_graph_context::build_attn_mha` (llama-graph.cpp) from
ggml_mul_mat(k, q), `ggml_soft_max_ext` with the causal KQ mask and scale
(ggml-cpu ops.cpp `ggml_compute_forward_soft_max_f32`) and ggml_mul_mat(v, kq).

Layout of the computation. It was measured against the alternative, a numba prange
over (b, h) calling np.dot on contiguous per-head copies: single-threaded CPU time
at B=8, T=256, NH=8, NKV=4, HS=64 was fwd 20 vs 27 ms, bwd 45 vs 44 ms; the prange
version nests multi-threaded BLAS inside numba threads (10x slower here with
default OpenBLAS threading) and needs scipy for numba's np.dot. So:
* the T x S products are batched `np.matmul` calls over (NKV, G, TQ, HS) views of
  one batch element, G = NH // NKV query heads per kv head, so K and V are never
  repeated; nothing is copied except the q/dout blocks in the dk/dv products;
* queries go in blocks of _QBLOCK rows; block [i0, i1) only meets keys < n_past+i1,
  which skips most of the masked upper triangle and bounds the transient score
  buffers to (NH, _QBLOCK, S) per block (nothing of size B*NH*T*S exists at once);
* the masked softmax (and its backward) is a numba kernel over rows that never
  evaluates exp for a masked entry; it just writes 0 there.

The backward is flash-attention style: it recomputes P = exp(q.k*scale - lse) from
the saved log-sum-exp, so no (T, T) probabilities are kept between the passes:
    dP = dout v^T;  dS = P * (dP - rowsum(dout * out));  dq = dS k * scale
    dk = dS^T q * scale;  dv = P^T dout          (dk, dv summed over each group)
All gradients are overwritten.
"""

import numpy as np
from numba import njit, prange

_QBLOCK = 128  # query rows per block; at T=256 fwd 21 / bwd 48 ms vs 27 / 57 ms for 256


@njit(cache=True, parallel=True)
def _softmax_causal_kernel(att, lse, scale, first):
    # att (NH, TQ, S): raw scores q.k in, probabilities out (0 where masked)
    # lse (NH, TQ) out; first: absolute position of row 0, row i sees keys <= first+i
    NH, TQ, S = att.shape
    for r in prange(NH * TQ):
        h = r // TQ
        i = r % TQ
        n = first + i + 1  # visible keys
        mx = att[h, i, 0] * scale
        for j in range(n):
            s = att[h, i, j] * scale
            att[h, i, j] = s
            mx = max(mx, s)
        tot = 0.0
        for j in range(n):
            e = np.exp(att[h, i, j] - mx)
            att[h, i, j] = e
            tot += e
        inv = 1.0 / tot
        for j in range(n):
            att[h, i, j] *= inv
        for j in range(n, S):
            att[h, i, j] = 0.0
        lse[h, i] = mx + np.log(tot)


@njit(cache=True, parallel=True)
def _softmax_causal_backward_kernel(att, dp, lse, out, dout, scale, first):
    # att (NH, TQ, S): raw scores q.k in, P out; dp (NH, TQ, S): dout.v in, dS*scale out
    # lse (NH, TQ); out, dout (TQ, NH, HS): this block's rows; first as above
    NH, TQ, S = att.shape
    HS = out.shape[2]
    for r in prange(NH * TQ):
        h = r // TQ
        i = r % TQ
        n = first + i + 1
        d = 0.0  # rowsum(dout * out) = rowsum(P * dP)
        for c in range(HS):
            d += dout[i, h, c] * out[i, h, c]
        lse_i = lse[h, i]
        for j in range(n):
            p = np.exp(att[h, i, j] * scale - lse_i)
            att[h, i, j] = p
            dp[h, i, j] = p * (dp[h, i, j] - d) * scale
        for j in range(n, S):
            att[h, i, j] = 0.0
            dp[h, i, j] = 0.0


def _heads(x, NKV):
    # (TQ, NH, HS) rows of one batch element -> (NKV, G, TQ, HS) view (no copy)
    TQ, NH, HS = x.shape
    return x.reshape(TQ, NKV, NH // NKV, HS).transpose(1, 2, 0, 3)


def _check(name, a, shape, dtype, rows_only=False):
    # rows_only: k, v may be [:, :S] slices of a cache, contiguous per batch element
    ok = isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape
    if ok and rows_only:
        ok = shape[0] == 0 or a[0].flags.c_contiguous  # every a[b] has a[0]'s strides
    elif ok:
        ok = a.flags.c_contiguous
    if not ok:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        need = "contiguous per batch element" if rows_only else "C-contiguous"
        raise ValueError(f"attention: {name} must be a {need} {np.dtype(dtype)} array "
                         f"of shape {shape}, got {got}")


def _check_qkv(q, k, v, S):
    if not isinstance(q, np.ndarray) or q.ndim != 4 or q.dtype not in (np.float32, np.float64):
        raise ValueError("attention: q must be a 4-D float32 or float64 array (B, T, NH, HS)")
    if not isinstance(k, np.ndarray) or k.ndim != 4:
        raise ValueError("attention: k must be a 4-D array (B, S, NKV, HS)")
    B, T, NH, HS = q.shape
    NKV = k.shape[2]
    if NKV < 1 or NH % NKV:
        raise ValueError(f"attention: query heads {NH} must be a multiple of kv heads {NKV}")
    _check("q", q, (B, T, NH, HS), q.dtype)
    _check("k", k, (B, S, NKV, HS), q.dtype, rows_only=True)
    _check("v", v, (B, S, NKV, HS), q.dtype, rows_only=True)
    return B, T, NH, NKV, HS


def attention_forward(out, lse, q, k, v, n_past):
    """Causal GQA attention for T new queries after n_past cached positions.

    out (B, T, NH, HS); lse (B, NH, T) saved log-sum-exp; q (B, T, NH, HS);
    k, v (B, S, NKV, HS) with S = n_past + T (may be [:, :S] slices of a cache).
    """
    if n_past < 0:
        raise ValueError(f"attention: n_past must be >= 0, got {n_past}")
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, n_past + T)
    _check("out", out, q.shape, q.dtype)
    _check("lse", lse, (B, NH, T), q.dtype)
    scale = q.dtype.type(1.0 / np.sqrt(HS))
    for b in range(B):
        kT = k[b].transpose(1, 2, 0)[:, None]  # (NKV, 1, HS, S)
        vb = v[b].transpose(1, 0, 2)[:, None]  # (NKV, 1, S, HS)
        for i0 in range(0, T, _QBLOCK):
            i1 = min(i0 + _QBLOCK, T)
            S1 = n_past + i1  # keys any query of this block can see
            att = np.matmul(_heads(q[b, i0:i1], NKV), kT[..., :S1])  # (NKV, G, TQ, S1)
            _softmax_causal_kernel(att.reshape(NH, i1 - i0, S1), lse[b, :, i0:i1],
                                   scale, n_past + i0)
            np.matmul(att, vb[:, :, :S1], out=_heads(out[b, i0:i1], NKV))


def attention_backward(dq, dk, dv, dout, q, k, v, out, lse):
    """Gradients of causal GQA attention for training (n_past = 0, S = T), overwritten.

    dq (B, T, NH, HS); dk, dv (B, T, NKV, HS) summed over each kv head's query heads;
    dout, q, out (B, T, NH, HS); k, v (B, T, NKV, HS); lse (B, NH, T) from the forward.
    """
    T = q.shape[1] if isinstance(q, np.ndarray) and q.ndim == 4 else 0
    B, T, NH, NKV, HS = _check_qkv(q, k, v, T)
    for name, a in (("dq", dq), ("dout", dout), ("out", out)):
        _check(name, a, q.shape, q.dtype)
    _check("dk", dk, k.shape, q.dtype)
    _check("dv", dv, k.shape, q.dtype)
    _check("lse", lse, (B, NH, T), q.dtype)
    scale = q.dtype.type(1.0 / np.sqrt(HS))
    dk[...] = 0.0  # the query blocks add their share below
    dv[...] = 0.0
    for b in range(B):
        kb = k[b].transpose(1, 0, 2)[:, None]  # (NKV, 1, T, HS)
        vb = v[b].transpose(1, 0, 2)[:, None]
        for i0 in range(0, T, _QBLOCK):
            i1 = min(i0 + _QBLOCK, T)
            TQ = i1 - i0
            qb = _heads(q[b, i0:i1], NKV)  # (NKV, G, TQ, HS)
            dob = _heads(dout[b, i0:i1], NKV)
            att = np.matmul(qb, kb[:, :, :i1].swapaxes(-1, -2))  # (NKV, G, TQ, i1)
            dp = np.matmul(dob, vb[:, :, :i1].swapaxes(-1, -2))
            _softmax_causal_backward_kernel(att.reshape(NH, TQ, i1), dp.reshape(NH, TQ, i1),
                                            lse[b, :, i0:i1], out[b, i0:i1], dout[b, i0:i1],
                                            scale, i0)
            # dq rows of this block are complete: the block saw all their keys
            np.matmul(dp, kb[:, :, :i1], out=_heads(dq[b, i0:i1], NKV))
            # dk, dv: contract over (G, TQ) at once, i.e. sum over the group's heads
            dS = dp.reshape(NKV, -1, i1).swapaxes(-1, -2)  # (NKV, i1, G*TQ)
            P = att.reshape(NKV, -1, i1).swapaxes(-1, -2)
            dk[b, :i1] += np.matmul(dS, qb.reshape(NKV, -1, HS)).transpose(1, 0, 2)
            dv[b, :i1] += np.matmul(P, dob.reshape(NKV, -1, HS)).transpose(1, 0, 2)


# ----------------------------------------------------------------------------
# numpy references: same arguments and contract as the kernels, no checks; plain
# per-head loops with a full masked (T, S) softmax


def _probs_ref(q, k, b, h, kvh, n_past):
    T, S = q.shape[1], k.shape[1]
    s = q[b, :, h] @ k[b, :, kvh].T / np.sqrt(q.shape[3])  # (T, S)
    s = np.where(np.arange(S)[None, :] <= n_past + np.arange(T)[:, None], s, -np.inf)
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    return e / e.sum(axis=1, keepdims=True), (mx + np.log(e.sum(axis=1, keepdims=True)))[:, 0]


def attention_forward_ref(out, lse, q, k, v, n_past):
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    for b in range(B):
        for h in range(NH):
            P, lse[b, h] = _probs_ref(q, k, b, h, h // G, n_past)
            out[b, :, h] = P @ v[b, :, h // G]


def attention_backward_ref(dq, dk, dv, dout, q, k, v, out, lse):
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    dk[...] = 0.0
    dv[...] = 0.0
    for b in range(B):
        for h in range(NH):
            P, _ = _probs_ref(q, k, b, h, h // G, 0)
            dP = dout[b, :, h] @ v[b, :, h // G].T
            dS = P * (dP - np.sum(P * dP, axis=1, keepdims=True)) / np.sqrt(HS)
            dq[b, :, h] = dS @ k[b, :, h // G]
            dk[b, :, h // G] += dS.T @ q[b, :, h]
            dv[b, :, h // G] += P.T @ dout[b, :, h]
