"""A GGUF llama-family model: config, frozen base weights, tokenizer.

The base weights stay exactly as stored in the GGUF file (quantized or not) and
memory-mapped; `Dequantizer` expands one weight at a time into a reused f32
scratch buffer right before its matmul, so the model is never held in f32.
Norm weights and biases (small vectors) are read into f32 at load time.

Tensor names follow llama.cpp (`token_embd`, `blk.N.attn_q`, ..., `output`); a
weight `W` of `y = x W^T` is (n_out, n_in) in numpy order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from .config import ModelConfig
from .errors import LlamatuneError
from .gguf_io import GGUFFile, Tensor
from .kernels import dequant
from .tensors import check_finite, check_type

# Per-layer weights, llama.cpp names. Matrices (n_out, n_in) and which config dims they have.
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
LAYER_NORMS = ("attn_norm", "ffn_norm")


def matrix_shape(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    """(n_out, n_in) of a weight kind, as the architecture requires it."""
    C, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    return {
        "attn_q": (cfg.n_embd_q, C), "attn_k": (cfg.n_embd_kv, C), "attn_v": (cfg.n_embd_kv, C),
        "attn_output": (C, cfg.n_embd_q), "ffn_gate": (F, C), "ffn_up": (F, C), "ffn_down": (C, F),
        "token_embd": (V, C), "output": (V, C),
    }[kind]


@dataclass
class Layer:
    attn_norm: np.ndarray        # (C,) f32
    ffn_norm: np.ndarray         # (C,) f32
    mats: dict[str, Tensor]      # LAYER_MATRICES -> frozen weight (n_out, n_in), as stored
    biases: dict[str, np.ndarray]  # qwen2: attn_q/k/v -> (n_out,) f32


@dataclass
class BaseWeights:
    token_embd: Tensor           # (V, C) as stored
    output: Tensor               # (V, C); the same tensor as token_embd when tied
    output_norm: np.ndarray      # (C,) f32
    layers: list[Layer]
    rope_freqs: np.ndarray | None  # (n_rot/2,) f32 Llama-3.1 frequency factors, or None

    def all_matrices(self):
        """(name, Tensor) of every matrix that goes through a matmul, llama.cpp names."""
        yield "token_embd.weight", self.token_embd
        for i, layer in enumerate(self.layers):
            for kind, t in layer.mats.items():
                yield f"blk.{i}.{kind}.weight", t
        yield "output.weight", self.output


def _vector(f: GGUFFile, name: str, n: int) -> np.ndarray:
    t = f.tensor(name)
    if t.shape != (n,):
        raise LlamatuneError(f"{f.path}: tensor '{name}' has shape {t.shape}, expected ({n},)")
    check_type(f, t)
    return dequant.dequantize(t.raw_rows(), t.qtype, n).reshape(n).astype(np.float32)


def _matrix(f: GGUFFile, name: str, shape: tuple[int, int]) -> Tensor:
    t = f.tensor(name)
    if t.shape != shape:
        raise LlamatuneError(f"{f.path}: tensor '{name}' has shape {t.shape}, expected {shape}")
    check_type(f, t)
    return t


def load_weights(f: GGUFFile, cfg: ModelConfig) -> BaseWeights:
    """Map every tensor of the model, checking names and shapes against `cfg`."""
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        mats = {k: _matrix(f, f"{p}{k}.weight", matrix_shape(cfg, k)) for k in LAYER_MATRICES}
        biases = {}
        if cfg.has_qkv_bias:
            for k in ("attn_q", "attn_k", "attn_v"):
                biases[k] = _vector(f, f"{p}{k}.bias", matrix_shape(cfg, k)[0])
        layers.append(Layer(_vector(f, f"{p}attn_norm.weight", cfg.n_embd),
                            _vector(f, f"{p}ffn_norm.weight", cfg.n_embd), mats, biases))
    token_embd = _matrix(f, "token_embd.weight", matrix_shape(cfg, "token_embd"))
    output = _matrix(f, "output.weight", matrix_shape(cfg, "output")) if "output.weight" in f else token_embd
    rope_freqs = _vector(f, "rope_freqs.weight", cfg.n_rot // 2) if "rope_freqs.weight" in f else None
    return BaseWeights(token_embd, output, _vector(f, "output_norm.weight", cfg.n_embd), layers, rope_freqs)


class Dequantizer:
    """Expands frozen weights into one reused f32 scratch buffer.

    The scratch holds the largest layer matrix. The embedding and the output head
    (vocabulary x embedding, the largest tensors of most models) never exist in f32:
    `block(t, lo, hi)` expands rows lo:hi of the head (`head_rows` at a time fit the
    scratch) and `rows(t, ids, out)` only the embedding rows used. `get(t)` returns a
    (n_rows, n_cols) view valid until the next call. F32 weights are returned as
    their memory-mapped array, no copy."""

    def __init__(self, weights: BaseWeights):
        vocab = {id(weights.token_embd), id(weights.output)}
        layer_max = max((t.n_rows * t.n_cols for _, t in weights.all_matrices() if id(t) not in vocab), default=0)
        head = weights.output
        self.head_rows = max(1, min(head.n_rows, layer_max // head.n_cols))   # rows of the head per block
        self.size = max(layer_max, self.head_rows * head.n_cols)
        self._buf: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.size * 4

    def get(self, t: Tensor) -> np.ndarray:
        return self.block(t, 0, t.n_rows)

    def block(self, t: Tensor, lo: int, hi: int) -> np.ndarray:
        """Rows lo:hi of a weight as (hi - lo, n_cols) f32, valid until the next call."""
        if t.qtype == QType.F32:
            return t.data.reshape(t.n_rows, t.n_cols)[lo:hi]
        if (hi - lo) * t.n_cols > self.size:
            raise ValueError(f"{t.name}: rows {lo}:{hi} do not fit the dequantization scratch; expand it in blocks")
        if self._buf is None:
            self._buf = np.empty(self.size, np.float32)
        out = self._buf[: (hi - lo) * t.n_cols].reshape(hi - lo, t.n_cols)
        raw = t.raw_rows()[lo:hi]
        if t.qtype in dequant.NUMBA_TYPES:
            dequant.dequantize_into(raw, t.qtype, out)
        else:
            out[...] = dequant.dequantize(raw, t.qtype, t.n_cols)
        return out

    def rows(self, t: Tensor, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = W[ids[i]]: embedding lookup that dequantizes only the rows used."""
        ids = np.ascontiguousarray(ids, np.int64)
        if t.qtype in dequant.NUMBA_TYPES:
            dequant.dequantize_rows_into(t.raw_rows(), t.qtype, ids, out)
        else:
            out[...] = dequant.dequantize(t.raw_rows()[ids], t.qtype, t.n_cols)
        return out


class Model:
    """A loaded GGUF model. Weights are memory-mapped; nothing is copied to f32.
    Every weight is checked for inf/nan (an error unless `allow_nonfinite`)."""

    def __init__(self, path: str | Path, allow_nonfinite: bool = False):
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.config = ModelConfig.from_metadata(self.file.metadata, str(self.path))
        if self.file.get("general.type", "model") == "adapter":
            raise LlamatuneError(f"{self.path}: is a LoRA adapter, not a model (pass it with --lora)")
        self.weights = load_weights(self.file, self.config)
        check_finite(self.path, self._used_tensors(), allow_nonfinite)
        self.dequantizer = Dequantizer(self.weights)

    def _used_tensors(self):
        """(name, Tensor) of every weight the model computes with (the tied output once)."""
        names = {"output_norm.weight", "rope_freqs.weight"} | {n for n, _ in self.weights.all_matrices()}
        for i in range(self.config.n_layer):
            names |= {f"blk.{i}.attn_norm.weight", f"blk.{i}.ffn_norm.weight"}
            if self.config.has_qkv_bias:
                names |= {f"blk.{i}.{k}.bias" for k in ("attn_q", "attn_k", "attn_v")}
        return [(n, t) for n, t in self.file.tensors.items() if n in names]

    @cached_property
    def tokenizer(self):
        from .tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.file)
