"""Writing llama-family GGUF models: from f32 tensors to a file llama.cpp loads.

Used by train-from-scratch (`--model-out`), by export-lora, by the benchmarks
(random-weight models of a given shape) and by the tests (tiny synthetic models).
Also: the vocabulary, either copied from another GGUF (`tokenizer.*` keys) or
trained with the SentencePiece trainer on a text and stored in the same keys
llama.cpp's convert script writes.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Iterable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from ..console import notice
from ..errors import LlamatuneError
from ..formats.gguf_io import KV, GGUFFile, TensorOut, kv, write_gguf
from .arch import model_tensor_shapes, tensor_shape
from .config import ModelConfig
from .model import ROPE_FACTORS

# llama.cpp's LLAMA_FTYPE for a file whose matrices are all of one type
FILE_TYPE = {QType.F32: 0, QType.F16: 1, QType.Q4_0: 2, QType.Q4_1: 3, QType.Q8_0: 7, QType.Q5_0: 8,
             QType.Q5_1: 9, QType.Q2_K: 10, QType.Q3_K: 12, QType.Q4_K: 15, QType.Q5_K: 17,
             QType.Q6_K: 18, QType.BF16: 32}

OUTTYPES = {name.lower(): q for q, name in ((q, q.name) for q in FILE_TYPE)}


def parse_outtype(name: str) -> QType:
    q = OUTTYPES.get(name.lower())
    if q is None:
        raise LlamatuneError(f"unknown output type '{name}' (choose from {', '.join(OUTTYPES)})")
    return q


def tensor_names(cfg: ModelConfig, tied: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of a model with `cfg`, llama.cpp names -> numpy shape, in llama.cpp's order
    (no `output` when tied, or when the architecture always ties its head)."""
    tied = tied or cfg.spec.tied
    names: dict[str, tuple[int, ...]] = {"token_embd.weight": tensor_shape(cfg, "token_embd"),
                                         "output_norm.weight": (cfg.n_embd,)}
    if not tied:
        names["output.weight"] = tensor_shape(cfg, "output")
    names |= model_tensor_shapes(cfg)
    for i in range(cfg.n_layer):
        kinds = cfg.spec.kinds(cfg, i)
        for kind, name in zip(kinds + cfg.spec.experts, cfg.spec.layer_tensors(i, kinds)):
            names[name] = tensor_shape(cfg.layer(i), kind)
    return names


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02, tied: bool = False) -> dict[str, np.ndarray]:
    """Seeded random f32 weights: N(0, std) matrices (output projections scaled by
    1/sqrt(2 L), as GPT-2/llama practice), norms 1, biases 0."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_names(cfg, tied).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            s = std / np.sqrt(2 * cfg.n_layer) if name.endswith(("attn_output.weight", "ffn_down.weight")) else std
            out[name] = rng.normal(0.0, s, size=shape).astype(np.float32)
    return out


def fit_type(n_cols: int, qtype: QType) -> QType:
    """`qtype` if rows of `n_cols` fit its blocks, else llama-quantize's kind of
    fallback: Q8_0 for quantized types (32-wide blocks), F16 otherwise."""
    if n_cols % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    return QType.Q8_0 if n_cols % 32 == 0 and qtype not in (QType.F32, QType.F16, QType.BF16) else QType.F16


def out_type(t, target: QType | None, retyped: bool, note) -> QType:
    """The type base tensor `t` is written in after its values changed (`retyped`: merged by
    export-lora, trained by a full finetune): the base's own type for target None, F16
    (llama.cpp export-lora's choice) where that type cannot be re-quantized; `target`
    for matrices, with fit_type's fallback (1-D tensors stay F32). `note(text)` hears of
    every fallback."""
    from ..kernels.quantize import QUANTIZABLE
    if target is None:
        if retyped and t.qtype not in QUANTIZABLE:
            note(f"{t.name}: {t.qtype.name} cannot be re-quantized; written as F16")
            return QType.F16
        return t.qtype
    if len(t.shape) == 1:
        return QType.F32
    fitted = fit_type(t.n_cols, target)
    if fitted != target:
        note(f"{t.name}: {t.n_cols} columns do not fit {target.name} blocks; written as {fitted.name}")
    return fitted


def encode_tensor(name: str, data: np.ndarray, qtype: QType) -> TensorOut:
    """A TensorOut that converts f32 `data` to `qtype` when written. 1-D tensors
    (norms, biases) always stay F32, as llama.cpp keeps them."""
    if data.ndim == 1:
        qtype = QType.F32
    fitted = fit_type(data.shape[-1], qtype)
    if fitted != qtype:
        notice(f"{name}: {data.shape[-1]} columns do not fit {qtype.name} blocks; writing {fitted.name}")
        qtype = fitted

    def make() -> np.ndarray:
        if qtype == QType.F32:
            return np.ascontiguousarray(data, np.float32)
        if qtype == QType.F16:
            return np.ascontiguousarray(data, np.float16)
        from ..kernels.quantize import quantize
        return quantize(np.ascontiguousarray(data, np.float32).reshape(-1, data.shape[-1]), qtype)

    return TensorOut(name, tuple(data.shape), qtype, make)


def write_model(path: str | Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], vocab: Iterable[KV],
                outtype: QType = QType.F32, name: str = "llamatune", extra: Iterable[KV] = ()) -> None:
    """Write a complete model GGUF atomically (tensors in llama.cpp's order; rope frequency
    factor vectors in `tensors` (models/model.ROPE_FACTORS) first, as the converter does)."""
    expected = tensor_names(cfg, tied="output.weight" not in tensors)
    missing = [n for n in expected if n not in tensors]
    wrong = [f"{n} {tensors[n].shape} != {s}" for n, s in expected.items() if n in tensors and tensors[n].shape != s]
    if missing or wrong:
        raise LlamatuneError(f"{path}: cannot write model: missing {missing}, wrong shapes {wrong}")
    kvs = [kv("general.type", "model"), kv("general.name", name)]
    kvs += [kv(k, v) for k, v in cfg.metadata().items()]
    kvs += [kv("general.file_type", FILE_TYPE.get(outtype, 0)), kv("general.quantization_version", 2)]
    kvs += list(vocab) + list(extra)
    factors = [f"{k}.weight" for k in ROPE_FACTORS if f"{k}.weight" in tensors]   # optional (n_rot/2,) vectors
    write_gguf(path, cfg.arch, kvs, [encode_tensor(n, tensors[n], outtype) for n in [*factors, *expected]])


# --------------------------------------------------------------------------- vocabularies

def vocab_kvs(f: GGUFFile) -> list[KV]:
    """The `tokenizer.*` keys of a GGUF (model or vocab-only), to embed in a new model."""
    kvs = [item for key, item in f.kvs.items() if key.startswith("tokenizer.")]
    if not any(k.key == "tokenizer.ggml.model" for k in kvs):
        raise LlamatuneError(f"{f.path}: has no tokenizer metadata (tokenizer.ggml.model)")
    return kvs


def train_spm_vocab(text: str, vocab_size: int, source: str = "training data",
                    control: tuple[str, ...] = ()) -> list[KV]:
    """Train a llama-style SentencePiece BPE vocabulary (byte fallback, <unk>/<s>/</s>
    at ids 0/1/2, identity normalization) and return it as GGUF tokenizer keys. `control`:
    control tokens placed after </s> (e.g. ChatML's <|im_start|>, <|im_end|>): text parses
    to them only with special-token parsing, as chat templates render, and llama.cpp ends
    generation at the end-of-turn ones (<|im_end|>, <|eot_id|>, <end_of_turn>, ...)."""
    import sentencepiece as spm
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise LlamatuneError(f"{source}: no text to train a vocabulary on")
    if vocab_size < 300:
        raise LlamatuneError(f"--vocab-size {vocab_size} is too small: byte fallback alone needs 259 tokens")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
            add_dummy_prefix=True, remove_extra_whitespaces=False, split_digits=True,
            allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=2, minloglevel=2, hard_vocab_limit=False, control_symbols=list(control))
    except RuntimeError as e:
        raise LlamatuneError(f"{source}: SentencePiece training failed: {e}") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 1)
    V = gguf.GGUFValueType
    return [kv("tokenizer.ggml.model", "llama"), kv("tokenizer.ggml.pre", "default"),
            KV("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            KV("tokenizer.ggml.scores", scores, V.ARRAY, V.FLOAT32),
            KV("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            kv("tokenizer.ggml.bos_token_id", 1), kv("tokenizer.ggml.eos_token_id", 2),
            kv("tokenizer.ggml.unknown_token_id", 0), kv("tokenizer.ggml.add_bos_token", True),
            kv("tokenizer.ggml.add_eos_token", False)]
