"""Inference forward pass with a KV cache: tokens (B, T) -> logits (B, T, V) in f32.

Mirrors llama.cpp's llm_build_llama / llm_build_qwen2 graph:
    x = token_embd[tokens]
    per layer:  x += Wo · attn(rope(Wq·n(x)), rope(Wk·n(x)), Wv·n(x))     n = RMSNorm(attn_norm)
                x += Wdown · (silu(Wgate·n(x)) * Wup·n(x))                 n = RMSNorm(ffn_norm)
    logits = Wout · RMSNorm(x, output_norm)
Matmuls run through BLAS on one weight at a time dequantized into a scratch buffer;
everything elementwise runs in the numba kernels. Runtime LoRA adapters (as
llama.cpp applies them with --lora) add `scale · (x A^T) B^T` to each matmul.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kernels import attention, rmsnorm, rope, swiglu
from .model import Model


@dataclass
class RuntimeAdapters:
    """LoRA adapters applied at run time: weight name -> [(A (r, n_in), B (n_out, r), scale)].
    `token_embd.weight` entries use llama.cpp's flipped layout: A (V, r), B (C, r)."""
    by_weight: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = field(default_factory=dict)

    def add(self, name: str, a: np.ndarray, b: np.ndarray, scale: float) -> None:
        self.by_weight.setdefault(name, []).append((a, b, scale))

    def __bool__(self) -> bool:
        return bool(self.by_weight)


@dataclass
class KVCache:
    k: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    v: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    n_past: int = 0

    @classmethod
    def empty(cls, model: Model, batch: int, n_ctx: int) -> "KVCache":
        c = model.config
        shape = (batch, n_ctx, c.n_head_kv, c.head_dim)
        return cls([np.zeros(shape, np.float32) for _ in range(c.n_layer)],
                   [np.zeros(shape, np.float32) for _ in range(c.n_layer)])

    @property
    def n_ctx(self) -> int:
        return self.k[0].shape[1]


class Runner:
    """Runs the forward pass of one model (optionally with runtime adapters)."""

    def __init__(self, model: Model, adapters: RuntimeAdapters | None = None):
        self.model = model
        self.cfg = model.config
        self.adapters = adapters or RuntimeAdapters()

    def linear(self, x: np.ndarray, name: str, tensor, bias: np.ndarray | None = None) -> np.ndarray:
        """y (N, n_out) = x (N, n_in) · W^T (+ bias) + sum_i s_i (x A_i^T) B_i^T."""
        w = self.model.dequantizer.get(tensor)
        y = x @ w.T
        if bias is not None:
            y += bias
        for a, b, s in self.adapters.by_weight.get(name, ()):
            y += (s * (x @ a.T)) @ b.T
        return y

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(N,) ids -> (N, C) rows of token_embd (+ runtime token_embd adapters)."""
        W = self.model.weights.token_embd
        x = np.empty((tokens.size, self.cfg.n_embd), np.float32)
        self.model.dequantizer.rows(W, tokens.reshape(-1), x)
        for a, b, s in self.adapters.by_weight.get("token_embd.weight", ()):
            x += (s * a[tokens.reshape(-1)]) @ b.T
        return x

    def forward(self, tokens: np.ndarray, cache: KVCache | None = None) -> np.ndarray:
        """tokens (B, T) int -> logits (B, T, V) f32. With a cache, the tokens follow
        the cache's n_past positions and their keys/values are appended to it."""
        cfg, w = self.cfg, self.model.weights
        tokens = np.asarray(tokens, np.int64)
        B, T = tokens.shape
        N, C, NH, NKV, HS = B * T, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
        n_past = cache.n_past if cache is not None else 0
        if cache is not None and n_past + T > cache.n_ctx:
            raise ValueError(f"KV cache overflow: {n_past} + {T} > {cache.n_ctx}")

        cos = np.empty((T, cfg.n_rot // 2), np.float32)
        sin = np.empty_like(cos)
        rope.rope_cache(cos, sin, np.arange(n_past, n_past + T, dtype=np.int64), cfg.n_rot,
                        cfg.rope_freq_base, cfg.rope_freq_scale, w.rope_freqs)

        x = self.embed(tokens)                                   # (N, C) residual stream
        xn = np.empty_like(x)
        rstd = np.empty(N, np.float32)
        att = np.empty((B, T, NH, HS), np.float32)
        lse = np.empty((B, NH, T), np.float32)
        h = np.empty((N, cfg.n_ff), np.float32)
        for i, layer in enumerate(w.layers):
            p = f"blk.{i}."
            rmsnorm.rmsnorm_forward(xn, rstd, x, layer.attn_norm, cfg.norm_eps)
            q = self.linear(xn, p + "attn_q.weight", layer.mats["attn_q"], layer.biases.get("attn_q"))
            k = self.linear(xn, p + "attn_k.weight", layer.mats["attn_k"], layer.biases.get("attn_k"))
            v = self.linear(xn, p + "attn_v.weight", layer.mats["attn_v"], layer.biases.get("attn_v"))
            q = q.reshape(B, T, NH, HS)
            k = k.reshape(B, T, NKV, HS)
            rope.rope_forward(q, q, cos, sin, cfg.n_rot, cfg.rope_mode)
            rope.rope_forward(k, k, cos, sin, cfg.n_rot, cfg.rope_mode)
            v = v.reshape(B, T, NKV, HS)
            if cache is not None:
                cache.k[i][:, n_past:n_past + T] = k
                cache.v[i][:, n_past:n_past + T] = v
                k = cache.k[i][:, :n_past + T]
                v = cache.v[i][:, :n_past + T]
            attention.attention_forward(att, lse, q, k, v, n_past)
            x += self.linear(att.reshape(N, NH * HS), p + "attn_output.weight", layer.mats["attn_output"])

            rmsnorm.rmsnorm_forward(xn, rstd, x, layer.ffn_norm, cfg.norm_eps)
            g = self.linear(xn, p + "ffn_gate.weight", layer.mats["ffn_gate"])
            u = self.linear(xn, p + "ffn_up.weight", layer.mats["ffn_up"])
            swiglu.swiglu_forward(h, g, u)
            x += self.linear(h, p + "ffn_down.weight", layer.mats["ffn_down"])

        rmsnorm.rmsnorm_forward(xn, rstd, x, w.output_norm, cfg.norm_eps)
        logits = self.linear(xn, "output.weight", w.output)
        if cache is not None:
            cache.n_past += T
        return logits.reshape(B, T, cfg.n_vocab)
