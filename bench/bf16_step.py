"""A training step of bench/finetune_step.py's shape with the frozen base's products in
bf16 (`StepExecutor(..., policy=precision.policy("bf16"))`, issue #29) against the float32 step, in one
process: rounds alternate f32 step, bf16 step. Printed: each step's best and worst time,
the share of the step spent in the base's products (models/products.py, rounding to
bf16 included) and in attention, and the losses. `--f32-attention` adds a third graph,
bf16 products with the float32 attention kernels (kernels/attention.py instead of
kernels/attention_bf16.py, whose products but the scores are bf16), to the rounds.

    python bench/bf16_step.py [--type q4_k] [--mode selective] [--rounds 4] [--f32-attention]
        [--workdir /tmp/llamatune-bench]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path


class Timed:
    """A graph's Products with the seconds its products take (rounding included): the
    calls, `add` and `adapted` timed, everything else handed through."""

    def __init__(self, products):
        self.products, self.seconds = products, defaultdict(float)

    def __call__(self, *args, **kw):
        return self._timed(self.products, args, kw)

    def __getattr__(self, name):
        attr = getattr(self.products, name)
        if name in ("add", "adapted"):
            return lambda *args, **kw: self._timed(attr, args, kw)
        return attr

    def _timed(self, fn, args, kw):
        t = time.perf_counter()
        out = fn(*args, **kw)
        self.seconds["products"] += time.perf_counter() - t
        return out


class TimedAttention:
    """A graph's attention kernels, adding their seconds to `seconds["attention"]`."""

    def __init__(self, kernels, seconds):
        self.kernels, self.seconds = kernels, seconds

    def attention_forward(self, *args, **kw):
        return self._timed(self.kernels.attention_forward, args, kw)

    def attention_backward(self, *args, **kw):
        return self._timed(self.kernels.attention_backward, args, kw)

    def _timed(self, fn, args, kw):
        t = time.perf_counter()
        fn(*args, **kw)
        self.seconds["attention"] += time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--mode", default="selective")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--f32-attention", action="store_true",
                    help="also run bf16 products with the float32 attention kernels")
    ap.add_argument("--workdir", default="/tmp/llamatune-bench")
    a = ap.parse_args()
    import llamatune  # noqa: F401  (first: the threading policy)
    import numpy as np
    from finetune_step import B, R, T, TARGETS, build   # bench/ is sys.path[0] when run as a script
    from llamatune.models.model import Model
    from llamatune.options import FinetuneOptions
    from llamatune.models.weights import FrozenBase
    from llamatune.precision import policy
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.train.optimizer import optimizer_step
    from llamatune.train.params import ParamBuffer

    path = Path(a.workdir) / f"bench-llama-{a.type}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    build(path, a.type)
    model = Model(path)
    cfg = model.config
    targets = lora_targets(cfg, {k: R for k in TARGETS}, float(R), tied=False)
    rng = np.random.default_rng(1)
    inputs, labels = rng.integers(0, cfg.n_vocab, (B, T)), rng.integers(0, cfg.n_vocab, (B, T))
    w = np.full((B, T), 1.0 / (B * T), np.float32)
    from llamatune.kernels import attention
    runs = {}
    for name in ("f32", "bf16") + (("bf16, f32 attention",) if a.f32_attention else ()):
        params = ParamBuffer(lora_specs(targets))      # one graph and parameter set each
        init_lora(params, targets, np.random.default_rng(0))
        executor = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, a.mode, policy=policy(name[:4]))
        executor.products = Timed(executor.products)
        kernels = attention if name.endswith("f32 attention") else executor.attention
        executor.attention = TimedAttention(kernels, executor.products.seconds)
        runs[name] = (executor, params)
    opts = FinetuneOptions(warmup=1)
    times, losses, split = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in range(a.rounds + 1):                      # round 0 warms up (compiles, builds primitives)
        for name, (executor, params) in runs.items():
            executor.products.seconds.clear()
            t = time.perf_counter()
            params.zero_grad()
            loss = executor.step(inputs, labels, w, (0, i, 0))
            optimizer_step(params, i, opts)
            if i:
                times[name].append(time.perf_counter() - t)
                losses[name].append(loss)
                split[name].append(dict(executor.products.seconds))
    tok = B * T
    print(f"bench shape ({cfg.n_layer} layers, embd {cfg.n_embd}, ffn {cfg.n_ff}, vocab {cfg.n_vocab}), "
          f"{a.type}, {a.mode}, batch {B} x ctx {T}, {a.rounds} alternating rounds")
    for name in runs:
        best = min(range(a.rounds), key=lambda r: times[name][r])
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in split[name][best].items())
        print(f"{name} step {min(times[name]):.3f}-{max(times[name]):.3f} s "
              f"({tok / min(times[name]):.0f}-{tok / max(times[name]):.0f} tokens/s); best step: {parts}; "
              f"losses {' '.join(f'{x:.5f}' for x in losses[name])}")
    f32_best = min(range(a.rounds), key=lambda r: times["f32"][r])
    share = split["f32"][f32_best]["products"] / times["f32"][f32_best]
    print(f"base products: {share:.0%} of the f32 step; bf16 step / f32 step (best): "
          f"{min(times['f32']) / min(times['bf16']):.2f}x faster")
    if a.f32_attention:
        ratios = sorted(x / y for x, y in zip(times["bf16, f32 attention"], times["bf16"]))
        print(f"bf16 step with the float32 attention / with bf16 attention, per round: median "
              f"{ratios[len(ratios) // 2]:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
