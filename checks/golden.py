"""A golden record of what the model code computes, to prove a restructuring changes no bit.

    python -m checks.golden record OUT.npz [--only PREFIX]
    python -m checks.golden compare BEFORE.npz AFTER.npz

`record` builds small seeded models of every architecture (llama, qwen2, qwen3, gemma,
gemma2, gemma3, phi3), each stored F32 and Q8_0, and writes into one .npz:
  - inference: logits of a full forward and token by token through the KV cache, without
    and with a runtime adapter, f32 and bf16 products;
  - training: the loss, per-token losses and every parameter's gradient of one LoRA step
    (adapters on every kind) in checkpointing modes none, selective and layer, plain and
    packed rows, with and without dropout, f32 and bf16 products; a dense
    (train-from-scratch) step; merge-aware on Q8_0; an evaluation's losses;
  - preference: a DPO and an ORPO step's loss and gradient (reference from the same graph);
  - runs: short finetunes (LoRA sft f32 and bf16, DPO, full) and a train-from-scratch: the
    adapters and checkpoint tensors they wrote and the losses of metrics.jsonl.
`compare` reports every array that differs (bits, not tolerances; for arrays whose name
holds "bf16" also the largest relative difference) and exits non-zero when one does.
Nothing of the record depends on time or on the machine but the bf16 products (oneDNN's
kernels on this CPU): record and compare on the same machine.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from llamatune.precision import policy

ARCHS = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
SHAPE = dict(n_vocab=400, n_ctx_train=64, n_embd=32, n_layer=2, n_ff=48, n_head=4, n_head_kv=2, head_dim=8,
             n_rot=8, norm_eps=1e-5)
EXTRA = {"qwen3": dict(head_dim=12, n_rot=12, rope_freq_base=1e6),
         "gemma2": dict(n_layer=3, attn_softcap=5.0, final_softcap=8.0, sliding_window=8, swa_pattern=2),
         "gemma3": dict(n_layer=3, sliding_window=8, swa_pattern=3, rope_freq_base=1e6, rope_freq_scale=0.5,
                        rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0),
         "phi3": dict(n_rot=6, n_ctx_train=1024, n_ctx_orig=256, rope_attn_factor=1.25)}
TIED = {"gemma": True, "gemma2": True}
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
        "First Citizen:\nFirst, you know Caius Marcius is chief enemy to the people.\n\n"
        "All:\nWe know't, we know't.\n\nFirst Citizen:\nLet us kill him, and we'll have corn at our own price.\n") * 4
PACKED = dict(positions=np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7]] * 2),
              segments=np.array([[0] * 4 + [1] * 6 + [2] * 8, [0] * 10 + [1] * 8], np.int32))


def _config(arch: str):
    from llamatune.models.config import ModelConfig
    return ModelConfig(arch=arch, **(SHAPE | EXTRA.get(arch, {})))


def _weights(cfg, tied: bool) -> dict[str, np.ndarray]:
    from checks.arch_reference import random_model_weights
    w = random_model_weights(cfg, seed=5, std=0.15, tied=tied)
    if cfg.arch == "phi3":
        half = cfg.n_rot // 2
        w["rope_factors_long.weight"] = np.linspace(1.0, 6.0, half).astype(np.float32)
        w["rope_factors_short.weight"] = np.linspace(1.0, 1.7, half).astype(np.float32)
    return w


def _adapter(path: Path, cfg, tied: bool) -> Path:
    from llamatune.formats.adapter import LoraAdapter, write_adapter
    from llamatune.models.writer import tensor_names
    rng, lora = np.random.default_rng(8), LoraAdapter(cfg.arch, 4.0)
    for name, shape in tensor_names(cfg, tied=tied).items():
        if len(shape) == 2 and name != "token_embd.weight":
            lora.pairs[name] = (rng.normal(0, 0.2, (2, shape[1])).astype(np.float32),
                                rng.normal(0, 0.2, (shape[0], 2)).astype(np.float32))
    write_adapter(path, lora)
    return path


def _batch(cfg, B: int, T: int, seed: int):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, cfg.n_vocab, (B, T))
    targets = rng.integers(0, cfg.n_vocab, (B, T))
    targets[0, -3:] = -1
    weights = (targets >= 0) / max(1, int((targets >= 0).sum()))
    return inputs, targets, weights


def _lora(model, seed: int = 0):
    from checks.arch_reference import all_ranks, lora_setup
    tied = model.weights.output is model.weights.token_embd
    return lora_setup(model, all_ranks(model.config, tied), np.float32, seed)


def record_inference(out: dict, key: str, model, adapter: Path) -> None:
    from llamatune.formats.adapter import load_runtime_adapters
    from llamatune.models.infer import KVCache, Runner
    inputs = _batch(model.config, 2, 18, seed=1)[0]
    runtime = load_runtime_adapters(model, [(str(adapter), 0.7)])
    for dtype in ("f32", "bf16"):
        for name, adapters in (("plain", None), ("adapter", runtime)):
            runner = Runner(model, adapters, policy=policy(dtype))
            out[f"{key}/infer/{dtype}/{name}/full"] = np.array(runner.forward(inputs))
            cache = KVCache.empty(model, 2, 18)
            parts = [runner.forward(inputs[:, :9], cache)]            # a prompt, then token by token
            parts += [runner.forward(inputs[:, t:t + 1], cache) for t in range(9, 18)]
            out[f"{key}/infer/{dtype}/{name}/kv"] = np.concatenate([np.array(p) for p in parts], 1)


def _step(out: dict, key: str, executor, params, inputs, targets, weights, pack: dict) -> None:
    params.zero_grad()
    out[key + "/loss"] = np.array(executor.step(inputs, targets, weights, key=(3,), **pack))
    out[key + "/grad"] = params.grad.copy()
    out[key + "/losses"] = np.array(executor.losses).copy()


def record_training(out: dict, key: str, model) -> None:
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    cfg = model.config
    inputs, targets, weights = _batch(cfg, 2, 18, seed=2)
    for dtype in ("f32", "bf16"):
        for dropout in ((0.0, 0.2) if dtype == "f32" else (0.0,)):
            for mode in ("none", "selective", "layer"):
                for packed in (False, True):
                    tg, params = _lora(model)
                    g = StepExecutor(cfg, FrozenBase(model), params, tg, 2, 18, mode, dropout, policy=policy(dtype))
                    name = f"{key}/step/{dtype}/d{dropout}/{mode}/{'packed' if packed else 'plain'}"
                    _step(out, name, g, params, inputs, targets, weights, PACKED if packed else {})
            tg, params = _lora(model)
            g = StepExecutor(cfg, FrozenBase(model), params, tg, 2, 18, "selective", dropout, policy=policy(dtype))
            out[f"{key}/eval/{dtype}/d{dropout}/loss"] = np.array(g.loss(inputs, targets, weights))
            out[f"{key}/eval/{dtype}/d{dropout}/losses"] = np.array(g.losses).copy()
    if model.file.tensors["blk.0.ffn_down.weight"].qtype.name != "F32":        # merge-aware
        for mode in ("none", "layer"):
            tg, params = _lora(model)
            g = StepExecutor(cfg, FrozenBase(model), params, tg, 2, 18, mode, 0.0, policy=policy("f32", merge_aware=True))
            _step(out, f"{key}/step/merge_aware/{mode}", g, params, inputs, targets, weights, {})
    # a micro-batch whose last columns have no target (the trimmed graph), and a long one (merged adapters)
    tg, params = _lora(model)
    g = StepExecutor(cfg, FrozenBase(model), params, tg, 2, 60, "selective", 0.0)
    inputs, targets, weights = _batch(cfg, 2, 60, seed=4)
    targets[:, 40:] = -1
    _step(out, f"{key}/step/trimmed", g, params, inputs, targets, weights, {})
    targets[:, 40:] = 5
    _step(out, f"{key}/step/long", g, params, inputs, targets, weights / 2, {})


def record_dense(out: dict, key: str, cfg, tied: bool) -> None:
    from llamatune.models.writer import tensor_names
    from llamatune.train.step import StepExecutor
    from llamatune.train.params import DenseWeights, ParamBuffer, ParamSpec
    shapes = tensor_names(cfg, tied=tied)
    params = ParamBuffer([ParamSpec(n, s) for n, s in shapes.items()])
    for n, a in _weights(cfg, tied).items():
        if n in shapes:
            params[n][...] = a
    inputs, targets, weights = _batch(cfg, 2, 18, seed=3)
    for mode in ("none", "layer"):
        g = StepExecutor(cfg, DenseWeights(params, tied="output.weight" not in shapes), params, [], 2, 18, mode)
        _step(out, f"{key}/dense/{mode}", g, params, inputs, targets, weights, {})


def record_preference(out: dict, key: str, model) -> None:
    from llamatune.data.samples import Batch
    from llamatune.models.weights import FrozenBase
    from llamatune.options import FinetuneOptions
    from llamatune.train.step import StepExecutor
    from llamatune.train.preference import Preference
    cfg, T = model.config, 10
    rng = np.random.default_rng(6)
    inputs = rng.integers(0, cfg.n_vocab, (4, T))
    targets = np.full((4, T), -1, np.int64)
    for r in range(4):
        targets[r, 3: 5 + r] = rng.integers(0, cfg.n_vocab, 2 + r)
    b = Batch(inputs, targets, int((targets >= 0).sum()), False, sample_ids=np.arange(4, dtype=np.int64))
    for method in ("dpo", "orpo"):
        tg, params = _lora(model)
        g = StepExecutor(cfg, FrozenBase(model), params, tg, 4, T, "selective", 0.0)
        pref = Preference(FinetuneOptions(method=method, beta=0.5))
        cache = np.full((2, 2), np.nan)
        params.zero_grad()
        out[f"{key}/{method}/loss"] = np.array(pref.step(g, b, cache, *Preference.counts([b]), (0,)))
        out[f"{key}/{method}/grad"] = params.grad.copy()
        out[f"{key}/{method}/cache"] = cache


def _tensors(path: Path) -> dict[str, np.ndarray]:
    from llamatune.formats.gguf_io import GGUFFile
    return {n: np.array(t.data) for n, t in GGUFFile(path).tensors.items()}


def _pairs(path: Path) -> Path:
    good = [" Speak, speak.", " Resolved. resolved.", " We know't, we know't."]
    bad = [" we'll have corn at our own price.", " chief enemy to the people.", " kill him"]
    prompts = ["First Citizen:", "All:", "Before we proceed", "You are all resolved", "Let us kill him",
               "hear me speak", "Caius Marcius", "rather to die"]
    path.write_text("".join(json.dumps({"prompt": p, "chosen": good[i % 3], "rejected": bad[(i + 1) % 3]}) + "\n"
                            for i, p in enumerate(prompts * 2)))
    return path


def record_runs(out: dict, work: Path, model: Path) -> None:
    """Short runs through the commands: what they write."""
    from llamatune.commands.finetune import finetune
    from llamatune.commands.scratch import train_from_scratch
    from llamatune.options import FinetuneOptions, ScratchOptions
    (work / "train.txt").write_text(TEXT)
    common = dict(train_data=work / "train.txt", ctx=16, batch=2, adam_iter=3, save_every=2, warmup=1,
                  adam_alpha=1e-2, plot=False, val_split=0.2, eval_every=2, seed=3)
    runs = {
        "sft_f32": dict(lora_r=2, lora_dropout=0.1, rank_out=2, rank_att_norm=1, compute_dtype="f32", pack=True),
        "sft_bf16": dict(lora_r=2, lora_dropout=0.0, compute_dtype="bf16", grad_acc=2),
        "full": dict(fine_tune_type="full", compute_dtype="f32", checkpointing="layer"),
        "dpo": dict(lora_r=2, method="dpo", train_data=_pairs(work / "pairs.jsonl"), ctx=24, batch=4,
                    val_split=0.25, compute_dtype="f32"),
    }
    for name, over in runs.items():
        d = work / name
        d.mkdir()
        o = FinetuneOptions(**(common | dict(model_base=model, checkpoint_out=d / "chk-ITERATION.gguf",
                                             lora_out=d / "adapter-ITERATION.gguf", metrics_out=d / "m.jsonl",
                                             model_out=d / "model-ITERATION.gguf") | over))
        finetune(o, quiet=True)
        _run_files(out, f"run/{name}", d)
    d = work / "scratch"
    d.mkdir()
    o = ScratchOptions(**(common | dict(embd=32, layer=2, head=4, ff=48, vocab_size=320, checkpoint_out=d / "chk-ITERATION.gguf",
                                        model_out=d / "model-ITERATION.gguf", metrics_out=d / "m.jsonl")))
    train_from_scratch(o, quiet=True)
    _run_files(out, "run/scratch", d)


def _run_files(out: dict, key: str, d: Path) -> None:
    for f in sorted(d.glob("*.gguf")):
        if "LATEST" in f.name:
            continue
        for n, a in _tensors(f).items():
            out[f"{key}/{f.name}/{n}"] = a
    rows = [json.loads(line) for line in (d / "m.jsonl").read_text().splitlines()]
    for field in ("loss", "val_loss"):
        out[f"{key}/metrics/{field}"] = np.array([r[field] for r in rows if field in r], np.float64)


def record(out_path: Path, only: str = "") -> int:
    from gguf import GGMLQuantizationType as QType
    from llamatune.models.model import Model
    from llamatune.models.writer import train_spm_vocab, write_model
    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        vocab = train_spm_vocab(TEXT, 400)
        for arch in ARCHS:
            if only and not arch.startswith(only) and only != "run":
                continue
            cfg, tied = _config(arch), TIED.get(arch, False)
            adapter = _adapter(work / f"{arch}-adapter.gguf", cfg, tied)
            for qtype in (QType.F32, QType.Q8_0):
                if only == "run":
                    break
                path = work / f"{arch}-{qtype.name}.gguf"
                write_model(path, cfg, _weights(cfg, tied), vocab, qtype)
                model, key = Model(path), f"{arch}/{qtype.name}"
                record_inference(out, key, model, adapter)
                record_training(out, key, model)
                record_preference(out, key, model)
                print(f"{key}: {sum(1 for k in out if k.startswith(key + '/'))} arrays", flush=True)
            if only != "run":
                record_dense(out, arch, cfg, tied)
        if not only or only == "run":
            cfg = _config("llama")
            path = work / "llama-run.gguf"
            write_model(path, cfg, _weights(cfg, False), vocab, QType.Q8_0)
            record_runs(out, work, path)
    np.savez(out_path, **out)
    print(f"{len(out)} arrays written to {out_path}")
    return 0


def compare(a_path: Path, b_path: Path) -> int:
    a, b = np.load(a_path), np.load(b_path)
    missing = sorted(set(a.files) ^ set(b.files))
    differ = []
    for k in sorted(set(a.files) & set(b.files)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            differ.append(f"{k}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif x.tobytes() != y.tobytes():
            rel = np.max(np.abs(x.astype(np.float64) - y) / (np.abs(x).max() + 1e-30)) if x.dtype.kind == "f" else 0
            differ.append(f"{k}: differs (largest difference {rel:.3g} of the largest element)")
    for k in missing:
        print(f"only in {'the first' if k in a.files else 'the second'}: {k}")
    for line in differ:
        print(line)
    n = len(set(a.files) & set(b.files))
    print(f"{n} arrays compared: {n - len(differ)} equal bit for bit, {len(differ)} differ, {len(missing)} unmatched")
    return 1 if differ or missing else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        only = argv[argv.index("--only") + 1] if "--only" in argv else ""
        return record(Path(argv[1]), only)
    if len(argv) == 3 and argv[0] == "compare":
        return compare(Path(argv[1]), Path(argv[2]))
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
