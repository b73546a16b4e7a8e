"""The layer parts of Qwen3.5 (models/archs/qwen35.py): the gated delta-net mixer, the
gated full-attention mixer, and the feed-forward whose input norm is
post_attention_norm. They follow models/parts.py's interface (kind, Acts, act_shapes,
fused_width, forward(fw, a, x, residual, y)); parts.py lists them in PARTS (this module
imports nothing of parts.py, so they carry their own small Acts base). CPU only: the
delta-net kernels have no CUDA twins yet.

`delta_net`: attn_norm; attn_qkv, attn_gate, ssm_alpha, ssm_beta from the normed input;
the mixer (models/deltanet_mixer.py: conv, gates, the delta rule, gated norm) between
them and ssm_out. In a runner with a cache (`fw.recurrent_state(i)`: the layer's conv
and delta state) it runs from and into that state, as attention appends to its KV cache.

`gated_attention`: attn_norm; attn_q gives per head the query and the output gate
(models/gated_attention.py); per-head q/k norms and rope (n_rot of head_dim) as qwen3's;
attention; the output times sigmoid(gate), then attn_output.

(The third, `feed_forward_post`, is parts.py's feed-forward with post_attention_norm as
its input norm: Qwen3.5 names its FFN norm so; llama.cpp's qwen35.cpp `attn_post_norm`.)
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ..errors import LlamatuneError
from .deltanet_mixer import MixerParams, MixerShape, mixer_decode, mixer_forward
from .gated_attention import output_gate_forward, split_q_gate


class _Acts:
    @classmethod
    def of(cls, get):
        return cls(*(get(f.name) for f in fields(cls)))


@dataclass
class DeltaNetActs(_Acts):
    rstd: np.ndarray     # (N,) attn_norm's
    mixed: np.ndarray    # (N, channels) attn_qkv's product: the conv input
    z: np.ndarray        # (N, NV DV) attn_gate's product: the output gate
    alpha: np.ndarray    # (N, NV) ssm_alpha's product
    b: np.ndarray        # (N, NV) ssm_beta's product
    y: np.ndarray        # (N, NV DV) the gated norm's output: ssm_out's input
    g: np.ndarray        # (B, T, NV) the decays (also gives B and T)
    xn: np.ndarray | None = None      # (N, C) normed input, kept only in checkpointing mode "none"


@dataclass
class GatedAttentionActs(_Acts):
    rstd: np.ndarray     # (N,) attn_norm's
    qp: np.ndarray       # (N, NH HS) q before its per-head norm
    gate: np.ndarray     # (N, NH HS) the output gate
    kp: np.ndarray       # (N, NKV HS)
    q: np.ndarray        # (N, NH HS) after norm and rope
    k: np.ndarray        # (N, NKV HS)
    v: np.ndarray        # (N, NKV HS)
    rstd_q: np.ndarray   # (N NH,)
    rstd_k: np.ndarray   # (N NKV,)
    att: np.ndarray      # (N, NH HS) attention output
    gated: np.ndarray    # (N, NH HS) att * sigmoid(gate): attn_output's input
    lse: np.ndarray      # (B, NH, T)
    xn: np.ndarray | None = None


def _input_norm(fw, cfg, xn, rstd, x, residual, name):
    if residual is None:
        fw.ops.rmsnorm.rmsnorm_forward(xn, rstd, x, fw.linears.norm_weight(name), cfg.norm_eps)
    else:
        fw.ops.fused.add_rmsnorm_forward(xn, rstd, x, residual, fw.linears.norm_weight(name), cfg.norm_eps)


class DeltaNet:
    kind, Acts, bf16_saved = "delta_net", DeltaNetActs, ()
    PROJECTIONS = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta")

    def __init__(self, cfg, i: int):
        self.cfg, self.i, p = cfg, i, f"blk.{i}."
        self.p, self.norm, self.out = p, p + "attn_norm.weight", p + "ssm_out.weight"
        self.shape = MixerShape.of(cfg)
        self.projections = [f"{p}{n}.weight" for n in self.PROJECTIONS]

    def act_shapes(self, B, T, keep_inputs):
        N, s = B * T, self.shape
        acts = {"rstd": (N,), "mixed": (N, s.channels), "z": (N, s.inner), "alpha": (N, s.NV), "b": (N, s.NV),
                "y": (N, s.inner), "g": (B, T, s.NV)}
        return acts | ({"xn": (N, self.cfg.n_embd)} if keep_inputs else {})

    def fused_width(self) -> int:
        return 0

    def params(self, fw, dtype) -> MixerParams:
        p = self.p
        vec = {k: fw.weights.vector(p + k) for k in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias")}
        return MixerParams.of(vec, {"ssm_norm": fw.linears.norm_weight(p + "ssm_norm.weight")}, dtype)

    def project(self, fw, a: DeltaNetActs, xn) -> None:
        with fw.products.shared_input(xn, fw.linears.shared_extension(self.projections, xn.shape[0])):
            for name, y in zip(self.projections, (a.mixed, a.z, a.alpha, a.b)):
                fw.linear(y, xn, name)

    def mix(self, fw, a: DeltaNetActs, B: int, T: int):
        """a.y from the projections (training: what the backward needs, returned)."""
        s, state = self.shape, fw.recurrent_state(self.i)
        args = [a.mixed.reshape(B, T, -1), a.z.reshape(B, T, -1), a.alpha.reshape(B, T, -1), a.b.reshape(B, T, -1),
                self.params(fw, a.mixed.dtype), s]
        y = a.y.reshape(B, T, -1)
        if state is not None:
            mixer_decode(y, *args, state)
            return None
        saved = mixer_forward(y, *args, fw.segments)
        a.g[...] = saved.g
        return saved

    def forward(self, fw, a: DeltaNetActs, x, residual, y) -> None:
        if fw.backend.name != "cpu":
            raise LlamatuneError(f"architecture {self.cfg.arch}: its gated delta-net layers run on the CPU only "
                                 "(no CUDA kernels yet): give --device cpu")
        xn = fw.xn if a.xn is None else a.xn
        _input_norm(fw, self.cfg, xn, a.rstd, x, residual, self.norm)
        self.project(fw, a, xn)
        self.mix(fw, a, *a.g.shape[:2])
        fw.linear(y, a.y, self.out)


class GatedAttention:
    kind, Acts, bf16_saved = "gated_attention", GatedAttentionActs, ()

    def __init__(self, cfg, i: int):
        self.cfg, self.i, p = cfg, i, f"blk.{i}."
        self.p, self.norm = p, p + "attn_norm.weight"
        self.q, self.k, self.v, self.out = (f"{p}attn_{c}.weight" for c in ("q", "k", "v", "output"))
        self.qk_norms = (p + "attn_q_norm.weight", p + "attn_k_norm.weight")
        self.rope_set, self.options = cfg.rope_set(i), cfg.attention_options(i)

    def act_shapes(self, B, T, keep_inputs):
        cfg, N = self.cfg, B * T
        Cq, Ckv = cfg.n_embd_q, cfg.n_embd_kv
        acts = {"rstd": (N,), "qp": (N, Cq), "gate": (N, Cq), "kp": (N, Ckv), "q": (N, Cq), "k": (N, Ckv),
                "v": (N, Ckv), "rstd_q": (N * cfg.n_head,), "rstd_k": (N * cfg.n_head_kv,), "att": (N, Cq),
                "gated": (N, Cq), "lse": (B, cfg.n_head, T)}
        return acts | ({"xn": (N, cfg.n_embd)} if keep_inputs else {})

    def fused_width(self) -> int:
        return 2 * self.cfg.n_embd_q          # attn_q's product: query | gate per head

    def heads(self, a, q, k):
        B, T, cfg = a.lse.shape[0], a.lse.shape[2], self.cfg
        return q.reshape(B, T, cfg.n_head, cfg.head_dim), k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)

    def forward(self, fw, a: GatedAttentionActs, x, residual, y) -> None:
        cfg = self.cfg
        cos, sin = fw.ropes[self.rope_set]
        xn = fw.xn if a.xn is None else a.xn
        _input_norm(fw, cfg, xn, a.rstd, x, residual, self.norm)
        with fw.products.shared_input(xn, fw.linears.shared_extension([self.q, self.k, self.v], xn.shape[0])):
            qg = fw.linear(fw.fused_rows(2 * cfg.n_embd_q), xn, self.q)     # xn rounded to bf16 once
            fw.linear(a.kp, xn, self.k)
            fw.linear(a.v, xn, self.v)
        a.qp[...], a.gate[...] = split_q_gate(qg, cfg.n_head, cfg.head_dim)
        q4, k4 = self.heads(a, a.q, a.k)
        wq, wk = (fw.linears.norm_weight(n) for n in self.qk_norms)
        fw.ops.fused.qk_norm_rope_forward(q4, a.rstd_q, a.qp.reshape(q4.shape), wq, k4, a.rstd_k,
                                          a.kp.reshape(k4.shape), wk, cos, sin, cfg.norm_eps, cfg.n_rot,
                                          cfg.rope_mode)
        k_all, v_all, n_past = fw.kv(self.i, k4, a.v.reshape(k4.shape))
        fw.attention.attention_forward(a.att.reshape(q4.shape), a.lse, q4, k_all, v_all, n_past,
                                       segments=fw.segments, **self.options)
        output_gate_forward(a.gated, a.att, a.gate)
        fw.linear(y, a.gated, self.out)
