"""`llamatune finetune`: LoRA adapters trained on a frozen, possibly quantized base
(or, with --fine-tune-type full, the base's own weights: train/full.py).

Sets up the job (base model memory-mapped and left as stored, adapter targets,
data) and hands it to the shared training loop. Outputs: training checkpoints and
an adapter in llama.cpp's `--lora` format, each also under the LATEST name.
"""
from __future__ import annotations

from pathlib import Path

from ..backend import get_backend
from ..console import notice
from ..errors import LlamatuneError
from ..formats.adapter import write_adapter
from ..formats.gguf_io import kv
from ..models.model import Model
from ..models.weights import FrozenBase
from ..options import FinetuneOptions
from ..outputs import check_training_paths
from ..train import checkpoint as ckpt
from ..train import distributed
from ..train.data import Samples, read_text
from ..train.datasets import load_dataset
from ..train.full import full_job
from ..train.lora import init_lora, lora_specs, lora_targets, to_adapter
from ..train.params import ParamBuffer
from ..train.trainer import Job, TrainResult, run
from ..train.validation import validation_samples


def read_training_text(path: Path | None) -> str:
    if path is None:
        raise LlamatuneError("--train-data is required")
    return read_text(path, "training data")


def check_packing(o, samples) -> None:
    """--pack needs whole-sequence samples and a graph with segment-aware attention.
    Without it (or --fill-with-next-samples for text samples), says so when samples
    fill less than half of --ctx on average: the rest of each window is padding, and
    up to the longest sample of a micro-batch (Graph._trimmed) it is computed in every
    layer like a real token."""
    import inspect

    from ..train.graph import Graph
    if not o.pack:
        fill = float(samples.sizes.mean()) / o.ctx if len(samples) else 1.0
        remedy = ("--pack puts several in a window" if samples.mask is not None else
                  "--fill-with-next-samples fills it" if o.sample_start and not o.fill_with_next_samples else None)
        if remedy and fill < 0.5:
            notice(f"samples fill {fill:.0%} of --ctx {o.ctx} on average, the rest of each window is padding: "
                   + remedy)
        return
    if samples.mask is None:
        notice("--pack applies to conversations and rows; raw text already fills every window")
    elif "segments" not in inspect.signature(Graph.step).parameters:
        raise LlamatuneError("--pack: this build's attention cannot confine packed samples; train without --pack")


def load_data(path: Path, tokenizer, o, role: str = "training") -> Samples:
    """The samples of a training or validation data file: the one place both are loaded."""
    return load_dataset(path, tokenizer, o, role)


def train_and_validation(o, tokenizer) -> tuple[Samples, Samples | None]:
    """Training samples, and validation samples from --val-data or --val-split (or None)."""
    return validation_samples(load_data(o.train_data, tokenizer, o), o,
                              lambda path: load_data(path, tokenizer, o, "validation"))


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
    if o.fine_tune_type == "full":                    # every weight trained (train/full.py)
        return full_job(o, model, samples, val_samples, get_backend(o.device, o.tf32))
    tied = model.weights.output is model.weights.token_embd
    alpha = float(o.lora_alpha if o.lora_alpha is not None else o.lora_r)
    targets = lora_targets(cfg, o.ranks(), alpha, tied)
    if any(t.kind.endswith("norm") for t in targets):
        notice("norm adapters are trained and kept in the adapter file, but llama.cpp ignores them at run time; "
               "`llamatune export-lora` merges them")
    params = ParamBuffer(lora_specs(targets))

    def write_outputs(tag: str) -> list[Path]:
        path = ckpt.iteration_path(o.lora_out, tag)
        write_adapter(path, to_adapter(params, targets, cfg.arch, alpha),
                      extra=[kv("adapter.lora.base_model", model.path.name)])
        return [path]

    ranks = o.ranks()
    model_kvs = [kv(f"training.lora.rank.{k}", r) for k, r in ranks.items()] + [kv("training.lora.alpha", alpha)]
    model_kvs += [kv(k, v) for k, v in cfg.metadata().items()]        # the base's shape, for converters
    backend = get_backend(o.device, o.tf32)
    return Job(ckpt.KIND_LORA, o, cfg, FrozenBase(model, backend), params, targets, samples, model.tokenizer,
               lambda rng: init_lora(params, targets, rng), write_outputs, model_kvs,
               ckpt.fingerprint(model.file), mapped_bytes=model.path.stat().st_size,
               scratch_bytes=model.dequantizer.nbytes, backend=backend, model_path=model.path,
               output_size=(o.lora_out, 4 * params.size + 2**16), val_samples=val_samples)


def finetune(o: FinetuneOptions, quiet: bool = False) -> TrainResult:
    distributed.setup(o)                  # join an MPI job first: only rank 0 prints while loading
    return run(build_job(o), quiet=quiet)
