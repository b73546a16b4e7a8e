"""Every buffer a training graph allocates, planned before anything is allocated.

`buffer_plan` lists them by name and shape (the memory estimate, train/memory.py,
counts exactly this list) and `carve` cuts them out of one arena:
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

import numpy as np

from ..models.arch import layer_matrix_shapes
from ..models.config import ModelConfig
from ..models.parts import fused_width, layer_act_shapes, layer_parts
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
    return kind not in LORA_VECTOR_KINDS and kind not in cfg.spec.norms


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
    """Name -> shape of every array a Graph allocates (it allocates exactly these);
    `bf16_saved`: the parts' bf16_saved activations as bf16 bits (Bf16 shapes)."""
    mode = checkpointing_mode(mode)
    N, C, F, Cq = B * T, cfg.n_embd, cfg.n_ff, cfg.n_embd_q
    plan: dict[str, tuple[int, ...]] = {}
    layers = layer_parts(cfg)
    held = {f"{part.kind}.{k}" for parts in layers for part in parts for k in part.bf16_saved} if bf16_saved else ()
    for i, parts in enumerate(layers):
        for k, shape in layer_act_shapes(parts, B, T, keep_inputs=mode == "none").items():
            if k in held:
                shape = Bf16(shape)
            plan[f"blk.{i}.{k}" if mode != "layer" or k == "x" else f"layer.{k}"] = shape
    plan |= {"x_final": (N, C), "rstd_f": (N,)}                     # output of the last layer, its norm
    for t in targets:                                              # x A^T of each adapter (shared per kind
        if has_xa(cfg, t.kind):                                    # in layer mode: recomputed with the layer)
            plan[f"xa.{t.kind}.{t.rank}" if mode == "layer" else f"xa.{t.weight}"] = (N, t.rank)
    room = sum(n * m for n, m in grad_scratch(cfg, N, mode).values())
    per_token = head_floats(cfg)
    chunk = head_chunk(N, per_token, room)
    mats = layer_matrix_shapes(cfg)
    plan |= {"xn": (N, C), "dx": (N, C), "dxn": (N, C),
             "grads_logits": (max(room, chunk * per_token),),        # grad_scratch, or the head's chunk
             "tmp": (N * max(C, F, Cq, *(max(s) for s in mats)),), "dnorm": (max(C, 2 * cfg.head_dim),), "losses": (N,),
             "rope_cos": (T, cfg.n_rot // 2), "rope_sin": (T, cfg.n_rot // 2)}
    if fused_width(layers):                                        # a fused product, or its gradient,
        plan["fused"] = (N * fused_width(layers),)                 # before it is split / after it is joined
    for j in range(1, len(cfg.rope_sets)):                         # layers with another rope base
        plan |= {f"rope_cos.{j}": (T, cfg.n_rot // 2), f"rope_sin.{j}": (T, cfg.n_rot // 2)}
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


def plan_bytes(plan: dict[str, tuple[int, ...]], itemsize: int = 4) -> int:
    return sum(floats(s) for s in plan.values()) * itemsize


def carve(plan: dict[str, tuple[int, ...]], arena: np.ndarray) -> dict[str, np.ndarray]:
    """Name -> view of `arena`, the plan's buffers laid end to end (the rope tables excepted:
    their values are set per graph, see Graph)."""
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
