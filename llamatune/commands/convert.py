"""`llamatune convert-checkpoint`: between llamatune checkpoints, GGUF and PEFT
LoRA adapters, and llama.cpp's 2023 training files.

The input's kind comes from its content, never its name:
  - a directory with adapter_config.json + adapter_model.safetensors: a PEFT adapter;
  - a GGUF with general.type = llamatune-checkpoint: ours (finetune_lora or train_model);
  - a GGUF with general.type = adapter: a GGUF LoRA adapter;
  - a GGUF with training.type = finetune_lora | train_model: a llama.cpp 2023 checkpoint;
  - a file starting with b"algg": a 2023 ggla LoRA .bin.

Conversions (first = default --to):
  llamatune finetune checkpoint  -> gguf-adapter (the file finetune's --lora-out writes), peft
  llamatune train_model checkpoint -> model (a full finetune's frozen tensors from --model-base)
  GGUF LoRA adapter              -> peft
  PEFT adapter                   -> gguf-adapter (as llama.cpp's convert_lora_to_gguf.py, without torch)
  2023 finetune checkpoint       -> checkpoint (resumable: parameters, Adam moments, counters), gguf-adapter, peft
  2023 train-text-from-scratch   -> model (llama, F32, tokenizer copied), checkpoint (train_model)
  ggla .bin                      -> gguf-adapter, peft
Layouts and scales: formats/peft.py (PEFT), formats/llamacpp2023.py (2023 files).
Every output is written atomically (GGUF through write_gguf; a PEFT directory is
built beside the target and renamed into place); a GGUF adapter is checked
against --model-base with read_adapter before it replaces anything.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from ..data.recorded import KEY as RECORD_KEY
from ..errors import LlamatuneError
from ..formats.adapter import LoraAdapter, is_norm, read_adapter, write_adapter
from ..formats import llamacpp2023
from ..formats.gguf_io import GGUFFile, atomic_path, check_float, kv, write_error
from ..formats.peft import Heads, PeftNames, peft_files, read_peft
from ..formats.tensors import float_array
from ..locks import hold
from ..models.arch import get_arch
from ..models.config import ModelConfig
from ..models.writer import tensor_names, vocab_kvs, write_model
from ..outputs import Out, check_paths
from ..train import checkpoint as ckpt
from ..train import legacy

TARGETS = ("gguf-adapter", "peft", "checkpoint", "model")
# input kind -> (what it is, the --to choices; the first is the default)
KINDS = {
    "llamatune-lora": ("a llamatune finetune checkpoint", ("gguf-adapter", "peft")),
    "llamatune-full": ("a llamatune train-from-scratch or full-finetune checkpoint", ("model",)),
    "gguf-adapter": ("a GGUF LoRA adapter", ("peft",)),
    "peft": ("a Hugging Face PEFT LoRA adapter", ("gguf-adapter",)),
    "finetune-2023": ("a llama.cpp 2023 finetune checkpoint", ("checkpoint", "gguf-adapter", "peft")),
    "train-2023": ("a llama.cpp 2023 train-text-from-scratch checkpoint", ("model", "checkpoint")),
    "ggla": ("a llama.cpp 2023 ggla LoRA adapter", ("gguf-adapter", "peft")),
}
SUPPORTED = ("supported inputs: llamatune checkpoints, GGUF LoRA adapters, PEFT adapter directories "
             "(adapter_config.json + adapter_model.safetensors), llama.cpp 2023 finetune and train-text-from-scratch "
             "checkpoints, and ggla .bin adapters")


@dataclass
class Source:
    kind: str
    path: Path
    file: GGUFFile | None = None

    @property
    def what(self) -> str:
        return KINDS[self.kind][0]


@dataclass
class Base:
    path: Path
    file: GGUFFile
    cfg: ModelConfig

    @property
    def heads(self) -> Heads:
        return self.cfg.n_head, self.cfg.n_head_kv

    @property
    def name(self) -> str:
        return str(self.file.get("general.name") or self.path.stem)


# --------------------------------------------------------------------------- detection

def detect(path: str | Path) -> Source:
    """What `path` is, from its content (module docstring)."""
    path = Path(path)
    if not path.exists():
        raise LlamatuneError(f"{path}: not found")
    if path.is_dir():
        has_cfg = (path / "adapter_config.json").is_file()
        if has_cfg and (path / "adapter_model.safetensors").is_file():
            return Source("peft", path)
        if has_cfg and (path / "adapter_model.bin").is_file():
            raise LlamatuneError(f"{path}: a PEFT adapter saved as a PyTorch pickle (adapter_model.bin); re-save it "
                                 "with safetensors (save_pretrained(..., safe_serialization=True)) to convert it")
        raise LlamatuneError(f"{path}: a directory without adapter_config.json and adapter_model.safetensors, so not "
                             f"a PEFT adapter; {SUPPORTED}")
    with open(path, "rb") as fh:
        head = fh.read(9)
    if head[:4] == b"GGUF":
        f = GGUFFile(path)
        gtype, ttype = f.get("general.type"), f.get("training.type")
        if gtype == "llamatune-checkpoint":
            kind = f.get("llamatune.checkpoint.kind")
            if kind not in (ckpt.KIND_LORA, ckpt.KIND_FULL):
                raise LlamatuneError(f"{path}: llamatune checkpoint of unknown kind {kind!r}")
            return Source("llamatune-lora" if kind == ckpt.KIND_LORA else "llamatune-full", path, f)
        if gtype == "adapter":
            if f.get("adapter.type") != "lora":
                raise LlamatuneError(f"{path}: a GGUF adapter of type {f.get('adapter.type')!r}; only LoRA adapters "
                                     "can be converted")
            return Source("gguf-adapter", path, f)
        if ttype == "finetune_lora":
            return Source("finetune-2023", path, f)
        if ttype == "train_model":
            return Source("train-2023", path, f)
        if gtype in (None, "model") and f.get("general.architecture") is not None:
            raise LlamatuneError(f"{path}: a {f.get('general.architecture')} model GGUF (as llama.cpp's llama-finetune "
                                 "writes), nothing to convert: use it as it is (--model-base of finetune, "
                                 "-m of perplexity or llama.cpp)")
        raise LlamatuneError(f"{path}: a GGUF {gtype or 'model'} file (general.type={gtype!r}, no training.type), "
                             f"nothing to convert; {SUPPORTED}")
    if head[:4] == b"algg":
        return Source("ggla", path)
    if head[:4] == b"lcgg":
        raise LlamatuneError(f"{path}: a pre-GGUF 'ggcl' training checkpoint; convert it to GGUF first with "
                             "llama.cpp's convert-finetune-checkpoint-to-gguf.py or convert-train-checkpoint-to-gguf.py")
    if len(head) == 9 and head[8:9] == b"{":
        raise LlamatuneError(f"{path}: a safetensors file; pass the PEFT adapter directory that holds it "
                             "(with adapter_config.json)")
    raise LlamatuneError(f"{path}: unknown file type (starts with {head[:4]!r}); {SUPPORTED}")


def load_base(model_base: str | Path | None) -> Base | None:
    if model_base is None:
        return None
    f = GGUFFile(model_base)
    if f.get("general.type") in ("adapter", "llamatune-checkpoint") or f.get("training.type"):
        raise LlamatuneError(f"{f.path}: --model-base must be a model, not {f.get('general.type') or 'a checkpoint'}")
    return Base(f.path, f, ModelConfig.from_metadata(f.metadata, str(f.path), f.tensors))


def _need_base(base: Base | None, src: Source, why: str) -> Base:
    if base is None:
        raise LlamatuneError(f"{src.path}: --model-base is required to convert {src.what}: {why}")
    return base


# --------------------------------------------------------------------------- outputs

def _write_gguf_adapter(output: Path, adapter: LoraAdapter, base: Base | None, base_name: str = "",
                        record: list = ()) -> str:
    """Write a GGUF adapter; with a base it is checked with read_adapter before it replaces the target.
    `record`: the KVs of finetune's record of its training data, carried over (data/recorded.py)."""
    if output.is_dir():
        raise LlamatuneError(f"{output}: is a directory; a GGUF adapter is one file")
    extra = ([kv("adapter.lora.base_model", base_name)] if base_name else []) + list(record)
    with atomic_path(output) as tmp:
        write_adapter(tmp, adapter, extra=extra)
        if base is not None:
            read_adapter(tmp, base.file)
    norms = sum(is_norm(n) for n in adapter.pairs)
    return (f"wrote GGUF LoRA adapter {output} ({len(adapter.pairs)} tensor pairs, alpha {adapter.alpha:g}"
            + (f", {norms} norm adapters that llama.cpp skips at run time" if norms else "")
            + (f"; checked against {base.path.name}" if base else "") + ")")


def peft_names(arch: str, cfg: ModelConfig | None = None) -> PeftNames:
    """The PEFT module names of an architecture, from its declaration (with the base model's
    config, the orders of the kinds the converter reorders)."""
    spec = get_arch(arch)
    orders = spec.peft_orders(cfg) if spec.peft_orders else {}
    return PeftNames(arch, dict(spec.peft_modules), spec.peft_permute_qk, spec.peft_experts, orders)


def _write_peft(output: Path, adapter: LoraAdapter, heads: Heads | None, base_name: str,
                cfg: ModelConfig | None = None) -> tuple[str, list[str]]:
    """Write a PEFT adapter directory: built beside `output`, then renamed into place."""
    from safetensors.numpy import save_file
    config, tensors, notes = peft_files(adapter, peft_names(adapter.arch, cfg), heads, base_name)
    if output.exists() and not output.is_dir():
        raise LlamatuneError(f"{output}: exists and is a file; a PEFT adapter is a directory")
    if output.is_dir() and any(output.iterdir()) and not (output / "adapter_config.json").exists():
        raise LlamatuneError(f"{output}: an existing directory that is not a PEFT adapter; will not replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            with open(tmp / name, "rb+") as fh:
                os.fsync(fh.fileno())
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
            os.replace(output, old / output.name)
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(output, e) from None
        raise
    ranks = sorted({config["r"], *config["rank_pattern"].values()})
    return (f"wrote PEFT adapter {output} ({len(tensors) // 2} modules, r {'/'.join(map(str, ranks))}, "
            f"lora_alpha {config['lora_alpha']:g})"), notes


def _adapter_out(to: str, output: Path, adapter: LoraAdapter, base: Base | None, heads: Heads | None,
                 base_name: str, record: list = ()) -> tuple[str, list[str]]:
    if to == "peft":
        return _write_peft(output, adapter, heads, base.name if base else base_name, base.cfg if base else None)
    return _write_gguf_adapter(output, adapter, base, base.path.name if base else base_name, record), []


def data_record(f: GGUFFile) -> list:
    """The KVs of finetune's record of its training data in a checkpoint or adapter file: a
    converted adapter keeps them, so export-lora calibrates on that data by default too."""
    return [item for key, item in f.kvs.items() if key.startswith(RECORD_KEY)]


# --------------------------------------------------------------------------- llamatune checkpoints

def _llamatune_lora(src: Source) -> tuple[LoraAdapter, str]:
    """The adapter a finetune checkpoint holds (as finetune's --lora-out writes it) and its base model's file name."""
    c = ckpt.load(src.path)
    f = c.file
    pairs = {}
    for name in f.tensors:
        if name.endswith(".lora_a"):
            stem = name[:-len(".lora_a")]
            a, b = f.tensor(name), f.tensor(stem + ".lora_b")
            pairs[stem] = (float_array(f.path, a), float_array(f.path, b))
    alpha = f.get_float("training.lora.alpha")
    if alpha is None:
        alpha = c.options.get("lora_alpha") or c.options.get("lora_r", 0)
        alpha = check_float(alpha, f"{f.path}: the lora_alpha of its options")
    base = c.options.get("model_base")
    return LoraAdapter(f.arch, float(alpha), pairs), Path(base).name if isinstance(base, str) and base else ""


def _raw_adapter(f: GGUFFile) -> LoraAdapter:
    """A GGUF adapter read without a base model: no shape checks (peft_files checks what it needs)."""
    halves: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    for name, t in f.tensors.items():
        stem, _, suffix = name.rpartition(".")
        if suffix not in ("lora_a", "lora_b") or t.qtype not in (QType.F32, QType.F16):
            raise LlamatuneError(f"{f.path}: tensor '{name}' ({t.qtype.name}) is not an F32/F16 .lora_a/.lora_b "
                                 "tensor (with --model-base, quantized adapters are read too)")
        halves[stem][suffix] = float_array(f.path, t)
    broken = [s for s, h in halves.items() if len(h) != 2]
    if broken:
        raise LlamatuneError(f"{f.path}: adapter tensors without their other half: {broken[:4]}")
    return LoraAdapter(f.arch, f.get_float("adapter.lora.alpha", 0.0),
                       {s: (h["lora_a"], h["lora_b"]) for s, h in halves.items()})


def _model_from(f: GGUFFile, cfg: ModelConfig, output: Path, name: str, more: dict | None = None) -> str:
    tensors = {n: float_array(f.path, t) for n, t in f.tensors.items() if not n.startswith("optimizer.")}
    tensors |= more or {}
    write_model(output, cfg, tensors, vocab_kvs(f), QType.F32, name=name)
    return (f"wrote F32 {cfg.arch} model {output} ({cfg.n_layer} layers, n_embd {cfg.n_embd}, vocabulary of "
            f"{cfg.n_vocab} copied)")


def _frozen_tensors(c: ckpt.Checkpoint, cfg: ModelConfig, base: Base | None) -> dict[str, np.ndarray]:
    """The tensors a full-finetune checkpoint does not hold (kept frozen by --freeze /
    --train-only), in f32 from the base it was trained on; none for a complete one."""
    tied = "output.weight" not in c.file.tensors and (base is None or "output.weight" not in base.file.tensors)
    missing = [n for n in tensor_names(cfg, tied) if n not in c.file.tensors]
    if not missing:
        return {}
    if base is None:
        raise LlamatuneError(f"{c.path}: holds no {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} "
                             "(frozen in a full finetune): give the base model it was trained on with --model-base")
    if c.base_fingerprint and c.base_fingerprint != ckpt.fingerprint(base.file):
        raise LlamatuneError(f"{c.path}: was trained on a different base model than {base.path}")
    from ..kernels import dequant
    return {n: dequant.dequantize(base.file.tensors[n].raw_rows(), base.file.tensors[n].qtype,
                                  base.file.tensors[n].n_cols).reshape(base.file.tensors[n].shape) for n in missing}


# --------------------------------------------------------------------------- 2023 files

def _legacy_lora(src: Source, base: Base | None) -> tuple[ModelConfig, dict[str, llamacpp2023.LegacyPair]]:
    f = src.file
    cfg = legacy.legacy_config(f)
    if base is not None:
        legacy.check_same_model(cfg, base.cfg, str(src.path), base.path)
        cfg = base.cfg
    tensors = {n: float_array(f.path, t) for n, t in f.tensors.items() if not n.startswith("optimizer.")}
    return cfg, llamacpp2023.legacy_pairs(legacy.base_shapes(cfg), tensors, (".lora_a", ".lora_b"), str(src.path))


def _ordered_adapter(arch: str, cfg: ModelConfig, alpha: float, pairs: dict) -> LoraAdapter:
    """An adapter with its tensors in llama.cpp's (and finetune's) order."""
    order = [n for n in tensor_names(cfg) if n in pairs]
    return LoraAdapter(arch, alpha, {n: pairs[n] for n in order})


def _ggla_adapter(src: Source, base: Base) -> tuple[LoraAdapter, list[str]]:
    r, alpha_h, tensors = llamacpp2023.read_ggla(src.path)
    if r == 0:
        raise LlamatuneError(f"{src.path}: ggla header has lora_r 0")
    pairs = llamacpp2023.legacy_pairs(legacy.base_shapes(base.cfg), tensors, (".loraA", ".loraB"),
                                f"{src.path} does not fit the base model {base.path.name}")
    alpha, ours = llamacpp2023.to_ours(pairs, alpha_h, r)
    notes = [f"the ggla header's r {r} and alpha {alpha_h} applied every tensor with scale {alpha_h / r:g}",
             llamacpp2023.scale_note(pairs, alpha)]
    return _ordered_adapter(base.file.arch, base.cfg, alpha, ours), notes


# --------------------------------------------------------------------------- entry point

def convert(input: Path, output: Path, to: str | None = None, model_base: Path | None = None) -> str:
    """Convert INPUT to OUTPUT (see the module docstring); returns a one-paragraph description."""
    src = detect(input)
    output = Path(output)
    what, allowed = KINDS[src.kind]
    if to is None:
        to = allowed[0]
    if to not in TARGETS:
        raise LlamatuneError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    if to not in allowed:
        raise LlamatuneError(f"{src.path}: is {what}, which converts to {' or '.join(allowed)}, not {to}")
    out = Out("--output", output, is_dir=to == "peft")
    check_paths([("INPUT", src.path), ("--model-base", model_base)], [out])
    with hold([out], "convert-checkpoint"):     # before loading: another run may be writing `output`
        return _convert(src, output, to, model_base)


def _convert(src: Source, output: Path, to: str, model_base: Path | None) -> str:
    """convert once its paths are checked and its output is locked."""
    base = load_base(model_base)
    notes: list[str] = []

    if src.kind in ("llamatune-lora", "gguf-adapter"):
        if src.kind == "llamatune-lora":
            adapter, base_name = _llamatune_lora(src)
        else:
            adapter = read_adapter(src.path, base.file) if base else _raw_adapter(src.file)
            base_name = str(src.file.get("adapter.lora.base_model", ""))
        done, notes = _adapter_out(to, output, adapter, base, base.heads if base else None, base_name,
                                   data_record(src.file))
    elif src.kind == "peft":
        base = _need_base(base, src, "it gives the architecture, the head counts for the q/k row order and the "
                                     "shapes to check")
        adapter, notes, _ = read_peft(src.path, peft_names(base.file.arch, base.cfg), base.heads)
        # safetensors sorts names: write the tensors in the base model's (llama.cpp's) order
        adapter.pairs = {n: adapter.pairs[n] for n in base.file.tensors if n in adapter.pairs} | adapter.pairs
        done = _write_gguf_adapter(output, adapter, base, base.path.name)
    elif src.kind == "ggla":
        base = _need_base(base, src, "ggla files name no architecture and carry shapes to check")
        adapter, notes = _ggla_adapter(src, base)
        done, more = _adapter_out(to, output, adapter, base, base.heads, "")
        notes += more
    elif src.kind == "finetune-2023" and to == "checkpoint":
        cfg, pairs = _legacy_lora(src, base)
        fingerprint = ckpt.fingerprint(base.file) if base else ""
        done, notes = legacy.finetune_checkpoint(src.file, cfg, pairs, output, fingerprint)
    elif src.kind == "finetune-2023":
        cfg, pairs = _legacy_lora(src, base)
        alpha, ours = llamacpp2023.to_ours(pairs, 1, 1)
        adapter = _ordered_adapter("llama", cfg, alpha, ours)
        notes = [llamacpp2023.scale_note(pairs, alpha)]
        done, more = _adapter_out(to, output, adapter, base, (cfg.n_head, cfg.n_head_kv), "")
        notes += more
    elif src.kind == "train-2023" and to == "checkpoint":
        done, notes = legacy.train_checkpoint(src.file, output)
    elif src.kind == "train-2023":
        done = _model_from(src.file, legacy.legacy_config(src.file), output,
                           str(src.file.get("general.name") or "llama"))
    else:   # llamatune-full -> model
        c = ckpt.load(src.path)
        cfg = ModelConfig.from_metadata(c.file.metadata, str(src.path), c.file.tensors)
        frozen = _frozen_tensors(c, cfg, base)
        done = _model_from(c.file, cfg, output, str(c.file.get("general.name") or "llamatune"), frozen)
        if frozen:
            base = None                                   # (it was needed)
    if base is not None and src.kind in ("train-2023", "llamatune-full"):
        notes.append(f"--model-base {base.path.name} was not needed")
    text = f"Converted {src.what} {src.path} to {to}: {done}."
    return text + "".join(f" Note: {n}." for n in notes if n)

