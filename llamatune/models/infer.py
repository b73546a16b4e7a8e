"""Inference forward pass with a KV cache: tokens (B, T) -> logits (B, T, V) in f32.

Mirrors llama.cpp's llm_build_llama / llm_build_qwen2 graph:
    x = token_embd[tokens]
    per layer:  x += Wo · attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x))     n = RMSNorm(attn_norm)
                x += Wdown · (silu(Wgate·n(x)) * Wup·n(x))                 n = RMSNorm(ffn_norm)
    logits = Wout · RMSNorm(x, output_norm)
Matmuls run on one weight at a time dequantized into a scratch buffer
(weights.FrozenBase), the output head in row blocks; everything elementwise runs in the backend's kernels (numba
on the CPU, numba-cuda on a GPU). Runtime LoRA adapters (as llama.cpp applies them
with --lora) add `scale · (x A^T) B^T` to each matmul.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import Backend, cpu
from ..formats.adapter import RuntimeAdapters
from ..kernels import rope as host_rope
from .model import Model
from .weights import FrozenBase


@dataclass
class KVCache:
    k: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    v: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    n_past: int = 0

    @classmethod
    def empty(cls, model: Model, batch: int, n_ctx: int, backend: Backend | None = None) -> "KVCache":
        c, xp = model.config, (backend or cpu()).xp
        shape = (batch, n_ctx, c.n_head_kv, c.head_dim)
        return cls([xp.zeros(shape, np.float32) for _ in range(c.n_layer)],
                   [xp.zeros(shape, np.float32) for _ in range(c.n_layer)])

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

    def linear(self, x, name: str):
        """y (N, n_out) = x (N, n_in) · W^T (+ bias) + sum_i s_i (x A_i^T) B_i^T."""
        y = x @ self.base.matrix(name).T
        bias = self.base.vector(name.replace(".weight", ".bias"))
        if bias is not None:
            y += bias
        for a, b, s in self.adapters.get(name, ()):
            y += (s * (x @ a.T)) @ b.T
        return y

    def head(self, x):
        """logits (N, V) = x W_out^T (+ runtime adapters), the head expanded in row blocks."""
        V, R = self.cfg.n_vocab, self.base.head_rows
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

        cos = np.empty((T, cfg.n_rot // 2), np.float32)
        sin = np.empty_like(cos)
        host_rope.rope_cache(cos, sin, np.arange(n_past, n_past + T, dtype=np.int64), cfg.n_rot,
                             cfg.rope_freq_base, cfg.rope_freq_scale, self.base.rope_freqs)
        cos, sin = self.backend.to_device(cos), self.backend.to_device(sin)

        x = self.embed(self.backend.to_device(tokens.reshape(-1)))   # (N, C) residual stream
        xn = xp.empty_like(x)
        rstd = xp.empty(N, np.float32)
        att = xp.empty((B, T, NH, HS), np.float32)
        lse = xp.empty((B, NH, T), np.float32)
        h = xp.empty((N, cfg.n_ff), np.float32)
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector(p + "attn_norm.weight"), cfg.norm_eps)
            q = self.linear(xn, p + "attn_q.weight").reshape(B, T, NH, HS)
            k = self.linear(xn, p + "attn_k.weight").reshape(B, T, NKV, HS)
            v = self.linear(xn, p + "attn_v.weight").reshape(B, T, NKV, HS)
            ops.rope.rope_forward(q, q, cos, sin, cfg.n_rot, cfg.rope_mode)
            ops.rope.rope_forward(k, k, cos, sin, cfg.n_rot, cfg.rope_mode)
            if cache is not None:
                cache.k[i][:, n_past:n_past + T] = k
                cache.v[i][:, n_past:n_past + T] = v
                k = cache.k[i][:, :n_past + T]
                v = cache.v[i][:, :n_past + T]
            ops.attention.attention_forward(att, lse, q, k, v, n_past)
            x += self.linear(att.reshape(N, NH * HS), p + "attn_output.weight")

            ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector(p + "ffn_norm.weight"), cfg.norm_eps)
            g = self.linear(xn, p + "ffn_gate.weight")
            u = self.linear(xn, p + "ffn_up.weight")
            ops.swiglu.swiglu_forward(h, g, u)
            x += self.linear(h, p + "ffn_down.weight")

        ops.rmsnorm.rmsnorm_forward(xn, rstd, x, self.base.vector("output_norm.weight"), cfg.norm_eps)
        logits = self.head(xn)
        if cache is not None:
            cache.n_past += T
        return logits.reshape(B, T, cfg.n_vocab)
