"""llamatune checkpoints made from llama.cpp's 2023 ones (formats/llamacpp2023.py reads
them: layouts, scale, Adam moment order).

They keep the parameters, the moments and the iteration/sample/token/epoch counters;
the data order restarts (the 2023 mt19937 shuffle state has no equivalent). Their
options JSON holds only what the file tells (finetune: ranks, alpha; train_model: the
model shape), so other options are free on resume. A train_model checkpoint lists its
parameters in llama.cpp tensor order (writer.tensor_names), the order its flat moments
follow.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..errors import LlamatuneError
from ..formats.gguf_io import GGUFFile, kv
from ..formats.llamacpp2023 import (
    LegacyPair,
    convert_chunk,
    kind_of,
    legacy_metadata,
    main_rank,
    mappings,
    scale_note,
    split_moments,
    weight_names,
)
from ..formats.tensors import float_array
from ..models.arch import tensor_shape
from ..models.config import ModelConfig
from ..models.writer import tensor_names, vocab_kvs
from ..options import FinetuneOptions
from . import checkpoint as ckpt
from .lora import lora_specs, lora_targets
from .params import ParamBuffer, ParamSpec


def legacy_config(f: GGUFFile) -> ModelConfig:
    """Model hyperparameters of a 2023 checkpoint (llama only)."""
    return ModelConfig.from_metadata(legacy_metadata(f), str(f.path))


def base_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(n_out, n_in) of each base weight in the 2023 tensor order; norms (C,) count as (1, C)."""
    return {w: (1, cfg.n_embd) if kind_of(w).endswith("norm") else tensor_shape(cfg, kind_of(w))
            for w in weight_names(cfg.n_layer)}


def check_same_model(cfg: ModelConfig, base_cfg: ModelConfig, what: str, base_path: Path) -> None:
    fields = ("n_embd", "n_ff", "n_head", "n_head_kv", "n_layer", "n_vocab")
    diff = [f"{k} {getattr(cfg, k)} vs {getattr(base_cfg, k)}" for k in fields
            if getattr(cfg, k) != getattr(base_cfg, k)]
    if diff:
        raise LlamatuneError(f"{what} does not fit the base model {base_path.name}: " + ", ".join(diff))


# FinetuneOptions field for each LoRA tensor kind; the matrix kinds default to --lora-r
RANK_FIELDS = {"attn_q": "rank_wq", "attn_k": "rank_wk", "attn_v": "rank_wv", "attn_output": "rank_wo",
               "ffn_gate": "rank_ffn_gate", "ffn_up": "rank_ffn_up", "ffn_down": "rank_ffn_down",
               "token_embd": "rank_tok_embd", "output": "rank_out", "attn_norm": "rank_att_norm",
               "ffn_norm": "rank_ffn_norm", "output_norm": "rank_out_norm"}
MATRIX_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _save(output: Path, kind: str, cfg: ModelConfig, options: dict, params: ParamBuffer, state: ckpt.TrainState,
          model_kvs: list, fingerprint: str) -> None:
    """ckpt.save with an options JSON holding only `options`: what is known; the rest is not checked on resume."""
    known = dataclasses.make_dataclass("KnownOptions", [(k, object, dataclasses.field(default=v))
                                                       for k, v in options.items()])
    ckpt.save(output, kind, cfg.arch, known(), params, state, model_kvs, fingerprint)


def _f32(x: float) -> float:
    """The shortest decimal of a float32 (1e-05 rather than 9.999999747378752e-06), as users type it."""
    return float(str(np.float32(x)))


def _state(f: GGUFFile) -> ckpt.TrainState:
    """Counters of a 2023 checkpoint (file_version 0 has u32 counters and no epochs); the data order restarts."""
    return ckpt.TrainState(f.get_int("training.iteration_count", 0), f.get_int("training.sample_count", 0),
                           f.get_int("training.token_count", 0), f.get_int("training.epoch_count", 0),
                           f.get_float("optimizer.adam.previous_loss", float("nan")), None)


def finetune_checkpoint(f: GGUFFile, cfg: ModelConfig, pairs: dict[str, LegacyPair], output: Path,
                        fingerprint: str) -> tuple[str, list[str]]:
    """A 2023 finetune checkpoint as a resumable llamatune finetune_lora checkpoint."""
    by_kind: dict[str, set[int]] = defaultdict(set)
    for w, p in pairs.items():
        by_kind[kind_of(w)].add(p.rank)
    uneven = sorted(k for k, rs in by_kind.items() if len(rs) > 1)
    if uneven:
        raise LlamatuneError(f"{f.path}: ranks differ between layers for {uneven}; a llamatune run has one rank "
                             "per kind")
    ranks = {k: (min(by_kind[k]) if k in by_kind else 0) for k in RANK_FIELDS}
    r_main = main_rank(pairs)
    alpha = float(r_main)
    params = ParamBuffer(lora_specs(lora_targets(cfg, ranks, alpha, tied=False)))
    maps = mappings(pairs)
    for w, p in pairs.items():
        for suffix, arr in ((".lora_a", p.a), (".lora_b", p.b)):
            params[maps[w + suffix].ours][...] = convert_chunk(arr, maps[w + suffix])
    m_chunks, v_chunks, note = split_moments(f, {n: math.prod(m.shape) for n, m in maps.items()}, True, cfg.n_layer)
    if m_chunks is not None:
        for n, m in maps.items():
            lo, hi = params.offsets[m.ours]
            params.m[lo:hi] = convert_chunk(m_chunks[n], m, -1).reshape(-1)
            params.v[lo:hi] = convert_chunk(v_chunks[n], m, -2).reshape(-1)
    state = _state(f)
    # what `llamatune finetune` with these ranks stores: rank None = --lora-r, lora_alpha None = alpha lora_r
    options: dict = {"lora_r": r_main, "lora_alpha": None}
    for kind, field in RANK_FIELDS.items():
        options[field] = None if kind in MATRIX_KINDS and ranks[kind] == r_main else ranks[kind]
    defaults = FinetuneOptions()
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in options.items() if v != getattr(defaults, k))
    model_kvs = [kv(f"training.lora.rank.{k}", r) for k, r in ranks.items()] + [kv("training.lora.alpha", alpha)]
    _save(output, ckpt.KIND_LORA, cfg, options, params, state, model_kvs, fingerprint)
    notes = [scale_note(pairs, alpha), note, "the data order restarts (the 2023 shuffle state cannot be carried over)"]
    return (f"wrote llamatune finetune checkpoint {output} at iteration {state.iteration} ({len(pairs)} adapter pairs, "
            f"{params.size:,} parameters); resume it with `llamatune finetune --checkpoint-in {output}{flags}` "
            "and the same --model-base"), notes


def train_checkpoint(f: GGUFFile, output: Path) -> tuple[str, list[str]]:
    """A 2023 train-text-from-scratch checkpoint as a llamatune train_model checkpoint (parameters in
    llama.cpp tensor order, as writer.tensor_names lists them)."""
    cfg = legacy_config(f)
    shapes = tensor_names(cfg, tied="output.weight" not in f.tensors)
    problems = [n for n, s in shapes.items() if n not in f.tensors or f.tensors[n].shape != s]
    if problems:
        raise LlamatuneError(f"{f.path}: tensors missing or of the wrong shape for its hyperparameters: {problems[:5]}")
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()])
    for n, s in shapes.items():
        params[n][...] = float_array(f.path, f.tensors[n])
    m_chunks, v_chunks, note = split_moments(f, {n: math.prod(s) for n, s in shapes.items()}, False, cfg.n_layer)
    if m_chunks is not None:
        for n in shapes:
            lo, hi = params.offsets[n]
            params.m[lo:hi], params.v[lo:hi] = m_chunks[n], v_chunks[n]
    state = _state(f)
    options = {"embd": cfg.n_embd, "head": cfg.n_head, "head_kv": None, "layer": cfg.n_layer, "ff": cfg.n_ff,
               "norm_rms_eps": _f32(cfg.norm_eps), "rope_freq_base": _f32(cfg.rope_freq_base)}
    model_kvs = [kv(k, v) for k, v in cfg.metadata().items()] + vocab_kvs(f)
    _save(output, ckpt.KIND_FULL, cfg, options, params, state, model_kvs, "")
    return (f"wrote llamatune train_model checkpoint {output} at iteration {state.iteration} ({cfg.n_layer} layers, "
            f"{params.size:,} parameters)"), [note, "the data order restarts"]
