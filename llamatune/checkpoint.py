"""Training checkpoints: one GGUF file holding everything a run needs to go on
exactly where it stopped.

Layout (format version 1):
  KVs  general.type = "llamatune-checkpoint", llamatune.checkpoint.version = 1,
       llamatune.checkpoint.kind = "finetune_lora" | "train_model",
       llamatune.options (JSON of every training option), llamatune.base_model
       (fingerprint of the base GGUF), training.{iteration,sample,token,epoch}_count
       (u64, llama.cpp's 2023 names), llamatune.data_state (JSON: batcher state,
       shuffle generator state), llamatune.guard_state (JSON: divergence guard
       history, absent in older files), training.loss_ema (f32), the model's `{arch}.*`
       keys, LoRA ranks `training.lora.rank.<kind>` and alpha, and for full models
       the tokenizer keys.
  Tensors: every trainable parameter by name (f32, numpy shapes as in the
       ParamBuffer: lora_a (r, n_in), lora_b (n_out, r) like today's adapters), then
       `optimizer.adam.first_moments` and `optimizer.adam.second_moments` (flat,
       parameter order), as llama.cpp's 2023 checkpoints stored them.
Writes are atomic (see gguf_io.atomic_path); the LATEST copy is a second atomic write.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as VType

from .errors import LlamatuneError
from .gguf_io import KV, GGUFFile, atomic_path, kv, tensor_out, write_gguf
from .params import ParamBuffer

FORMAT_VERSION = 1
KIND_LORA, KIND_FULL = "finetune_lora", "train_model"


@dataclass
class TrainState:
    iteration: int = 0          # optimizer steps done
    sample_count: int = 0
    token_count: int = 0
    epoch: int = 0
    loss_ema: float = float("nan")
    data_state: dict | None = None
    guard: dict | None = None   # divergence guard history (guard.Guard.state)


def fingerprint(f: GGUFFile) -> str:
    """Identifies a base model by its tensors' names, types and shapes and its name."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str(f.get("general.name", "")).encode())
    for name, t in f.tensors.items():
        h.update(f"{name}:{t.qtype.name}:{t.shape};".encode())
    return h.hexdigest()


def options_json(opts) -> str:
    return json.dumps({k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
                      sort_keys=True)


def iteration_path(template: Path | str, iteration: int | str) -> Path:
    return Path(str(template).replace("ITERATION", str(iteration)))


def save(path: Path, kind: str, arch: str, opts, params: ParamBuffer, state: TrainState,
         model_kvs: list[KV], base_fingerprint: str = "") -> None:
    kvs = [kv("general.type", "llamatune-checkpoint"), kv("llamatune.checkpoint.version", FORMAT_VERSION),
           kv("llamatune.checkpoint.kind", kind), kv("llamatune.options", options_json(opts)),
           kv("llamatune.base_model", base_fingerprint),
           KV("training.iteration_count", state.iteration, VType.UINT64),
           KV("training.sample_count", state.sample_count, VType.UINT64),
           KV("training.token_count", state.token_count, VType.UINT64),
           KV("training.epoch_count", state.epoch, VType.UINT64),
           kv("training.loss_ema", float(state.loss_ema)),
           kv("llamatune.data_state", json.dumps(state.data_state or {})),
           kv("llamatune.guard_state", json.dumps(state.guard or {}))] + list(model_kvs)
    values = params.host_views(params.data)
    tensors = [tensor_out(s.name, values[s.name]) for s in params.specs]
    tensors += [tensor_out("optimizer.adam.first_moments", params.host(params.m)),
                tensor_out("optimizer.adam.second_moments", params.host(params.v))]
    write_gguf(path, arch, kvs, tensors)


def copy_atomic(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


@dataclass
class Checkpoint:
    path: Path
    kind: str
    options: dict[str, Any]
    base_fingerprint: str
    state: TrainState
    file: GGUFFile

    def load_into(self, params: ParamBuffer) -> None:
        """Copy parameters and moments; every name and shape must match."""
        f = self.file
        problems = []
        for s in params.specs:
            t = f.tensors.get(s.name)
            if t is None:
                problems.append(f"missing tensor '{s.name}'")
            elif t.shape != s.shape:
                problems.append(f"'{s.name}' has shape {t.shape}, this run needs {s.shape}")
        extra = [n for n in f.tensors if n not in params.offsets and not n.startswith("optimizer.")]
        if extra:
            problems.append(f"unexpected tensors {extra[:5]}")
        for name in ("optimizer.adam.first_moments", "optimizer.adam.second_moments"):
            t = f.tensors.get(name)
            if t is None or t.shape != (params.size,):
                problems.append(f"'{name}' missing or not of {params.size} values")
        if problems:
            raise LlamatuneError(f"{self.path}: checkpoint does not fit this run: " + "; ".join(problems))
        for s in params.specs:
            params[s.name][...] = f.tensors[s.name].data.reshape(s.shape)
        params.m[...] = f.tensors["optimizer.adam.first_moments"].data
        params.v[...] = f.tensors["optimizer.adam.second_moments"].data


def load(path: Path) -> Checkpoint:
    f = GGUFFile(path)
    if f.get("general.type") != "llamatune-checkpoint":
        hint = ""
        if f.get("training.type") in ("finetune_lora", "train_model"):
            hint = " (a llama.cpp 2023 checkpoint: convert it with `llamatune convert-checkpoint`)"
        raise LlamatuneError(f"{f.path}: not a llamatune checkpoint{hint}")
    version = f.get("llamatune.checkpoint.version")
    if version != FORMAT_VERSION:
        raise LlamatuneError(f"{f.path}: checkpoint format version {version}; this llamatune reads version "
                             f"{FORMAT_VERSION} (use the llamatune version that wrote it)")
    try:
        options = json.loads(f.require("llamatune.options"))
        data_state = json.loads(f.get("llamatune.data_state", "{}")) or None
        guard = json.loads(f.get("llamatune.guard_state", "{}")) or None
    except json.JSONDecodeError as e:
        raise LlamatuneError(f"{f.path}: corrupt checkpoint metadata ({e})") from None
    state = TrainState(int(f.require("training.iteration_count")), int(f.get("training.sample_count", 0)),
                       int(f.get("training.token_count", 0)), int(f.get("training.epoch_count", 0)),
                       float(f.get("training.loss_ema", float("nan"))), data_state, guard)
    return Checkpoint(f.path, f.require("llamatune.checkpoint.kind"), options,
                      f.get("llamatune.base_model", ""), state, f)


def check_frozen_options(ckpt: Checkpoint, opts) -> None:
    """Options that define the trajectory (shapes, data, ranks...) must not change on resume."""
    changed = []
    for fld in dataclasses.fields(opts):
        if fld.metadata.get("frozen") and fld.name in ckpt.options:
            now = getattr(opts, fld.name)
            now = str(now) if isinstance(now, Path) else now
            if now != ckpt.options[fld.name]:
                changed.append(f"--{fld.name.replace('_', '-')} {ckpt.options[fld.name]!r} -> {now!r}")
    if changed:
        raise LlamatuneError(f"{ckpt.path}: cannot resume with changed options: {', '.join(changed)} "
                             "(start a new run with another --checkpoint-out to change them)")
