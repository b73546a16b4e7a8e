"""The parts a block is built from: each owns its norms and linears and has a forward.

A layer is two parts in sequence, as llama.cpp's graph builders compose build_norm,
build_attn and build_ffn: a mixer (attention) and a feed-forward, each with its
residual add,
    x_mid = x + mixer(x)          x_out = x_mid + ffn(x_mid)
The architecture's declaration names the kind of each (`Arch.mixer`, `Arch.ffn`, or
`Arch.parts(cfg, i)` per layer: `ModelConfig.part_kinds`) and `PARTS` maps a kind to its
class. A part is made once per layer (its tensor names, rope set and attention options
resolved then, as llm.c resolves its weight pointers before the loop) and is handed,
on each call, the `Forward` that runs it (the linears' strategy, kernels, scratch) and
its own activations (its `Acts`: what it keeps for backward). Its backward lives in
train/parts.py, a subclass registered under the same kind (models/ knows no training).

    forward(fw, a, x, residual, y):  y (N, C) = the part's output for input x, before the
        residual add; with `residual` (the layer input, for the second part), x holds the
        first part's output and x += residual is done first, fused with the input norm.

A new kind (a mixture-of-experts feed-forward, a delta-net mixer) is one more class
with its Acts, act_shapes and forward here (or in a module of its own listed in
PARTS), its backward in train/parts.py, and a name in the declarations that use it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..errors import LlamatuneError
from ..kernels.attention_sinks import sinks_forward
from .config import ModelConfig
from .moe import MoeActs, moe_forward
from .qwen35_parts import DeltaNet, GatedAttention


class Acts:
    """A part's activations: fields are arrays (or None where the run keeps none)."""

    @classmethod
    def of(cls, get) -> "Acts":
        """The activations `get(name)` hands out (None where it has none)."""
        return cls(*(get(f.name) for f in fields(cls)))


@dataclass
class AttentionActs(Acts):
    rstd: np.ndarray     # (N,) the input norm's
    q: np.ndarray        # (N, NH*HS) after rope
    k: np.ndarray        # (N, NKV*HS) after rope
    v: np.ndarray        # (N, NKV*HS)
    att: np.ndarray      # (N, NH*HS) attention output
    lse: np.ndarray      # (B, NH, T)  softmax log-sum-exp
    xn: np.ndarray | None = None      # (N, C) normed input, kept only in checkpointing mode "none"
    qp: np.ndarray | None = None      # (N, NH*HS)  q before its per-head norm (qk_norm)
    kp: np.ndarray | None = None      # (N, NKV*HS) k before its per-head norm
    rstd_q: np.ndarray | None = None  # (N*NH,)
    rstd_k: np.ndarray | None = None  # (N*NKV,)
    o: np.ndarray | None = None       # (N, C) output projection before its norm (post_norms)
    rstd_o: np.ndarray | None = None  # (N,)


@dataclass
class FeedForwardActs(Acts):
    rstd: np.ndarray     # (N,) the input norm's
    g: np.ndarray        # (N, F)   (training with bf16 products: bf16 bits, uint16)
    u: np.ndarray        # (N, F)
    xn: np.ndarray | None = None      # (N, C) normed input, kept only in checkpointing mode "none"
    h: np.ndarray | None = None       # (N, F) act(g) * u, kept only in mode "none"
    f: np.ndarray | None = None       # (N, C) down projection before its norm (post_norms)
    rstd_f: np.ndarray | None = None  # (N,)


@dataclass
class LayerActs:
    """One layer's activations: its residual stream and each part's own."""
    x: np.ndarray        # (N, C) layer input (residual stream)
    x_mid: np.ndarray    # (N, C) the mixer's output, then (plus x) the feed-forward's input
    mixer: Any           # the mixer part's Acts
    ffn: Any             # the feed-forward part's Acts
    post: Any = None     # a third part's Acts (gemma4's per-layer input), None without
    x_post: np.ndarray | None = None   # (N, C) the feed-forward's output, then (plus x_mid) the third part's input


class Part:
    """One sublayer of layer i: names resolved once; forward(fw, a, x, residual, y)."""
    kind = ""                    # its name in the declarations (Arch.mixer / Arch.ffn)
    Acts: type = Acts            # the record of its activations
    bf16_saved: tuple[str, ...] = ()   # activations kept as bf16 bits with bf16 products (train/buffers.py)

    kept: tuple[str, ...] = ()   # activations kept per layer in checkpointing mode "layer" too (what
    #                              later layers read: the keys and values a shared-KV layer reuses)

    def __init__(self, cfg: ModelConfig, i: int):
        self.cfg, self.i, p = cfg.layer(i), i, f"blk.{i}."     # cfg: layer i's shapes (ModelConfig.layer)
        self.p = p
        self.residual_scale = cfg.residual_scale    # granite: the output times this before the residual add

    def act_shapes(self, B: int, T: int, keep_inputs: bool) -> dict[str, tuple[int, ...]]:
        """Name -> shape of its activations (its Acts' fields); `keep_inputs`: also those
        checkpointing mode "none" keeps (the normed input, ...)."""
        raise NotImplementedError

    def fused_width(self) -> int:
        """Columns of its widest fused product (fw.fused_rows), 0 without."""
        return 0

    def forward(self, fw, a, x: np.ndarray, residual: np.ndarray | None, y: np.ndarray) -> None:
        raise NotImplementedError

    # ---- shared steps of the llama-like parts
    def input_norm(self, fw, xn: np.ndarray, rstd: np.ndarray, x: np.ndarray, residual, name: str | None) -> None:
        """xn = RMSNorm(x) (x += residual first, in place, where given: one launch on a GPU);
        without an input norm (`name` None: olmo2) xn = x."""
        if name is None:
            if residual is not None:
                x += residual
            xn[...] = x
        elif residual is None:
            fw.ops.rmsnorm.rmsnorm_forward(xn, rstd, x, fw.linears.norm_weight(name), self.cfg.norm_eps)
        else:
            fw.ops.fused.add_rmsnorm_forward(xn, rstd, x, residual, fw.linears.norm_weight(name), self.cfg.norm_eps)

    def output(self, fw, y: np.ndarray, h: np.ndarray, name: str, post_norm: str | None, pre, rstd) -> None:
        """y = h W^T of linear `name`, or with a post norm (gemma2's sandwich) RMSNorm of it (pre, rstd kept)."""
        if post_norm is None:
            fw.linear(y, h, name)
        else:
            fw.linear(pre, h, name)
            fw.ops.rmsnorm.rmsnorm_forward(y, rstd, pre, fw.linears.norm_weight(post_norm), self.cfg.norm_eps)
        if self.residual_scale:                  # llama.cpp's ggml_scale by f_residual_scale (a float32)
            y *= y.dtype.type(self.residual_scale)


class Attention(Part):
    """attn_norm (none: olmo2), q/k/v (or fused attn_qkv), q/k norms per head (qk_norm) or
    over the whole projection (qk_norm_full: olmo2), rope (none on a NoPE layer:
    ModelConfig.has_rope), attention, attn_output, post_attention_norm (post_norms)."""
    kind, Acts = "attention", AttentionActs

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        spec, p = cfg.spec, self.p
        self.norm = p + "attn_norm.weight" if spec.pre_norms else None
        self.fused = p + "attn_qkv.weight" if spec.fused_qkv else None
        self.qkv = [f"{p}attn_{c}.weight" for c in "qkv"]
        self.qk_norms = (p + "attn_q_norm.weight", p + "attn_k_norm.weight") if spec.qk_norm else None
        self.out = p + "attn_output.weight"
        self.post_norm = p + "post_attention_norm.weight" if spec.post_norms else None
        self.rope_set, self.options = cfg.rope_set(i), cfg.attention_options(i)
        self.qk_norm_full, self.rotates = spec.qk_norm_full, cfg.has_rope(i)
        if self.qk_norms and not (self.qk_norm_full or self.rotates):
            raise LlamatuneError(f"architecture {cfg.arch}: layer {i} has per-head q/k norms and no rope, "
                                 "which is not supported")

    def act_shapes(self, B, T, keep_inputs):
        cfg, N = self.cfg, B * T
        C, Cq, Ckv = cfg.n_embd, cfg.n_embd_q, cfg.n_embd_kv
        acts = {"rstd": (N,), "q": (N, Cq), "k": (N, Ckv), "v": (N, Ckv), "att": (N, Cq), "lse": (B, cfg.n_head, T)}
        if keep_inputs:
            acts["xn"] = (N, C)
        if self.qk_norms:
            rows_q, rows_k = (N, N) if self.qk_norm_full else (N * cfg.n_head, N * cfg.n_head_kv)
            acts |= {"qp": (N, Cq), "kp": (N, Ckv), "rstd_q": (rows_q,), "rstd_k": (rows_k,)}
        if self.post_norm:
            acts |= {"o": (N, C), "rstd_o": (N,)}
        return acts

    def fused_width(self) -> int:
        return self.cfg.n_embd_q + 2 * self.cfg.n_embd_kv if self.fused else 0

    def heads(self, a, q, k):
        """q, k as (B, T, heads, HS)."""
        B, T, cfg = a.lse.shape[0], a.lse.shape[2], self.cfg
        return q.reshape(B, T, cfg.n_head, cfg.head_dim), k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)

    def forward(self, fw, a: AttentionActs, x, residual, y) -> None:
        cfg, ops = self.cfg, fw.ops
        cos, sin = fw.ropes[self.rope_set]
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        q4, k4 = self.heads(a, a.q, a.k)
        if self.qk_norm_full:                    # norms over all heads together, then rope
            self.project(fw, a.qp, a.kp, a.v, xn)
            for normed, rstd, pre, name in ((a.q, a.rstd_q, a.qp, self.qk_norms[0]),
                                            (a.k, a.rstd_k, a.kp, self.qk_norms[1])):
                ops.rmsnorm.rmsnorm_forward(normed, rstd, pre, fw.linears.norm_weight(name), cfg.norm_eps)
            self.rope(ops, q4, k4, cos, sin)
        elif self.qk_norms:                      # per-head norms, then rope (one launch on a GPU)
            self.project(fw, a.qp, a.kp, a.v, xn)
            wq, wk = (fw.linears.norm_weight(n) for n in self.qk_norms)
            ops.fused.qk_norm_rope_forward(q4, a.rstd_q, a.qp.reshape(q4.shape), wq, k4, a.rstd_k,
                                           a.kp.reshape(k4.shape), wk, cos, sin, cfg.norm_eps, cfg.n_rot, cfg.rope_mode)
        else:
            self.project(fw, a.q, a.k, a.v, xn)
            self.rope(ops, q4, k4, cos, sin)
        k_all, v_all, n_past = fw.kv(self.i, k4, a.v.reshape(k4.shape))
        fw.attention.attention_forward(a.att.reshape(q4.shape), a.lse, q4, k_all, v_all, n_past,
                                       segments=fw.segments, **self.options)
        self.output(fw, y, a.att, self.out, self.post_norm, a.o, a.rstd_o)

    def rope(self, ops, q4: np.ndarray, k4: np.ndarray, cos, sin) -> None:
        """q, k rotated in place, except on a NoPE layer (smollm3's every fourth)."""
        if self.rotates:
            ops.fused.rope_qk_forward(q4, k4, cos, sin, self.cfg.n_rot, self.cfg.rope_mode)

    def project(self, fw, q: np.ndarray, k: np.ndarray, v: np.ndarray, xn: np.ndarray) -> None:
        """q (N, Cq), k, v (N, Ckv) = the projections of xn: three, or one fused attn_qkv split by rows."""
        if self.fused is None:
            with fw.products.shared_input(xn, fw.linears.shared_extension(self.qkv, xn.shape[0])):
                for name, y in zip(self.qkv, (q, k, v)):
                    fw.linear(y, xn, name)
            return
        Cq, Ckv = self.cfg.n_embd_q, self.cfg.n_embd_kv
        qkv = fw.linear(fw.fused_rows(Cq + 2 * Ckv), xn, self.fused)
        q[...], k[...], v[...] = qkv[:, :Cq], qkv[:, Cq:Cq + Ckv], qkv[:, Cq + Ckv:]


@dataclass
class Gemma4AttentionActs(AttentionActs):
    vp: np.ndarray | None = None      # (N, NKV*HS) v before its per-head norm
    rstd_v: np.ndarray | None = None  # (N*NKV,)


class Gemma4Attention(Attention):
    """gemma4's attention: gemma3's (per-head q/k norms, rope, sandwich norm) with the values
    RMS-normed per head without a weight (llama.cpp's ggml_rms_norm of Vcur); its scale
    (1) and its layers' rope come from the config. A layer sharing KV (the last
    n_kv_shared, llama.cpp's !has_kv) projects, norms and rotates q alone and attends
    over the keys and values its source layer made (ModelConfig.kv_source), which that
    layer keeps for it (`kept`, Forward.kept_kv)."""
    kind, Acts = "gemma4_attention", Gemma4AttentionActs
    KV_ACTS = ("k", "v", "kp", "rstd_k", "vp", "rstd_v")     # what a layer sharing KV has none of

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.source = cfg.kv_source(i)
        self.shares = self.source != i
        self.kept = ("k", "v") if i in cfg.kv_sources else ()
        self.k_is_v = not cfg.has_v(i)         # attention_k_eq_v: v is k's projection (before k's norm)
        if self.shares:
            self.qkv = self.qkv[:1]
        elif self.k_is_v:
            self.qkv = self.qkv[:2]

    def act_shapes(self, B, T, keep_inputs):
        N, cfg = B * T, self.cfg
        shapes = super().act_shapes(B, T, keep_inputs) | {"vp": (N, cfg.n_embd_kv), "rstd_v": (N * cfg.n_head_kv,)}
        return {k: s for k, s in shapes.items() if not (self.shares and k in self.KV_ACTS)}

    def unit(self, xp, dtype) -> np.ndarray:
        """The value norm's weight: ones (head_dim,) on the device (xp: numpy or cupy)."""
        return xp.ones(self.cfg.head_dim, dtype)

    def q_heads(self, a) -> np.ndarray:
        """q as (B, T, NH, HS)."""
        B, T, cfg = a.lse.shape[0], a.lse.shape[2], self.cfg
        return a.q.reshape(B, T, cfg.n_head, cfg.head_dim)

    def forward(self, fw, a: Gemma4AttentionActs, x, residual, y) -> None:
        cfg, ops = self.cfg, fw.ops
        cos, sin = fw.ropes[self.rope_set]
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        if self.shares:
            q4 = self.q_heads(a)
            fw.linear(a.qp, xn, self.qkv[0])
            HS, wq = cfg.head_dim, fw.linears.norm_weight(self.qk_norms[0])
            ops.rmsnorm.rmsnorm_forward(a.q.reshape(-1, HS), a.rstd_q, a.qp.reshape(-1, HS), wq, cfg.norm_eps)
            ops.rope.rope_forward(q4, q4, cos, sin, cfg.n_rot, cfg.rope_mode)
            k_all, v_all, n_past = fw.kept_kv[self.source]
        else:
            q4, k_all, v_all, n_past = self.own_kv(fw, a, xn, cos, sin)
        fw.attention.attention_forward(a.att.reshape(q4.shape), a.lse, q4, k_all, v_all, n_past,
                                       segments=fw.segments, **self.options)
        self.output(fw, y, a.att, self.out, self.post_norm, a.o, a.rstd_o)

    def own_kv(self, fw, a: Gemma4AttentionActs, xn, cos, sin):
        """q, k, v projected, normed and rotated; (q4, the keys and values to attend over, their
        first position), kept for the layers that share them (Forward.kept_kv)."""
        cfg, ops = self.cfg, fw.ops
        self.project(fw, a.qp, a.kp, a.vp, xn)
        if self.k_is_v:
            a.vp[...] = a.kp
        HS = cfg.head_dim
        ops.rmsnorm.rmsnorm_forward(a.v.reshape(-1, HS), a.rstd_v, a.vp.reshape(-1, HS), self.unit(fw.xp, a.vp.dtype),
                                    cfg.norm_eps)
        q4, k4 = self.heads(a, a.q, a.k)
        wq, wk = (fw.linears.norm_weight(n) for n in self.qk_norms)
        ops.fused.qk_norm_rope_forward(q4, a.rstd_q, a.qp.reshape(q4.shape), wq, k4, a.rstd_k,
                                       a.kp.reshape(k4.shape), wk, cos, sin, cfg.norm_eps, cfg.n_rot, cfg.rope_mode)
        kv = fw.kv(self.i, k4, a.v.reshape(k4.shape))
        if self.kept:
            fw.kept_kv[self.i] = kv
        return (q4,) + kv


@dataclass
class PerLayerInputActs(Acts):
    gate: np.ndarray     # (N, P) x W_gate^T, before gelu
    t: np.ndarray        # (N, P) gelu(gate) * the layer's per-layer input
    o: np.ndarray        # (N, C) t W_proj^T, before its norm
    rstd_o: np.ndarray   # (N,)


class PerLayerInput(Part):
    """gemma4's per-layer input, after the feed-forward (llama.cpp's gemma4 graph, "per-layer
    embedding"): y = RMSNorm((gelu(x W_gate^T) * e_i) W_proj^T, post_norm), with e_i (N, P)
    layer i's per-layer input (Forward.per_layer_input) and W_gate = inp_gate (P, C),
    W_proj = proj (C, P)."""
    kind, Acts = "per_layer_input", PerLayerInputActs

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.gate, self.proj, self.post_norm = (self.p + k for k in ("inp_gate.weight", "proj.weight",
                                                                     "post_norm.weight"))

    def act_shapes(self, B, T, keep_inputs):
        N, P = B * T, self.cfg.n_embd_per_layer
        return {"gate": (N, P), "t": (N, P), "o": (N, self.cfg.n_embd), "rstd_o": (N,)}

    def forward(self, fw, a: PerLayerInputActs, x, residual, y) -> None:
        fw.linear(a.gate, x, self.gate)
        fw.ops.geglu.geglu_forward(a.t, a.gate, fw.per_layer_input(self.i))
        fw.linear(a.o, a.t, self.proj)
        fw.ops.rmsnorm.rmsnorm_forward(y, a.rstd_o, a.o, fw.linears.norm_weight(self.post_norm), self.cfg.norm_eps)


class FeedForward(Part):
    """ffn_norm (none: olmo2), gate/up (or fused ffn_up), SwiGLU or GeGLU, ffn_down,
    post_ffw_norm (post_norms)."""
    kind, Acts = "feed_forward", FeedForwardActs
    bf16_saved = ("g", "u")      # what PyTorch's bf16 training keeps: half the layer's saved floats

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        spec, p = cfg.spec, self.p
        self.norm = p + "ffn_norm.weight" if spec.pre_norms else None
        self.fused = p + "ffn_up.weight" if spec.fused_gate_up else None
        self.gate_up = [p + "ffn_gate.weight", p + "ffn_up.weight"]
        self.down = p + "ffn_down.weight"
        self.post_norm = p + "post_ffw_norm.weight" if spec.post_norms else None
        self.gelu = spec.activation == "gelu"
        if spec.activation not in ("silu", "gelu"):             # (gpt-oss's clamped SwiGLU: its experts only)
            raise LlamatuneError(f"architecture {cfg.arch}: a dense feed-forward with activation "
                                 f"{spec.activation!r} is not supported")

    def act_shapes(self, B, T, keep_inputs):
        N, C, F = B * T, self.cfg.n_embd, self.cfg.n_ff
        acts = {"rstd": (N,), "g": (N, F), "u": (N, F)}
        if keep_inputs:
            acts |= {"xn": (N, C), "h": (N, F)}
        if self.post_norm:
            acts |= {"f": (N, C), "rstd_f": (N,)}
        return acts

    def fused_width(self) -> int:
        return 2 * self.cfg.n_ff if self.fused else 0

    def gate(self, ops):
        """The gate's (forward, backward) kernels: SwiGLU or GeGLU (Arch.activation)."""
        if self.gelu:
            return ops.geglu.geglu_forward, ops.geglu.geglu_backward
        return ops.swiglu.swiglu_forward, ops.swiglu.swiglu_backward

    def forward(self, fw, a: FeedForwardActs, x, residual, y) -> None:
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        h, gate = fw.h if a.h is None else a.h, self.gate(fw.ops)[0]
        if a.g.dtype == np.uint16 and self.fused is None and fw.stores_bf16(self.gate_up, xn.shape[0]):
            self.project(fw, a.g, a.u, xn)                        # kept as bf16, stored so by the products
            gate(h, a.g, a.u)
        elif a.g.dtype == np.uint16:                              # kept as bf16 (training's bf16 products):
            g, u = fw.gate_scratch()                              # the products into float32 scratch, then
            self.project(fw, g, u, xn)                            # the gate rounds them into a.g, a.u and
            gate(h, g, u, a.g, a.u)                               # computes h from what it kept
        else:
            self.project(fw, a.g, a.u, xn)
            gate(h, a.g, a.u)
        self.output(fw, y, h, self.down, self.post_norm, a.f, a.rstd_f)

    def project(self, fw, g: np.ndarray, u: np.ndarray, xn: np.ndarray) -> None:
        """g, u (N, F): two projections, or one fused ffn_up whose first half is the gate."""
        if self.fused is None:
            with fw.products.shared_input(xn, fw.linears.shared_extension(self.gate_up, xn.shape[0])):
                fw.linear(g, xn, self.gate_up[0])
                fw.linear(u, xn, self.gate_up[1])
            return
        F = self.cfg.n_ff
        gu = fw.linear(fw.fused_rows(2 * F), xn, self.fused)
        g[...], u[...] = gu[:, :F], gu[:, F:]


@dataclass
class MoeFeedForwardActs(Acts):
    rstd: np.ndarray     # (N,) the input norm's
    xn: np.ndarray | None = None      # (N, C) normed input, kept only in checkpointing mode "none"
    probs: np.ndarray | None = None   # (N, E) the router's softmax
    w: np.ndarray | None = None       # (N, k) the weights of the experts chosen
    g: np.ndarray | None = None       # (N k, F) gate inputs of the (token, slot) rows sorted by expert
    u: np.ndarray | None = None       # (N k, F)
    state: MoeActs | None = None      # the router's choice and the rows' order (small integer arrays
    #                                   made by each forward) over the arrays above


class MoeFeedForward(Part):
    """ffn_norm, then a mixture of experts (models/moe.py): the router ffn_gate_inp, the top
    k experts of each token, their SwiGLUs (ffn_gate_exps, ffn_up_exps, ffn_down_exps)
    summed with the router's weights."""
    kind, Acts = "moe", MoeFeedForwardActs

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.norm = self.p + "ffn_norm.weight"

    def act_shapes(self, B, T, keep_inputs):
        N, cfg = B * T, self.cfg
        P = N * cfg.n_expert_used
        return ({"rstd": (N,)} | ({"xn": (N, cfg.n_embd)} if keep_inputs else {})
                | {"probs": (N, cfg.n_expert), "w": (N, cfg.n_expert_used), "g": (P, cfg.n_ff_exp),
                   "u": (P, cfg.n_ff_exp)})

    def forward(self, fw, a: MoeFeedForwardActs, x, residual, y) -> None:
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        a.state = moe_forward(fw, y, xn, self.i, {"probs": a.probs, "w": a.w, "g": a.g, "u": a.u})


@dataclass
class MoeSharedActs(Acts):
    rstd: np.ndarray     # (N,) the input norm's
    g: np.ndarray        # (N, F) the shared expert's gate product
    u: np.ndarray        # (N, F) its up product
    s: np.ndarray        # (N, C) its output before the sigmoid gate
    sg: np.ndarray       # (N, 1) its gate's logit
    xn: np.ndarray | None = None      # (N, C) normed input, kept only in checkpointing mode "none"
    h: np.ndarray | None = None       # (N, F) silu(g) * u, kept only in mode "none"
    state: MoeActs | None = None      # the mixture of experts' (made by each forward)


class MoeSharedFeedForward(Part):
    """qwen35moe's feed-forward: post_attention_norm, then the mixture of experts plus the
    shared expert (a SwiGLU of ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp, width n_ff)
    times sigmoid(xn . ffn_gate_inp_shexp), llama.cpp's qwen35moe build_layer_ffn."""
    kind, Acts = "moe_shared_post", MoeSharedActs

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        p = self.p
        self.norm = p + "post_attention_norm.weight"
        self.gate_up = [p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"]
        self.down, self.shared_gate = p + "ffn_down_shexp.weight", p + "ffn_gate_inp_shexp.weight"

    def act_shapes(self, B, T, keep_inputs):
        N, C, F = B * T, self.cfg.n_embd, self.cfg.n_ff
        acts = {"rstd": (N,), "g": (N, F), "u": (N, F), "s": (N, C), "sg": (N, 1)}
        return acts | ({"xn": (N, C), "h": (N, F)} if keep_inputs else {})

    def forward(self, fw, a: MoeSharedActs, x, residual, y) -> None:
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        a.state = moe_forward(fw, y, xn, self.i)
        h = fw.h if a.h is None else a.h
        fw.linear(a.g, xn, self.gate_up[0])
        fw.linear(a.u, xn, self.gate_up[1])
        fw.ops.swiglu.swiglu_forward(h, a.g, a.u)
        fw.linear(a.s, h, self.down)
        fw.linear(a.sg, xn, self.shared_gate)
        y += a.s * shared_gate(a.sg)


def shared_gate(sg: np.ndarray) -> np.ndarray:
    """sigmoid(sg), as ggml_sigmoid: 1 / (1 + exp(-sg)) in sg's dtype."""
    one = sg.dtype.type(1)
    return one / (one + np.exp(-sg))


class FeedForwardPost(FeedForward):
    """feed_forward with post_attention_norm as its input norm and no sandwich norm (qwen35)."""
    kind = "feed_forward_post"

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.norm, self.post_norm = self.p + "post_attention_norm.weight", None


class SinkAttention(Attention):
    """gpt-oss's attention (models/archs/gpt_oss.py): attn_norm, q/k/v (+ biases), rope,
    attention whose softmax rows also hold the layer's per-head sink (`attn_sinks`:
    attention_forward, then kernels/attention_sinks.py's sinks_forward on its output and
    log-sum-exp, kept as the backward reads them), attn_output (+ bias)."""
    kind = "attention_sinks"

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.post_norm = None                    # post_attention_norm is the experts' input norm
        self.sinks = self.p + "attn_sinks.weight"

    def forward(self, fw, a: AttentionActs, x, residual, y) -> None:
        cos, sin = fw.ropes[self.rope_set]
        xn = fw.xn if a.xn is None else a.xn
        self.input_norm(fw, xn, a.rstd, x, residual, self.norm)
        q4, k4 = self.heads(a, a.q, a.k)
        self.project(fw, a.q, a.k, a.v, xn)
        self.rope(fw.ops, q4, k4, cos, sin)
        k_all, v_all, n_past = fw.kv(self.i, k4, a.v.reshape(k4.shape))
        att4 = a.att.reshape(q4.shape)
        fw.attention.attention_forward(att4, a.lse, q4, k_all, v_all, n_past, segments=fw.segments, **self.options)
        sinks_forward(att4, a.lse, fw.weights.vector(self.sinks))
        self.output(fw, y, a.att, self.out, None, None, None)


class MoePostNorm(MoeFeedForward):
    """gpt-oss's mixture of experts: post_attention_norm is its input norm (llama.cpp's
    openai-moe graph norms ffn_inp with attn_post_norm)."""
    kind = "moe_post"

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.norm = self.p + "post_attention_norm.weight"


PARTS: dict[str, type[Part]] = {c.kind: c for c in (Attention, FeedForward, MoeFeedForward, FeedForwardPost,
                                                    DeltaNet, GatedAttention, SinkAttention, MoePostNorm,
                                                    MoeSharedFeedForward, Gemma4Attention,
                                                    PerLayerInput)}   # kind -> forward class


def layer_parts(cfg: ModelConfig, classes: dict[str, type[Part]] | None = None) -> list[tuple[Part, ...]]:
    """(mixer, feed-forward[, post]) of every layer, made from `classes` (kind -> class: PARTS,
    or train/parts.py's with their backward)."""
    classes = PARTS if classes is None else classes
    layers = []
    for i in range(cfg.n_layer):
        kinds = cfg.part_kinds(i)
        unknown = [k for k in kinds if k not in classes]
        if unknown:
            raise LlamatuneError(f"architecture {cfg.arch}: layer {i} has part kind(s) {unknown}, "
                                 f"not one of {sorted(classes)}")
        layers.append(tuple(classes[k](cfg, i) for k in kinds))
    return layers


def layer_act_shapes(parts: tuple[Part, ...], B: int, T: int, keep_inputs: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one layer's activations: its stream ("x", "x_mid") and each
    part's as "<kind>.<name>"."""
    N, C = B * T, parts[0].cfg.n_embd
    shapes = {"x": (N, C), "x_mid": (N, C)} | ({"x_post": (N, C)} if len(parts) > 2 else {})
    for part in parts:
        shapes |= {f"{part.kind}.{k}": s for k, s in part.act_shapes(B, T, keep_inputs).items()}
    return shapes


def layer_acts(parts: tuple[Part, ...], get) -> LayerActs:
    """One layer's activations from `get(name)` (names as layer_act_shapes; None where absent)."""
    acts = [part.Acts.of(lambda k, kind=part.kind: get(f"{kind}.{k}")) for part in parts]
    post = (acts[2], get("x_post")) if len(parts) > 2 else (None, None)
    return LayerActs(get("x"), get("x_mid"), acts[0], acts[1], *post)


def fused_width(layers: list[tuple[Part, ...]]) -> int:
    """Columns of the widest fused product (q|k|v or gate|up) of any part, 0 without."""
    return max((part.fused_width() for parts in layers for part in parts), default=0)
