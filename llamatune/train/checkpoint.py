"""Training checkpoints: one GGUF file holding everything a run needs to go on
exactly where it stopped.

Layout (format version 1):
  KVs  general.type = "llamatune-checkpoint", llamatune.checkpoint.version = 1,
       llamatune.checkpoint.kind = "finetune_lora" | "train_model",
       llamatune.options (JSON of every training option), llamatune.base_model
       (fingerprint of the base GGUF), training.{iteration,sample,token,epoch}_count
       (u64, llama.cpp's 2023 names), llamatune.data_state (JSON: batcher state,
       shuffle generator state), llamatune.guard_state (JSON: divergence guard
       history, absent in older files), training.loss_ema (f32), llamatune.validation
       (JSON: best validation loss, its step, evaluations since; only with validation;
       older checkpoints without it load with a fresh validation state), llamatune.ranks (MPI
       ranks that trained it, 1 when absent: the global batch is grad_acc x ranks), the model's `{arch}.*`
       keys, LoRA ranks `training.lora.rank.<kind>` and alpha, and for full models
       the tokenizer keys.
  Tensors: every trainable parameter by name (f32, numpy shapes as in the
       ParamBuffer: lora_a (r, n_in), lora_b (n_out, r) like today's adapters), then
       `optimizer.adam.first_moments` and `optimizer.adam.second_moments` (flat,
       parameter order; F32, or BF16 with --adam-moments bf16), as llama.cpp's 2023
       checkpoints stored them; none when
       the run keeps no moments (SGD: ParamBuffer(moments=False)); a LoRA run's
       imatrix statistics `imatrix.<weight>.in_sum2` with their counts in the KV
       llamatune.imatrix (train/statistics.py; absent in older files).
Writes are atomic (see gguf_io.atomic_path); the LATEST copy is a second atomic write.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from ..errors import LlamatuneError, listed
from ..formats.gguf_io import KV, GGUFFile, TensorOut, atomic_path, kv, tensor_out, write_gguf
from ..formats.tensors import check_finite
from .params import ParamBuffer
from .validation import ValidationState

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
    validation: ValidationState | None = None
    ranks: int = 1              # data-parallel ranks that wrote it (the global batch is grad_acc x ranks)


def fingerprint(f: GGUFFile) -> str:
    """Identifies a base model by its tensors' names, types and shapes and its name."""
    h = hashlib.blake2b(digest_size=12)
    h.update(str(f.get("general.name", "")).encode())
    for name, t in f.tensors.items():
        h.update(f"{name}:{t.qtype.name}:{t.shape};".encode())
    return h.hexdigest()


def options_json(opts, **given) -> str:
    """The options as JSON; `given` values stand for the options' own."""
    values = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}
    return json.dumps(values | given, sort_keys=True)


def iteration_path(template: Path | str, iteration: int | str) -> Path:
    return Path(str(template).replace("ITERATION", str(iteration)))


def moments_out(name: str, flat: np.ndarray) -> TensorOut:
    """AdamW moments as a checkpoint stores them: F32, or bf16 moments (--adam-moments bf16)
    as BF16, their bits as they are (nothing widened: no copy at save time)."""
    if flat.dtype == np.uint16:
        return TensorOut(name, flat.shape, QType.BF16, lambda: flat)
    return tensor_out(name, flat)


def bf16_bits(path: Path, name: str, t) -> np.ndarray:
    """A BF16 tensor's bits (uint16), checked finite without widening (an all-ones
    exponent is inf or nan)."""
    bits = np.asarray(t.data).view(np.uint16).reshape(-1)
    step = 1 << 24
    for lo in range(0, bits.size, step):
        if ((bits[lo:lo + step] & 0x7F80) == 0x7F80).any():
            raise LlamatuneError(f"{path}: tensor '{name}' holds non-finite values (inf or nan)")
    return bits


def save(path: Path, kind: str, arch: str, opts, params: ParamBuffer, state: TrainState,
         model_kvs: list[KV], base_fingerprint: str = "", extra: tuple[list[KV], list] = ([], []),
         policy=None) -> None:
    """`extra`: KVs and tensors of what else the run keeps (statistics.py: `imatrix.*`).
    `policy`: the run's precision.ComputePolicy, kept whole (`llamatune.compute`) and as the
    options' compute_dtype (the dtype it resolved to, which a resume with auto keeps)."""
    options = options_json(opts) if policy is None else options_json(opts, compute_dtype=policy.dtype)
    compute = [] if policy is None else [kv("llamatune.compute", json.dumps(policy.record(), sort_keys=True))]
    kvs = [kv("general.type", "llamatune-checkpoint"), kv("llamatune.checkpoint.version", FORMAT_VERSION),
           kv("llamatune.checkpoint.kind", kind), kv("llamatune.options", options), *compute,
           kv("llamatune.base_model", base_fingerprint),
           KV("training.iteration_count", state.iteration, VType.UINT64),
           KV("training.sample_count", state.sample_count, VType.UINT64),
           KV("training.token_count", state.token_count, VType.UINT64),
           KV("training.epoch_count", state.epoch, VType.UINT64),
           kv("training.loss_ema", float(state.loss_ema)),
           kv("llamatune.data_state", json.dumps(state.data_state or {})),
           kv("llamatune.guard_state", json.dumps(state.guard or {})),
           kv("llamatune.ranks", int(state.ranks))] + list(model_kvs)
    if state.validation is not None:
        kvs.append(kv("llamatune.validation", json.dumps(dataclasses.asdict(state.validation))))
    values = params.host_views(params.data)
    tensors = [tensor_out(s.name, values[s.name]) for s in params.specs]
    if params.has_moments:
        tensors += [moments_out("optimizer.adam.first_moments", params.host(params.m)),
                    moments_out("optimizer.adam.second_moments", params.host(params.v))]
    write_gguf(path, arch, kvs + list(extra[0]), tensors + list(extra[1]))


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
        extra = [n for n in f.tensors if n not in params.offsets and not n.startswith(("optimizer.", "imatrix."))]
        if extra:
            problems.append(f"unexpected tensors {extra[:5]}")
        moments = ("optimizer.adam.first_moments", "optimizer.adam.second_moments") if params.has_moments else ()
        for name in moments:                          # a run without moments (SGD) ignores any
            t = f.tensors.get(name)
            if t is None or t.shape != (params.size,):
                problems.append(f"'{name}' missing or not of {params.size} values")
        if problems:
            raise LlamatuneError(f"{self.path}: checkpoint does not fit this run: " + listed(problems))
        bf16_moments = params.has_moments and params.m.dtype == np.uint16
        used = [(s.name, f.tensors[s.name]) for s in params.specs]
        used += [(n, f.tensors[n]) for n in moments]
        for name, t in used:
            if t.qtype != QType.F32 and not (bf16_moments and name in moments and t.qtype == QType.BF16):
                raise LlamatuneError(f"{self.path}: tensor '{name}' has type {t.qtype.name}, expected F32 "
                                     "(checkpoints hold parameters and moments in F32, bf16 moments in BF16)")
        check_finite(self.path, [(n, t) for n, t in used if t.qtype == QType.F32])
        for s in params.specs:
            params[s.name][...] = f.tensors[s.name].data.reshape(s.shape)
        for flat, name in zip((params.m, params.v), moments):
            t = f.tensors[name]
            if t.qtype == QType.BF16:                   # bf16 moments, bit for bit
                flat[...] = bf16_bits(self.path, name, t)
            elif bf16_moments:                          # F32 moments into bf16 ones: rounded
                from ..kernels import bf16
                bf16.to_bf16(flat, np.ascontiguousarray(t.data, np.float32).reshape(-1))
            else:
                flat[...] = t.data


def load(path: Path) -> Checkpoint:
    f = GGUFFile(path)
    if f.get("general.type") != "llamatune-checkpoint":
        hint = ""
        if f.get("training.type") in ("finetune_lora", "train_model"):
            hint = " (a llama.cpp 2023 checkpoint: convert it with `llamatune convert-checkpoint`)"
        raise LlamatuneError(f"{f.path}: not a llamatune checkpoint{hint}")
    version = f.get("llamatune.checkpoint.version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise LlamatuneError(f"{f.path}: checkpoint format version {str(version)[:20]}; this llamatune reads "
                             f"version {FORMAT_VERSION} (use the llamatune version that wrote it)")
    kind = f.get_str("llamatune.checkpoint.kind", required=True)
    if kind not in (KIND_LORA, KIND_FULL):
        raise LlamatuneError(f"{f.path}: metadata key 'llamatune.checkpoint.kind' is {kind[:40]!r}, "
                             f"expected '{KIND_LORA}' or '{KIND_FULL}'")
    options = _json_object(f, "llamatune.options", None)
    data_state = _json_object(f, "llamatune.data_state", "{}") or None
    guard = _json_object(f, "llamatune.guard_state", "{}") or None
    validation = None
    if "llamatune.validation" in f.kvs:
        try:
            validation = ValidationState.from_dict(_json_object(f, "llamatune.validation", None))
        except (TypeError, ValueError) as e:
            raise LlamatuneError(f"{f.path}: metadata key 'llamatune.validation' is invalid ({e})") from None
    ranks = f.get_int("llamatune.ranks", 1, lo=1, hi=1 << 20)
    loss_ema = f.get("training.loss_ema", float("nan"))
    if not (isinstance(loss_ema, float) and math.isnan(loss_ema)):      # nan: no loss seen yet
        loss_ema = f.get_float("training.loss_ema")
    state = TrainState(f.get_int("training.iteration_count", required=True), f.get_int("training.sample_count", 0),
                       f.get_int("training.token_count", 0), f.get_int("training.epoch_count", 0),
                       float(loss_ema), data_state, guard, validation, ranks)
    _check_ranks(f)
    return Checkpoint(f.path, kind, options, f.get_str("llamatune.base_model", ""), state, f)


def _json_object(f: GGUFFile, key: str, default: str | None) -> dict:
    """A metadata string holding a JSON object (options, data state)."""
    text = f.get_str(key, default, required=default is None)
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise LlamatuneError(f"{f.path}: metadata key '{key}' is not valid JSON ({str(e)[:80]})") from None
    if not isinstance(value, dict):
        raise LlamatuneError(f"{f.path}: metadata key '{key}' holds {type(value).__name__} JSON, expected an object")
    return value


def _check_ranks(f: GGUFFile) -> None:
    """Each LoRA pair's rank (lora_b's last dimension) must be the rank recorded for its kind."""
    for name, t in f.tensors.items():
        if not name.endswith(".lora_b"):
            continue
        kind = name[:-len(".weight.lora_b")].rsplit(".", 1)[-1]
        recorded = f.get_int(f"training.lora.rank.{kind}", None)
        if recorded is not None and t.shape[-1] != recorded:
            raise LlamatuneError(f"{f.path}: tensor '{name}' has rank {t.shape[-1]} but the checkpoint records "
                                 f"training.lora.rank.{kind} = {recorded}")


def recorded_dtype(ckpt: Checkpoint) -> str:
    """The compute dtype a checkpoint was trained with ("auto" where it records none)."""
    return ckpt.options.get("compute_dtype", "auto")


def check_frozen_options(ckpt: Checkpoint, opts, ranks: int = 1, given: dict | None = None) -> None:
    """Options that define the trajectory (shapes, data, ranks...) must not change on resume.
    For gradient accumulation what is frozen is the global batch, --grad-acc x data-parallel
    ranks: a run saved by K ranks resumes with any other number of ranks. `given`: values
    that stand for the options' own (the compute dtype a resume with auto keeps)."""
    changed = []
    if "grad_acc" in ckpt.options and ckpt.options["grad_acc"] * ckpt.state.ranks != opts.grad_acc * ranks:
        changed.append(f"micro-batches per step (--grad-acc x ranks) {ckpt.options['grad_acc']} x {ckpt.state.ranks} "
                       f"-> {opts.grad_acc} x {ranks}")
    for fld in dataclasses.fields(opts):
        if fld.metadata.get("frozen") and fld.name in ckpt.options and fld.name != "grad_acc":
            now = (given or {}).get(fld.name, getattr(opts, fld.name))
            now = str(now) if isinstance(now, Path) else now
            if now != ckpt.options[fld.name]:
                changed.append(f"--{fld.name.replace('_', '-')} {ckpt.options[fld.name]!r} -> {now!r}")
    if changed:
        raise LlamatuneError(f"{ckpt.path}: cannot resume with changed options: {', '.join(changed)} "
                             "(start a new run with another --checkpoint-out to change them)")
