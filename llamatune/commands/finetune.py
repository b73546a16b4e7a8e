"""`llamatune finetune`: LoRA adapters trained on a frozen, possibly quantized base
(or, with --fine-tune-type full, the base's own weights: train/full.py).

Sets up the job (base model memory-mapped and left as stored, adapter targets,
data) and hands it to the shared training loop. Outputs: training checkpoints, an
adapter in llama.cpp's `--lora` format and beside it the imatrix of the training data
(train/statistics.py; by default named as export-lora looks for it: formats/imatrix.py
`beside`), each also under the LATEST name.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..backend import get_backend
from ..console import notice
from ..data.recorded import data_kvs
from ..errors import LlamatuneError
from ..formats.adapter import write_adapter
from ..formats.gguf_io import gguf_nbytes, kv
from ..formats.imatrix import COUNTS, SUMS, beside, write_imatrix
from ..locks import hold_training
from ..models.model import Model, check_is_model
from ..models.weights import FrozenBase
from ..models.writer import parse_outtype, tensor_names
from ..options import FinetuneOptions
from ..outputs import check_training_paths
from ..train import checkpoint as ckpt
from ..train import distributed
from ..train.full import FullWeights, load_trained, model_tensors, trained_names, write_full_model
from ..train.grpo import GRPO
from ..train.inputs import check_packing, read_training_text, train_and_validation
from ..train.linear import requantizable
from ..train.lora import init_lora, lora_specs, lora_targets, to_adapter
from ..train.objective import SFT
from ..train.params import ParamBuffer, ParamSpec
from ..train.preference import Preference
from ..train.statistics import PREFIX, TrainingStats
from ..train.trainer import Job, TrainResult, run


def build_job(o: FinetuneOptions) -> Job:
    if o.model_base is None:
        raise LlamatuneError("--model-base is required")
    check_training_paths(o)
    read_training_text(o.train_data)                  # a missing or unreadable file fails before the model loads
    model = Model(o.model_base)
    cfg = model.config
    if o.ctx > cfg.n_ctx_train:
        raise LlamatuneError(f"--ctx {o.ctx} is larger than the model's context length {cfg.n_ctx_train} "
                             f"({model.path.name})")
    samples, val_samples = train_and_validation(o, model.tokenizer)
    check_packing(o, samples)
    if o.merge_aware and o.fine_tune_type == "full":
        raise LlamatuneError("--merge-aware trains LoRA adapters for a quantized merge: not with --fine-tune-type full")
    if o.fine_tune_type == "full":                    # every weight trained (train/full.py)
        return full_job(o, model, samples, val_samples, get_backend(o.device, o.tf32))
    tied = model.weights.output is model.weights.token_embd
    alpha = float(o.lora_alpha if o.lora_alpha is not None else o.lora_r)
    targets = lora_targets(cfg, o.ranks(), alpha, tied)
    if any(t.kind.endswith("norm") for t in targets):
        notice("norm adapters are trained and kept in the adapter file, but llama.cpp ignores them at run time; "
               "`llamatune export-lora` merges them")
    merge_extra = _merge_aware_bytes(o, model, targets)
    params = ParamBuffer(lora_specs(targets))
    backend = get_backend(o.device, o.tf32)
    stats = None
    if o.method == "sft":
        stats = TrainingStats(backend.xp, Path(o.train_data).name, o.ctx)

    data = data_kvs(o)                                # the adapter records its training data (export-lora)

    def write_outputs(tag: str) -> list[Path]:
        path = ckpt.iteration_path(o.lora_out, tag)
        if stats is not None:
            imatrix = ckpt.iteration_path(o.imatrix_out or beside(o.lora_out), tag)
            write_imatrix(imatrix, stats.imatrix(), cfg.arch)
        write_adapter(path, to_adapter(params, targets, cfg.arch, alpha),
                      extra=[kv("adapter.lora.base_model", model.path.name)] + data)
        return [path] + ([imatrix] if stats is not None else [])

    ranks = o.ranks()
    model_kvs = [kv(f"training.lora.rank.{k}", r) for k, r in ranks.items()] + [kv("training.lora.alpha", alpha)]
    model_kvs += [kv(k, v) for k, v in cfg.metadata().items()]        # the base's shape, for converters
    model_kvs += data                                                  # and the data record (convert-checkpoint)
    sizes = _output_bytes(o, model, params, stats is not None)
    return Job(ckpt.KIND_LORA, o, cfg, FrozenBase(model, backend), params, targets, samples, model.tokenizer,
               lambda rng: init_lora(params, targets, rng), write_outputs, model_kvs,
               ckpt.fingerprint(model.file), mapped_bytes=model.path.stat().st_size,
               scratch_bytes=model.dequantizer.nbytes + merge_extra, backend=backend, model_path=model.path,
               output_size=sizes[0], val_samples=val_samples, statistics=stats, side_outputs=sizes[1],
               checkpoint_extra_bytes=sizes[2], objective=_objective(o, model, stats))


def _objective(o: FinetuneOptions, model: Model, stats):
    """What a LoRA run's steps train for (train/objective.py)."""
    if o.method == "grpo":
        return GRPO(o, model)
    return SFT(stats) if o.method == "sft" else Preference(o)


ADAPTER_META_BYTES = 1024          # an adapter's or imatrix's metadata (types, alpha, base name, datasets)


def _output_bytes(o: FinetuneOptions, model: Model, params: ParamBuffer, imatrix: bool):
    """What a save writes besides the checkpoint: (the adapter's template, its bytes), the
    imatrix files beside it [(template, bytes)], and the bytes of the imatrix sums a
    checkpoint keeps (statistics.py); every tensor f32."""
    adapter = gguf_nbytes(ADAPTER_META_BYTES, [(s.name, len(s.shape), 4 * math.prod(s.shape)) for s in params.specs])
    if not imatrix:
        return (o.lora_out, adapter), [], 0
    inputs = [(n, t.n_cols) for n, t in model.file.tensors.items() if n.startswith("blk.") and len(t.shape) == 2]
    sums = [(n + SUMS, 2, 4 * cols) for n, cols in inputs]
    file = gguf_nbytes(ADAPTER_META_BYTES, sums + [(n + COUNTS, 2, 4) for n, _ in inputs])
    in_checkpoint = gguf_nbytes(0, [(PREFIX + n, d, b) for n, d, b in sums]) + 64 * len(inputs)
    return (o.lora_out, adapter), [(o.imatrix_out or beside(o.lora_out), file)], in_checkpoint


def full_job(o: FinetuneOptions, model: Model, samples, val_samples, backend) -> Job:
    """A full finetune of `model`: its trained tensors as f32 parameters (train/full.py)."""
    cfg, f = model.config, model.file
    tied = model.weights.output is model.weights.token_embd
    shapes = tensor_names(cfg, tied)
    names = trained_names(list(shapes), o.train_only, o.freeze, model.path.name)
    params = ParamBuffer([ParamSpec(n, shapes[n]) for n in names], moments=o.optimizer == "adamw",
                         moments_bf16=o.adam_moments == "bf16")
    target = parse_outtype(o.out_type) if o.out_type else None
    weights = FullWeights(FrozenBase(model, backend), params, tied)

    def write_outputs(tag: str) -> list[Path]:
        path = ckpt.iteration_path(o.model_out, tag)
        write_full_model(path, f, params, target)
        return [path]

    frozen = {id(t): t for t in weights.tensors.values()}          # frozen matrices, the tied head once
    mapped = sum(t.nbytes for t in frozen.values())                 # (read every step; vectors are in memory)
    out_bytes = sum(t.nbytes for t in model_tensors(f, {n: None for n in names}, target, set())) + 2**20 + sum(
        len(repr(item.value)) for item in f.kvs.values())
    model_kvs = [kv(k, v) for k, v in cfg.metadata().items()]
    model_kvs += [item for key, item in f.kvs.items() if key.startswith("tokenizer.")]   # convert-checkpoint
    return Job(ckpt.KIND_FULL, o, cfg, weights, params, [], samples, model.tokenizer,
               lambda rng: load_trained(params, f), write_outputs, model_kvs, ckpt.fingerprint(f),
               mapped_bytes=mapped, scratch_bytes=model.dequantizer.nbytes if frozen else 0, backend=backend,
               model_path=model.path, output_size=(o.model_out, out_bytes), val_samples=val_samples,
               objective=_objective(o, model, None))


def _merge_aware_bytes(o: FinetuneOptions, model: Model, targets) -> int:
    """--merge-aware's checks, and the host bytes it adds: the largest requantized matrix
    held merged and dequantized in f32 at once (linear.py `requantized`)."""
    if not o.merge_aware:
        return 0
    if o.lora_dropout > 0:
        raise LlamatuneError(f"--merge-aware trains what the merged model computes, where no adapter input is dropped: "
                             f"give --lora-dropout 0 (not {o.lora_dropout})")
    stored = [model.file.tensors[t.weight] for t in targets if t.weight in model.file.tensors]
    sizes = [8 * m.n_rows * m.n_cols for m in stored if len(m.shape) == 2 and requantizable(m.qtype)]
    if not sizes:
        raise LlamatuneError(f"--merge-aware: no adapted matrix of {model.path.name} is stored in a quantized type "
                             "that a merge rounds to: nothing to train for")
    unsimulated = sorted({t.kind for t in targets if t.weight in ("token_embd.weight", "output.weight")})
    if unsimulated:
        notice(f"--merge-aware: the {' and '.join(unsimulated)} adapters train as usual (only the layers' "
               "matrices run through their merge)")
    return max(sizes)


def finetune(o: FinetuneOptions, quiet: bool = False) -> TrainResult:
    world = distributed.setup(o)          # join an MPI job first: only rank 0 prints while loading
    if o.model_base is not None and Path(o.model_base).is_file():
        check_is_model(o.model_base)      # an adapter or checkpoint passed as the model says so, before path checks
    with hold_training(o, "finetune", world.is_root):     # before loading: another run may hold the outputs
        return run(build_job(o), quiet=quiet)
