"""Benchmark: what a training step costs when only part of each row has targets.

Chat and instruction data is trained on the answers only: each row is a prompt (no
targets), an answer (targets) and padding up to --ctx (no targets). A step runs the
output head on the answer tokens only and stops each micro-batch at its last target
(step.py: `_head`, `_trimmed`), so its cost follows the prompt and answer lengths,
not the window. Rows here are `prompt`, `answer`, `padding` fractions of --ctx
(every row alike); tokens are random. Seconds per step are the least of --steps
after a first step (compilation), CPU seconds of this process with --cpu-clock.

    python bench/chat_step.py --model M.gguf [--batch 2 --ctx 256] [--rows 0:1:0,0.3:0.1:0.6]
        [--steps 3] [--cpu-clock]

Each `--rows` item is prompt:answer:padding (fractions of --ctx).
"""
from __future__ import annotations

import argparse
import time

from finetune_step import R, TARGETS   # the bench's adapters: rank R on every layer matrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--rows", default="0:1:0,0.6:0.4:0,0.15:0.1:0.75")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-clock", action="store_true")
    a = ap.parse_args()

    import llamatune  # noqa: F401  (threading policy before numpy loads)
    import numpy as np
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer

    model = Model(a.model)
    cfg = model.config
    targets = lora_targets(cfg, {k: R for k in TARGETS}, float(R), tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    B, T = a.batch, a.ctx
    executor = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, "selective")
    rng = np.random.default_rng(1)
    clock = time.process_time if a.cpu_clock else time.perf_counter
    print(f"{a.model}: batch {B} x ctx {T}, LoRA r {R}, selective; "
          f"{'CPU' if a.cpu_clock else 'wall'} seconds per step, least of {a.steps}")
    print(f"{'prompt':>7} {'answer':>7} {'padding':>8} {'s/step':>8} {'tokens/s':>9}")
    for item in a.rows.split(","):
        prompt, answer, _ = (float(f) for f in item.split(":"))
        p, n = int(round(prompt * T)), int(round(answer * T))
        inputs = rng.integers(0, cfg.n_vocab, (B, T))
        tg = np.full((B, T), -1)
        tg[:, p:p + n] = rng.integers(0, cfg.n_vocab, (B, n))
        w = (tg >= 0) / max(1, int((tg >= 0).sum()))
        times = []
        for _ in range(a.steps + 1):
            params.zero_grad()
            t = clock()
            executor.step(inputs, tg, w)
            times.append(clock() - t)
        s = min(times[1:])
        print(f"{prompt:7.2f} {answer:7.2f} {1 - prompt - answer:8.2f} {s:8.2f} {B * T / s:9.0f}", flush=True)


if __name__ == "__main__":
    main()
