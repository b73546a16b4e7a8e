"""Benchmark: export-lora's default merge (calibrated on the training data the adapter
records) against the plain merge, at Llama-2-7B tensor shapes (#52: at most 2x).

The model is Llama-2-7B-shaped with --layers of its 32 layers (random Q4_K blocks,
real_size.py's generator; the llama SPM vocabulary of --vocab so that text tokenizes);
the adapter is random, rank 8 on q, k, v, o, gate, up and down of every layer, and
records --data as its training data (data/recorded.py, --ctx as the training
context). Each export runs in a fresh process (`llamatune export-lora -m M --lora A
-o OUT [--merge-method plain]`), plain and default alternating for --rounds rounds.
Both costs grow with the layers (the calibration's forward and passes per layer, the
quantizers per matrix; what does not, the embedding copy and the tokenizer, is small
beside a layer), so the ratio at a few layers is the ratio at 32.

    python bench/merge_default_cost.py --vocab shared/vocab/ggml-vocab-llama-spm.gguf \
        --data shared/data/shakespeare.txt [--layers 2] [--ctx 128] [--rounds 2] [--threads 2]

With --model and --adapter it times those instead (a real model and an adapter whose
training data is still where it records it, e.g. Qwen2.5-Coder-0.5B and a finetune
run's adapter-LATEST.gguf):

    python bench/merge_default_cost.py --model qwen2.5-coder-0.5b-instruct.gguf \
        --adapter run/adapter-LATEST.gguf [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from real_size import SHAPES, random_q4_k  # bench/ is sys.path[0] when run as a script

R = 8
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def build_model(path: Path, vocab: Path, n_layer: int) -> None:
    from gguf import GGMLQuantizationType as QType
    from llamatune.formats.gguf_io import GGUFFile, TensorOut, kv, write_gguf
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import tensor_names
    shape = dict(SHAPES["llama2-7b"], n_layer=n_layer)
    cfg = ModelConfig(**shape)
    voc = GGUFFile(vocab)
    tokenizer = [item for key, item in voc.kvs.items() if key.startswith("tokenizer.")]
    n_vocab = len(voc.get("tokenizer.ggml.tokens"))
    cfg = ModelConfig(**dict(shape, n_vocab=n_vocab))
    tensors = []
    for i, (name, s) in enumerate(tensor_names(cfg).items()):
        if len(s) == 1:
            tensors.append(TensorOut(name, s, QType.F32, lambda s=s: np.ones(s, np.float32)))
        else:
            tensors.append(TensorOut(name, s, QType.Q4_K, lambda s=s, i=i: random_q4_k(s, i)))
    kvs = [kv("general.type", "model"), kv("general.name", f"random llama2-7b, {n_layer} layers")]
    kvs += [kv(k, v) for k, v in cfg.metadata().items()] + [kv("general.file_type", 14)] + tokenizer
    write_gguf(path, cfg.arch, kvs, tensors)


def build_adapter(path: Path, model: Path, data: Path, ctx: int) -> None:
    from llamatune.data.recorded import data_kvs
    from llamatune.formats.adapter import LoraAdapter, expected_shapes, write_adapter
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.options import FinetuneOptions
    f = GGUFFile(model)
    rng = np.random.default_rng(0)
    adapter = LoraAdapter(f.arch, float(R))
    for name, t in f.tensors.items():
        if name.startswith("blk.") and name.split(".")[2] in TARGETS:
            a_shape, b_shape = expected_shapes(name, t.shape, R)
            adapter.pairs[name] = (rng.normal(0, 0.02, a_shape).astype(np.float32),
                                   rng.normal(0, 0.002, b_shape).astype(np.float32))
    write_adapter(path, adapter, extra=data_kvs(FinetuneOptions(train_data=data, ctx=ctx)))


def export(model: Path, adapter: Path, out: Path, threads: int, plain: bool) -> tuple[float, float, str]:
    """One export in a fresh process: (wall s, CPU s of the process: user + system, its log).
    The CPU time is the fairer figure on a shared machine, where waits inflate the wall time."""
    cmd = [str(Path(sys.executable).with_name("llamatune")), "export-lora", "-m", str(model), "--lora", str(adapter),
           "-o", str(out)] + (["--merge-method", "plain"] if plain else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        sys.exit(f"export failed: {r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stderr + r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--model", type=Path, help="a model to merge into (with --adapter), in place of the 7B shape")
    ap.add_argument("--adapter", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-merge-cost"))
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if (a.model is None) != (a.adapter is None) or (a.model is None and (a.vocab is None or a.data is None)):
        ap.error("give --model and --adapter, or --vocab and --data (the 7B shape)")
    if a.model is not None:
        model, adapter, shape = a.model, a.adapter, a.model.name
    else:
        model, adapter = a.workdir / f"7b-{a.layers}l.Q4_K.gguf", a.workdir / "adapter.gguf"
        shape = f"{a.layers} layers of Llama-2-7B, Q4_K, r {R}"
        if not model.exists():
            build_model(model, a.vocab, a.layers)
        build_adapter(adapter, model, a.data, a.ctx)
    times = {"plain": [], "default": []}
    for r in range(a.rounds):
        for kind in ("plain", "default"):
            s, cpu, log = export(model, adapter, a.workdir / f"{kind}.gguf", a.threads, kind == "plain")
            times[kind].append((s, cpu))
            print(f"round {r + 1} {kind}: {s:.1f} s wall, {cpu:.1f} s CPU (load average {os.getloadavg()[0]:.1f})",
                  flush=True)
            if r == 0:
                print("  " + "\n  ".join(line for line in log.splitlines() if line.strip()), flush=True)
    (p, pc), (d, dc) = (np.median(np.array(times[k]), axis=0) for k in ("plain", "default"))
    print(f"{shape}: plain {p:.1f} s wall / {pc:.1f} s CPU, default "
          f"{d:.1f} s / {dc:.1f} s (medians of {a.rounds}): {d / p:.2f}x wall, {dc / pc:.2f}x CPU")


if __name__ == "__main__":
    main()
