"""LoRA during training: which weights carry an adapter, their shapes, init and export.

For a frozen weight W (n_out, n_in) an adapter of rank r is A (r, n_in) and
B (n_out, r) and the layer computes, in factored form,

    y = x W^T + s · (dropout(x) A^T) B^T,        s = alpha / r

which equals x · add_cast(W, s·B A)^T without ever forming the (n_out, n_in)
product. Exceptions, as llama.cpp lays them out:
  - token_embd (V, C) is flipped: A (V, r), B (C, r), row t gets s · A[t] B^T;
  - norm weights w (C,) take A (r, C), B (1, r): w' = w + s · (B A)[0].
Init follows PEFT: A ~ U(±1/sqrt(n_in)) (kaiming_uniform with a=sqrt(5)), B = 0;
for the embedding A = 0 and B ~ N(0, 1). Either way B·A = 0, so step 0 equals
the base model.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import LlamatuneError
from ..formats.adapter import LoraAdapter, expected_shapes
from ..models.arch import tensor_shape
from ..models.config import ModelConfig
from .params import ParamBuffer, ParamSpec


@dataclass(frozen=True)
class LoraTarget:
    weight: str                 # base weight name, e.g. "blk.0.attn_q.weight"
    kind: str                   # "attn_q", ..., "token_embd", "output", "attn_norm", ...
    rank: int
    scale: float                # alpha / rank
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]

    @property
    def a(self) -> str:
        return self.weight + ".lora_a"

    @property
    def b(self) -> str:
        return self.weight + ".lora_b"


class Lora:
    """One linear's adapter in a training graph: y += s (x A^T) B^T, s = alpha / r, with A, B
    and their gradients views of the flat ParamBuffer (taken at each use: the buffer may
    move to a GPU after the graph is built). `disabled`: the linear runs as its base
    alone, nothing added and no gradient (DPO's reference model: `disabled_adapters`)."""

    def __init__(self, target: LoraTarget, params: ParamBuffer):
        self.target, self.params, self.disabled = target, params, False
        self.weight, self.kind, self.rank, self.scale = target.weight, target.kind, target.rank, target.scale

    @property
    def a(self):                                   # (r, n_in); token_embd (V, r)
        return self.params[self.target.a]

    @property
    def b(self):                                   # (n_out, r); token_embd (C, r)
        return self.params[self.target.b]

    @property
    def da(self):
        return self.params.grad_of(self.target.a)

    @property
    def db(self):
        return self.params.grad_of(self.target.b)


@contextmanager
def disabled_adapters(adapters):
    """Every Lora of `adapters` switched off inside (the base model alone), back on after."""
    adapters = list(adapters)
    for a in adapters:
        a.disabled = True
    try:
        yield
    finally:
        for a in adapters:
            a.disabled = False


def lora_targets(cfg: ModelConfig, ranks: dict[str, int], alpha: float, tied: bool) -> list[LoraTarget]:
    """Targets in llama.cpp's tensor order; rank 0 means no adapter."""
    if tied and (ranks.get("output", 0) or ranks.get("token_embd", 0)):
        raise LlamatuneError("this model ties output and token_embd (one tensor): llama.cpp would apply a "
                             "token_embd or output adapter to both, so --rank-tok-embd/--rank-out must be 0")
    absent = [k for k, r in ranks.items() if r > 0 and k.endswith("_norm") and k != "output_norm"
              and k not in cfg.spec.norms]
    if absent:
        raise LlamatuneError(f"a {cfg.arch} model has no {', '.join(absent)} tensors: their LoRA rank must be 0")
    names: list[tuple[str, str, tuple[int, ...]]] = [
        ("token_embd.weight", "token_embd", tensor_shape(cfg, "token_embd")),
        ("output_norm.weight", "output_norm", (cfg.n_embd,)),
        ("output.weight", "output", tensor_shape(cfg, "output")),
    ]
    for i in range(cfg.n_layer):                                   # the architecture's layer tensors, file order
        names += [(f"blk.{i}.{k}.weight", k, tensor_shape(cfg.layer(i), k)) for k in cfg.spec.kinds(cfg, i) + cfg.spec.experts
                  if "." not in k and k not in cfg.spec.vectors]
    targets = []
    for weight, kind, shape in names:
        r = ranks.get(kind, 0)
        if r > 0:
            a_shape, b_shape = expected_shapes(weight, shape, r)
            targets.append(LoraTarget(weight, kind, r, alpha / r, a_shape, b_shape))
    return targets


def lora_specs(targets: list[LoraTarget]) -> list[ParamSpec]:
    specs = []
    for t in targets:
        specs += [ParamSpec(t.a, t.a_shape), ParamSpec(t.b, t.b_shape)]
    return specs


def init_lora(params: ParamBuffer, targets: list[LoraTarget], rng: np.random.Generator) -> None:
    """PEFT's init (module docstring); B·A = 0 for every target."""
    for t in targets:
        a, b = params[t.a], params[t.b]
        if t.kind == "token_embd":
            a[...] = 0.0
            b[...] = rng.standard_normal(b.shape, dtype=np.float32)
        else:
            bound = 1.0 / np.sqrt(t.a_shape[-1])           # (an expert tensor's: per expert)
            a[...] = rng.uniform(-bound, bound, size=a.shape).astype(np.float32)
            b[...] = 0.0


def to_adapter(params: ParamBuffer, targets: list[LoraTarget], arch: str, alpha: float) -> LoraAdapter:
    """The trained adapter, ready for `write_adapter` (llama.cpp --lora format)."""
    adapter = LoraAdapter(arch, alpha)
    values = params.host_views(params.data)
    for t in targets:
        adapter.pairs[t.weight] = (values[t.a].copy(), values[t.b].copy())
    return adapter
