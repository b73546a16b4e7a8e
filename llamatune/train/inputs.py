"""A training run's inputs, read the same way by every training command (finetune,
train-from-scratch): the training text, the training and validation samples, and
the check of --pack against those samples."""
from __future__ import annotations

from pathlib import Path

from ..console import notice
from ..data.datasets import load_dataset, load_pairs
from ..data.prompts import load_prompts
from ..data.samples import Samples, read_text
from ..errors import LlamatuneError
from ..options import TrainOptions
from .preference import split_pairs
from .validation import validation_samples


def read_training_text(path: Path | None) -> str:
    if path is None:
        raise LlamatuneError("--train-data is required")
    return read_text(path, "training data")


def check_packing(o: TrainOptions, samples: Samples) -> None:
    """--pack needs whole-sequence samples and a graph with segment-aware attention.
    Without it (or --fill-with-next-samples for text samples), says so when samples
    fill less than half of --ctx on average: the rest of each window is padding, and
    up to the longest sample of a micro-batch (StepExecutor._trimmed) it is computed in every
    layer like a real token."""
    import inspect

    from .step import StepExecutor
    if not o.pack:
        if trains_pairs(o) or trains_prompts(o):     # preference pairs and prompts are never packed
            return
        fill = float(samples.sizes.mean()) / o.ctx if len(samples) else 1.0
        remedy = ("--pack puts several in a window" if samples.mask is not None else
                  "--fill-with-next-samples fills it" if o.sample_start and not o.fill_with_next_samples else None)
        if remedy and fill < 0.5:
            notice(f"samples fill {fill:.0%} of --ctx {o.ctx} on average, the rest of each window is padding: "
                   + remedy)
        return
    if samples.mask is None:
        notice("--pack applies to conversations and rows; raw text already fills every window")
    elif "segments" not in inspect.signature(StepExecutor.step).parameters:
        raise LlamatuneError("--pack: this build's attention cannot confine packed samples; train without --pack")


def trains_pairs(o) -> bool:
    """--method dpo / orpo (finetune only): the data is preference pairs."""
    return getattr(o, "method", "sft") in ("dpo", "orpo")


def trains_prompts(o) -> bool:
    """--method grpo (finetune only): the data is prompts, completed while training."""
    return getattr(o, "method", "sft") == "grpo"


def load_data(path: Path, tokenizer, o, role: str = "training") -> Samples:
    """The samples of a training or validation data file (--method dpo / orpo: preference
    pairs, chosen and rejected as samples 2i and 2i + 1)."""
    if trains_pairs(o):
        return load_pairs(path, tokenizer, o, role)
    if trains_prompts(o):
        return load_prompts(path, tokenizer, o, role)
    return load_dataset(path, tokenizer, o, role)


def train_and_validation(o: TrainOptions, tokenizer) -> tuple[Samples, Samples | None]:
    """Training samples, and validation samples from --val-data or --val-split (or None):
    the one place both are loaded."""
    train = load_data(o.train_data, tokenizer, o)
    if trains_pairs(o) and o.val_split > 0:
        return split_pairs(train, o.val_split, o.seed)          # whole pairs held out
    return validation_samples(train, o, lambda path: load_data(path, tokenizer, o, "validation"))
