"""A GGUF llama-family model: config, frozen base weights, tokenizer.

The base weights stay exactly as stored in the GGUF file (quantized or not) and
memory-mapped; `Dequantizer` expands one weight at a time into a reused f32
scratch buffer right before its matmul, so the model is never held in f32.
Norm weights and biases (small vectors) are read into f32 at load time.

Tensor names follow llama.cpp (`token_embd`, `blk.N.attn_q`, ..., `output`); a
weight `W` of `y = x W^T` is (n_out, n_in) in numpy order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..errors import LlamatuneError
from ..formats.gguf_io import GGUFFile, Tensor
from ..formats.tensors import check_finite, check_type
from ..kernels import dequant
from .arch import model_tensor_shapes, tensor_shape
from .config import ModelConfig


@dataclass
class Layer:
    norms: dict[str, np.ndarray]   # Arch.norms -> (n,) f32
    mats: dict[str, Tensor]        # Arch.matrices -> frozen weight (n_out, n_in), as stored
    biases: dict[str, np.ndarray]  # Arch.biases -> (n_out,) f32
    experts: dict[str, Tensor] = None   # Arch.experts -> frozen 3-D expert tensor (E, n_out, n_in), as stored
    vectors: dict[str, np.ndarray] = field(default_factory=dict)   # Arch.vectors of the layer -> f32, as shaped


@dataclass
class BaseWeights:
    token_embd: Tensor           # (V, C) as stored
    output: Tensor               # (V, C); the same tensor as token_embd when tied
    output_norm: np.ndarray      # (C,) f32
    layers: list[Layer]
    rope_freqs: np.ndarray | None  # (n_rot/2,) f32 Llama-3.1 frequency factors, or None
    rope_long: np.ndarray | None = None   # (n_rot/2,) f32 Phi-3 su/longrope factors above n_ctx_orig
    rope_short: np.ndarray | None = None  # (n_rot/2,) f32 ... and within it
    # the architecture's model-level tensors (Arch.model_tensors: gemma4's per-layer embeddings)
    tables: dict[str, Tensor] = field(default_factory=dict)         # read row by row, as token_embd
    model_mats: dict[str, Tensor] = field(default_factory=dict)     # matrices
    model_vectors: dict[str, np.ndarray] = field(default_factory=dict)   # norm weights, f32

    def all_matrices(self):
        """(name, Tensor) of every matrix that goes through a matmul, llama.cpp names."""
        yield "token_embd.weight", self.token_embd
        for i, layer in enumerate(self.layers):
            for kind, t in layer.mats.items():
                yield f"blk.{i}.{kind}.weight", t
        yield from self.model_mats.items()
        yield from self.tables.items()
        yield "output.weight", self.output

    def all_experts(self):
        """(name, Tensor) of every 3-D expert tensor (mixtures of experts), llama.cpp names."""
        for i, layer in enumerate(self.layers):
            for kind, t in (layer.experts or {}).items():
                yield f"blk.{i}.{kind}.weight", t


def _vector(f: GGUFFile, name: str, n: int) -> np.ndarray:
    return _small(f, name, (n,))


def _matrix(f: GGUFFile, name: str, shape: tuple[int, ...]) -> Tensor:
    t = f.tensor(name)
    if t.shape != shape:
        raise LlamatuneError(f"{f.path}: tensor '{name}' has shape {t.shape}, expected {shape}")
    check_type(f, t)
    return t


def _small(f: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A small per-layer tensor (a vector, or the delta-net's (channels, taps) convolution) in f32."""
    t = f.tensor(name)
    if t.shape != shape:
        raise LlamatuneError(f"{f.path}: tensor '{name}' has shape {t.shape}, expected {shape}")
    check_type(f, t)
    return dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(shape).astype(np.float32)


ROPE_FACTORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")   # optional model-level vectors


def load_weights(f: GGUFFile, cfg: ModelConfig) -> BaseWeights:
    """Map every tensor the architecture declares, checking names and shapes against `cfg`."""
    spec = cfg.spec
    layers = []
    for i in range(cfg.n_layer):
        p, kinds, at = f"blk.{i}.", spec.kinds(cfg, i), cfg.layer(i)     # at: layer i's shapes
        layers.append(Layer(
            {k: _vector(f, f"{p}{k}.weight", tensor_shape(at, k)[0]) for k in spec.norms_of(kinds)},
            {k: _matrix(f, f"{p}{k}.weight", tensor_shape(at, k)) for k in spec.matrices_of(kinds)},
            {k: _vector(f, f"{p}{k}.bias", tensor_shape(at, k)[0]) for k in spec.biases_of(kinds)},
            {k: _matrix(f, f"{p}{k}.weight", tensor_shape(at, k)) for k in spec.experts},
            {k: _small(f, p + k, tensor_shape(at, k)) for k in kinds if k in spec.vectors}))
    token_embd = _matrix(f, "token_embd.weight", tensor_shape(cfg, "token_embd"))
    has_output = "output.weight" in f and not spec.tied          # gemma, gemma2: always token_embd
    output = _matrix(f, "output.weight", tensor_shape(cfg, "output")) if has_output else token_embd
    factors = {k: _vector(f, f"{k}.weight", cfg.n_rot // 2) if f"{k}.weight" in f else None for k in ROPE_FACTORS}
    if (factors["rope_factors_long"] is None) != (factors["rope_factors_short"] is None):
        raise LlamatuneError(f"{f.path}: has only one of rope_factors_long.weight and rope_factors_short.weight "
                             "(su/longrope scaling needs both)")
    extra = model_tensor_shapes(cfg)
    return BaseWeights(token_embd, output, _vector(f, "output_norm.weight", cfg.n_embd), layers,
                       factors["rope_freqs"], factors["rope_factors_long"], factors["rope_factors_short"],
                       {n: _matrix(f, n, s) for n, s in extra.items() if n.endswith("token_embd.weight")},
                       {n: _matrix(f, n, s) for n, s in extra.items() if len(s) == 2
                        and not n.endswith("token_embd.weight")},
                       {n: _vector(f, n, s[0]) for n, s in extra.items() if len(s) == 1})


class Dequantizer:
    """Expands frozen weights into one reused f32 scratch buffer.

    The scratch holds the largest layer matrix. The embedding and the output head
    (vocabulary x embedding, the largest tensors of most models) never exist in f32:
    `block(t, lo, hi)` expands rows lo:hi of the head (`head_rows` at a time fit the
    scratch) and `rows(t, ids, out)` only the embedding rows used. `get(t)` returns a
    (n_rows, n_cols) view valid until the next call. F32 weights are returned as
    their memory-mapped array, no copy.

    `block_bf16` expands rows straight to bf16 (uint16 bits, kernels/bf16.py) into a
    second scratch of half the bytes, for the bf16 products (models/products.py); a
    run uses one scratch or the other, and an untouched one takes no memory."""

    def __init__(self, weights: BaseWeights):
        vocab = {id(weights.token_embd), id(weights.output)} | {id(t) for t in weights.tables.values()}
        layer_max = max((t.n_rows * t.n_cols for _, t in weights.all_matrices() if id(t) not in vocab), default=0)
        layer_max = max([layer_max] + [t.shape[1] * t.n_cols for _, t in weights.all_experts()])   # one expert
        head = weights.output
        self.head_rows = max(1, min(head.n_rows, layer_max // head.n_cols))   # rows of the head per block
        self.size = max(layer_max, self.head_rows * head.n_cols)
        # the longest side of a layer matrix: what an adapter's parts add to a bf16 block per column
        self.layer_side = max((max(t.n_rows, t.n_cols) for _, t in weights.all_matrices() if id(t) not in vocab),
                              default=0)
        self._buf: np.ndarray | None = None
        self._buf_bf16: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.size * 4

    @property
    def nbytes_bf16(self) -> int:
        """The scratch of `block_bf16`: the bf16 matrix (the kernels round as they store)."""
        return self.size * 2

    def nbytes_bf16_extended(self, extension: int) -> int:
        """The same with room for `extension` more columns or rows (`block_bf16`'s cols/rows)."""
        return 2 * (self.size + extension * self.layer_side)

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

    def block_bf16(self, t: Tensor, lo: int, hi: int, cols: int = 0, rows: int = 0) -> np.ndarray:
        """Rows lo:hi of a weight as (hi - lo, n_cols) bf16 bits (uint16), equal to
        to_bf16(block(t, lo, hi)) bit for bit, valid until the next call. With cols or
        rows, the (hi - lo + rows, n_cols + cols) buffer it sits in, top left, the rest
        left for the caller (an adapter's parts in a product's K axis: models/products.py)."""
        from ..kernels import bf16
        n_rows, width = hi - lo + rows, t.n_cols + cols
        n = n_rows * width
        if (hi - lo) * t.n_cols > self.size:
            raise ValueError(f"{t.name}: rows {lo}:{hi} do not fit the dequantization scratch; expand it in blocks")
        if self._buf_bf16 is None or self._buf_bf16.size < n:
            self._buf_bf16 = np.empty(max(n, self.size), np.uint16)
        out = self._buf_bf16[:n].reshape(n_rows, width)
        block = out[: hi - lo]
        if t.qtype == QType.F32:
            bf16.to_bf16_rows(block, t.data.reshape(t.n_rows, t.n_cols)[lo:hi])
        elif t.qtype in dequant.NUMBA_TYPES:
            bf16.dequantize_into(t.raw_rows()[lo:hi], t.qtype, block, t.n_cols)
        else:
            bf16.to_bf16_rows(block, dequant.dequantize(t.raw_rows()[lo:hi], t.qtype, t.n_cols))
        return out

    def expert(self, t: Tensor, e: int) -> np.ndarray:
        """Expert e's (n_out, n_in) matrix of a 3-D expert tensor (E, n_out, n_in) as f32,
        valid until the next call: its rows of the stored tensor, dequantized alone."""
        n_out = t.shape[1]
        return self.block(t, e * n_out, (e + 1) * n_out)

    def rows(self, t: Tensor, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[i] = W[ids[i]]: embedding lookup that dequantizes only the rows used."""
        ids = np.ascontiguousarray(ids, np.int64)
        if t.qtype in dequant.NUMBA_TYPES:
            dequant.dequantize_rows_into(t.raw_rows(), t.qtype, ids, out)
        else:
            out[...] = dequant.dequantize(t.raw_rows()[ids], t.qtype, t.n_cols)
        return out


def not_a_model(f: GGUFFile) -> str | None:
    """What a GGUF that is not a model is, and the option it belongs to (None for a model)."""
    gtype, ttype = f.get("general.type"), f.get("training.type")
    if gtype == "adapter":
        return "a LoRA adapter, not a model: pass it with --lora, the model it was trained on with -m"
    if gtype == "llamatune-checkpoint":
        return ("a llamatune training checkpoint, not a model: resume its run with --checkpoint-in, or write its "
                "adapter (or model) with convert-checkpoint")
    if ttype == "finetune_lora":
        return ("a llama.cpp 2023 finetune checkpoint, not a model: convert it with convert-checkpoint (--to "
                "checkpoint, then resume with --checkpoint-in; or --to gguf-adapter)")
    if ttype == "train_model":
        return ("a llama.cpp 2023 train-text-from-scratch checkpoint, not a model: make a model of it with "
                "convert-checkpoint --to model")
    if gtype == "imatrix" or any(n.endswith(".in_sum2") for n in f.tensors):
        return ("an importance matrix (imatrix), not a model: it goes to export-lora --imatrix (or llama-quantize "
                "--imatrix)")
    if not f.tensors:
        return ("a vocabulary-only GGUF (no weights), not a model: it goes to tokenize -m or train-from-scratch "
                "--vocab-model")
    return None


def check_is_model(path: str | Path | GGUFFile) -> None:
    """Refuse, in one line saying what the file is, a GGUF passed as a model that is an
    adapter, a checkpoint, an imatrix or a vocabulary (not_a_model)."""
    f = path if isinstance(path, GGUFFile) else GGUFFile(path)
    problem = not_a_model(f)
    if problem:
        raise LlamatuneError(f"{f.path}: is {problem}")


class Model:
    """A loaded GGUF model. Weights are memory-mapped; nothing is copied to f32.
    Every weight is checked for inf/nan (an error unless `allow_nonfinite`)."""

    def __init__(self, path: str | Path | GGUFFile, allow_nonfinite: bool = False):
        self.file = path if isinstance(path, GGUFFile) else GGUFFile(path)     # (a file already read: kept)
        self.path = self.file.path
        check_is_model(self.file)
        self.config = ModelConfig.from_metadata(self.file.metadata, str(self.path), self.file.tensors)
        self.weights = load_weights(self.file, self.config)
        check_finite(self.path, self._used_tensors(), allow_nonfinite)
        self.dequantizer = Dequantizer(self.weights)

    def _used_tensors(self):
        """(name, Tensor) of every weight the model computes with (the tied output once)."""
        names = {"output_norm.weight"} | {f"{k}.weight" for k in ROPE_FACTORS}
        names |= {n for n, _ in self.weights.all_matrices()}       # (layer_tensors name the expert tensors)
        for i in range(self.config.n_layer):
            names |= set(self.config.spec.layer_tensors(i, self.config.spec.kinds(self.config, i)))
        return [(n, t) for n, t in self.file.tensors.items() if n in names]

    @cached_property
    def tokenizer(self):
        from .tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.file)
