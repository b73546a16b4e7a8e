"""Full finetuning of an existing model (`llamatune finetune --fine-tune-type full`).

What llama.cpp's `llama-finetune` does (every weight trained, AdamW or SGD) on a
base of any type: each tensor the run trains (every matrix, norm and bias of the
model, less what `--train-only` / `--freeze` leave out) becomes an f32 parameter of
the flat ParamBuffer, F16/BF16 widened and quantized ones dequantized; the others
stay memory-mapped as stored and are dequantized right before their matmul, as in
LoRA finetuning (`FullWeights` hands the graph one or the other, tensor by tensor).

The trained model is written with every metadata key and tensor of the base, in
file order: a trained tensor in the base's own type (re-quantized with
kernels/quantize.py, bit-exact with ggml's reference quantizers) or `--out-type`,
a frozen one byte for byte (or converted to `--out-type`).

Memory: 4 bytes a trained value for the weights, 4 for the gradient and, with AdamW,
8 for the two moments (`state_bytes`); the base's pages of the trained tensors are
read once, at the start, and released.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..console import notice
from ..errors import LlamatuneError
from ..formats.gguf_io import KV, GGUFFile, TensorOut, kv, write_gguf
from ..kernels import dequant
from ..kernels.quantize import quantize
from ..models.writer import FILE_TYPE, out_type
from ..models.weights import FrozenBase
from .params import ParamBuffer


def patterns(text: str) -> list[str]:
    """Comma-separated fnmatch patterns (spaces around them ignored)."""
    return [p.strip() for p in text.split(",") if p.strip()]


def trained_names(names: list[str], train_only: str, freeze: str, source: Path | str) -> list[str]:
    """The tensors a full finetune trains, in `names` order: those matching a --train-only
    pattern (all when none is given), less those matching a --freeze pattern. A pattern
    that matches no tensor is an error (a misspelt name would silently train everything)."""
    chosen = list(names)
    for flag, text, keep in (("--train-only", train_only, True), ("--freeze", freeze, False)):
        pats = patterns(text)
        for p in pats:
            if not any(fnmatchcase(n, p) for n in names):
                raise LlamatuneError(f"{flag} '{p}': matches no tensor of {source} "
                                     f"(names look like {names[min(3, len(names) - 1)]}, blk.0.attn_q.weight)")
        if pats:
            chosen = [n for n in chosen if any(fnmatchcase(n, p) for p in pats) == keep]
    if not chosen:
        raise LlamatuneError(f"--train-only / --freeze leave no tensor of {source} to train")
    return chosen


def state_bytes(n_params: int, optimizer: str, moments: str = "f32") -> dict[str, int]:
    """What the trained values cost: f32 weights and gradients and (AdamW) the two moments,
    in f32 or bf16 (--adam-moments)."""
    return {"weights": 4 * n_params, "gradients": 4 * n_params,
            "moments": (4 if moments == "bf16" else 8) * n_params if optimizer == "adamw" else 0}


class FullWeights:
    """The graph's weights when some or all of a base model's tensors are trained: a trained
    tensor is its f32 parameter (gradient: its view of params.grad), a frozen one comes
    from the FrozenBase as stored (gradient: None, so the graph computes none). Its
    gradients are cleared lazily (ParamBuffer.zero_grad(lazy=True))."""
    trainable = True
    lazy_grads = True

    def __init__(self, frozen: FrozenBase, params: ParamBuffer, tied: bool):
        self.frozen, self.params, self.tied = frozen, params, tied
        self.rope_freqs, self.rope_long, self.rope_short = frozen.rope_freqs, frozen.rope_long, frozen.rope_short
        self.tensors = {n: t for n, t in frozen.tensors.items() if self._name(n) not in params}   # frozen ones

    def _name(self, name: str) -> str:
        return "token_embd.weight" if self.tied and name == "output.weight" else name

    @property
    def head_rows(self) -> int:
        """The head's row blocks, as the frozen base's: a trained head needs no expansion, but
        the graph's `head_tmp` (its gradient block before it is added) stays as small."""
        return self.frozen.head_rows

    def matrix(self, name: str):
        n = self._name(name)
        return self.params[n] if n in self.params else self.frozen.matrix(name)

    def matrix_rows(self, name: str, lo: int, hi: int):
        n = self._name(name)
        return self.params[n][lo:hi] if n in self.params else self.frozen.matrix_rows(name, lo, hi)

    def is_scratch(self, name: str) -> bool:
        n = self._name(name)
        return False if n in self.params else self.frozen.is_scratch(name)

    def vector(self, name: str):
        return self.params[name] if name in self.params else self.frozen.vector(name)

    def embed(self, ids, out) -> None:
        if "token_embd.weight" in self.params:
            out[...] = self.params["token_embd.weight"][ids]
        else:
            self.frozen.embed(ids, out)

    def grad(self, name: str):
        """The gradient of a trained tensor, ready to be added to; None for a frozen one."""
        n = self._name(name)
        return self.params.grad_to_add(n) if n in self.params else None

    def is_kept_bf16(self, name: str) -> bool:
        return False                          # trained weights multiply in f32: no bf16 copies

    def grad_to_write(self, name: str):
        """(gradient, whether the first product may write it whole), or None if frozen."""
        n = self._name(name)
        return self.params.grad_to_write(n) if n in self.params else None


def load_trained(params: ParamBuffer, f: GGUFFile) -> None:
    """Each trained tensor's values from the base GGUF into its parameter, in f32, one
    tensor at a time (dequantized straight into the parameter where a kernel exists), then
    the mapped pages released: from here on only the frozen tensors are read."""
    for s in params.specs:
        t = f.tensors[s.name]
        out = params[s.name].reshape(t.n_rows, t.n_cols)
        if params.data.dtype == np.float32 and t.qtype in dequant.NUMBA_TYPES:
            dequant.dequantize_into(t.raw_rows(), t.qtype, out)
        else:
            out[...] = dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols)
    f.release_pages()


# --------------------------------------------------------------------------- the model written

def _encode(values, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """f32 `values` (a parameter, or a frozen tensor dequantized) in `qtype`."""
    values = values() if callable(values) else values
    if qtype == QType.F32:
        return np.ascontiguousarray(values, np.float32).reshape(shape)
    return quantize(np.asarray(values, np.float32).reshape(-1, shape[-1]), qtype)


def model_tensors(f: GGUFFile, values: dict[str, np.ndarray], target: QType | None,
                  notes: set[str]) -> list[TensorOut]:
    """Every tensor of the base, in its order: trained ones from `values` (f32, numpy
    shapes), frozen ones byte for byte or converted to `target`. Data is made lazily,
    one tensor at a time, as the writer streams it."""
    out = []
    for t in f.tensors.values():
        if t.name in values:
            q = out_type(t, target, True, notes.add)
            out.append(TensorOut(t.name, t.shape, q, partial(_encode, values[t.name], q, t.shape)))
            continue
        q = t.qtype if target is None else out_type(t, target, True, notes.add)
        if q == t.qtype or t.qtype not in dequant.NUMBA_TYPES:
            if q != t.qtype:
                notes.add(f"{t.name}: {t.qtype.name} cannot be converted; copied as stored")
            out.append(TensorOut(t.name, t.shape, t.qtype, t.raw_rows))       # byte for byte
        else:
            out.append(TensorOut(t.name, t.shape, q, partial(_encode, partial(dequant.dequantize, t.raw_rows(),
                                                                               t.qtype, t.n_cols), q, t.shape)))
    return out


def model_metadata(f: GGUFFile, target: QType | None) -> list[KV]:
    """The base's keys exactly (tokenizer, chat template, hyperparameters); general.file_type
    follows an explicit output type."""
    kvs = [item._replace(value=FILE_TYPE[target]) if item.key == "general.file_type" and target is not None
           else item for item in f.kvs.values()]
    if target is not None and "general.file_type" not in f.kvs:
        kvs.append(kv("general.file_type", FILE_TYPE[target]))
    return kvs


def write_full_model(path: Path, f: GGUFFile, params: ParamBuffer, target: QType | None) -> None:
    """The base model with the trained tensors replaced, written atomically."""
    notes: set[str] = set()
    tensors = model_tensors(f, params.host_views(params.data), target, notes)
    for note in sorted(notes):
        notice(note)
    write_gguf(path, f.arch, model_metadata(f, target), tensors)
