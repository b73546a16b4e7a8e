"""Every buffer a training graph allocates, planned before anything is allocated.

`step_plan` is the one plan of a step's memory (`StepPlan`): `buffer_plan`'s list of
every buffer by name and shape, which `carve` cuts out of one arena, the head's chunk,
the bf16 operand copies of the products and the head's kept bf16 copy. The graph
allocates from it and the estimate (train/memory.py) sums it, so the two cannot drift.
The buffers:
  - `blk.I.*`: the activations layer I keeps for backward (models/parts.layer_act_shapes:
    `blk.I.x`, `blk.I.x_mid` and each part's as `blk.I.<kind>.<name>`);
  - `layer.*`: checkpointing mode `layer` keeps only each layer's input and recomputes
    the rest into this one set, shared by all layers;
  - `xa.*`: x A^T of each adapter on a matrix inside a layer (kept for backward);
  - with bf16 products (`bf16_saved`), the activations a part lists in its `bf16_saved`
    (the feed-forward's gate inputs g and u) are kept as bf16 bits (`Bf16`: uint16 views,
    half the floats): what PyTorch's bf16 training keeps, and half of a layer's saved
    activations at the usual widths;
  - the rest is scratch reused by every layer. The layer backward's gradients share one
    buffer with the output head's logits chunk (`grad_scratch`: the head runs before any
    layer backward), so a larger chunk of tokens costs no memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.moe import scratch_shapes
from ..models.arch import layer_matrix_shapes
from ..models.config import ModelConfig
from ..models.parts import fused_width, layer_act_shapes, layer_parts
from ..models.products import adapter_extension, bf16_bytes
from ..precision import F32, ComputePolicy
from .lora import LoraTarget

HEAD_CHUNK_BYTES = 32 << 20   # logits computed at least this many bytes at a time,
HEAD_CHUNK_TOKENS = 128       # and for at least this many tokens (large vocabularies)
MODES = ("layer", "selective", "none")   # --checkpointing, least memory first
LORA_VECTOR_KINDS = ("output_norm", "output", "token_embd")   # with the layers' norms: no (N, r) x A^T buffer


class Bf16(tuple):
    """The shape of a buffer held as bf16 bits (uint16) in the float32 arena."""


def floats(shape: tuple[int, ...]) -> int:
    """Arena floats a planned buffer takes (a Bf16 one half its elements, rounded up)."""
    n = int(np.prod(shape, dtype=np.int64))
    return -(-n // 2) if isinstance(shape, Bf16) else n


def has_xa(cfg: ModelConfig, kind: str) -> bool:
    """Whether an adapter on `kind` keeps an (N, r) x A^T buffer (matrices inside a layer)."""
    return kind not in LORA_VECTOR_KINDS and kind not in cfg.spec.norms and kind not in cfg.spec.experts


def checkpointing_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"checkpointing {mode!r}: choose one of {MODES}")
    return mode


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
                trainable: bool, bf16_saved: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every array a StepExecutor allocates (it allocates exactly these);
    `bf16_saved`: the parts' bf16_saved activations as bf16 bits (Bf16 shapes)."""
    mode = checkpointing_mode(mode)
    N, C, F, Cq = B * T, cfg.n_embd, cfg.n_ff, cfg.n_embd_q
    plan: dict[str, tuple[int, ...]] = {}
    layers = layer_parts(cfg)
    held = {f"{part.kind}.{k}" for parts in layers for part in parts for k in part.bf16_saved} if bf16_saved else ()
    for i, parts in enumerate(layers):
        kept = {f"{part.kind}.{k}" for part in parts for k in getattr(part, "kept", ())}   # read by later layers
        for k, shape in layer_act_shapes(parts, B, T, keep_inputs=mode == "none").items():
            if k in held:
                shape = Bf16(shape)
            if mode != "layer" or k == "x" or k in kept:
                plan[f"blk.{i}.{k}"] = shape
            else:                       # one set for every layer: the largest where widths differ (flat)
                plan[f"layer.{k}"] = widest(plan.get(f"layer.{k}"), shape)
    plan |= {"x_final": (N, C), "rstd_f": (N,)}                     # output of the last layer, its norm
    for t in targets:                                              # x A^T of each adapter (shared per kind
        if has_xa(cfg, t.kind):                                    # in layer mode: recomputed with the layer)
            plan[f"xa.{t.kind}.{t.rank}" if mode == "layer" else f"xa.{t.weight}"] = (N, t.rank)
    if cfg.n_expert:
        plan |= expert_plan(cfg, targets, N, mode)
    for src in cfg.kv_sources:                                     # gemma4: the gradients shared-KV
        Ckv = cfg.layer(src).n_embd_kv                             # layers send their source
        plan |= {f"kv_grad.{src}.k": (N, Ckv), f"kv_grad.{src}.v": (N, Ckv)}
    if cfg.n_embd_per_layer:                                       # gemma4's per-layer embeddings
        L, P = cfg.n_layer, cfg.n_embd_per_layer
        plan |= {"ple.inputs": (L, N, P), "ple.proj": (N, L * P), "ple.rstd": (N * L,), "ple.d": (L, N, P)}
    room = sum(n * m for n, m in grad_scratch(cfg, N, mode).values())
    per_token = head_floats(cfg)
    chunk = head_chunk(N, per_token, room)
    mats = layer_matrix_shapes(cfg)
    plan |= {"xn": (N, C), "dx": (N, C), "dxn": (N, C),
             "grads_logits": (max(room, chunk * per_token),),        # grad_scratch, or the head's chunk
             "tmp": (N * max(C, F, Cq, *(max(s) for s in mats)),), "dnorm": (max(C, 2 * cfg.head_dim),), "losses": (N,),
             "rope_cos": (T, rope_half(cfg, 0)), "rope_sin": (T, rope_half(cfg, 0))}
    if cfg.spec.qk_norm_full:                                      # olmo2: its q/k norms' weight gradient
        plan["dnorm_qk"] = (Cq,)
    if fused_width(layers):                                        # a fused product, or its gradient,
        plan["fused"] = (N * fused_width(layers),)                 # before it is split / after it is joined
    for j in range(1, len(cfg.rope_sets)):                         # layers with another rope base
        plan |= {f"rope_cos.{j}": (T, rope_half(cfg, j)), f"rope_sin.{j}": (T, rope_half(cfg, j))}
    if cfg.spec.qk_norm:
        plan |= {"dqp": (N, Cq), "dkp": (N, cfg.n_embd_kv)}
    head_tmp = 0                                                   # products added to a block in the head
    if any(t.kind == "output" for t in targets):
        head_tmp = chunk * head_rows                               # (chunk, rows) LoRA share of the logits
    if trainable:                                                  # weight gradients before they are added
        head_tmp = max(head_tmp, head_rows * C, *(o * i for o, i in mats))
    if head_tmp:
        plan["head_tmp"] = (head_tmp,)
    return plan


def rope_half(cfg: ModelConfig, j: int) -> int:
    """Columns of rope set j's cos / sin tables: half its rotated dimensions."""
    return cfg.rope_rot(cfg.rope_sets[j]) // 2


def widest(planned: tuple[int, ...] | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a buffer every layer uses: `shape` where all layers have it, else one
    flat buffer of the most elements (shared_view gives each layer its shape of it)."""
    if planned is None or planned == shape:
        return shape
    n = max(int(np.prod(planned)), int(np.prod(shape)))
    return Bf16((n,)) if isinstance(shape, Bf16) else (n,)


def shared_view(buffer, shape):
    """A layer's view of a buffer every layer uses (None: none), at its own `shape`."""
    if buffer is None or shape is None or buffer.shape == tuple(shape):
        return buffer
    return buffer.reshape(-1)[: int(np.prod(shape))].reshape(shape)


def expert_plan(cfg: ModelConfig, targets: list[LoraTarget], N: int, mode: str) -> dict[str, tuple[int, ...]]:
    """A mixture of experts' rows, P = N k (token, slot) pairs sorted by expert: the
    experts' scratch every layer reuses (kernels/moe.py scratch_shapes, `moe.<name>`) and
    x A^T of each expert adapter (P, r), kept per layer (shared in layer mode). The
    dequantized expert takes the dequantizer's scratch; the kept probs, w, g, u are the
    part's activations (models/parts.MoeFeedForward)."""
    P = N * cfg.n_expert_used
    plan = {f"moe.{k}": s for k, s in scratch_shapes(P, cfg.n_embd, cfg.n_ff_exp).items()}
    for t in targets:
        if t.kind in cfg.spec.experts:
            plan[f"moe.xa.{t.kind}.{t.rank}" if mode == "layer" else f"moe.xa.{t.weight}"] = (P, t.rank)
    return plan


def blocked_head(cfg, adapted: bool, trained: bool) -> bool:
    """Whether the head's chunks go through LossHead._bf16_chunk when its products are
    bf16: no adapter on the head, the head frozen, no final soft-cap or logit scale."""
    return not (adapted or trained or cfg.final_softcap or cfg.logit_scale)


def kept_head_bytes(cfg, chunk: int) -> int:
    """Bytes of the head's whole bf16 copy that training with bf16 products keeps
    (FrozenBase.keep_bf16) where it takes at most half of a chunk's logits (n_embd <=
    chunk): each chunk then multiplies it as is, where it would expand every block
    twice (bench shape: 8 expansions of the Q4_K head, 39 ms of a 1.5 s step); 0 where
    it would take more (larger widths expand it once per chunk of tokens, as before)."""
    return 2 * cfg.n_vocab * cfg.n_embd if cfg.n_embd <= chunk else 0


def gpu_bf16_bytes(cfg, N: int, chunk: int, head_rows: int) -> int:
    """Bytes of the bf16 operand copies a GPU's bf16 products keep (kernels/cuda/bf16.py
    CudaBf16Products): the rounded activation of the widest product (N tokens x a layer
    matrix's widest side, or the head's chunk x its block of logit gradient) and the
    shared normed input (N x n_embd)."""
    widest = max(cfg.n_embd, cfg.n_ff, cfg.n_embd_q, *(max(o, i) for o, i in layer_matrix_shapes(cfg)))
    return 2 * (max(N * widest, chunk * head_rows) + N * cfg.n_embd)


def adapters_extension(cfg: ModelConfig, targets: list[LoraTarget], policy: ComputePolicy, dropout: float) -> int:
    """Columns (or rows) the adapters riding in bf16 products add to their operands
    (train.linear.LoraLinears.in_product: the policy's choice, no dropout)."""
    if dropout > 0 or not policy.adapters_in_products:
        return 0
    return max((adapter_extension(t.rank) for t in targets if has_xa(cfg, t.kind)), default=0)


@dataclass(frozen=True)
class StepPlan:
    """The memory of one training step of a (B, T) shape: what the graph allocates and
    takes from here, and what the estimate adds up."""
    buffers: dict[str, tuple[int, ...]]   # name -> shape of every array the graph allocates (buffer_plan)
    chunk: int                            # tokens of the head computed at a time (head_chunk)
    extension: int                        # operand columns of the adapters in bf16 products
    bf16_copies: int                      # bytes of the products' bf16 operand copies (host or GPU)
    kept_head: int                        # bytes of the head's whole bf16 copy kept (the CPU's bf16; 0: none)

    @property
    def buffer_bytes(self) -> int:
        return plan_bytes(self.buffers)


def step_plan(cfg: ModelConfig, targets: list[LoraTarget], B: int, T: int, mode: str, head_rows: int,
              trainable: bool, policy: ComputePolicy = F32, device: bool = False, dropout: float = 0.0) -> StepPlan:
    """The plan of a step (StepPlan): the buffers (a CPU's bf16 products keep the
    parts' bf16_saved activations as bf16; a GPU's keeps float32 activations and bf16
    operand copies), the head's chunk in the room of the backward's scratch, and the
    bf16 copies of the products (models/products.bf16_bytes, gpu_bf16_bytes)."""
    N = B * T
    buffers = buffer_plan(cfg, targets, B, T, mode, head_rows, trainable, bf16_saved=policy.host_bf16)
    chunk = head_chunk(N, head_floats(cfg), sum(n * m for n, m in grad_scratch(cfg, N, mode).values()))
    extension = adapters_extension(cfg, targets, policy, dropout)
    copies = kept = 0
    if policy.dtype == "bf16" and device:
        copies += gpu_bf16_bytes(cfg, N, chunk, head_rows)
    if policy.host_bf16:
        adapted = any(t.kind == "output" for t in targets)
        copies += bf16_bytes(cfg, N, head_rows, chunk, blocked_head(cfg, adapted, trainable), extension)
        kept = kept_head_bytes(cfg, chunk)
    return StepPlan(buffers, chunk, extension, copies, kept)


def plan_bytes(plan: dict[str, tuple[int, ...]], itemsize: int = 4) -> int:
    return sum(floats(s) for s in plan.values()) * itemsize


def carve(plan: dict[str, tuple[int, ...]], arena: np.ndarray) -> dict[str, np.ndarray]:
    """Name -> view of `arena`, the plan's buffers laid end to end (the rope tables excepted:
    their values are set per graph, see StepExecutor)."""
    buf, at = {}, 0
    for name, shape in plan.items():
        if name.startswith("rope_"):
            continue
        n = floats(shape)
        if isinstance(shape, Bf16):
            buf[name] = arena[at: at + n].view(np.uint16)[: int(np.prod(shape))].reshape(shape)
        else:
            buf[name] = arena[at: at + n].reshape(shape)
        at += n
    return buf


def arena_size(plan: dict[str, tuple[int, ...]]) -> int:
    return sum(floats(s) for k, s in plan.items() if not k.startswith("rope_"))
