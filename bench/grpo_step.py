"""Benchmark: one GRPO step split into generation (the group decode and the rewards) and
training (the reweighted forward + backward and the optimizer update).

The job is finetune's own (`--method grpo`, LoRA r 8 on the attention and MLP matrices,
`--reward boxed-answer` on configs/prompts-example.jsonl): a step takes --prompts prompts,
completes each --generations times up to --max-len tokens, and trains on them in one
micro-batch. One warm-up step (kernel compilation, first page-in), then --repeats steps,
each timed in its two parts, wall time and the process's CPU time (all its threads: on
a machine shared with other work the CPU time is the steadier figure); reported as
median and spread (min-max), with the sampled tokens per second and the load average.

    python bench/grpo_step.py [--model M.gguf] [--prompts 2] [--generations 4] [--max-len 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def build(args, out: Path):
    from llamatune.commands.finetune import build_job
    from llamatune.options import FinetuneOptions
    from llamatune.train.trainer import set_up
    o = FinetuneOptions(model_base=args.model, train_data=REPO / "configs" / "prompts-example.jsonl",
                        method="grpo", reward=["boxed-answer"], num_generations=args.generations,
                        batch=args.prompts * args.generations, max_completion_length=args.max_len,
                        ctx=args.ctx, lora_r=8, adam_iter=1000, save_every=0, plot=False, output_dir=out,
                        checkpoint_out=out / "chk-ITERATION.gguf", lora_out=out / "adapter-ITERATION.gguf",
                        metrics_out=out / "m.jsonl", overwrite=True, threads=args.threads)
    o.check()
    return set_up(build_job(o), quiet=True)


def one_step(t, step: int) -> dict:
    """A step as trainer.step runs it, timed in parts (no metrics, saves or guard)."""
    from llamatune.train.optimizer import apply_update, gradient_norm
    job, objective = t.job, t.job.objective
    job.params.zero_grad(lazy=job.weights.lazy_grads)
    t0, c0 = time.perf_counter(), time.process_time()
    b = t.batcher.next_batch()
    t1, c1 = time.perf_counter(), time.process_time()
    objective.begin_step([b])
    objective.micro_step(t.executor, b, (0, step, 0))
    apply_update(job.params, step, job.opts, gradient_norm(job.params))
    t2, c2 = time.perf_counter(), time.process_time()
    m = objective.end_step(t.world)
    return {"generation_s": t1 - t0, "training_s": t2 - t1, "generation_cpu_s": c1 - c0, "training_cpu_s": c2 - c1,
            "completion_tokens": int(b.lengths.sum()),
            "trained_tokens": b.n_targets, "reward": m["reward"], "mean_length": m["completions/mean_length"]}


def spread(xs: list[float]) -> str:
    return f"{np.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    import tempfile
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("qwen2.5-coder-0.5b-instruct.gguf"))
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON line per step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t = build(args, Path(d))
        warm = one_step(t, 0)
        print(f"warm-up step: generation {warm['generation_s']:.2f} s, training {warm['training_s']:.2f} s "
              f"(CPU {warm['generation_cpu_s']:.2f} s, {warm['training_cpu_s']:.2f} s)", flush=True)
        rows = [one_step(t, k) for k in range(1, args.repeats + 1)]
    for r in rows if args.json else ():
        print(json.dumps(r))
    import os
    gen, train = [r["generation_s"] for r in rows], [r["training_s"] for r in rows]
    cpu = {k: [r[f"{k}_cpu_s"] for r in rows] for k in ("generation", "training")}
    tps = [r["completion_tokens"] / r["generation_s"] for r in rows]
    print(f"{args.model.name}: {args.prompts} prompts x {args.generations} generations x up to {args.max_len} "
          f"tokens, {len(rows)} steps")
    print(f"  generation {spread(gen)}, {np.median(tps):.1f} sampled tokens/s "
          f"(mean completion {np.mean([r['mean_length'] for r in rows]):.1f} tokens)")
    print(f"  training   {spread(train)} ({np.median([r['trained_tokens'] for r in rows]):.0f} trained tokens)")
    print(f"  CPU time: generation {spread(cpu['generation'])}, training {spread(cpu['training'])}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    share = np.median(gen) / (np.median(gen) + np.median(train))
    print(f"  generation is {share:.0%} of the step")


if __name__ == "__main__":
    main()
