"""Benchmark: data parallelism on one machine, 1 rank x 2 threads vs 2 ranks x 1 thread.

Model and training shape of bench/finetune_step.py (embd 512, 8 layers, GQA 8/4,
ffn 1536, vocab 32000, Q8_0; ctx 256, micro-batches of 8, LoRA r 8 on q,k,v,o,
gate,up,down), through the real `llamatune finetune` command, with the same global
batch of 16 samples per step in both configurations:

    1 rank  x 2 threads:  llamatune finetune --batch 8 --grad-acc 2 --threads 2
    2 ranks x 1 thread:   mpiexec -n 2 llamatune finetune --batch 8

Steady-state tokens/s: the command's own figure after the first step (which holds
the numba cache loading and the first page-in) of a (1+N)-step run. (It used to be
the difference of a (1+N)-step and a 1-step run, two processes whose first steps
differ by a good part of a step: 2119 tokens/s for one process that reports 1874.)
Also prints the gradient bytes each rank handed to
MPI per step (llamatune's own count) and what summing micro-batch gradients in
a separate buffer (exact order, distributed.GradientSum) costs one process.

    python bench/mpi_scaling.py [--steps 3] [--workdir /tmp/llamatune-bench]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from finetune_step import SHAPE  # bench/ is sys.path[0] when run as a script

B, T, R, GLOBAL = 8, 256, 8, 16


def byte_vocab(n: int):
    """finetune_step's dummy vocabulary plus the 256 byte tokens, so any text tokenizes
    (byte by byte: the training cost does not depend on which tokens they are)."""
    from gguf import GGUFValueType as V
    from llamatune.formats.gguf_io import KV, kv
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"t{i}" for i in range(259, n)]
    return [kv("tokenizer.ggml.model", "llama"), KV("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            KV("tokenizer.ggml.scores", [0.0] * n, V.ARRAY, V.FLOAT32),
            KV("tokenizer.ggml.token_type", [2, 3, 3] + [6] * 256 + [1] * (n - 259), V.ARRAY, V.INT32),
            kv("tokenizer.ggml.bos_token_id", 1), kv("tokenizer.ggml.eos_token_id", 2)]


def build(workdir: Path) -> tuple[Path, Path]:
    import numpy as np
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import parse_outtype, random_weights, write_model
    model, text = workdir / "bench-512x8-bytes.q8_0.gguf", workdir / "random-words.txt"
    if not model.exists():
        cfg = ModelConfig(**SHAPE)
        write_model(model, cfg, random_weights(cfg, seed=0), byte_vocab(cfg.n_vocab), parse_outtype("q8_0"))
    if not text.exists():
        ids = np.random.default_rng(0).integers(0, 10**6, 4000)
        text.write_text(" ".join(f"w{i}" for i in ids))
    return model, text


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def finetune(prefix: list[str], env: dict, model: Path, text: Path, out: Path, steps: int, extra: list[str]):
    """(steady tokens/s, stderr) of one run, from the command's own report."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = prefix + [sys.executable, "-m", "llamatune.cli.main", "finetune", "--model-base", str(model),
                    "--train-data", str(text), "-c", str(T), "-b", str(B), "--lora-r", str(R),
                    "--adam-iter", str(steps), "--save-every", "0", "--warmup", "1",
                    "--checkpoint-out", str(out / "chk-ITERATION.gguf"),
                    "--lora-out", str(out / "adapter-ITERATION.gguf")] + extra
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    m = re.search(r"([\d,]+) after the first step", r.stdout)
    return float(m.group(1).replace(",", "")), r.stderr


def fold_cost(model: Path) -> tuple[int, float]:
    """(P, seconds) of GradientSum's extra work per micro-batch in one process: copy or
    add the micro-batch gradient into the running sum and zero it (plus the final copy)."""
    import numpy as np
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.models.model import Model
    from llamatune.train.params import ParamBuffer
    cfg = Model(model).config
    targets = lora_targets(cfg, {k: R for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                 "ffn_up", "ffn_down")}, float(R), tied=False)
    p = ParamBuffer(lora_specs(targets))
    acc = np.zeros_like(p.grad)
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        acc += p.grad
        p.zero_grad()
    return p.size, (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-bench"))
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    model, text = build(a.workdir)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "OPENBLAS_NUM", "NUMBA_NUM"))}
    base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    configs = {
        "1 rank x 2 threads": ([], {**base, "OPENBLAS_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"},
                               ["--grad-acc", str(GLOBAL // B), "--threads", "2"]),
        "2 ranks x 1 thread": ([mpiexec(), "-n", "2"], {**base, "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"},
                               []),
    }
    print(f"{os.cpu_count()} CPUs; model {SHAPE} Q8_0; ctx {T}, {GLOBAL} samples per step, LoRA r {R}")
    for name, (prefix, env, extra) in configs.items():
        tps, err = finetune(prefix, env, model, text, a.workdir / "mpi" / name.replace(" ", ""), 1 + a.steps, extra)
        line = f"{name}: {tps:6.0f} tokens/s ({GLOBAL * T / tps:.2f} s per step of {GLOBAL * T} tokens)"
        sent = re.search(r"each rank sent ([\d.]+) MiB and received ([\d.]+) MiB", err)
        if sent:
            line += f"; gradient bytes per rank per step: sent {sent.group(1)} MiB, received {sent.group(2)} MiB"
        print(line, flush=True)
    P, s = fold_cost(model)
    print(f"exact-order gradient sum in one process: {P:,} LoRA parameters ({P * 4 / 2**20:.2f} MiB), "
          f"{s * 1e3:.2f} ms per extra micro-batch")


if __name__ == "__main__":
    main()
