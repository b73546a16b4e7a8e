"""Attention sinks (gpt-oss): a learned logit per query head in each softmax's denominator,
forward and backward, applied around kernels/attention.py's attention.

    P_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)),   out_i = sum_j P_ij v_j

as llama.cpp's ggml_soft_max_add_sinks (build_attn_mha with `sinks`: ggml-cpu soft_max
takes the sink into the row's max and sum, and no value) and HF's gpt-oss eager
attention (a sink column concatenated to the scores, dropped after the softmax). With
the plain attention's out and log-sum-exp lse, the sink only rescales each row:

    lse' = logaddexp(lse, sink_h);   out' = out * exp(lse - lse')

and the backward of attention (flash style: P recomputed as exp(s - lse'), dS = P (dP -
rowsum(dout * out'))) is exact for out', lse' as saved: the sink is one more column of
the softmax whose value is 0 (its dP is 0). What it adds is the sink's own gradient,

    dsink_h = -sum_{b,i} exp(sink_h - lse'_bhi) * rowsum(dout_bi,h * out'_bi,h)

so the attention part runs attention_forward, `sinks_forward` in place on (out, lse),
and in its backward attention_backward on what was saved and, where the sinks are
trained or checked, `sinks_backward`.
"""
from __future__ import annotations

import numpy as np


def sinks_forward(out: np.ndarray, lse: np.ndarray, sinks: np.ndarray) -> None:
    """out (B, T, NH, HS) and lse (B, NH, T) of attention without sinks, rescaled in place
    to those with the per-head sinks (NH,)."""
    s = sinks.astype(lse.dtype)[None, :, None]
    new = np.logaddexp(lse, s)
    out *= np.exp(lse - new).transpose(0, 2, 1)[..., None]
    lse[...] = new


def sinks_backward(dsinks: np.ndarray, dout: np.ndarray, out: np.ndarray, lse: np.ndarray,
                   sinks: np.ndarray) -> None:
    """dsinks (NH,) += dL/dsinks from dout (B, T, NH, HS) and the forward's out, lse (after
    sinks_forward)."""
    d = np.einsum("bthd,bthd->bht", dout, out)
    p_sink = np.exp(sinks.astype(lse.dtype)[None, :, None] - lse)
    dsinks -= (p_sink * d).sum(axis=(0, 2)).astype(dsinks.dtype)


def attention_sinks_forward_ref(out, lse, q, k, v, sinks, *, scale=None, window=0):
    """out, lse of causal GQA attention (n_past 0) with the sink as an explicit column of
    every softmax (HF's eager attention), float64 maths."""
    B, T, NH, HS = q.shape
    G = NH // k.shape[2]
    scale = 1 / np.sqrt(HS) if scale is None else scale
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) if window > 0 else True)
    for b in range(B):
        for h in range(NH):
            s = np.where(visible, q[b, :, h] @ k[b, :, h // G].T * scale, -np.inf)
            s = np.concatenate([s, np.full((T, 1), sinks[h])], axis=1)
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            p = e / e.sum(axis=1, keepdims=True)
            out[b, :, h] = p[:, :T] @ v[b, :, h // G]
            lse[b, h] = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
