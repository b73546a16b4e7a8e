"""The gated delta-net mixer of Qwen3.5's linear-attention layers, between its input
projections and its output projection, forward and backward, on explicit arrays.

llama.cpp's `build_layer_attn_linear` (src/models/qwen35.cpp, delta-net-base.cpp) and HF's
`Qwen3_5GatedDeltaNet.forward`, from the projections of the normed input x:

    mixed = x attn_qkv^T (B, T, 2 NK DK + NV DV)   z = x attn_gate^T (B, T, NV DV)
    alpha = x ssm_alpha^T (B, T, NV)                b = x ssm_beta^T (B, T, NV)

the mixer computes

    c = silu(causal_conv(mixed, ssm_conv1d))       kernels/causal_conv.py
    q, k, v = c split (NK DK | NK DK | NV DV)
    g = ssm_a softplus(alpha + ssm_dt.bias), beta = sigmoid(b)    kernels/deltanet_gates.py
    o = gated delta rule(q, k, v, g, beta)         kernels/deltanet.py: l2-normed q, k,
                                                   scale 1/sqrt(DK), tiled heads
    y = gated_rmsnorm(o, z, ssm_norm)              kernels/gated_norm.py, per value head

and the caller multiplies y (B, T, NV DV) by ssm_out. The projections stay with the
caller (they are the base's products, with their adapters); this module owns what lies
between them.

Training (`mixer_forward` / `mixer_backward`): packed rows give `segments`; the forward
keeps what the backward needs in a `MixerSaved` (the conv output, the gates, the rule's
output and the norm's rstd); the rule's backward recomputes its chunk states.
`mixer_backward` returns d(mixed), dz, dalpha, db (overwriting the arrays it is given)
and accumulates into the small tensors' gradients when asked (conv, ssm_a, ssm_dt,
ssm_norm: frozen in LoRA training, trainable as options).

Decoding (`mixer_decode`): the layer's `RecurrentState` (conv state (B, K - 1, channels)
and delta state (B, NV, DK, DV)) replaces the KV cache; each call reads and updates it,
prefill of any length included (the chunked form from the state, then its final state).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import causal_conv, deltanet, deltanet_gates, gated_norm

HEADS = "tiled"     # llama.cpp's head order (the converter reorders HF's grouped value heads)


@dataclass(frozen=True)
class MixerShape:
    NK: int      # q/k heads (ssm.group_count)
    NV: int      # value heads (ssm.time_step_rank)
    DK: int      # q/k head size (ssm.state_size)
    DV: int      # value head size (ssm.inner_size / NV)
    K: int       # convolution taps (ssm.conv_kernel)
    eps: float   # the gated norm's eps (the model's RMS eps)

    @property
    def channels(self) -> int:
        """The convolution's channels: q | k | v."""
        return 2 * self.NK * self.DK + self.NV * self.DV

    @property
    def inner(self) -> int:
        return self.NV * self.DV

    @classmethod
    def of(cls, cfg) -> "MixerShape":
        return cls(cfg.ssm_group_count, cfg.ssm_time_step_rank, cfg.ssm_state_size,
                   cfg.ssm_inner_size // cfg.ssm_time_step_rank, cfg.ssm_conv_kernel, cfg.norm_eps)


@dataclass
class MixerParams:
    """The layer's small tensors (float arrays of the compute dtype): conv (channels, K)
    = ssm_conv1d, a (NV,) = ssm_a, dt_bias (NV,) = ssm_dt.bias, norm (DV,) = ssm_norm."""
    conv: np.ndarray
    a: np.ndarray
    dt_bias: np.ndarray
    norm: np.ndarray

    @classmethod
    def of(cls, vectors: dict, norms: dict, dtype=np.float32) -> "MixerParams":
        """From a loaded layer's `vectors` and `norms` (models/model.py Layer)."""
        def arr(x):
            return np.ascontiguousarray(x, dtype)
        return cls(arr(vectors["ssm_conv1d.weight"]), arr(vectors["ssm_a"]), arr(vectors["ssm_dt.bias"]),
                   arr(norms["ssm_norm"]))


@dataclass
class MixerSaved:
    """What the forward keeps for the backward (one layer, one micro-batch)."""
    mixed: np.ndarray    # (B, T, channels) conv input
    conv: np.ndarray     # (B, T, channels) silu(conv): q | k | v
    z: np.ndarray        # (N NV, DV) output gate
    alpha: np.ndarray    # (N, NV)
    b: np.ndarray        # (N, NV)
    g: np.ndarray        # (B, T, NV)
    beta: np.ndarray     # (B, T, NV)
    o: np.ndarray        # (N NV, DV) the rule's output
    rstd: np.ndarray     # (N NV,) the gated norm's
    segments: np.ndarray | None


@dataclass
class RecurrentState:
    """A delta-net layer's decoding state: what the KV cache is to attention."""
    conv: np.ndarray     # (B, K - 1, channels): the last K - 1 conv inputs
    delta: np.ndarray    # (B, NV, DK, DV)

    @classmethod
    def empty(cls, shape: MixerShape, B: int, dtype=np.float32) -> "RecurrentState":
        return cls(np.zeros((B, shape.K - 1, shape.channels), dtype),
                   np.zeros((B, shape.NV, shape.DK, shape.DV), dtype))


def _qkv(c: np.ndarray, s: MixerShape):
    """q, k (B, T, NK, DK) and v (B, T, NV, DV), contiguous, from the conv output."""
    B, T, _ = c.shape
    nq = s.NK * s.DK
    return (np.ascontiguousarray(c[..., :nq]).reshape(B, T, s.NK, s.DK),
            np.ascontiguousarray(c[..., nq:2 * nq]).reshape(B, T, s.NK, s.DK),
            np.ascontiguousarray(c[..., 2 * nq:]).reshape(B, T, s.NV, s.DV))


def _gates(alpha, b, p: MixerParams, B, T, NV):
    g, beta = np.empty_like(alpha), np.empty_like(alpha)
    deltanet_gates.deltanet_gates_forward(g, beta, alpha, b, p.a, p.dt_bias)
    return g.reshape(B, T, NV), beta.reshape(B, T, NV)


def _rows(a: np.ndarray, cols: int) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1, cols)


def mixer_forward(y, mixed, z, alpha, b, p: MixerParams, s: MixerShape, segments=None) -> MixerSaved:
    """y (B, T, NV DV) out, the input of ssm_out; mixed (B, T, channels), z (B, T, NV DV),
    alpha, b (B, T, NV): the projections; segments: None or (B, T) int32 packed samples."""
    B, T, _ = mixed.shape
    mixed = np.ascontiguousarray(mixed)
    c = np.empty_like(mixed)
    causal_conv.causal_conv_forward(c, mixed, p.conv, None, segments)
    q, k, v = _qkv(c, s)
    alpha, b = _rows(alpha, s.NV), _rows(b, s.NV)
    g, beta = _gates(alpha, b, p, B, T, s.NV)
    o = np.empty_like(v)
    deltanet.deltanet_forward(o, None, q, k, v, g, beta, None, segments, heads=HEADS)
    o, z = o.reshape(-1, s.DV), _rows(z, s.DV)
    rstd = np.empty(len(o), o.dtype)
    out = np.empty_like(o)
    gated_norm.gated_rmsnorm_forward(out, rstd, o, z, p.norm, s.eps)
    y[...] = out.reshape(y.shape)
    return MixerSaved(mixed, c, z, alpha, b, g, beta, o, rstd, segments)


@dataclass
class MixerGrads:
    """Gradients of the small tensors, accumulated (+=); None: frozen."""
    conv: np.ndarray | None = None
    a: np.ndarray | None = None
    dt_bias: np.ndarray | None = None
    norm: np.ndarray | None = None


def mixer_backward(dmixed, dz, dalpha, db, dy, sv: MixerSaved, p: MixerParams, s: MixerShape,
                   grads: MixerGrads | None = None) -> None:
    """dmixed (B, T, channels), dz (B, T, NV DV), dalpha, db (B, T, NV) overwritten from dy
    (B, T, NV DV); the small tensors' gradients accumulated into `grads` where given."""
    grads = grads or MixerGrads()
    B, T, C = sv.mixed.shape
    do, dzr = np.empty_like(sv.o), np.empty_like(sv.z)
    dnorm = grads.norm if grads.norm is not None else np.zeros_like(p.norm)
    gated_norm.gated_rmsnorm_backward(do, dzr, dnorm, _rows(dy, s.DV), sv.o, sv.z, p.norm, sv.rstd)
    dz[...] = dzr.reshape(dz.shape)
    q, k, v = _qkv(sv.conv, s)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dg, dbeta = np.empty_like(sv.g), np.empty_like(sv.beta)
    deltanet.deltanet_backward(dq, dk, dv, dg, dbeta, None, do.reshape(v.shape), q, k, v, sv.g, sv.beta, None,
                               None, sv.segments, heads=HEADS)
    dal, dbr = np.empty_like(sv.alpha), np.empty_like(sv.b)
    deltanet_gates.deltanet_gates_backward(dal, dbr, grads.a, grads.dt_bias, dg.reshape(-1, s.NV),
                                           dbeta.reshape(-1, s.NV), sv.alpha, sv.b, p.a, p.dt_bias)
    dalpha[...], db[...] = dal.reshape(dalpha.shape), dbr.reshape(db.shape)
    dc = np.concatenate([dq.reshape(B, T, -1), dk.reshape(B, T, -1), dv.reshape(B, T, -1)], axis=-1)
    dconv = grads.conv if grads.conv is not None else np.zeros_like(p.conv)
    causal_conv.causal_conv_backward(dmixed, dconv, dc, sv.mixed, p.conv, None, sv.segments)


def mixer_backward_floats(s: MixerShape, B: int, T: int, threads: int | None = None) -> int:
    """Floats of numpy scratch alive at mixer_backward's peak, with what mixer_forward
    saved for it: per token the saved conv output and rule output (channels + inner), do
    and dzr (2 inner), q, k, v and their gradients (2 channels), the gates' and decays'
    (7 NV); then the larger of the rule's work items (kernels/deltanet.working_floats)
    and the joined conv gradient dc (channels), which come one after the other."""
    N = B * T
    held = N * (3 * s.inner + 3 * s.channels + 7 * s.NV)
    return held + max(deltanet.working_floats(B, T, s.NK, s.NV, s.DK, s.DV, threads), N * s.channels)


def mixer_decode(y, mixed, z, alpha, b, p: MixerParams, s: MixerShape, state: RecurrentState) -> None:
    """Decoding and prefill: y (B, T, NV DV) out from the projections of T new tokens, from
    and into `state` (conv inputs and delta state, updated in place)."""
    B, T, _ = mixed.shape
    mixed = np.ascontiguousarray(mixed)
    c = np.empty_like(mixed)
    causal_conv.causal_conv_forward(c, mixed, p.conv, state.conv)
    q, k, v = _qkv(c, s)
    g, beta = _gates(_rows(alpha, s.NV), _rows(b, s.NV), p, B, T, s.NV)
    o = np.empty_like(v)
    if T == 1:
        deltanet.deltanet_decode(o, state.delta, q, k, v, g, beta, heads=HEADS)
    else:
        deltanet.deltanet_forward(o, state.delta, q, k, v, g, beta, state.delta, heads=HEADS)
    o = o.reshape(-1, s.DV)
    out, rstd = np.empty_like(o), np.empty(len(o), o.dtype)
    gated_norm.gated_rmsnorm_forward(out, rstd, o, _rows(z, s.DV), p.norm, s.eps)
    y[...] = out.reshape(y.shape)
