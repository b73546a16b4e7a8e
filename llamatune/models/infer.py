"""Inference: tokens (B, T) -> logits (B, T, V) in f32, with a KV cache.

The blocks are `forward.Forward`'s, the same code training runs; this module adds
what inference has and training has not: a KV cache (each call appends its keys and
values and attends over the cache), runtime adapters (as llama.cpp applies them with
--lora / --lora-scaled: `scale · (x A^T) B^T` on each matmul, several per weight,
norm adapters skipped) and the full logits. Nothing is kept for a backward: one set
of activations serves every layer and the residual stream is updated in place.
Matmuls run on one weight at a time dequantized into a scratch buffer
(weights.FrozenBase), the output head in row blocks; the final norm and gemma2's
logit soft-cap as llama.cpp's graph. A decode step (one token for each of up to 16
sequences, on the CPU) multiplies the quantized weights on their blocks instead, with
8-bit activations as llama.cpp does (kernels/qdot.py, `Runner.quantized_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from ..backend import Backend, cpu
from ..formats.adapter import RuntimeAdapters
from ..precision import F32, ComputePolicy
from .deltanet_mixer import MixerShape, RecurrentState
from .forward import Forward, Linears
from .model import Model
from .parts import fused_width, layer_act_shapes, layer_acts
from .rope import rope_cache
from .weights import FrozenBase


@dataclass
class KVCache:
    k: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    v: list[np.ndarray]   # per layer (B, S_max, NKV, HS)
    n_past: int = 0
    context: int = 0      # the context size rope factors are chosen for (llama.cpp's n_ctx); 0: n_ctx
    # per layer: a gated delta-net layer's conv and delta state (qwen35), which it has instead of k, v
    recurrent: list[RecurrentState | None] = field(default_factory=list)

    @classmethod
    def empty(cls, model: Model, batch: int, n_ctx: int, backend: Backend | None = None,
              context: int = 0) -> "KVCache":
        c, xp = model.config, (backend or cpu()).xp
        attends = [not c.is_recurrent(i) for i in range(c.n_layer)]
        # per layer (its own kv heads and head size: gemma4); none where a layer has no keys and
        # values of its own (a delta-net layer, or one sharing an earlier layer's)
        shapes = [(batch, n_ctx, c.layer(i).n_head_kv, c.layer(i).head_dim) if a and c.has_kv(i)
                  else (batch, n_ctx, 0, 0) for i, a in enumerate(attends)]
        states = [None if a else RecurrentState.empty(MixerShape.of(c), batch) for a in attends]
        return cls([xp.zeros(s, np.float32) for s in shapes], [xp.zeros(s, np.float32) for s in shapes],
                   context=context, recurrent=states)

    @property
    def n_ctx(self) -> int:
        return self.k[0].shape[1]

    def rows(self, idx) -> "KVCache":
        """A new cache of the sequences `idx` (a device index array; repeats copy a row):
        keys, values and the delta-net layers' states."""
        return KVCache([k[idx] for k in self.k], [v[idx] for v in self.v], self.n_past, self.context,
                       [None if s is None else RecurrentState(s.conv[idx], s.delta[idx]) for s in self.recurrent])


class QuantizedRows(NamedTuple):
    """Rows of a base matrix left in their GGUF blocks, for kernels/qdot.py."""
    data: np.ndarray      # (n_rows, row_bytes) uint8
    qtype: int


class Runner(Forward):
    """Runs the forward pass of one model (optionally with runtime adapters)."""

    quantized_decode = True   # decode steps (one token for each of at most QDOT_MAX_ROWS sequences, on
    QDOT_MAX_ROWS = 16        # the CPU) multiply quantized weights on their blocks, as llama.cpp (qdot.py)
    decoding = False          # whether the forward under way is such a step

    def __init__(self, model: Model, adapters: RuntimeAdapters | None = None, backend: Backend | None = None,
                 policy: ComputePolicy = F32):
        """`policy`: precision.policy's resolution of --compute-dtype (runner.make_runner)."""
        backend = backend or cpu()
        super().__init__(model.config, FrozenBase(model, backend), backend, policy)
        self.model = model
        self.adapters = {name: [(backend.to_device(a), backend.to_device(b), s) for a, b, s in pairs]
                         for name, pairs in (adapters or RuntimeAdapters()).by_weight.items()}
        self.linears = Linears(self, self.adapters)
        self.cache, self.n_past = None, 0
        self._blocks: dict[str, QuantizedRows | None] = {}   # quantized_rows' matrices, by name

    # ---------------------------------------------------- decode steps on the quantized blocks
    def quantized_rows(self, name: str, lo: int, hi: int | None) -> QuantizedRows | None:
        """Rows lo:hi of base matrix `name` in their blocks where this decode step multiplies
        them there (kernels/qdot.py has the type); None: the dequantized path."""
        if not self.decoding:
            return None
        if name not in self._blocks:                  # once a matrix: a decode step asks ~170 times
            from ..kernels.qdot import QDOT_TYPES
            t = self.weights.tensors[name]
            self._blocks[name] = (QuantizedRows(np.asarray(t.raw_rows()), int(t.qtype))
                                  if int(t.qtype) in QDOT_TYPES else None)
        q = self._blocks[name]
        if q is None or (lo == 0 and hi is None):
            return q
        return QuantizedRows(q.data[lo:hi], q.qtype)

    def weight(self, name: str, N: int):
        q = self.quantized_rows(name, 0, None)
        return super().weight(name, N) if q is None else q

    def weight_rows(self, name: str, lo: int, hi: int, N: int):
        q = self.quantized_rows(name, lo, hi)
        return super().weight_rows(name, lo, hi, N) if q is None else q

    def base_product(self, y, x, W) -> None:
        if isinstance(W, QuantizedRows):
            from ..kernels.qdot import qdot_into
            qdot_into(y, x, W.data, W.qtype)
            return
        super().base_product(y, x, W)

    def kv(self, i: int, k, v):
        """Append layer i's keys and values (B, T, NKV, HS) to the cache; attend over all of it."""
        c, n = self.cache, self.n_past
        if c is None:
            return k, v, 0
        T = k.shape[1]
        c.k[i][:, n:n + T] = k
        c.v[i][:, n:n + T] = v
        return c.k[i][:, :n + T], c.v[i][:, :n + T], n

    def layer_activations(self, B: int, T: int) -> list:
        """Each layer's activations (LayerActs) for a call of (B, T) tokens: one set for every
        layer of the same kinds and widths of parts, the residual stream x one for all; a
        layer whose keys and values later layers reuse (gemma4) has a set of its own."""
        sets, x = {}, self.xp.empty((B * T, self.cfg.n_embd), np.float32)
        layers = []
        for i, parts in enumerate(self.layer_parts):
            shapes = layer_act_shapes(parts, B, T)
            key = (tuple(shapes.items()), i if i in self.cfg.kv_sources else None)
            if key not in sets:
                sets[key] = {k: x if k == "x" else self.xp.empty(s, np.float32) for k, s in shapes.items()}
            layers.append(layer_acts(parts, sets[key].get))
        return layers

    def enter_layer(self, i: int) -> None:
        """The gate's output scratch h at layer i's width (layers of several widths: gemma4)."""
        if self.cfg.varies:
            F = self.cfg.layer(i).n_ff
            self.h = self._h.reshape(-1)[: self._h.shape[0] * F].reshape(-1, F)

    def recurrent_state(self, i: int) -> RecurrentState | None:
        """Layer i's conv and delta state in the cache (a gated delta-net layer), None without a cache."""
        return None if self.cache is None else self.cache.recurrent[i]

    def head(self, x):
        """logits (N, V) = x W_out^T (+ runtime adapters), the head expanded in row blocks."""
        V, R = self.cfg.n_vocab, self.weights.head_rows
        if self.decoding and self.quantized_rows("output.weight", 0, None) is not None:
            R = V                                 # on its blocks: no scratch to fit, one product
        if self.observer is not None:
            self.observer("output.weight", x)
        logits = self.xp.empty((x.shape[0], V), np.float32)
        adapters = [(s * (x @ a.T), b) for a, b, s in self.adapters.get("output.weight", ())]
        self.head_logits(logits, x, [(lo, min(V, lo + R)) for lo in range(0, V, R)],
                         lambda block: self.weight_rows("output.weight", *block, x.shape[0]), adapters)
        return logits

    def forward(self, tokens: np.ndarray, cache: KVCache | None = None,
                start: tuple[int, np.ndarray] | None = None,
                at_layer: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
        """tokens (B, T) int (host) -> logits (B, T, V) f32 on the backend's device. With a
        cache, the tokens follow the cache's n_past positions and their keys/values are
        appended to it. start = (i, x): begin at layer i with the residual stream x
        (B*T, n_embd) that layer i received (what at_layer(i, x), called before each
        layer, saw), not at the embeddings (calibration.py's later passes)."""
        cfg, xp = self.cfg, self.xp
        tokens = np.asarray(tokens, np.int64)
        B, T = tokens.shape
        N = B * T
        n_past = cache.n_past if cache is not None else 0
        if cache is not None and n_past + T > cache.n_ctx:
            raise ValueError(f"KV cache overflow: {n_past} + {T} > {cache.n_ctx}")
        context = (cache.context or cache.n_ctx) if cache is not None else T   # chooses rope factors
        self.ropes = []                               # one (cos, sin) per distinct layer rope
        for rope in cfg.rope_sets:
            cos, sin = rope_cache(cfg, self.weights, np.arange(n_past, n_past + T, dtype=np.int64), context, rope)
            self.ropes.append((self.backend.to_device(cos), self.backend.to_device(sin)))
        self.cache, self.n_past = cache, n_past
        self.decoding = (self.quantized_decode and cache is not None and T == 1 and B <= self.QDOT_MAX_ROWS
                         and self.backend.name == "cpu")
        layers = self.layer_activations(B, T)
        a = layers[0]                                 # x is updated in place, the same in each
        self.xn, self.h = xp.empty((N, cfg.n_embd), np.float32), xp.empty((N, cfg.n_ff), np.float32)
        self._h = self.h
        self.fused = xp.empty(N * fused_width(self.layer_parts), np.float32)
        try:
            first = 0 if start is None else start[0]
            if start is None:
                self.embed(self.backend.to_device(tokens.reshape(-1)), a.x)
            else:
                if cfg.n_embd_per_layer:                  # gemma4: the layers' per-layer inputs
                    self.embed(self.backend.to_device(tokens.reshape(-1)), a.x)
                a.x[...] = start[1]
            for i in range(first, cfg.n_layer):
                if at_layer is not None:
                    at_layer(i, a.x)
                self.layer_forward(i, layers[i], a.x)
        finally:
            self.cache = None
        rstd = xp.empty(N, np.float32)
        self.ops.rmsnorm.rmsnorm_forward(self.xn, rstd, a.x, self.linears.norm_weight("output_norm.weight"), cfg.norm_eps)
        logits = self.head(self.xn)
        inv_scale = cfg.logit_multiplier(logits.dtype)
        if inv_scale is not None:                 # granite: logits / logit_scale
            logits *= inv_scale
        if cfg.final_softcap:
            self.ops.softcap.softcap_forward(logits, logits, cfg.final_softcap)
        if cache is not None:
            cache.n_past += T
        return logits.reshape(B, T, cfg.n_vocab)
