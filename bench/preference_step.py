"""Benchmark: a DPO / ORPO micro-batch step against an SFT step on the same batch.

The batch: --batch rows of --ctx tokens, pairs of rows sharing a prompt of a third of the
context, answers filling the rest (targets on the answers only, as preference rows give).
The SFT step trains the same targets with uniform weights, so both steps see the same
rows and count the same tokens (both answers of each pair). Steps alternate in one
process (SFT, DPO with its reference cached, DPO computing its reference, ORPO), each
`--repeats` times after one warm-up round; tokens/s is targets per second, reported as
median and spread (min-max). `--memory` runs SFT and DPO each in a fresh process and
reports their peak RSS (the graph is the same size; DPO adds the per-token losses' copy
and the reference cache).

    python bench/preference_step.py [--model M.gguf] [--ctx 128] [--batch 8] [--repeats 5] [--memory]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def make_batch(n_vocab: int, B: int, T: int, seed: int = 0):
    from llamatune.data.samples import Batch
    rng = np.random.default_rng(seed)
    inputs = rng.integers(3, n_vocab, (B, T))
    targets = np.full((B, T), -1, np.int64)
    prompt = T // 3
    for k in range(0, B, 2):
        inputs[k + 1, :prompt] = inputs[k, :prompt]                  # the pair's shared prompt
        for j in (k, k + 1):
            end = T - int(rng.integers(0, T // 8))                   # answers of slightly different lengths
            targets[j, prompt - 1:end - 1] = inputs[j, prompt:end]
    return Batch(inputs, targets, int((targets >= 0).sum()), False, sample_ids=np.arange(B))


def setup(model_path: Path, B: int, T: int, mode: str):
    from llamatune.models.model import Model
    from llamatune.options import FinetuneOptions
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    model = Model(model_path)
    ranks = {k: 8 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    targets = lora_targets(model.config, ranks, 8.0, model.weights.output is model.weights.token_embd)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    params.data[...] += np.random.default_rng(1).normal(0, 1e-3, params.size).astype(np.float32)
    executor = StepExecutor(model.config, FrozenBase(model), params, targets, B, T, mode)
    return model, executor, params, targets, FinetuneOptions


def run_steps(args) -> dict:
    from llamatune.train.preference import Preference
    model, executor, params, targets, Opts = setup(args.model, args.batch, args.ctx, args.checkpointing)
    b = make_batch(model.config.n_vocab, args.batch, args.ctx)
    n = b.n_targets
    n_pairs, n_chosen = Preference.counts([b])
    dpo = Preference(Opts(method="dpo"))
    orpo = Preference(Opts(method="orpo"))
    cache = np.full((args.batch // 2, 2), np.nan)
    w = (b.targets >= 0).astype(np.float32) / np.float32(n)

    def sft():
        executor.step(b.inputs, b.targets, w, (0,))

    def dpo_cached():
        dpo.step(executor, b, cache, n_pairs, n_chosen, (0,))

    def dpo_fresh():
        cache[...] = np.nan
        dpo.step(executor, b, cache, n_pairs, n_chosen, (0,))

    def orpo_step():
        orpo.step(executor, b, cache, n_pairs, n_chosen, (0,))
    kinds = {"sft": sft, "dpo (reference cached)": dpo_cached, "dpo (reference computed)": dpo_fresh,
             "orpo": orpo_step}
    if args.only:
        kinds = {args.only: kinds[args.only]}
    times = {k: [] for k in kinds}
    for r in range(args.repeats + 1):                                 # round 0 warms up (compiles)
        for name, fn in kinds.items():
            params.zero_grad()
            t = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t)
    out = {"targets": n, "tokens_per_s": {k: [n / s for s in v] for k, v in times.items()},
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF to run (default: the finetune_step bench shape, Q8_0)")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkpointing", default="selective")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-bench"))
    ap.add_argument("--memory", action="store_true", help="peak RSS of SFT and DPO, each in a fresh process")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from finetune_step import build   # bench/ is sys.path[0] when run as a script
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.model = args.workdir / "bench-q8_0.gguf"
        build(args.model, "q8_0")
    if args.only:
        res = run_steps(args)
        print(json.dumps(res) if args.json else res)
        return
    print(f"model {args.model.name}, batch {args.batch} (pairs {args.batch // 2}), ctx {args.ctx}, "
          f"--checkpointing {args.checkpointing}")
    res = run_steps(args)
    base = np.median(res["tokens_per_s"]["sft"])
    for name, v in res["tokens_per_s"].items():
        print(f"  {name:26s} {np.median(v):8.1f} tokens/s (min {min(v):.1f}, max {max(v):.1f}), "
              f"{np.median(v) / base:.2f}x SFT")
    if args.memory:
        for kind in ("sft", "dpo (reference computed)"):
            cmd = [sys.executable, __file__, "--model", str(args.model), "--ctx", str(args.ctx), "--batch",
                   str(args.batch), "--repeats", "1", "--checkpointing", args.checkpointing, "--only", kind, "--json"]
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            print(f"  peak RSS {kind:26s} {got['peak_rss_mib']:8.1f} MiB")


if __name__ == "__main__":
    main()
