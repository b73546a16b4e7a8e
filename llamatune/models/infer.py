"""Inference forward pass with a KV cache: tokens (B, T) -> logits (B, T, V) in f32.

Mirrors llama.cpp's per-architecture graph builders (src/models/llama.cpp, qwen2,
qwen3, gemma, gemma2, gemma3, phi3), read from the architecture's declaration (models/arch.py)
and its config:
    x = token_embd[tokens]                       (gemma: times sqrt(n_embd))
    per layer:  q, k, v = Wq·n(x), Wk·n(x), Wv·n(x)                      n = RMSNorm(attn_norm)
                q, k = RMSNorm per head (attn_q_norm, attn_k_norm)      (qwen3, gemma3)
                a = Wo · attn(rope(q), rope(k), v)    scale, soft-cap, sliding window per layer
                x += a          (gemma2/3: x += RMSNorm(a, post_attention_norm))
                f = Wdown · (act(Wgate·n(x)) * Wup·n(x))   act = silu or gelu; n = RMSNorm(ffn_norm)
                x += f          (gemma2/3: x += RMSNorm(f, post_ffw_norm))
    logits = Wout · RMSNorm(x, output_norm)      (gemma2: cap * tanh(logits / cap))
q/k/v and gate/up come from one fused matmul split by rows where the architecture
declares it (phi3's attn_qkv, ffn_up; `qkv`, `gate_up`). Rope uses one cache per
distinct (base, scale) of the layers (gemma3's local layers
have their own). Matmuls run on one weight at a time dequantized into a scratch buffer
(weights.FrozenBase), the output head in row blocks; everything elementwise runs in the backend's kernels (numba
on the CPU, numba-cuda on a GPU). Runtime LoRA adapters (as llama.cpp applies them
with --lora) add `scale · (x A^T) B^T` to each matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Backend, cpu
from ..formats.adapter import RuntimeAdapters
from .model import Model
from .rope import rope_cache
from .weights import FrozenBase


@dataclass
class KVCache:
    k: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    v: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    n_past: int = 0
    context: int = 0      # the context size rope factors are chosen for (llama.cpp's n_ctx); 0: n_ctx

    @classmethod
    def empty(cls, model: Model, batch: int, n_ctx: int, backend: Backend | None = None,
              context: int = 0) -> "KVCache":
        c, xp = model.config, (backend or cpu()).xp
        shape = (batch, n_ctx, c.n_head_kv, c.head_dim)
        return cls([xp.zeros(shape, np.float32) for _ in range(c.n_layer)],
                   [xp.zeros(shape, np.float32) for _ in range(c.n_layer)], context=context)

    @property
    def n_ctx(self) -> int:
        return self.k[0].shape[1]


class Runner:
    """Runs the forward pass of one model (optionally with runtime adapters)."""

    def __init__(self, model: Model, adapters: RuntimeAdapters | None = None, backend: Backend | None = None):
        self.model = model
        self.cfg = model.config
        self.backend = backend or cpu()
        self.xp, self.ops = self.backend.xp, self.backend.ops
        self.base = FrozenBase(model, self.backend)
        to_device = self.backend.to_device
        self.adapters = {name: [(to_device(a), to_device(b), s) for a, b, s in pairs]
                         for name, pairs in (adapters or RuntimeAdapters()).by_weight.items()}
        self.observer = None      # optional observer(name, x): every matmul's input (calibration.py)

    def linear(self, x, name: str):
        """y (N, n_out) = x (N, n_in) · W^T (+ bias) + sum_i s_i (x A_i^T) B_i^T."""
        if self.observer is not None:
            self.observer(name, x)
        y = x @ self.base.matrix(name).T
        bias = self.base.vector(name.replace(".weight", ".bias"))
        if bias is not None:
            y += bias
        for a, b, s in self.adapters.get(name, ()):
            y += (s * (x @ a.T)) @ b.T
        return y

    def qkv(self, xn, p: str):
        """q (N, Cq), k, v (N, Ckv): three projections, or one fused attn_qkv split by rows."""
        cfg = self.cfg
        if not cfg.spec.fused_qkv:
            return tuple(self.linear(xn, f"{p}attn_{c}.weight") for c in "qkv")
        qkv = self.linear(xn, p + "attn_qkv.weight")
        Cq, Ckv = cfg.n_embd_q, cfg.n_embd_kv
        return tuple(self.xp.ascontiguousarray(qkv[:, lo:hi]) for lo, hi in
                     ((0, Cq), (Cq, Cq + Ckv), (Cq + Ckv, Cq + 2 * Ckv)))

    def gate_up(self, xn, p: str):
        """g, u (N, F): two projections, or one fused ffn_up whose first half is the gate."""
        if not self.cfg.spec.fused_gate_up:
            return self.linear(xn, p + "ffn_gate.weight"), self.linear(xn, p + "ffn_up.weight")
        gu, F = self.linear(xn, p + "ffn_up.weight"), self.cfg.n_ff
        return self.xp.ascontiguousarray(gu[:, :F]), self.xp.ascontiguousarray(gu[:, F:])

    def head(self, x):
        """logits (N, V) = x W_out^T (+ runtime adapters), the head expanded in row blocks."""
        V, R = self.cfg.n_vocab, self.base.head_rows
        if self.observer is not None:
            self.observer("output.weight", x)
        logits = self.xp.empty((x.shape[0], V), np.float32)
        adapters = [(s * (x @ a.T), b) for a, b, s in self.adapters.get("output.weight", ())]
        for lo in range(0, V, R):
            hi = min(V, lo + R)
            self.xp.matmul(x, self.base.matrix_rows("output.weight", lo, hi).T, out=logits[:, lo:hi])
            for xa, b in adapters:
                logits[:, lo:hi] += xa @ b[lo:hi].T
        return logits

    def embed(self, tokens):
        """(N,) ids on the device -> (N, C) rows of token_embd (+ runtime token_embd adapters)."""
        x = self.xp.empty((tokens.size, self.cfg.n_embd), np.float32)
        self.base.embed(tokens, x)
        for a, b, s in self.adapters.get("token_embd.weight", ()):
            x += (s * a[tokens]) @ b.T
        return x

    def _head_norm(self, t, name: str):
        """RMSNorm of every head of t (B, T, H, HS) with one (HS,) weight, into a new array."""
        B, T, H, HS = t.shape
        out = self.xp.empty_like(t)
        rstd = self.xp.empty(B * T * H, np.float32)
        self.ops.rmsnorm.rmsnorm_forward(out.reshape(-1, HS), rstd, t.reshape(-1, HS), self.base.vector(name),
                                         self.cfg.norm_eps)
        return out

    def _post_norm(self, y, name: str, rstd):
        """RMSNorm(y, name) when the layer has that norm (gemma2/3 sandwich norms), else y."""
        w = self.base.vector(name)
        if w is None:
            return y
        out = self.xp.empty_like(y)
        self.ops.rmsnorm.rmsnorm_forward(out, rstd, y, w, self.cfg.norm_eps)
        return out

    def forward(self, tokens: np.ndarray, cache: KVCache | None = None) -> np.ndarray:
        """tokens (B, T) int (host) -> logits (B, T, V) f32 on the backend's device. With a
        cache, the tokens follow the cache's n_past positions and their keys/values are
        appended to it."""
        cfg, xp, ops = self.cfg, self.xp, self.ops
        tokens = np.asarray(tokens, np.int64)
        B, T = tokens.shape
        N, C, NH, NKV, HS = B * T, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        n_past = cache.n_past if cache is not None else 0
        if cache is not None and n_past + T > cache.n_ctx:
            raise ValueError(f"KV cache overflow: {n_past} + {T} > {cache.n_ctx}")

        context = (cache.context or cache.n_ctx) if cache is not None else T   # chooses rope factors
        ropes = []                                    # one (cos, sin) per distinct layer rope
        for rope in cfg.rope_sets:
            cos, sin = rope_cache(cfg, self.base, np.arange(n_past, n_past + T, dtype=np.int64), context, rope)
            ropes.append((self.backend.to_device(cos), self.backend.to_device(sin)))

        spec = cfg.spec
        x = self.embed(self.backend.to_device(tokens.reshape(-1)))   # (N, C) residual stream
        if spec.embd_scale:
            x *= np.float32(np.sqrt(np.float32(C)))                  # ggml_scale(inpL, sqrtf(n_embd))
        xn = xp.empty_like(x)
        rstd = xp.empty(N, np.float32)
        att = xp.empty((B, T, NH, HS), np.float32)
        lse = xp.empty((B, NH, T), np.float32)
        h = xp.empty((N, cfg.n_ff), np.float32)
        gate = ops.geglu.geglu_forward if spec.activation == "gelu" else ops.swiglu.swiglu_forward
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            cos, sin = ropes[cfg.rope_set(i)]
            ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector(p + "attn_norm.weight"), cfg.norm_eps)
            q, k, v = self.qkv(xn, p)
            q, k, v = q.reshape(B, T, NH, HS), k.reshape(B, T, NKV, HS), v.reshape(B, T, NKV, HS)
            if spec.qk_norm:                                         # per head, one (HS,) weight
                q, k = (self._head_norm(t, p + name) for t, name in ((q, "attn_q_norm.weight"),
                                                                     (k, "attn_k_norm.weight")))
            ops.rope.rope_forward(q, q, cos, sin, cfg.n_rot, cfg.rope_mode)
            ops.rope.rope_forward(k, k, cos, sin, cfg.n_rot, cfg.rope_mode)
            if cache is not None:
                cache.k[i][:, n_past:n_past + T] = k
                cache.v[i][:, n_past:n_past + T] = v
                k = cache.k[i][:, :n_past + T]
                v = cache.v[i][:, :n_past + T]
            ops.attention.attention_forward(att, lse, q, k, v, n_past, **cfg.attention_options(i))
            x += self._post_norm(self.linear(att.reshape(N, NH * HS), p + "attn_output.weight"),
                                 p + "post_attention_norm.weight", rstd)

            ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector(p + "ffn_norm.weight"), cfg.norm_eps)
            g, u = self.gate_up(xn, p)
            gate(h, g, u)
            x += self._post_norm(self.linear(h, p + "ffn_down.weight"), p + "post_ffw_norm.weight", rstd)

        ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector("output_norm.weight"), cfg.norm_eps)
        logits = self.head(xn)
        if cfg.final_softcap:
            ops.softcap.softcap_forward(logits, logits, cfg.final_softcap)
        if cache is not None:
            cache.n_past += T
        return logits.reshape(B, T, cfg.n_vocab)
