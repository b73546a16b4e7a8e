"""A float64 forward of qwen35 (Qwen3.5 dense) and qwen35moe from a GGUF's tensors, written from
llama.cpp's graphs (src/models/qwen35.cpp, qwen35moe.cpp): numpy for the norms, rope, attention and the
feed-forward, the project's delta-net mixer (llamatune/models/deltanet_mixer.py) for the
linear-attention layers, and its gated-attention helpers. The architecture tests compare
it with HF's float64 logits (checks/qwen35_hf.py) and with llama-perplexity; it is the
oracle the model's own forward will be held to once the layers are wired in.

    python -m checks.qwen35_reference MODEL.gguf TEXT [--ctx 64]   # perplexity as llama-perplexity scores it
"""
from __future__ import annotations

import argparse

import numpy as np

from checks.arch_reference import _norm, model_weights


def _rope_partial(v, pos, base, n_rot):
    """NEOX rope of the first n_rot dimensions of v (T, H, HS); the rest unchanged. The
    angles in float32, as llama.cpp's and HF's tables."""
    half = n_rot // 2
    inv = (1.0 / np.float32(base) ** (np.arange(0, n_rot, 2, dtype=np.float32) / np.float32(n_rot)))
    theta = pos.astype(np.float32)[:, None] * inv.astype(np.float32)
    c, s = np.cos(theta).astype(np.float64)[:, None], np.sin(theta).astype(np.float64)[:, None]
    a, b = v[..., :half], v[..., half:n_rot]
    return np.concatenate([a * c - b * s, a * s + b * c, v[..., n_rot:]], -1)


def _attention_layer(cfg, W, p, h, pos):
    from llamatune.models.gated_attention import output_gate_forward, split_q_gate
    T, NH, NKV, HS = len(h), cfg.n_head, cfg.n_head_kv, cfg.head_dim
    q, gate = split_q_gate(h @ W[p + "attn_q.weight"].T, NH, HS)
    q = _norm(q.reshape(T, NH, HS), W[p + "attn_q_norm.weight"], cfg.norm_eps)
    k = _norm((h @ W[p + "attn_k.weight"].T).reshape(T, NKV, HS), W[p + "attn_k_norm.weight"], cfg.norm_eps)
    v = (h @ W[p + "attn_v.weight"].T).reshape(T, NKV, HS)
    q, k = (_rope_partial(t, pos, cfg.rope_freq_base, cfg.n_rot) for t in (q, k))
    att = np.empty((T, NH, HS))
    for hd in range(NH):
        kv = hd // (NH // NKV)
        s = np.where(np.tril(np.ones((T, T), bool)), q[:, hd] @ k[:, kv].T / np.sqrt(HS), -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        att[:, hd] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
    att = att.reshape(T, -1)
    output_gate_forward(att, att, gate)
    return att @ W[p + "attn_output.weight"].T


def _delta_layer(cfg, W, p, h, state=None):
    from llamatune.models.deltanet_mixer import MixerParams, MixerShape, mixer_decode, mixer_forward
    s = MixerShape.of(cfg)
    prm = MixerParams(*(np.ascontiguousarray(W[p + n]) for n in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias",
                                                                   "ssm_norm.weight")))
    proj = [(h @ W[p + n + ".weight"].T)[None] for n in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta")]
    y = np.empty((1, len(h), s.inner))
    if state is None:
        mixer_forward(y, *proj, prm, s)
    else:
        mixer_decode(y, *proj, prm, s, state)
    return y[0] @ W[p + "ssm_out.weight"].T


def _swiglu(W, p, h, suffix):
    g, u = h @ W[f"{p}ffn_gate{suffix}.weight"].T, h @ W[f"{p}ffn_up{suffix}.weight"].T
    return (g / (1 + np.exp(-g)) * u) @ W[f"{p}ffn_down{suffix}.weight"].T


def _moe_shared(cfg, W, p, h):
    """qwen35moe's feed-forward (src/models/qwen35moe.cpp build_layer_ffn): the experts
    (top n_expert_used, weights normalized) plus the shared expert times the sigmoid of its gate."""
    from checks.arch_reference import _moe
    gate = h @ W[p + "ffn_gate_inp_shexp.weight"].T
    return _moe(h, W, p, cfg.n_expert_used, True) + _swiglu(W, p, h, "_shexp") / (1 + np.exp(-gate))


def forward(cfg, W: dict, tokens: np.ndarray) -> np.ndarray:
    """logits (T, V) of one row of tokens (T,), float64."""
    T, eps = len(tokens), cfg.norm_eps
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd.weight"][tokens]
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = _norm(x, W[p + "attn_norm.weight"], eps)
        x = x + (_delta_layer(cfg, W, p, h) if cfg.is_recurrent(i) else _attention_layer(cfg, W, p, h, pos))
        h = _norm(x, W[p + "post_attention_norm.weight"], eps)
        x = x + (_moe_shared(cfg, W, p, h) if p + "ffn_gate_inp.weight" in W else _swiglu(W, p, h, ""))
    return _norm(x, W["output_norm.weight"], eps) @ W.get("output.weight", W["token_embd.weight"]).T


def perplexity(model, ids: list[int], ctx: int) -> float:
    """llama-perplexity's figure: windows of ctx tokens (the first one BOS when the vocabulary
    adds it), each scored on its second half."""
    from checks.arch_reference import cross_entropy
    W = model_weights(model)
    bos = model.tokenizer.bos_id if getattr(model.tokenizer, "add_bos", False) else None
    nll, n = 0.0, 0
    for c in range(len(ids) // ctx):
        row = np.array(ids[c * ctx:(c + 1) * ctx])
        if bos is not None:
            row[0] = bos
        logits = forward(model.config, W, row)
        first = ctx // 2
        nll += cross_entropy(logits[first:-1], row[first + 1:]).sum()
        n += ctx - 1 - first
    return float(np.exp(nll / n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--ctx", type=int, default=64)
    a = ap.parse_args()
    from llamatune.models.model import Model
    m = Model(a.model)
    ids = m.tokenizer.encode(open(a.text, encoding="utf-8").read())
    print(f"perplexity {perplexity(m, ids, a.ctx):.4f}")


if __name__ == "__main__":
    main()
