"""Training forward and backward of a llama model, written out by hand.

One micro-batch step runs the forward pass layer by layer, keeping what backward
needs; the output head computes logits, loss and the logits' gradient chunk by
chunk (the (N, V) logits never exist in full); then backward runs the layers in
reverse and accumulates parameter gradients (+=) into the flat `ParamBuffer`.

The same graph trains two kinds of model (weights.py): `FrozenBase` (LoRA
finetuning: base weights stay quantized, each dequantized right before its
matmul, in forward and again in backward; adapters in factored form, lora.py) and
`DenseWeights` (train-from-scratch: every weight an f32 parameter). Arrays and
kernels come from a backend (backend.py): numpy + numba on the CPU, CuPy +
numba-cuda on a GPU; the code below is the same for both.

What backward recomputes (`checkpointing`, the same gradients bit for bit in each):
  - "none": every activation is kept;
  - "selective": the outputs of matmuls and attention (the expensive parts) are kept,
    the cheap elementwise ops (RMSNorm, SwiGLU) are recomputed in backward;
  - "layer": only each layer's input is kept (as PyTorch's per-layer gradient
    checkpointing); backward recomputes the layer's forward into one set of buffers
    shared by all layers, then runs its backward.
Every buffer is listed by `buffer_plan` (what the memory estimate counts) and
carved from one arena allocated from that list; a micro-batch whose last columns
have no target runs in a graph of shorter rows over the same arena (`_trimmed`).
The output head is expanded in row blocks inside the token-chunked head loop, so
nothing of size vocabulary x embedding exists in f32.

Per layer, with xn = RMSNorm(x), the architecture's options (models/arch.py) in brackets:
    q, k, v = xn Wq^T, xn Wk^T, xn Wv^T      [qk_norm: q, k = RMSNorm per head (qp, kp kept)]
    q, k    = rope(q), rope(k)               (the layer's rope cache: gemma3's local layers differ)
    o       = attn(q, k, v) Wo^T             (the layer's scale, soft-cap and sliding window)
    x_mid   = x + o                          [post_norms: x + RMSNorm(o, post_attention_norm)]
    g, u    = n2 Wg^T, n2 Wu^T               n2 = RMSNorm(x_mid)
    f       = (act(g) * u) Wd^T              act = silu (SwiGLU) or gelu (GeGLU)
    x_out   = x_mid + f                      [post_norms: x_mid + RMSNorm(f, post_ffw_norm)]
The embedding may be scaled (gemma: sqrt(n_embd)) and the logits soft-capped (gemma2)
before the loss, chunk by chunk.
Fused projections (Arch.fused_qkv / fused_gate_up, phi3) compute q|k|v or g|u in one
matmul (one LoRA pair on the whole product) and split it into the same activations.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import numpy as np

from ..backend import Backend, cpu
from ..kernels import attention as host_attention
from ..kernels import rope as host_rope
from ..models.arch import layer_matrix_shapes
from ..models.config import ModelConfig
from ..models.rope import rope_cache
from ..models.weights import FrozenBase  # noqa: F401
from .lora import LoraTarget
from .params import (
    DenseWeights,  # noqa: F401  (re-exported: the graph's weight providers)
    ParamBuffer,
)

HEAD_CHUNK_BYTES = 32 << 20   # logits computed at least this many bytes at a time,
HEAD_CHUNK_TOKENS = 128       # and for at least this many tokens (large vocabularies)
MODES = ("layer", "selective", "none")   # --checkpointing, least memory first
TRIM_TOKENS = 32              # a micro-batch is cut after its last target, to a multiple of this
LORA_VECTOR_KINDS = ("output_norm", "output", "token_embd")   # with the layers' norms: no (N, r) x A^T buffer


def _has_xa(cfg: ModelConfig, kind: str) -> bool:
    """Whether an adapter on `kind` keeps an (N, r) x A^T buffer (matrices inside a layer)."""
    return kind not in LORA_VECTOR_KINDS and kind not in cfg.spec.norms


@dataclass
class LayerActs:
    """One layer's activations (N = B*T rows); in layer mode all but x are shared."""
    x: np.ndarray        # (N, C)   layer input (residual stream)
    rstd1: np.ndarray    # (N,)
    q: np.ndarray        # (N, NH*HS) after rope
    k: np.ndarray        # (N, NKV*HS) after rope
    v: np.ndarray        # (N, NKV*HS)
    att: np.ndarray      # (N, NH*HS) attention output
    lse: np.ndarray      # (B, NH, T)  softmax log-sum-exp
    x_mid: np.ndarray    # (N, C)   residual after attention
    rstd2: np.ndarray    # (N,)
    g: np.ndarray        # (N, F)
    u: np.ndarray        # (N, F)
    xn1: np.ndarray | None = None   # (N, C) only in mode "none"
    xn2: np.ndarray | None = None   # (N, C)
    h: np.ndarray | None = None     # (N, F)
    qp: np.ndarray | None = None     # (N, NH*HS)  q before its per-head norm (qk_norm)
    kp: np.ndarray | None = None     # (N, NKV*HS) k before its per-head norm
    rstd_q: np.ndarray | None = None  # (N*NH,)
    rstd_k: np.ndarray | None = None  # (N*NKV,)
    o: np.ndarray | None = None      # (N, C) attention output projection (post_norms)
    rstd_o: np.ndarray | None = None  # (N,)
    f: np.ndarray | None = None      # (N, C) feed-forward output (post_norms)
    rstd_f: np.ndarray | None = None  # (N,)


def checkpointing_mode(checkpointing) -> str:
    """A mode of MODES; True / False are the old spellings of selective / none."""
    if checkpointing is True or checkpointing is False:
        return "selective" if checkpointing else "none"
    if checkpointing not in MODES:
        raise ValueError(f"checkpointing {checkpointing!r}: choose one of {MODES}")
    return checkpointing


def grad_scratch(cfg: ModelConfig, N: int, mode: str) -> dict[str, tuple[int, int]]:
    """Scratch of the layer backward (gradients, dx2) and the SwiGLU output that backward
    recomputes (not in mode none, whose layers keep theirs), (N, *) each. The output head
    uses none of them and runs before any layer backward (evaluation runs none), so its
    logits overlay them all in one shared buffer: a larger token chunk at no memory cost."""
    F, Cq, Ckv = cfg.n_ff, cfg.n_embd_q, cfg.n_embd_kv
    views = {"dg": (N, F), "du": (N, F), "dh": (N, F), "dq": (N, Cq), "dk": (N, Ckv), "dv": (N, Ckv),
             "datt": (N, Cq), "dx2": (N, cfg.n_embd)}
    if checkpointing_mode(mode) != "none":
        views["h"] = (N, F)
    return views


def head_floats(cfg: ModelConfig) -> int:
    """Floats the head keeps per token of a chunk: its logits, and with a final soft-cap
    their gradient beside them (the capped logits stay for the cap's backward)."""
    return cfg.n_vocab * (2 if cfg.final_softcap else 1)


def head_chunk(N: int, per_token: int, room: int = 0) -> int:
    """Token rows of the head computed at a time (`per_token` floats each, head_floats):
    the N tokens in as few chunks as fit `room` floats (the scratch they overlay) or
    HEAD_CHUNK_BYTES, whichever holds more, but at least HEAD_CHUNK_TOKENS tokens, all
    of about the same size. Every chunk expands the quantized head twice (logits,
    gradient to its input), so fewer, larger chunks expand it less often and multiply
    it in better-shaped products: with Qwen2.5-0.5B's Q8_0 head (151936 x 896), chunks
    of 74 tokens (what its room held, 43 MB) took 2.66 s per 512 tokens for the head's
    expansions and products on two Zen 3 cores, chunks of 128 tokens (74 MB) 2.09 s,
    of 512 tokens (297 MB) 1.70 s (bench/head_chunks.py)."""
    most = max(HEAD_CHUNK_BYTES // 4, room) // per_token
    return even_chunk(N, max(1, min(N, max(most, HEAD_CHUNK_TOKENS))))


def even_chunk(n: int, most: int) -> int:
    """The size of n rows' chunks when they go in as few chunks of at most `most` rows
    as possible, all about the same size: ceil(n / ceil(n / most)); 1 when n is 0."""
    return -(-n // -(-n // most)) if n else 1


def buffer_plan(cfg: ModelConfig, targets: list[LoraTarget], B: int, T: int, mode: str, head_rows: int,
                trainable: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array a Graph allocates (it allocates exactly these).

    `blk.I.*` are kept per layer; `layer.*` is the one set of activations that layer
    mode recomputes into, shared by all layers; the rest is scratch reused by every layer."""
    mode = checkpointing_mode(mode)
    N, C, F, Cq, Ckv, V = B * T, cfg.n_embd, cfg.n_ff, cfg.n_embd_q, cfg.n_embd_kv, cfg.n_vocab
    acts = {"x": (N, C), "rstd1": (N,), "q": (N, Cq), "k": (N, Ckv), "v": (N, Ckv), "att": (N, Cq),
            "lse": (B, cfg.n_head, T), "x_mid": (N, C), "rstd2": (N,), "g": (N, F), "u": (N, F)}
    if mode == "none":
        acts |= {"xn1": (N, C), "xn2": (N, C), "h": (N, F)}
    if cfg.spec.qk_norm:
        acts |= {"qp": (N, Cq), "kp": (N, Ckv), "rstd_q": (N * cfg.n_head,), "rstd_k": (N * cfg.n_head_kv,)}
    if cfg.spec.post_norms:
        acts |= {"o": (N, C), "rstd_o": (N,), "f": (N, C), "rstd_f": (N,)}
    plan: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_layer):
        for k, shape in acts.items():
            plan[f"blk.{i}.{k}" if mode != "layer" or k == "x" else f"layer.{k}"] = shape
    plan |= {"x_final": (N, C), "rstd_f": (N,)}                     # output of the last layer, its norm
    for t in targets:                                              # x A^T of each adapter (shared per kind
        if _has_xa(cfg, t.kind):                                   # in layer mode: recomputed with the layer)
            plan[f"xa.{t.kind}.{t.rank}" if mode == "layer" else f"xa.{t.weight}"] = (N, t.rank)
    room = sum(n * m for n, m in grad_scratch(cfg, N, mode).values())
    per_token = head_floats(cfg)
    chunk = head_chunk(N, per_token, room)
    mats = layer_matrix_shapes(cfg)
    plan |= {"xn": (N, C), "dx": (N, C), "dxn": (N, C),
             "grads_logits": (max(room, chunk * per_token),),        # grad_scratch, or the head's chunk
             "tmp": (N * max(C, F, Cq, *(max(s) for s in mats)),), "dnorm": (C,), "losses": (N,),
             "rope_cos": (T, cfg.n_rot // 2), "rope_sin": (T, cfg.n_rot // 2)}
    fused = [w for on, w in ((cfg.spec.fused_qkv, Cq + 2 * Ckv), (cfg.spec.fused_gate_up, 2 * F)) if on]
    if fused:                                                      # a fused product, or its gradient,
        plan["fused"] = (N * max(fused),)                          # before it is split / after it is joined
    for j in range(1, len(cfg.rope_sets)):                         # layers with another rope base
        plan |= {f"rope_cos.{j}": (T, cfg.n_rot // 2), f"rope_sin.{j}": (T, cfg.n_rot // 2)}
    if cfg.spec.qk_norm:
        plan |= {"dqp": (N, Cq), "dkp": (N, Ckv)}
    head_tmp = 0                                                   # products added to a block in the head
    if any(t.kind == "output" for t in targets):
        head_tmp = chunk * head_rows                               # (chunk, rows) LoRA share of the logits
    if trainable:                                                  # weight gradients before they are added
        head_tmp = max(head_tmp, head_rows * C, *(o * i for o, i in mats))
    if head_tmp:
        plan["head_tmp"] = (head_tmp,)
    return plan


def plan_bytes(plan: dict[str, tuple[int, ...]], itemsize: int = 4) -> int:
    return int(sum(np.prod(s, dtype=np.int64) for s in plan.values())) * itemsize


class Graph:
    """Buffers for one (B, T) shape and the step that uses them."""

    def __init__(self, cfg: ModelConfig, base, params: ParamBuffer, targets: list[LoraTarget],
                 B: int, T: int, checkpointing: str | bool = "selective", lora_dropout: float = 0.0,
                 dtype=np.float32, backend: Backend | None = None, within: "Graph | None" = None):
        """`within`: a graph of the same batch and longer rows whose memory this one uses
        (its `_trimmed` views, for micro-batches whose last columns have no target)."""
        self.cfg, self.base, self.params = cfg, base, params
        self.backend = backend or cpu()
        self.xp, self.ops = self.backend.xp, self.backend.ops
        xp = self.xp
        self.lora = {t.weight: t for t in targets}
        self.B, self.T, self.N = B, T, B * T
        self.n_ctx = T if within is None else within.n_ctx   # the context the rope factors are for
        self.mode = checkpointing_mode(checkpointing)
        self.dropout = lora_dropout
        self.merge_lora = True                 # _matrix may merge adapters into dequantized W
        self.head_rows = base.head_rows
        self.plan = buffer_plan(cfg, targets, B, T, self.mode, self.head_rows, base.trainable)
        # one arena holds every buffer but the rope tables (float64 only in tests); a
        # trimmed graph takes its buffers from the arena of the graph it is within and
        # its rope tables are the first rows of that graph's
        sizes = {k: int(np.prod(v, dtype=np.int64)) for k, v in self.plan.items() if not k.startswith("rope_")}
        self.arena = xp.zeros(sum(sizes.values()), dtype) if within is None else within.arena
        assert self.arena.size >= sum(sizes.values())
        buf, at = {}, 0
        for name, n in sizes.items():
            buf[name] = self.arena[at: at + n].reshape(self.plan[name])
            at += n
        self._trimmed_graphs: dict[int, Graph] = {}
        self.layers = []
        for i in range(cfg.n_layer):
            get = lambda k: buf.get(f"blk.{i}.{k}", buf.get(f"layer.{k}"))  # noqa: E731
            self.layers.append(LayerActs(*(get(f.name) for f in fields(LayerActs))))
        self.xa = {t.weight: buf[f"xa.{t.kind}.{t.rank}" if self.mode == "layer" else f"xa.{t.weight}"]
                   for t in targets if _has_xa(cfg, t.kind)}
        self.x_final, self.rstd_f = buf["x_final"], buf["rstd_f"]
        # scratch, reused by every layer
        self.xn, self.dx, self.dxn, self.h = buf["xn"], buf["dx"], buf["dxn"], None
        shared, at = buf["grads_logits"], 0
        for name, (n, m) in grad_scratch(cfg, self.N, self.mode).items():   # views of the shared buffer
            setattr(self, name, shared[at: at + n * m].reshape(n, m))
            at += n * m
        self.chunk, V = head_chunk(self.N, head_floats(cfg), at), cfg.n_vocab
        self.logits = shared[: self.chunk * V].reshape(self.chunk, V)
        self.dlogits = None                                                 # the capped logits' gradient
        if cfg.final_softcap:
            self.dlogits = shared[self.chunk * V: 2 * self.chunk * V].reshape(self.chunk, V)
        self.tmp, self.dnorm, self.losses = buf["tmp"], buf["dnorm"], buf["losses"]
        self.head_tmp = buf.get("head_tmp")
        self.fused = buf.get("fused")
        self.dqp, self.dkp = buf.get("dqp"), buf.get("dkp")
        if within is None:                             # per rope set: f32 cache; 0..T-1 tables
            self.rope_host, self.rope_rows = [], []
            for j, rope in enumerate(cfg.rope_sets):
                cos, sin = rope_cache(cfg, base, np.arange(T, dtype=np.int64), T, rope)   # in f32, as llama.cpp
                names = [k + (f".{j}" if j else "") for k in ("rope_cos", "rope_sin")]
                buf |= {k: xp.zeros(self.plan[k], dtype) for k in names}
                dcos, dsin = (buf[k] for k in names)
                dcos[...] = self.backend.to_device(cos.astype(dtype))
                dsin[...] = self.backend.to_device(sin.astype(dtype))
                self.rope_host.append((cos, sin))
                self.rope_rows.append((dcos, dsin))
        else:
            self.rope_host = within.rope_host
            self.rope_rows = [(c[:T], s[:T]) for c, s in within.rope_rows]
            buf |= {k: v[:T] for k, v in within.buffers.items() if k.startswith("rope_")}
        self.buffers = buf                             # name -> array, as planned
        self.ropes = self.rope_rows                    # the step's tables, per rope set
        self.segments = None
        self.step_key = (0,)

    # ------------------------------------------------------------------ sizes
    @property
    def checkpointing(self) -> bool:
        return self.mode != "none"

    @property
    def cos(self) -> np.ndarray:
        """The step's rope cos table of the first rope set (every layer's, for most models)."""
        return self.ropes[0][0]

    @property
    def sin(self) -> np.ndarray:
        return self.ropes[0][1]

    def activation_bytes(self) -> int:
        """Bytes of every buffer the graph allocated (= plan_bytes of its plan)."""
        return plan_bytes(self.plan, self.tmp.dtype.itemsize)

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
                    cos, sin = rope_cache(self.cfg, self.base, np.arange(n, dtype=np.int64), self.n_ctx, rope)
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

    # ------------------------------------------------------------------ building blocks
    def _scratch(self, rows: int, cols: int) -> np.ndarray:
        return self.tmp[: rows * cols].reshape(rows, cols)

    def _head_scratch(self, rows: int, cols: int) -> np.ndarray:
        return self.head_tmp[: rows * cols].reshape(rows, cols)

    def _dropout_mask(self, name: str, shape) -> np.ndarray | None:
        """Inverted-dropout mask for an adapter input; regenerated identically in backward."""
        if self.dropout <= 0:
            return None
        key = [zlib.crc32(name.encode()), *self.step_key]
        keep = np.random.default_rng(key).random(shape, dtype=np.float32) >= self.dropout
        return self.backend.to_device(keep.astype(self.tmp.dtype) / self.tmp.dtype.type(1.0 - self.dropout))

    def _norm_weight(self, name: str) -> np.ndarray:
        """Effective norm weight: base (or parameter) + s·(B A)[0] when it has an adapter."""
        w = self.base.vector(name).astype(self.tmp.dtype, copy=False)
        t = self.lora.get(name)
        if t is None:
            return w
        return w + t.scale * (self.params[t.b] @ self.params[t.a])[0]

    def _weight_grad(self, name: str):
        """The gradient of a trained base weight (dense or full training); None when frozen."""
        return self.base.grad(name) if self.base.trainable else None

    def _norm_grad(self, name: str, dw: np.ndarray) -> None:
        """Route a norm weight's gradient to its parameter or its adapter."""
        g = self._weight_grad(name)
        if g is not None:
            g[...] += dw
        t = self.lora.get(name)
        if t is not None:
            A, B = self.params[t.a], self.params[t.b]
            self.params.grad_of(t.a)[...] += t.scale * self.xp.outer(B[0], dw)
            self.params.grad_of(t.b)[...] += t.scale * (A @ dw)[None, :]

    def _matrix(self, name: str, N: int) -> tuple[np.ndarray, bool]:
        """The base matrix W (n_out, n_in) of a linear over N tokens, and whether its
        adapter was merged into it: W + s B A, when the matrix is a dequantized copy
        (a scratch of the step's dtype), the adapter sees x without dropout, and
        N > max(n_out, n_in), where adding (r-factored) B A to W costs less than adding
        the adapter's (N, n_out) share to the product (and, in backward, its (N, n_in)
        share to dx). Either way the product is the same up to float rounding."""
        W = self.base.matrix(name)
        t = self.lora.get(name)
        merge = (t is not None and self.merge_lora and self.dropout <= 0 and N > max(W.shape)
                 and W.dtype == self.tmp.dtype and self.base.is_scratch(name))
        if merge:
            W += self.xp.matmul(t.scale * self.params[t.b], self.params[t.a], out=self._scratch(*W.shape))
        return W, merge

    def linear(self, y: np.ndarray, x: np.ndarray, name: str) -> np.ndarray:
        """y (N, n_out) = x W^T (+ bias) + s (drop(x) A^T) B^T."""
        W, merged = self._matrix(name, x.shape[0])
        self.xp.matmul(x, W.T, out=y)
        bias = self.base.vector(name.replace(".weight", ".bias"))
        if bias is not None:
            y += bias
        t = self.lora.get(name)
        if t is not None:
            mask = self._dropout_mask(name, x.shape)
            xa = self.xa[name]                                  # kept for the backward
            self.xp.matmul(x if mask is None else x * mask, self.params[t.a].T, out=xa)
            if not merged:
                y += self.xp.matmul(t.scale * xa, self.params[t.b].T, out=self._scratch(*y.shape))
        return y

    def linear_backward(self, dx: np.ndarray | None, dy: np.ndarray, x: np.ndarray, name: str,
                        accumulate: bool) -> None:
        """dx (=, or += when accumulate) = dy W + s (dy B) A; parameter grads +=."""
        W, merged = self._matrix(name, dy.shape[0])
        if dx is not None:
            if accumulate:
                tmp = self._scratch(*dx.shape)
                self.xp.matmul(dy, W, out=tmp)
                dx += tmp
            else:
                self.xp.matmul(dy, W, out=dx)
        dW = self._weight_grad(name)
        if dW is not None:
            dW += self.xp.matmul(dy.T, x, out=self._head_scratch(*dW.shape))
        bias = name.replace(".weight", ".bias")
        db = self._weight_grad(bias) if self.base.vector(bias) is not None else None
        if db is not None:                                         # qwen2's q/k/v biases
            db[...] += dy.sum(axis=0)
        t = self.lora.get(name)
        if t is not None:
            mask = self._dropout_mask(name, x.shape)
            self._lora_backward(t, dy, x if mask is None else x * mask, self.xa[name], None if merged else dx, mask)

    def _lora_backward(self, t: LoraTarget, dy, xd, xa, dx, mask=None) -> None:
        """The adapter's share of a linear's backward, y += s (xd A^T) B^T with xa = xd A^T:
        dB += s dy^T xa, dA += (s dy B)^T xd, and dx += (s dy B) A (times the dropout mask;
        dx None: the adapter was merged into the W of dy W, which gave that share)."""
        A, B = self.params[t.a], self.params[t.b]
        self.params.grad_of(t.b)[...] += t.scale * (dy.T @ xa)
        dxa = t.scale * (dy @ B)                                       # (N, r)
        self.params.grad_of(t.a)[...] += (xd.T @ dxa).T                # not dxa.T @ xd: BLAS takes up
        #                                   to 50x longer with the r-row transposed operand on the left
        if dx is not None:
            dxd = self.xp.matmul(dxa, A, out=self._scratch(*dx.shape))
            dx += dxd if mask is None else dxd * mask

    # ------------------------------------------------------------------ projections
    # q/k/v and gate/up: separate matmuls, or one fused matmul (Arch.fused_qkv /
    # fused_gate_up) whose product is split into the same activations; backward joins
    # their gradients into one dy for the fused weight (and its LoRA pair).
    def _fused_rows(self, width: int) -> np.ndarray:
        return self.fused[: self.N * width].reshape(self.N, width)

    def _qkv_forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, xn: np.ndarray, p: str) -> None:
        """q (N, Cq), k, v (N, Ckv) = the projections of xn."""
        if not self.cfg.spec.fused_qkv:
            for c, y in (("q", q), ("k", k), ("v", v)):
                self.linear(y, xn, f"{p}attn_{c}.weight")
            return
        Cq, Ckv = self.cfg.n_embd_q, self.cfg.n_embd_kv
        qkv = self.linear(self._fused_rows(Cq + 2 * Ckv), xn, p + "attn_qkv.weight")
        q[...], k[...], v[...] = qkv[:, :Cq], qkv[:, Cq:Cq + Ckv], qkv[:, Cq + Ckv:]

    def _qkv_backward(self, dq: np.ndarray, dk: np.ndarray, xn: np.ndarray, p: str) -> None:
        """self.dxn = dL/dxn from the projections' gradients dq, dk and self.dv."""
        if not self.cfg.spec.fused_qkv:
            for j, (c, dy) in enumerate((("q", dq), ("k", dk), ("v", self.dv))):
                self.linear_backward(self.dxn, dy, xn, f"{p}attn_{c}.weight", accumulate=j > 0)
            return
        Cq, Ckv = self.cfg.n_embd_q, self.cfg.n_embd_kv
        dqkv = self._fused_rows(Cq + 2 * Ckv)
        dqkv[:, :Cq], dqkv[:, Cq:Cq + Ckv], dqkv[:, Cq + Ckv:] = dq, dk, self.dv
        self.linear_backward(self.dxn, dqkv, xn, p + "attn_qkv.weight", accumulate=False)

    def _gate_up_forward(self, a: LayerActs, xn: np.ndarray, p: str) -> None:
        if not self.cfg.spec.fused_gate_up:
            self.linear(a.g, xn, p + "ffn_gate.weight")
            self.linear(a.u, xn, p + "ffn_up.weight")
            return
        F = self.cfg.n_ff
        gu = self.linear(self._fused_rows(2 * F), xn, p + "ffn_up.weight")
        a.g[...], a.u[...] = gu[:, :F], gu[:, F:]

    def _gate_up_backward(self, xn: np.ndarray, p: str) -> None:
        """self.dxn = dL/dxn from dg, du."""
        if not self.cfg.spec.fused_gate_up:
            self.linear_backward(self.dxn, self.dg, xn, p + "ffn_gate.weight", accumulate=False)
            self.linear_backward(self.dxn, self.du, xn, p + "ffn_up.weight", accumulate=True)
            return
        F = self.cfg.n_ff
        dgu = self._fused_rows(2 * F)
        dgu[:, :F], dgu[:, F:] = self.dg, self.du
        self.linear_backward(self.dxn, dgu, xn, p + "ffn_up.weight", accumulate=False)

    # ------------------------------------------------------------------ forward
    def _embd_scale(self):
        """gemma's embedding scale, sqrtf(n_embd) in f32 (as llama.cpp's ggml_scale)."""
        return self.tmp.dtype.type(np.sqrt(np.float32(self.cfg.n_embd)))

    def _embed(self, tokens: np.ndarray, x: np.ndarray) -> None:
        self.base.embed(tokens, x)
        t = self.lora.get("token_embd.weight")
        if t is not None:
            x += self.xp.matmul(t.scale * self.params[t.a][tokens], self.params[t.b].T, out=self._scratch(*x.shape))
        if self.cfg.spec.embd_scale:
            x *= self._embd_scale()

    def _gate(self):
        """The feed-forward gate's (forward, backward) kernels: SwiGLU or GeGLU (Arch.activation)."""
        if self.cfg.spec.activation == "gelu":
            return self.ops.geglu.geglu_forward, self.ops.geglu.geglu_backward
        return self.ops.swiglu.swiglu_forward, self.ops.swiglu.swiglu_backward

    def _head_norm(self, y: np.ndarray, rstd: np.ndarray, x: np.ndarray, name: str) -> None:
        """y = RMSNorm of every head of x (N, H*HS) with one (HS,) weight (qk_norm)."""
        HS = self.cfg.head_dim
        self.ops.rmsnorm.rmsnorm_forward(y.reshape(-1, HS), rstd, x.reshape(-1, HS), self._norm_weight(name),
                                         self.cfg.norm_eps)

    def _head_norm_backward(self, dx: np.ndarray, dy: np.ndarray, x: np.ndarray, rstd: np.ndarray,
                            name: str) -> None:
        HS = self.cfg.head_dim
        dw = self.dnorm[:HS]
        dw.fill(0.0)
        self.ops.rmsnorm.rmsnorm_backward(dx.reshape(-1, HS), dw, dy.reshape(-1, HS), x.reshape(-1, HS),
                                          self._norm_weight(name), rstd)
        self._norm_grad(name, dw)

    def _layer_forward(self, i: int, x_out: np.ndarray) -> None:
        cfg, a, p = self.cfg, self.layers[i], f"blk.{i}."
        B, T = self.B, self.T
        cos, sin = self.ropes[cfg.rope_set(i)]
        xn = self.xn if a.xn1 is None else a.xn1
        self.ops.rmsnorm.rmsnorm_forward(xn, a.rstd1, a.x, self._norm_weight(p + "attn_norm.weight"), cfg.norm_eps)
        if cfg.spec.qk_norm:
            self._qkv_forward(a.qp, a.kp, a.v, xn, p)
            self._head_norm(a.q, a.rstd_q, a.qp, p + "attn_q_norm.weight")
            self._head_norm(a.k, a.rstd_k, a.kp, p + "attn_k_norm.weight")
        else:
            self._qkv_forward(a.q, a.k, a.v, xn, p)
        q4 = a.q.reshape(B, T, cfg.n_head, cfg.head_dim)
        k4 = a.k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        self.ops.rope.rope_forward(q4, q4, cos, sin, cfg.n_rot, cfg.rope_mode)
        self.ops.rope.rope_forward(k4, k4, cos, sin, cfg.n_rot, cfg.rope_mode)
        self.ops.attention.attention_forward(a.att.reshape(q4.shape), a.lse, q4, k4,
                                    a.v.reshape(k4.shape), 0, segments=self.segments, **cfg.attention_options(i))
        if cfg.spec.post_norms:
            self.linear(a.o, a.att, p + "attn_output.weight")
            self.ops.rmsnorm.rmsnorm_forward(a.x_mid, a.rstd_o, a.o, self._norm_weight(p + "post_attention_norm.weight"),
                                             cfg.norm_eps)
        else:
            self.linear(a.x_mid, a.att, p + "attn_output.weight")
        a.x_mid += a.x
        xn = self.xn if a.xn2 is None else a.xn2
        self.ops.rmsnorm.rmsnorm_forward(xn, a.rstd2, a.x_mid, self._norm_weight(p + "ffn_norm.weight"), cfg.norm_eps)
        self._gate_up_forward(a, xn, p)
        h = self.h if a.h is None else a.h
        self._gate()[0](h, a.g, a.u)
        if cfg.spec.post_norms:
            self.linear(a.f, h, p + "ffn_down.weight")
            self.ops.rmsnorm.rmsnorm_forward(x_out, a.rstd_f, a.f, self._norm_weight(p + "post_ffw_norm.weight"),
                                             cfg.norm_eps)
        else:
            self.linear(x_out, h, p + "ffn_down.weight")
        x_out += a.x_mid

    def _head(self, targets: np.ndarray, weights: np.ndarray, backward: bool = True) -> float:
        """Output norm, logits, loss and (backward) the gradient back to the last layer's
        output (left in self.dx), chunk by chunk of tokens; inside a chunk the head W (V, C)
        is expanded `head_rows` rows at a time, once for the logits and once for the
        gradient to the chunk's input (the block still expanded is used first).
        Only the tokens with a target (>= 0) go through the head: the others (prompts
        and padding of chat data, trained on answers only) have loss 0 and gradient 0,
        so their normed inputs are first gathered into the rows of self.dx, idle until
        the norm's backward fills it, and their input gradients scattered back over
        zeros in self.xn. Returns sum(weights * loss)."""
        cfg, xp, N, V, C = self.cfg, self.xp, self.N, self.cfg.n_vocab, self.cfg.n_embd
        wn = self._norm_weight("output_norm.weight")
        self.ops.rmsnorm.rmsnorm_forward(self.xn, self.rstd_f, self.x_final, wn, cfg.norm_eps)
        scored = xp.flatnonzero(targets >= 0)
        M = int(scored.shape[0])
        if M < N:                                            # compact: row k is token scored[k]
            xn, dxn, losses = self.dx[:M], self.dxn[:M], self.losses[:M]
            xp.take(self.xn, scored, axis=0, out=xn)
            targets, weights = targets[scored], weights[scored]
        else:
            xn, dxn, losses = self.xn, self.dxn, self.losses
        chunk = even_chunk(M, self.chunk)
        t = self.lora.get("output.weight")
        dW = self._weight_grad("output.weight")
        blocks = [(lo, min(V, lo + self.head_rows)) for lo in range(0, V, self.head_rows)]
        held = [None, None]                                  # (block, its expanded rows)

        def rows(block):
            if held[0] != block:
                held[:] = block, self.base.matrix_rows("output.weight", *block)
            return held[1]
        for lo in range(0, M, chunk):
            hi = min(M, lo + chunk)
            x, logits, dx = xn[lo:hi], self.logits[: hi - lo], dxn[lo:hi]
            if t is not None:
                xa = x @ self.params[t.a].T                  # (n, r)
                sxa, Bt = t.scale * xa, self.params[t.b]
            for vlo, vhi in blocks:
                xp.matmul(x, rows((vlo, vhi)).T, out=logits[:, vlo:vhi])
                if t is not None:
                    logits[:, vlo:vhi] += xp.matmul(sxa, Bt[vlo:vhi].T, out=self._head_scratch(hi - lo, vhi - vlo))
            if cfg.final_softcap:                            # cap * tanh(logits / cap), in place
                self.ops.softcap.softcap_forward(logits, logits, cfg.final_softcap)
            if not backward:                                 # the step's kernel: the same losses bit for bit
                self.ops.cross_entropy.cross_entropy_forward_backward(
                    losses[lo:hi], logits, logits, targets[lo:hi], weights[lo:hi])  # gradient dropped
                continue
            if cfg.final_softcap:                            # d(capped) aside, then back through the cap
                dcap = self.dlogits[: hi - lo]
                self.ops.cross_entropy.cross_entropy_forward_backward(losses[lo:hi], dcap, logits,
                                                                      targets[lo:hi], weights[lo:hi])
                self.ops.softcap.softcap_backward(logits, dcap, logits, cfg.final_softcap)
            else:
                self.ops.cross_entropy.cross_entropy_forward_backward(losses[lo:hi], logits, logits,
                                                                      targets[lo:hi], weights[lo:hi])
            for j, (vlo, vhi) in enumerate(reversed(blocks)):
                W, g = rows((vlo, vhi)), logits[:, vlo:vhi]
                if j == 0:
                    xp.matmul(g, W, out=dx)
                else:
                    dx += xp.matmul(g, W, out=self._scratch(hi - lo, C))
                if dW is not None:
                    dW[vlo:vhi] += xp.matmul(g.T, x, out=self._head_scratch(vhi - vlo, C))
            if t is not None:
                self._lora_backward(t, logits, x, xa, dx)
        loss = float(xp.dot(losses.astype(np.float64), weights.astype(np.float64)))
        if M < N:                                            # the tokens without a target: loss 0
            kept = losses.copy()
            self.losses.fill(0.0)
            self.losses[scored] = kept
        if backward:
            if M < N:                                        # and gradient 0
                dxn = self.xn
                dxn.fill(0.0)
                dxn[scored] = self.dxn[:M]
            self.dnorm.fill(0.0)
            self.ops.rmsnorm.rmsnorm_backward(self.dx, self.dnorm, dxn, self.x_final, wn, self.rstd_f)
            self._norm_grad("output_norm.weight", self.dnorm)
        return loss

    # ------------------------------------------------------------------ backward
    def _layer_backward(self, i: int) -> None:
        """In: self.dx = dL/d(layer output). Out: self.dx = dL/d(layer input)."""
        cfg, a, p = self.cfg, self.layers[i], f"blk.{i}."
        B, T = self.B, self.T
        dx_out = self.dx
        gate_forward, gate_backward = self._gate()
        # ---- feed-forward
        if a.h is None:
            gate_forward(self.h, a.g, a.u)
        h = self.h if a.h is None else a.h
        self.linear_backward(self.dh, self._post_norm_backward(dx_out, a.f, a.rstd_f, p + "post_ffw_norm.weight"),
                             h, p + "ffn_down.weight", accumulate=False)
        gate_backward(self.dg, self.du, self.dh, a.g, a.u)
        wn2 = self._norm_weight(p + "ffn_norm.weight")
        if a.xn2 is None:
            self.ops.rmsnorm.rmsnorm_forward(self.xn, a.rstd2, a.x_mid, wn2, cfg.norm_eps)
        xn2 = self.xn if a.xn2 is None else a.xn2
        self._gate_up_backward(xn2, p)
        self.dnorm.fill(0.0)
        self.ops.rmsnorm.rmsnorm_backward(self.dx2, self.dnorm, self.dxn, a.x_mid, wn2, a.rstd2)
        self._norm_grad(p + "ffn_norm.weight", self.dnorm)
        dx_mid = dx_out
        dx_mid += self.dx2                                   # residual: dL/d(x_mid)
        # ---- attention
        self.linear_backward(self.datt, self._post_norm_backward(dx_mid, a.o, a.rstd_o, p + "post_attention_norm.weight"),
                             a.att, p + "attn_output.weight", accumulate=False)
        q4 = a.q.reshape(B, T, cfg.n_head, cfg.head_dim)
        k4 = a.k.reshape(B, T, cfg.n_head_kv, cfg.head_dim)
        dq4, dk4 = self.dq.reshape(q4.shape), self.dk.reshape(k4.shape)
        self.ops.attention.attention_backward(dq4, dk4, self.dv.reshape(k4.shape), self.datt.reshape(q4.shape),
                                     q4, k4, a.v.reshape(k4.shape), a.att.reshape(q4.shape), a.lse,
                                     segments=self.segments, **cfg.attention_options(i))
        cos, sin = self.ropes[cfg.rope_set(i)]
        self.ops.rope.rope_backward(dq4, dq4, cos, sin, cfg.n_rot, cfg.rope_mode)
        self.ops.rope.rope_backward(dk4, dk4, cos, sin, cfg.n_rot, cfg.rope_mode)
        dq, dk = self.dq, self.dk
        if cfg.spec.qk_norm:                                  # back through the per-head norms
            self._head_norm_backward(self.dqp, dq, a.qp, a.rstd_q, p + "attn_q_norm.weight")
            self._head_norm_backward(self.dkp, dk, a.kp, a.rstd_k, p + "attn_k_norm.weight")
            dq, dk = self.dqp, self.dkp
        wn1 = self._norm_weight(p + "attn_norm.weight")
        if a.xn1 is None:
            self.ops.rmsnorm.rmsnorm_forward(self.xn, a.rstd1, a.x, wn1, cfg.norm_eps)
        xn1 = self.xn if a.xn1 is None else a.xn1
        self._qkv_backward(dq, dk, xn1, p)
        self.dnorm.fill(0.0)
        self.ops.rmsnorm.rmsnorm_backward(self.dx2, self.dnorm, self.dxn, a.x, wn1, a.rstd1)
        self._norm_grad(p + "attn_norm.weight", self.dnorm)
        self.dx += self.dx2                                   # residual: dL/d(layer input)

    def _post_norm_backward(self, dy: np.ndarray, y_in: np.ndarray | None, rstd: np.ndarray | None,
                            name: str) -> np.ndarray:
        """Gradient through a sandwich norm (post_norms): dL/d(its input) into self.dx2, or
        dy itself when the layer has none."""
        if y_in is None:
            return dy
        self.dnorm.fill(0.0)
        w = self._norm_weight(name)
        self.ops.rmsnorm.rmsnorm_backward(self.dx2, self.dnorm, dy, y_in, w, rstd)
        self._norm_grad(name, self.dnorm)
        return self.dx2

    def _embed_backward(self, tokens: np.ndarray) -> None:
        dx = self.dx
        if self.cfg.spec.embd_scale:
            dx *= self._embd_scale()
        dE = self._weight_grad("token_embd.weight")
        if dE is not None:
            self.backend.scatter_add(dE, tokens, dx)
        t = self.lora.get("token_embd.weight")
        if t is not None:
            A, B = self.params[t.a], self.params[t.b]
            self.params.grad_of(t.b)[...] += t.scale * (dx.T @ A[tokens])
            self.backend.scatter_add(self.params.grad_of(t.a), tokens, t.scale * (dx @ B))

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
        g = self._trimmed_graphs.get(T)
        if g is None:
            g = self._trimmed_graphs[T] = Graph(self.cfg, self.base, self.params, list(self.lora.values()), self.B, T,
                                                self.mode, self.dropout, self.tmp.dtype, self.backend, within=self)
        g.dropout, g.merge_lora = self.dropout, self.merge_lora

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
        self.step_key = tuple(int(k) for k in key)
        tokens, tg, w = self._forward(inputs, targets, weights, positions, segments)
        loss = self._head(tg, w)
        for i in reversed(range(self.cfg.n_layer)):
            if self.mode == "layer" and i + 1 < self.cfg.n_layer:   # the last layer's are still there
                self._layer_forward(i, self.dx2)                    # recompute; its output is not needed
            self._layer_backward(i)
        self._embed_backward(tokens)
        return loss

    def loss(self, inputs: np.ndarray, targets: np.ndarray, weights: np.ndarray,
             positions: np.ndarray | None = None, segments: np.ndarray | None = None) -> float:
        """Forward only, for evaluation: sum(weights * loss) of one micro-batch (arguments as
        in `step`), without dropout; no gradient is computed and params.grad is untouched."""
        dropout, self.dropout = self.dropout, 0.0
        try:
            return self._trimmed(lambda g, *batch: g._head(*g._forward(*batch)[1:], backward=False),
                                 inputs, targets, weights, positions, segments)
        finally:
            self.dropout = dropout

    def _forward(self, inputs, targets, weights, positions, segments):
        """Set the step's rope positions and segments, upload one micro-batch and run
        embedding and layers; returns the device arrays (tokens, targets, weights), (N,)."""
        self._set_packing(positions, segments)
        to_device = self.backend.to_device
        tokens = to_device(np.asarray(inputs, np.int64).reshape(-1))
        tg = to_device(np.asarray(targets, np.int64).reshape(-1))
        w = to_device(np.asarray(weights, self.tmp.dtype).reshape(-1))
        self._embed(tokens, self.layers[0].x)
        for i in range(self.cfg.n_layer):
            x_out = self.layers[i + 1].x if i + 1 < self.cfg.n_layer else self.x_final
            self._layer_forward(i, x_out)
        return tokens, tg, w
