"""Training forward and backward of a llama-family model, written out by hand.

One micro-batch step runs the forward pass layer by layer (models/forward.py, the
same blocks inference runs), keeping what backward needs; the output head computes
logits, loss and the logits' gradient chunk by chunk (head.py); then backward runs
the layers in reverse and accumulates parameter gradients (+=) into the flat
`ParamBuffer`. The parts: buffers.py plans and carves every buffer, linear.py is the
trainable side of a linear (LoRA, its backward), head.py the loss head, parts.py the
backward of each block part (attention, feed-forward); this file holds the step.

The same graph trains two kinds of model: `weights.FrozenBase` (LoRA finetuning: base
weights stay quantized, each dequantized right before its matmul, in forward and again
in backward; adapters in factored form, lora.py) and `params.DenseWeights`
(train-from-scratch: every weight an f32 parameter). Arrays and kernels come from a
backend (backend.py): numpy + numba on the CPU, CuPy + numba-cuda on a GPU; the code
below is the same for both.

What backward recomputes (`checkpointing`, the same gradients bit for bit in each):
  - "none": every activation is kept;
  - "selective": the outputs of matmuls and attention (the expensive parts) are kept,
    the cheap elementwise ops (RMSNorm, SwiGLU) are recomputed in backward;
  - "layer": only each layer's input is kept (as PyTorch's per-layer gradient
    checkpointing); backward recomputes the layer's forward into one set of buffers
    shared by all layers, then runs its backward.
A micro-batch whose last columns have no target runs in a graph of shorter rows over
the same arena (`_trimmed`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..backend import Backend, cpu
from ..kernels import attention as host_attention
from ..kernels import rope as host_rope
from ..kernels.moe import SCRATCH
from ..models.config import ModelConfig
from ..models.forward import PLE_NORM, PLE_PROJ, Forward
from ..models.moe import PROJECTIONS
from ..models.parts import MoeFeedForwardActs, layer_act_shapes, layer_acts
from ..models.rope import rope_cache
from ..precision import F32, ComputePolicy
from .buffers import (arena_size, carve, checkpointing_mode, grad_scratch, has_xa, plan_bytes, shared_view,
                      step_plan)
from .head import LossHead
from .linear import LoraLinears
from .lora import Lora, LoraTarget
from .moe import load_balancing, warm_up_experts
from .params import ParamBuffer
from .parts import TRAIN_PARTS

TRIM_TOKENS = 32              # a micro-batch is cut after its last target, to a multiple of this


class StepExecutor(Forward):
    """Buffers for one (B, T) shape and the step that uses them: the blocks' forward
    (Forward) keeping activations, its linears' trainable side (`linears`:
    linear.LoraLinears), the loss head (`head`: head.LossHead) and the backward."""

    def __init__(self, cfg: ModelConfig, weights, params: ParamBuffer, targets: list[LoraTarget],
                 B: int, T: int, checkpointing: str = "selective", lora_dropout: float = 0.0,
                 dtype=np.float32, backend: Backend | None = None, within: "StepExecutor | None" = None,
                 policy: ComputePolicy = F32):
        """`within`: a graph of the same batch and longer rows whose memory this one uses
        (its `_trimmed` views, for micro-batches whose last columns have no target).
        `policy`: the run's compute policy (precision.policy); bf16 products are a frozen
        base's (trained weights multiply in float32, or TF32 on a GPU: policy(trainable=True))."""
        if policy.dtype == "bf16" and weights.trainable:
            raise ValueError("bf16 products are for a frozen base: trained weights multiply in float32")
        super().__init__(cfg, weights, backend or cpu(), policy, TRAIN_PARTS)
        xp = self.xp
        self.params = params
        # one Lora per adapted weight, shared with the trimmed graphs (their `disabled` switch too)
        self.lora = {t.weight: Lora(t, params) for t in targets} if within is None else within.lora
        self.B, self.T, self.N = B, T, B * T
        self.n_ctx = T if within is None else within.n_ctx   # the context the rope factors are for
        self.mode = checkpointing_mode(checkpointing)
        self.reweight = None                   # (graph, weights) -> a step's weights from its own losses (preference.py)
        self.router_aux_coef = 0.0             # --router-aux-loss-coef (a mixture of experts)
        self.router_aux_grad = None            # (E,) its dL/d(router probabilities) in a step (router_aux)
        self.head_rows = weights.head_rows
        self.plan = step_plan(cfg, targets, B, T, self.mode, self.head_rows, weights.trainable, policy,
                              self.backend.name != "cpu", lora_dropout)
        # one arena holds every buffer but the rope tables (float64 only in tests); a
        # trimmed graph takes its buffers from the arena of the graph it is within and
        # its rope tables are the first rows of that graph's
        self.arena = xp.zeros(arena_size(self.plan.buffers), dtype) if within is None else within.arena
        assert self.arena.size >= arena_size(self.plan.buffers)
        buf = carve(self.plan.buffers, self.arena)
        self._trimmed_executors: dict[int, StepExecutor] = {}
        self.layers = [layer_acts(parts, lambda k, i=i, shapes=layer_act_shapes(parts, B, T, self.mode == "none"):
                                  buf.get(f"blk.{i}.{k}", shared_view(buf.get(f"layer.{k}"), shapes.get(k))))
                       for i, parts in enumerate(self.layer_parts)]
        xa = {t.weight: buf[f"xa.{t.kind}.{t.rank}" if self.mode == "layer" else f"xa.{t.weight}"]
              for t in targets if has_xa(cfg, t.kind)}
        self.linears = LoraLinears(self, self.lora, xa, lora_dropout)   # each linear's trainable side
        self.head = LossHead(self)                                     # final norm, logits, loss, gradient
        self.x_final, self.rstd_f = buf["x_final"], buf["rstd_f"]
        self._scratch_views(buf, weights, within)
        self._rope_tables(weights, buf, T, dtype, within)
        self.buffers = buf                             # name -> array, as planned
        self.ropes = self.rope_rows                    # the step's tables, per rope set
        self.segments = None

    def _scratch_views(self, buf: dict, weights, within: "StepExecutor | None") -> None:
        """The scratch every layer reuses, the head's chunk of logits, and the family's own
        buffers, as views of the planned `buf`."""
        cfg = self.cfg
        self.xn, self.dx, self.dxn, self.h = buf["xn"], buf["dx"], buf["dxn"], None
        shared, at = buf["grads_logits"], 0
        self._flat = {}                                # name -> the whole of a scratch (enter_layer)
        for name, (n, m) in grad_scratch(cfg, self.N, self.mode).items():   # views of the shared buffer
            setattr(self, name, shared[at: at + n * m].reshape(n, m))
            self._flat[name] = shared[at: at + n * m]
            at += n * m
        self.chunk, V = self.plan.chunk, cfg.n_vocab                        # the head's, in that room
        self.logits = shared[: self.chunk * V].reshape(self.chunk, V)
        self.dlogits = None                                                 # the capped logits' gradient
        if cfg.final_softcap:
            self.dlogits = shared[self.chunk * V: 2 * self.chunk * V].reshape(self.chunk, V)
        if self.plan.kept_head and within is None:
            weights.keep_bf16("output.weight")                # the CPU's bf16: a frozen base (FrozenBase)
        self.tmp, self.dnorm, self.losses = buf["tmp"], buf["dnorm"], buf["losses"]
        self.head_tmp = buf.get("head_tmp")
        self.fused = buf.get("fused")
        self.dqp, self.dkp = buf.get("dqp"), buf.get("dkp")
        self._flat |= {k: buf[k].reshape(-1) for k in ("dqp", "dkp") if k in buf}
        # gemma4: the gradients of the keys and values that shared-KV layers reuse, per source
        self.kv_grads = {s: (buf[f"kv_grad.{s}.k"], buf[f"kv_grad.{s}.v"]) for s in cfg.kv_sources}
        if cfg.n_embd_per_layer:
            self.ple = {k: buf[f"ple.{k}"] for k in ("inputs", "proj", "rstd", "d")}

    def _rope_tables(self, weights, buf: dict, T: int, dtype, within: "StepExecutor | None") -> None:
        """Each rope set's cos and sin tables for positions 0..T-1, added to `buf` (a trimmed
        graph's: the first rows of the graph it is within), and their f32 host copies."""
        xp, cfg = self.xp, self.cfg
        if within is None:                             # per rope set: f32 cache; 0..T-1 tables
            self.rope_host, self.rope_rows = [], []
            for j, rope in enumerate(cfg.rope_sets):
                cos, sin = rope_cache(cfg, weights, np.arange(T, dtype=np.int64), T, rope)   # in f32, as llama.cpp
                names = [k + (f".{j}" if j else "") for k in ("rope_cos", "rope_sin")]
                buf |= {k: xp.zeros(self.plan.buffers[k], dtype) for k in names}
                dcos, dsin = (buf[k] for k in names)
                dcos[...] = self.backend.to_device(cos.astype(dtype))
                dsin[...] = self.backend.to_device(sin.astype(dtype))
                self.rope_host.append((cos, sin))
                self.rope_rows.append((dcos, dsin))
        else:
            self.rope_host = within.rope_host
            self.rope_rows = [(c[:T], s[:T]) for c, s in within.rope_rows]
            buf |= {k: v[:T] for k, v in within.buffers.items() if k.startswith("rope_")}

    def ple_buffers(self, N: int) -> dict:
        return self.ple                                # planned (buffers.buffer_plan)

    def enter_layer(self, i: int) -> None:
        """Where layers differ in width (gemma4): the backward's scratch viewed at layer i's."""
        if not self.cfg.varies:
            return
        at, N = self.cfg.layer(i), self.N
        widths = {name: m for name, (_, m) in grad_scratch(at, N, self.mode).items()}
        widths |= {"dqp": at.n_embd_q, "dkp": at.n_embd_kv}
        for name, m in widths.items():
            if name in self._flat:
                setattr(self, name, self._flat[name][: N * m].reshape(N, m))

    def gate_scratch(self) -> tuple[np.ndarray, np.ndarray]:
        """The gate's float32 inputs before the layer keeps them as bf16: the backward's
        dg and du, idle in a forward (and in `layer` mode's recompute, which runs
        before that layer's backward)."""
        return self.dg, self.du

    def expert_buffers(self, i: int) -> dict:
        """Layer i's planned mixture-of-experts buffers (buffers.expert_plan): the experts'
        scratch and its expert adapters' x A^T as "xa.<projection>"."""
        out = {k: self.buffers[f"moe.{k}"] for k in SCRATCH}
        for proj, kind in PROJECTIONS:
            lora = self.lora.get(f"blk.{i}.{kind}.weight")
            if lora is not None:
                t = lora.target
                out[f"xa.{proj}"] = self.buffers[f"moe.xa.{kind}.{t.rank}" if self.mode == "layer"
                                                 else f"moe.xa.{t.weight}"]
        return out

    def activation_bytes(self) -> int:
        """Bytes of every buffer the graph allocated (the plan's)."""
        return plan_bytes(self.plan.buffers, self.tmp.dtype.itemsize)

    def _set_packing(self, positions, segments) -> None:
        """Rope tables (self.ropes: (cos, sin) per rope set) and attention segments of one step (packed
        rows, issue 9's --pack): positions (B, T) int64 rope position of each token or
        None (0..T-1 in every row); segments (B, T) int32 sample id of each token or
        None (one sample per row). Per-token tables are gathered from a float32 cache
        of positions 0..max, so a packed sample rotates exactly as it does alone."""
        shape = (self.B, self.T)
        if positions is None:
            self.ropes = self.rope_rows
        else:
            positions = np.asarray(positions)
            if positions.shape != shape or positions.dtype.kind not in "iu":
                raise ValueError(f"graph: positions must be an integer array of shape {shape}, "
                                 f"got {positions.dtype} {positions.shape}")
            positions = positions.astype(np.int64)
            dtype, self.ropes = self.tmp.dtype, []
            for j, rope in enumerate(self.cfg.rope_sets):
                cos, sin = self.rope_host[j]
                if positions.size and positions.max() >= cos.shape[0]:      # grow the cache
                    n = int(positions.max()) + 1
                    cos, sin = rope_cache(self.cfg, self.weights, np.arange(n, dtype=np.int64), self.n_ctx, rope)
                    self.rope_host[j] = (cos, sin)
                self.ropes.append(tuple(self.backend.to_device(a.astype(dtype))
                                        for a in host_rope.rope_tables(cos, sin, positions)))
        self.segments = None
        if segments is not None:
            segments = np.asarray(segments)
            if segments.dtype.kind not in "iu":
                raise ValueError(f"graph: segments must be an integer array, got {segments.dtype}")
            segments = segments.astype(np.int32)
            host_attention.segment_starts(segments, shape)                # shape, contiguous runs
            self.segments = self.backend.to_device(segments)

    # ------------------------------------------------------------------ backward
    def layer_backward(self, i: int) -> None:
        """In: self.dx = dL/d(layer output). Out: self.dx = dL/d(layer input): the parts'
        backward in reverse (train/parts.py), each adding its share to the residual's."""
        self.enter_layer(i)
        mixer, ffn, *post = self.layer_parts[i]
        a = self.layers[i]
        if self.output_scales[i] is not None:               # gemma4: the output was scaled
            self.dx *= self.output_scale(i, self.dx.dtype)
        if post:
            post[0].backward(self, a.post, a.x_post)
        ffn.backward(self, a.ffn, a.x_mid)
        mixer.backward(self, a.mixer, a.x)

    def post_norm_backward(self, dy: np.ndarray, y_in: np.ndarray | None, rstd: np.ndarray | None,
                            name: str) -> np.ndarray:
        """Gradient through a sandwich norm (post_norms): dL/d(its input) into self.dx2, or
        dy itself when the layer has none."""
        if y_in is None:
            return dy
        self.dnorm.fill(0.0)
        w = self.linears.norm_weight(name)
        self.ops.rmsnorm.rmsnorm_backward(self.dx2, self.dnorm, dy, y_in, w, rstd)
        self.linears.norm_grad(name, self.dnorm)
        return self.dx2

    def per_layer_embed_backward(self) -> None:
        """self.dx += dL/dx0 through the per-layer embeddings' projection (Forward.per_layer_embed),
        from the layers' inputs' gradient self.ple["d"] (L, N, P); the token table stays frozen
        (no gradient), as does per_layer_proj_norm unless trained."""
        cfg, b, N = self.cfg, self.ple, self.N
        L, P, dt = cfg.n_layer, cfg.n_embd_per_layer, self.dx.dtype.type
        dsum = b["inputs"].reshape(N, L, P)                 # free now: the layers are done
        dsum[...] = b["d"].transpose(1, 0, 2)
        dsum *= dt(np.float32(1) / np.sqrt(np.float32(2)))
        dproj, dw = b["d"].reshape(N * L, P), self.xp.zeros(P, self.dx.dtype)
        self.ops.rmsnorm.rmsnorm_backward(dproj, dw, dsum.reshape(N * L, P), b["proj"].reshape(N * L, P),
                                          self.linears.norm_weight(PLE_NORM), b["rstd"])
        if self.norm_trained(PLE_NORM):
            self.linears.norm_grad(PLE_NORM, dw)
        dproj *= dt(np.float32(1) / np.sqrt(np.float32(cfg.n_embd)))
        self.linears.backward(self.dx, dproj.reshape(N, L * P), self.layers[0].x, PLE_PROJ, accumulate=True)

    def _embed_backward(self, tokens: np.ndarray) -> None:
        dx = self.dx
        if self.embd_scale() is not None:
            dx *= self.embd_scale()
        dE = self.linears.weight_grad("token_embd.weight")
        if dE is not None:
            self.backend.scatter_add(dE, tokens, dx)
        t = self.linears.adapter("token_embd.weight")
        if t is not None:
            t.db[...] += t.scale * (dx.T @ t.a[tokens])
            self.backend.scatter_add(t.da, tokens, t.scale * (dx @ t.b))

    def norm_trained(self, name: str) -> bool:
        """A norm weight with a gradient: trained itself (dense, full) or through an adapter."""
        return self.linears.weight_grad(name) is not None or self.linears.adapter(name) is not None

    def norm_dw(self, name: str) -> np.ndarray | None:
        """self.dnorm zeroed for a norm weight's gradient, or None where the weight is frozen
        (norm_grad then has nothing to route, and the GPU skips the dw kernel)."""
        if not self.norm_trained(name):
            return None
        self.dnorm.fill(0.0)
        return self.dnorm

    # ------------------------------------------------------------------ the step
    def step(self, inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray, key: tuple = (0,),
             positions: np.ndarray | None = None, segments: np.ndarray | None = None) -> float:
        """Forward + backward of one micro-batch. inputs, targets (B, T) int (target -1:
        ignored); weights (B, T) f32 per-position loss weights (e.g. 1/n_targets of the
        whole accumulated batch); positions, segments (B, T): packed rows (_set_packing),
        None for one sample per row. Gradients are added to params.grad. Returns sum(w*loss).
        Columns after the last target of every row are left out (`_trimmed`)."""
        return self._trimmed(lambda g, *batch: g._forward_backward(*batch[:3], key, *batch[3:]),
                             inputs, targets, weights, positions, segments)

    def _trimmed(self, run, inputs, targets, weights, positions, segments) -> float:
        """run(graph, inputs, targets, weights, positions, segments) on the columns up to
        the last one with a target in any row, rounded up to TRIM_TOKENS: a graph of those
        shorter rows over this one's memory (made once per length). The columns left out
        change nothing: no token there has a target, and no token with one attends to them
        (attention is causal), so their gradients are zero; a chat micro-batch of short
        conversations padded to --ctx is mostly such columns. self.losses gets the
        per-token losses (0 in the columns left out)."""
        t = np.asarray(targets).reshape(self.B, self.T)
        used = np.flatnonzero((t >= 0).any(axis=0))
        last = int(used[-1]) + 1 if used.size else 1          # the columns up to the last target
        T = min(self.T, -(-last // TRIM_TOKENS) * TRIM_TOKENS)
        if T == self.T:
            return run(self, inputs, targets, weights, positions, segments)
        g = self._trimmed_executors.get(T)
        if g is None:
            g = self._trimmed_executors[T] = StepExecutor(self.cfg, self.weights, self.params,
                                                [a.target for a in self.lora.values()], self.B, T, self.mode,
                                                self.linears.dropout, self.tmp.dtype, self.backend, within=self,
                                                policy=self.policy)
        g.linears.dropout, g.reweight, g.observer = self.linears.dropout, self.reweight, self.observer
        g.router_aux_coef = self.router_aux_coef

        def cut(a):
            return None if a is None else np.asarray(a).reshape(self.B, self.T)[:, :T]
        loss = run(g, cut(inputs), cut(targets), cut(weights), cut(positions), cut(segments))
        rows, kept = self.losses.reshape(self.B, self.T), g.losses.reshape(self.B, T).copy()   # (same arena)
        rows[:, :T] = kept
        rows[:, T:] = 0.0
        return loss

    def warm_up(self, packed: bool = False) -> None:
        """Run every kernel of a step and of an evaluation once (compiling it, or loading it
        from numba's disk cache) on token ids 0..; with `packed`, also their packed-rows
        variants. It is no training step: the gradients it adds are cleared."""
        shape = (self.B, self.T)
        ids = np.arange(self.N).reshape(shape) % self.cfg.n_vocab
        w = np.full(shape, 1 / self.N, np.float32)
        packing = [(None, None)]
        if packed:                                  # one sample per row, given as packed rows
            packing.append((np.broadcast_to(np.arange(self.T), shape), np.zeros(shape, np.int32)))
        for positions, segments in packing:
            self._forward_backward(ids, ids, w, (0, 0, 0), positions, segments)
            self.loss(ids, ids, w, positions, segments)
        self.params.zero_grad()

    def _forward_backward(self, inputs, targets, weights, key, positions, segments) -> float:
        self.linears.step_key = tuple(int(k) for k in key)
        tokens, tg, w = self._forward(inputs, targets, weights, positions, segments)
        self.observer = None                                # the step's forward alone is observed, not a recompute
        if self.reweight is not None:                       # the head forward alone: self.losses, then weights
            self.head.loss(tg, w, backward=False)
            w = self.reweight(self, w)
        loss = self.head.loss(tg, w) + self.router_aux(w)
        for dk, dv in self.kv_grads.values():               # gemma4: sent by the shared-KV layers
            dk.fill(0.0)
            dv.fill(0.0)
        for i in reversed(range(self.cfg.n_layer)):
            if self.mode == "layer" and i + 1 < self.cfg.n_layer:   # the last layer's are still there
                self.recomputing = True                                           # recompute; its output is not needed
                try:
                    self.layer_forward(i, self.layers[i], self.dx2)
                finally:
                    self.recomputing = False
            self.layer_backward(i)
        if self.cfg.n_embd_per_layer:
            self.per_layer_embed_backward()
        self._embed_backward(tokens)
        self.params.settle()                                # lazily cleared gradients no product wrote
        return loss

    def router_aux(self, w) -> float:
        """The load-balancing loss of the step's routers (train/moe.load_balancing) times
        router_aux_coef and the micro-batch's share of the step's loss weights (sum w: 1
        for a step of one micro-batch, as transformers adds it to its mean loss); its
        gradient into self.router_aux_grad for the layers' backward. 0 where off."""
        self.router_aux_grad = None
        if not self.router_aux_coef:
            return 0.0
        states = [a.ffn.state for a in self.layers if isinstance(a.ffn, MoeFeedForwardActs)]
        aux, dp = load_balancing(states, self.cfg.n_expert)
        scale = self.router_aux_coef * float(w.sum())
        self.router_aux_grad = scale * dp
        return scale * aux

    def loss(self, inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray,
             positions: np.ndarray | None = None, segments: np.ndarray | None = None) -> float:
        """Forward only, for evaluation: sum(weights * loss) of one micro-batch (arguments as
        in `step`), without dropout; no gradient is computed and params.grad is untouched."""
        dropout, self.linears.dropout = self.linears.dropout, 0.0
        try:
            return self._trimmed(lambda g, *batch: g.head.loss(*g._forward(*batch)[1:], backward=False),
                                 inputs, targets, weights, positions, segments)
        finally:
            self.linears.dropout = dropout

    def _forward(self, inputs, targets, weights, positions, segments):
        """Set the step's rope positions and segments, upload one micro-batch and run
        embedding and layers; returns the device arrays (tokens, targets, weights), (N,)."""
        self._set_packing(positions, segments)
        to_device = self.backend.to_device
        tokens = to_device(np.asarray(inputs, np.int64).reshape(-1))
        tg = to_device(np.asarray(targets, np.int64).reshape(-1))
        w = to_device(np.asarray(weights, self.tmp.dtype).reshape(-1))
        self.embed(tokens, self.layers[0].x)
        for i in range(self.cfg.n_layer):
            x_out = self.layers[i + 1].x if i + 1 < self.cfg.n_layer else self.x_final
            self.layer_forward(i, self.layers[i], x_out)
        return tokens, tg, w


def tiny_config(like: ModelConfig | None, n_ctx: int = 8, n_vocab: int = 64) -> ModelConfig:
    """A tiny model of `like`'s grouping (with one KV head when that has one), family and
    hyperparameters (activation, soft-caps, norms, windows): a mixture of experts gives a
    dense llama of its grouping (its router and expert kernels compile on their first
    use), a hybrid one layer of each kind, gemma4 one width with its own K/V and small
    per-layer inputs. numba compiles a kernel apart for each array
    layout it sees, and the attention's slices are contiguous or not depending on the
    heads per KV head."""
    kv, group = (1, 2) if like is None else (min(2, like.n_head_kv), like.n_head // like.n_head_kv)
    tiny = dict(n_vocab=n_vocab, n_ctx_train=n_ctx, n_embd=32, n_layer=2, n_ff=64, n_head=kv * group, n_head_kv=kv,
                head_dim=16, n_rot=16)
    if like is not None and like.recurrent_layers:
        tiny["recurrent_layers"] = (True, False)
    if like is not None and like.swa_pattern > 2:                 # one sliding layer, one full
        tiny["swa_pattern"] = 2
    if like is not None and (like.varies or like.n_kv_shared or like.n_embd_per_layer):      # gemma4: one width,
        tiny |= dict(head_dim_swa=0, n_rot_swa=0, n_head_kv_layers=(), n_ff_layers=(), n_kv_shared=0,  # its own
                     n_embd_per_layer=8 if like.n_embd_per_layer else 0)                    # K/V, small inputs
    if like is not None and like.spec.moe:
        return ModelConfig.new("llama", norm_eps=like.norm_eps, **tiny)
    return ModelConfig.new("llama", **tiny) if like is None else replace(like, **tiny)


def compile_kernels(backend, opts, qtypes=(), like=None, policy: ComputePolicy = F32) -> None:
    """Run every training kernel once on a tiny model (`tiny_config` of `like`, the run's
    ModelConfig), compiling it or loading it from numba's disk cache, so that the runtime
    measured afterwards includes them; with the CPU's bf16 products also those of
    `policy` (`compile_bf16_kernels`)."""
    from ..models.writer import random_weights, tensor_names
    from .optimizer import optimizer_step
    from .params import DenseWeights, ParamBuffer, ParamSpec
    if backend.name != "cpu":
        return
    cfg = tiny_config(like)
    params = ParamBuffer([ParamSpec(n, s) for n, s in tensor_names(cfg).items()])
    for n, a in random_weights(cfg, seed=0).items():
        params[n][...] = a
    executor = StepExecutor(cfg, DenseWeights(params, tied=cfg.spec.tied), params, [], 2, 8, "none")
    executor.warm_up(packed=getattr(opts, "pack", False))
    if like is not None and like.spec.moe:
        warm_up_experts()
    params.grad[...] = 1.0                                      # an update that uses every kernel
    optimizer_step(params, 0, opts)
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QType

    from ..kernels import dequant
    for q in sorted(set(qtypes) & set(dequant.NUMBA_TYPES)):
        block, size = GGML_QUANT_SIZES[QType(q)]
        raw = np.zeros((1, size), np.uint8)
        raw.flags.writeable = False                             # as the memory-mapped model: numba compiles
        dequant.dequantize_into(raw, q, np.empty((1, block), np.float32))   # read-only arrays apart
        if policy.host_bf16:
            dequant.dequantize_into(raw, q, np.empty((1, block), np.uint16))
    if policy.host_bf16:
        compile_bf16_kernels(like, policy, packed=getattr(opts, "pack", False))


def compile_bf16_kernels(like: ModelConfig | None, policy: ComputePolicy, packed: bool = False) -> None:
    """A step and an evaluation of a tiny frozen Q8_0 model (`tiny_config`, 2 x 16 tokens:
    the bf16 products' and attention's least rows; a head of several row blocks) with
    adapters on every layer matrix, then also on the head, under `policy`'s bf16 products:
    what the first bf16 step brings besides its buffers becomes part of the runtime
    measured afterwards: oneDNN's library pages, engine and streams,
    its first primitives, and the numba kernels of the bf16 layout (conversions,
    dequantization to bf16, attention_bf16). Measured at the bench shape (Q8_0, ctx 256 x
    8, layer): about 14 MiB, which the estimate missed before."""
    import tempfile
    from pathlib import Path

    from ..models.model import Model
    from ..models.weights import FrozenBase
    from ..models.writer import parse_outtype, random_weights, write_model
    from .lora import init_lora, lora_specs, lora_targets
    cfg = tiny_config(like, n_ctx=16, n_vocab=256)                  # the head in several row blocks
    kinds = {kind for i in range(cfg.n_layer) for kind in cfg.spec.kinds(cfg, i)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny.gguf"
        write_model(path, cfg, random_weights(cfg, seed=0), [], parse_outtype("q8_0"))
        model = Model(path)
        for head in (set(), set() if cfg.spec.tied else {"output", "token_embd"}):   # the head frozen (kept), adapted
            targets = lora_targets(cfg, {k: 4 for k in kinds | head}, 4.0, tied=cfg.spec.tied)
            params = ParamBuffer(lora_specs(targets))
            init_lora(params, targets, np.random.default_rng(0))
            StepExecutor(cfg, FrozenBase(model), params, targets, 2, 16, "none", policy=policy).warm_up(packed)
