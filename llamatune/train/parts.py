"""The backward of each block part (models/parts.py), beside its forward by subclassing.

    backward(g, a, x):  in: g.dx = dL/d(the residual stream after the part); out: g.dx =
        dL/d(its input x), its share added in place to the residual's (dx += dpart/dx^T dy);
        parameter gradients accumulated (+=) through g.linears (backward, norm_grad).

`g` is the training graph (train/step.py): the linears' backward, the norm weights'
gradients, the scratch (dx2, dxn, dnorm and the gradients of `buffers.grad_scratch`)
and the kernels. What checkpointing left unkept (the normed input, the gate's output)
is recomputed here from what was. TRAIN_PARTS maps each kind to its trainable class;
a new part kind adds its class here, registered under the kind its forward declares.
"""
from __future__ import annotations

import numpy as np

from ..models.deltanet_mixer import MixerGrads, MixerShape, mixer_backward, mixer_backward_floats, mixer_forward
from ..models.gated_attention import join_q_gate, output_gate_backward
from ..models.parts import (Attention, AttentionActs, FeedForward, FeedForwardActs, FeedForwardPost,
                            Gemma4Attention, Gemma4AttentionActs, MoeFeedForward, MoeFeedForwardActs,
                            MoePostNorm, MoeSharedActs, MoeSharedFeedForward, Part, PerLayerInput,
                            PerLayerInputActs, SinkAttention, shared_gate)
from ..models.qwen35_parts import DeltaNet, DeltaNetActs, GatedAttention, GatedAttentionActs
from .moe import moe_backward


def normed_input(part: Part, g, a, x: np.ndarray) -> np.ndarray:
    """The part's normed input: kept (a.xn) or recomputed into g.xn from x and a.rstd; x
    itself where the part has no input norm (olmo2)."""
    if a.xn is not None:
        return a.xn
    if part.norm is None:
        return x
    g.ops.rmsnorm.rmsnorm_forward(g.xn, a.rstd, x, g.linears.norm_weight(part.norm), part.cfg.norm_eps)
    return g.xn


def input_norm_backward(part: Part, g, a, x: np.ndarray) -> None:
    """g.dx += dL/dx through the input norm, from g.dxn = dL/d(normed input)."""
    if part.norm is None:
        g.dx += g.dxn
        return
    g.ops.fused.rmsnorm_backward_add(g.dx, g.norm_dw(part.norm), g.dxn, x, g.linears.norm_weight(part.norm),
                                     a.rstd, g.dx2)
    g.linears.norm_grad(part.norm, g.dnorm)


def output_grad(part: Part, g) -> np.ndarray:
    """dL/d(the part's output before its residual scale): g.dx, or (granite) g.dx times the
    scale, into g.dxn (free until the part's projections' backward writes it)."""
    if not part.residual_scale:
        return g.dx
    g.xp.multiply(g.dx, g.dx.dtype.type(part.residual_scale), out=g.dxn)
    return g.dxn


def core_attention_backward(part, g, a) -> tuple[np.ndarray, np.ndarray]:
    """g.dq, g.dk, g.dv = dL/d(q, k after rope, v) from g.datt = dL/d(the attention's output),
    with the part's scale, soft-cap, window and the packed rows; (dq, dk) viewed per head."""
    q4, k4 = part.heads(a, a.q, a.k)
    dq4, dk4 = g.dq.reshape(q4.shape), g.dk.reshape(k4.shape)
    g.attention.attention_backward(dq4, dk4, g.dv.reshape(k4.shape), g.datt.reshape(q4.shape),
                                   q4, k4, a.v.reshape(k4.shape), a.att.reshape(q4.shape), a.lse,
                                   segments=g.segments, **part.options)
    return dq4, dk4


class AttentionBackward(Attention):
    def backward(self, g, a: AttentionActs, x: np.ndarray) -> None:
        g.linears.backward(g.datt, g.post_norm_backward(output_grad(self, g), a.o, a.rstd_o, self.post_norm), a.att,
                           self.out, accumulate=False)
        dq4, dk4 = core_attention_backward(self, g, a)
        cos, sin = g.ropes[self.rope_set]
        dq, dk = g.dq, g.dk
        if self.qk_norm_full:                                 # back through rope, then the whole-width norms
            self.rope_backward(g, dq4, dk4, cos, sin)
            self.qk_norm_full_backward(g, a)
            dq, dk = g.dqp, g.dkp
        elif self.qk_norms:                                   # back through rope and the per-head norms
            self.qk_norm_rope_backward(g, dq4, dk4, a, cos, sin)
            dq, dk = g.dqp, g.dkp
        else:
            self.rope_backward(g, dq4, dk4, cos, sin)
        self.project_backward(g, dq, dk, normed_input(self, g, a, x))
        input_norm_backward(self, g, a, x)

    def rope_backward(self, g, dq4: np.ndarray, dk4: np.ndarray, cos, sin) -> None:
        """dq, dk rotated back in place (not on a NoPE layer)."""
        if self.rotates:
            g.ops.fused.rope_qk_backward(dq4, dk4, cos, sin, self.cfg.n_rot, self.cfg.rope_mode)

    def qk_norm_full_backward(self, g, a: AttentionActs) -> None:
        """g.dqp, g.dkp = dL/d(q, k before their whole-width norms) from g.dq, g.dk (olmo2);
        the norm weights' gradients routed."""
        for dpre, dy, pre, rstd, name in ((g.dqp, g.dq, a.qp, a.rstd_q, self.qk_norms[0]),
                                          (g.dkp, g.dk, a.kp, a.rstd_k, self.qk_norms[1])):
            dw = g.buffers["dnorm_qk"][:pre.shape[1]]
            dw.fill(0.0)
            g.ops.rmsnorm.rmsnorm_backward(dpre, dw, dy, pre, g.linears.norm_weight(name), rstd)
            g.linears.norm_grad(name, dw)

    def qk_norm_rope_backward(self, g, dq4: np.ndarray, dk4: np.ndarray, a: AttentionActs, cos, sin) -> None:
        """g.dqp, g.dkp = dL/d(q, k before their per-head norms) from dq4, dk4 = dL/d(q, k
        after rope) (rotated back in place); the norm weights' gradients routed."""
        HS, names = self.cfg.head_dim, self.qk_norms
        dwq, dwk = g.dnorm[:HS], g.dnorm[HS:2 * HS]
        trained = any(g.norm_trained(n) for n in names)
        if trained:
            g.dnorm[:2 * HS].fill(0.0)
        else:
            dwq = dwk = None
        g.ops.fused.qk_norm_rope_backward(g.dqp.reshape(dq4.shape), dwq, dq4, a.qp.reshape(dq4.shape),
                                          g.linears.norm_weight(names[0]), a.rstd_q,
                                          g.dkp.reshape(dk4.shape), dwk, dk4, a.kp.reshape(dk4.shape),
                                          g.linears.norm_weight(names[1]), a.rstd_k,
                                          cos, sin, self.cfg.n_rot, self.cfg.rope_mode)
        if trained:
            g.linears.norm_grad(names[0], dwq)
            g.linears.norm_grad(names[1], dwk)

    def project_backward(self, g, dq: np.ndarray, dk: np.ndarray, xn: np.ndarray) -> None:
        """g.dxn = dL/dxn from the projections' gradients dq, dk and g.dv."""
        if self.fused is None:
            for j, (name, dy) in enumerate(zip(self.qkv, (dq, dk, g.dv))):
                g.linears.backward(g.dxn, dy, xn, name, accumulate=j > 0)
            return
        Cq, Ckv = self.cfg.n_embd_q, self.cfg.n_embd_kv
        dqkv = g.fused_rows(Cq + 2 * Ckv)
        dqkv[:, :Cq], dqkv[:, Cq:Cq + Ckv], dqkv[:, Cq + Ckv:] = dq, dk, g.dv
        g.linears.backward(g.dxn, dqkv, xn, self.fused, accumulate=False)


class Gemma4AttentionBackward(AttentionBackward, Gemma4Attention):
    def backward(self, g, a: Gemma4AttentionActs, x: np.ndarray) -> None:
        """AttentionBackward's, with g.dv taken back through the values' unit-weight norm;
        the gradients of the keys and values the layers sharing them sent (g.kv_grads)
        added to the layer's own. A layer sharing KV sends its there and goes back
        through q alone."""
        g.linears.backward(g.datt, g.post_norm_backward(output_grad(self, g), a.o, a.rstd_o, self.post_norm), a.att,
                           self.out, accumulate=False)
        if self.shares:
            self.shared_backward(g, a, x)
            return
        dq4, dk4 = core_attention_backward(self, g, a)
        if self.kept:                                         # what the sharing layers sent
            dk, dv = g.kv_grads[self.i]
            g.dk += dk
            g.dv += dv
        cos, sin = g.ropes[self.rope_set]
        self.qk_norm_rope_backward(g, dq4, dk4, a, cos, sin)
        HS = self.cfg.head_dim
        dv = g.dv.copy()
        g.ops.rmsnorm.rmsnorm_backward(g.dv.reshape(-1, HS), g.xp.zeros(HS, dv.dtype), dv.reshape(-1, HS),
                                       a.vp.reshape(-1, HS), self.unit(g.xp, dv.dtype), a.rstd_v)
        if self.k_is_v:                                       # v was k's projection: one gradient
            g.dkp += g.dv
        self.project_backward(g, g.dqp, g.dkp, normed_input(self, g, a, x))
        input_norm_backward(self, g, a, x)

    def shared_backward(self, g, a: Gemma4AttentionActs, x: np.ndarray) -> None:
        """From g.datt: dq through the attention over the source layer's keys and values
        (their gradients added to g.kv_grads[source]), rope, q's norm and its projection."""
        k_all, v_all, _ = g.kept_kv[self.source]
        q4 = self.q_heads(a)
        dq4, dk4, dv4 = g.dq.reshape(q4.shape), g.dk.reshape(k_all.shape), g.dv.reshape(v_all.shape)
        g.attention.attention_backward(dq4, dk4, dv4, g.datt.reshape(q4.shape), q4, k_all, v_all,
                                       a.att.reshape(q4.shape), a.lse, segments=g.segments, **self.options)
        dk, dv = g.kv_grads[self.source]
        dk += g.dk
        dv += g.dv
        cos, sin = g.ropes[self.rope_set]
        cfg, HS, name = self.cfg, self.cfg.head_dim, self.qk_norms[0]
        g.ops.rope.rope_backward(dq4, dq4, cos, sin, cfg.n_rot, cfg.rope_mode)
        dw = g.dnorm[:HS]
        dw.fill(0.0)
        dqp = g.dqp.reshape(-1, HS)
        g.ops.rmsnorm.rmsnorm_backward(dqp, dw, g.dq.reshape(-1, HS), a.qp.reshape(-1, HS),
                                       g.linears.norm_weight(name), a.rstd_q)
        if g.norm_trained(name):
            g.linears.norm_grad(name, dw)
        g.linears.backward(g.dxn, g.dqp, normed_input(self, g, a, x), self.qkv[0], accumulate=False)
        input_norm_backward(self, g, a, x)


class PerLayerInputBackward(PerLayerInput):
    def backward(self, g, a: PerLayerInputActs, x: np.ndarray) -> None:
        """dy = g.dx back through the post norm, proj, the gelu gate (the per-layer input's
        gradient into g.ple["d"][i], summed up by StepExecutor.per_layer_embed_backward) and
        inp_gate, added to g.dx. Scratch: g.dg and g.du (the feed-forward's, free until its
        backward, which runs next)."""
        N, P = x.shape[0], self.cfg.n_embd_per_layer
        do = g.post_norm_backward(g.dx, a.o, a.rstd_o, self.post_norm)
        dt, dgate = (s.reshape(-1)[:N * P].reshape(N, P) for s in (g.dg, g.du))
        g.linears.backward(dt, do, a.t, self.proj, accumulate=False)
        g.ops.geglu.geglu_backward(dgate, g.ple["d"][self.i], dt, a.gate, g.per_layer_input(self.i))
        g.linears.backward(g.dx, dgate, x, self.gate, accumulate=True)


class FeedForwardBackward(FeedForward):
    def backward(self, g, a: FeedForwardActs, x: np.ndarray) -> None:
        gate_forward, gate_backward = self.gate(g.ops)
        if a.h is None:                                       # recompute the gate's output
            gate_forward(g.h, a.g, a.u)
        h = g.h if a.h is None else a.h
        g.linears.backward(g.dh, g.post_norm_backward(output_grad(self, g), a.f, a.rstd_f, self.post_norm), h,
                           self.down, accumulate=False)
        gate_backward(g.dg, g.du, g.dh, a.g, a.u)
        self.project_backward(g, normed_input(self, g, a, x))
        input_norm_backward(self, g, a, x)

    def project_backward(self, g, xn: np.ndarray) -> None:
        """g.dxn = dL/dxn from g.dg, g.du."""
        if self.fused is None:
            g.linears.backward(g.dxn, g.dg, xn, self.gate_up[0], accumulate=False)
            g.linears.backward(g.dxn, g.du, xn, self.gate_up[1], accumulate=True)
            return
        F = self.cfg.n_ff
        dgu = g.fused_rows(2 * F)
        dgu[:, :F], dgu[:, F:] = g.dg, g.du
        g.linears.backward(g.dxn, dgu, xn, self.fused, accumulate=False)


class MoeFeedForwardBackward(MoeFeedForward):
    def backward(self, g, a: MoeFeedForwardActs, x: np.ndarray) -> None:
        """Through the experts each token chose and the router (train/moe.py), then the norm."""
        moe_backward(g, g.dxn, g.dx, normed_input(self, g, a, x), a.state, self.i)
        input_norm_backward(self, g, a, x)


class MoeSharedFeedForwardBackward(MoeSharedFeedForward):
    def backward(self, g, a: MoeSharedActs, x: np.ndarray) -> None:
        """Through the mixture of experts (train/moe.py), the shared expert and its sigmoid
        gate, then the norm:  d sg = sum_c(dy s) sig (1 - sig),  d s = dy sig."""
        xn, dy = normed_input(self, g, a, x), g.dx
        sig = shared_gate(a.sg)
        dsg = (dy * a.s).sum(1, keepdims=True) * sig * (1 - sig)
        if a.h is None:                                       # recompute the shared expert's SwiGLU
            g.ops.swiglu.swiglu_forward(g.h, a.g, a.u)
        g.linears.backward(g.dh, dy * sig, g.h if a.h is None else a.h, self.down, accumulate=False)
        g.ops.swiglu.swiglu_backward(g.dg, g.du, g.dh, a.g, a.u)
        moe_backward(g, g.dxn, dy, xn, a.state, self.i)
        for name, d in zip(self.gate_up + [self.shared_gate], (g.dg, g.du, dsg)):
            g.linears.backward(g.dxn, d, xn, name, accumulate=True)
        input_norm_backward(self, g, a, x)


class FeedForwardPostBackward(FeedForwardBackward, FeedForwardPost):
    pass


class DeltaNetBackward(DeltaNet):
    """The mixer recomputed from the kept projections (models/deltanet_mixer.py), then its
    backward; LoRA on the projections and ssm_out, ssm_norm through a norm adapter; the
    conv, ssm_a and ssm_dt stay frozen. CPU; its scratch is allocated here."""

    @staticmethod
    def scratch_floats(cfg, B: int, T: int) -> int:
        """Floats of the numpy scratch a delta-net layer's backward allocates (one layer at
        a time): dy and the recomputed y (2 inner), the projections' gradients d
        (channels + inner + 2 NV) a token, and the mixer's (mixer_backward_floats)."""
        s = MixerShape.of(cfg)
        return B * T * (2 * s.inner + s.channels + s.inner + 2 * s.NV) + mixer_backward_floats(s, B, T)

    def backward(self, g, a: DeltaNetActs, x: np.ndarray) -> None:
        B, T = a.g.shape[:2]
        s, N = self.shape, B * T
        dy = np.empty((N, s.inner), g.dx.dtype)
        g.linears.backward(dy, g.dx, a.y, self.out, accumulate=False)
        prm = self.params(g, a.mixed.dtype)
        y = np.empty((B, T, s.inner), a.mixed.dtype)
        saved = mixer_forward(y, a.mixed.reshape(B, T, -1), a.z.reshape(B, T, -1), a.alpha.reshape(B, T, -1),
                              a.b.reshape(B, T, -1), prm, s, g.segments)
        norm = self.p + "ssm_norm.weight"
        grads = MixerGrads(norm=np.zeros_like(prm.norm) if g.norm_trained(norm) else None)
        d = {n: np.empty_like(getattr(a, n)) for n in ("mixed", "z", "alpha", "b")}
        mixer_backward(d["mixed"].reshape(B, T, -1), d["z"].reshape(B, T, -1), d["alpha"].reshape(B, T, -1),
                       d["b"].reshape(B, T, -1), dy.reshape(B, T, -1), saved, prm, s, grads)
        if grads.norm is not None:
            g.linears.norm_grad(norm, grads.norm.astype(g.dnorm.dtype))
        xn = normed_input(self, g, a, x)
        for j, (name, n) in enumerate(zip(self.projections, ("mixed", "z", "alpha", "b"))):
            g.linears.backward(g.dxn, d[n], xn, name, accumulate=j > 0)
        input_norm_backward(self, g, a, x)


class GatedAttentionBackward(GatedAttention):
    def backward(self, g, a: GatedAttentionActs, x: np.ndarray) -> None:
        cfg = self.cfg
        g.linears.backward(g.datt, g.dx, a.gated, self.out, accumulate=False)
        dgate = np.empty_like(a.gate)
        output_gate_backward(g.datt, dgate, g.datt, a.att, a.gate)
        dq4, dk4 = core_attention_backward(self, g, a)
        cos, sin = g.ropes[self.rope_set]
        AttentionBackward.qk_norm_rope_backward(self, g, dq4, dk4, a, cos, sin)
        xn = normed_input(self, g, a, x)
        dqg = g.fused_rows(2 * cfg.n_embd_q)
        join_q_gate(dqg, g.dqp, dgate, cfg.n_head, cfg.head_dim)
        g.linears.backward(g.dxn, dqg, xn, self.q, accumulate=False)
        g.linears.backward(g.dxn, g.dkp, xn, self.k, accumulate=True)
        g.linears.backward(g.dxn, g.dv, xn, self.v, accumulate=True)
        input_norm_backward(self, g, a, x)


class SinkAttentionBackward(AttentionBackward, SinkAttention):
    """gpt-oss's attention: the attention backward on the output and log-sum-exp the sinks
    left (exact for them, kernels/attention_sinks.py); the sinks stay frozen."""


class MoePostNormBackward(MoeFeedForwardBackward, MoePostNorm):
    pass


TRAIN_PARTS: dict[str, type[Part]] = {c.kind: c for c in (AttentionBackward, FeedForwardBackward,
                                                          MoeFeedForwardBackward, FeedForwardPostBackward,
                                                          DeltaNetBackward, GatedAttentionBackward,
                                                          SinkAttentionBackward, MoePostNormBackward,
                                                          MoeSharedFeedForwardBackward, Gemma4AttentionBackward,
                                                          PerLayerInputBackward)}
