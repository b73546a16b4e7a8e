"""An architecture, declared once and read by everything that depends on it.

A model family (llama, qwen2, ...) is a variation of one transformer block. What
varies is declared in one `Arch` in `models/archs/<name>.py` (the name is
`general.architecture`), in the spirit of llama.cpp's per-architecture tables
(llm_arch / LLM_TENSOR_NAMES, src/models/<arch>.cpp) and mlx-lm's model files:

  - which tensors each layer has, by their llama.cpp names, in file order
    (`config.py` reads the hyperparameters, `model.py` maps the tensors,
    `modelfile.py` writes them, `train/lora.py` lists LoRA targets from them);
  - how the block computes (rope mode, and the options `models/infer.py` and
    `train/graph.py` branch on);
  - extra hyperparameters the family keeps in metadata (`read_hparams`, `hparams_metadata`).

Adding an architecture is one file in `models/archs/` (plus any kernel it needs).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import LlamatuneError

NORM, NEOX = 0, 2   # rope modes as ggml numbers them: adjacent pairs / halves rotated

LLAMA_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
               "ffn_gate", "ffn_up", "ffn_down", "ffn_norm")


@dataclass(frozen=True)
class Arch:
    name: str                         # general.architecture
    rope_mode: int                    # NORM or NEOX
    layer: tuple[str, ...] = LLAMA_LAYER   # per-layer tensors, file order: "kind" is blk.N.kind.weight,
    #                                   "kind.bias" is blk.N.kind.bias; kinds ending in "norm" are vectors
    # extra ModelConfig fields from `{arch}.*` metadata, for families that keep more
    # hyperparameters than llama: read_hparams(read) with read.count(key, default),
    # read.number(key, default) (validated, errors name the file and key) and
    # read.raw(key, default); hparams_metadata(cfg) gives the keys back for writing
    read_hparams: Callable[[Any], dict[str, Any]] | None = None
    hparams_metadata: Callable[[Any], dict[str, Any]] | None = None

    @property
    def matrices(self) -> tuple[str, ...]:
        """Per-layer weight kinds that go through a matmul, file order."""
        return tuple(k for k in self.layer if "." not in k and not k.endswith("norm"))

    @property
    def norms(self) -> tuple[str, ...]:
        """Per-layer norm weight kinds (vectors), file order."""
        return tuple(k for k in self.layer if "." not in k and k.endswith("norm"))

    @property
    def biases(self) -> tuple[str, ...]:
        """Matrix kinds that also have a bias vector."""
        return tuple(k.removesuffix(".bias") for k in self.layer if k.endswith(".bias"))

    def layer_tensors(self, i: int) -> list[str]:
        """Full llama.cpp names of layer i's tensors, file order."""
        return [f"blk.{i}.{k}" if k.endswith(".bias") else f"blk.{i}.{k}.weight" for k in self.layer]


def tensor_shape(cfg, kind: str) -> tuple[int, ...]:
    """Numpy shape of a tensor kind ((n_out, n_in) for matrices, (n,) for vectors) in a
    model with config `cfg`. `kind` is a layer kind ("attn_q", "attn_q.bias", "attn_norm")
    or a model-level one ("token_embd", "output", "output_norm")."""
    C, F, V, Cq, Ckv = cfg.n_embd, cfg.n_ff, cfg.n_vocab, cfg.n_embd_q, cfg.n_embd_kv
    if kind.endswith(".bias"):
        return (tensor_shape(cfg, kind.removesuffix(".bias"))[0],)
    shapes = {
        "attn_q": (Cq, C), "attn_k": (Ckv, C), "attn_v": (Ckv, C), "attn_output": (C, Cq),
        "ffn_gate": (F, C), "ffn_up": (F, C), "ffn_down": (C, F),
        "token_embd": (V, C), "output": (V, C),
        "attn_norm": (C,), "ffn_norm": (C,), "output_norm": (C,),
    }
    if kind not in shapes:
        raise KeyError(f"architecture {cfg.arch}: no shape for tensor kind '{kind}'")
    return shapes[kind]


def supported() -> list[str]:
    """Names of the architectures declared in models/archs/."""
    from . import archs
    return sorted(m.name for m in pkgutil.iter_modules(archs.__path__) if not m.name.startswith("_"))


def get_arch(name: str) -> Arch:
    """The declaration of architecture `name`; an error listing the supported ones otherwise."""
    if name not in supported():
        raise LlamatuneError(f"architecture '{name}' is not supported (supported: {', '.join(supported())})")
    return importlib.import_module(f"{__package__}.archs.{name}").ARCH
