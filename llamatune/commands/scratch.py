"""`llamatune train-from-scratch`: a new model (`--arch`, default llama), every parameter trained.

Same training loop, data, optimizer and checkpoints as `finetune` (trainer.py);
only the job differs: the weights are dense f32 parameters (params.DenseWeights),
the vocabulary is copied from `--vocab-model` or trained with SentencePiece on the
data, and the output is a complete model GGUF that llama.cpp loads.
`--checkpoint-in` also accepts a model GGUF: training continues from its weights
in full precision with a fresh optimizer.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
from gguf import GGML_QUANT_SIZES

from ..backend import get_backend
from ..console import notice
from ..errors import LlamatuneError
from ..formats.gguf_io import GGUFFile, kv
from ..locks import hold_training
from ..models.arch import get_arch, supported
from ..models.config import ModelConfig
from ..models.model import Model
from ..models.writer import (
    parse_outtype,
    random_weights,
    tensor_names,
    train_spm_vocab,
    vocab_kvs,
    write_model,
)
from ..models.tokenizer import Tokenizer
from ..options import ScratchOptions, special_tokens
from ..outputs import check_training_paths
from ..train import checkpoint as ckpt
from ..train import distributed
from ..train.inputs import check_packing, read_training_text, train_and_validation
from ..train.params import DenseWeights, ParamBuffer, ParamSpec
from ..train.trainer import Job, TrainResult, run


def llama_ff(n_embd: int, multiple_of: int = 256) -> int:
    """Feed-forward size by llama's rule: 2/3 of 4*embd, rounded up to a multiple."""
    hidden = int(2 * 4 * n_embd / 3)
    return (hidden + multiple_of - 1) // multiple_of * multiple_of


def _vocab(o: ScratchOptions, text: str):
    """(tokenizer keys, tokenizer) from --vocab-model or trained on the data."""
    control = special_tokens(o)
    if o.vocab_model is not None:
        f = GGUFFile(o.vocab_model)
        kvs = vocab_kvs(f)
        return kvs, Tokenizer.from_gguf(f)
    kvs = train_spm_vocab(text, o.vocab_size, str(o.train_data), control)
    md = {item.key: item.value for item in kvs}
    view = SimpleNamespace(path=Path(f"{o.train_data} (trained vocabulary)"), get=lambda k, d=None: md.get(k, d))
    return kvs, Tokenizer.from_gguf(view)


def _model_init(path: Path, cfg: ModelConfig):
    """Continue from a model GGUF: its weights as f32 (checked against cfg)."""
    m = Model(path)
    if m.config != cfg:
        raise LlamatuneError(f"{path}: model shape {m.config} differs from the options given")
    weights = {}
    for name, t in m.file.tensors.items():
        if name in tensor_names(cfg):
            from ..kernels import dequant
            weights[name] = dequant.dequantize(t.raw_rows(), t.qtype, t.n_cols).reshape(t.shape)
    return weights


def scratch_arch(name: str) -> str:
    """`--arch`: a declared architecture that trains from scratch (Arch.scratch)."""
    names = [a for a in supported() if get_arch(a).scratch]
    if name not in names:
        raise LlamatuneError(f"--arch {name}: train-from-scratch builds {', '.join(names)}")
    return name


def build_job(o: ScratchOptions) -> Job:
    check_training_paths(o)
    text = read_training_text(o.train_data)
    vocab, tok = _vocab(o, text)
    n_head_kv = o.head_kv or o.head
    if o.embd % o.head:
        raise LlamatuneError(f"--embd {o.embd} is not a multiple of --head {o.head}")
    cfg = ModelConfig.new(scratch_arch(o.arch), n_vocab=tok.n_vocab, n_ctx_train=o.ctx, n_embd=o.embd,
                          n_layer=o.layer, n_ff=o.ff or llama_ff(o.embd), n_head=o.head, n_head_kv=n_head_kv,
                          head_dim=o.embd // o.head, n_rot=o.embd // o.head, norm_eps=o.norm_rms_eps,
                          rope_freq_base=o.rope_freq_base)
    tied = cfg.spec.tied                  # gemma: the head is token_embd
    samples, val_samples = train_and_validation(o, tok)
    check_packing(o, samples)
    shapes = tensor_names(cfg, tied)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()])
    outtype = parse_outtype(o.outtype)
    start_model = None
    if o.checkpoint_in is not None and Path(o.checkpoint_in).exists():
        f = GGUFFile(o.checkpoint_in)
        if f.get("general.type", "model") == "model":
            start_model = _model_init(Path(o.checkpoint_in), cfg)
            notice(f"{o.checkpoint_in} is a model: training continues from its weights with a fresh optimizer")
            o.checkpoint_in = None

    def init(rng: np.random.Generator) -> None:
        weights = start_model or random_weights(cfg, seed=int(rng.integers(1 << 31)), tied=tied)
        for name, a in weights.items():
            params[name][...] = a

    def write_outputs(tag: str) -> list[Path]:
        path = ckpt.iteration_path(o.model_out, tag)
        write_model(path, cfg, params.host_views(params.data), vocab, outtype, name="llamatune scratch model")
        return [path]

    model_kvs = [kv(k, v) for k, v in cfg.metadata().items()] + list(vocab)
    block, block_bytes = GGML_QUANT_SIZES[outtype]
    model_bytes = params.size * block_bytes // block + 2**20 + sum(len(repr(item.value)) for item in vocab)
    return Job(ckpt.KIND_FULL, o, cfg, DenseWeights(params, tied), params, [], samples, tok, init, write_outputs,
               model_kvs, backend=get_backend(o.device, o.tf32), output_size=(o.model_out, model_bytes),
               val_samples=val_samples)


def train_from_scratch(o: ScratchOptions, quiet: bool = False) -> TrainResult:
    world = distributed.setup(o)          # join an MPI job first: only rank 0 prints while loading
    with hold_training(o, "train-from-scratch", world.is_root):   # before loading: another run may hold the outputs
        return run(build_job(o), quiet=quiet)
