"""Prototype: a training step of bench/finetune_step.py's shape with the frozen base's
products in bf16 (issue #29), against today's float32 step, in one process.

The bf16 step swaps the graph's `xp` for one whose `matmul` sends every base product
(x W^T forward, dy W backward, the output head both ways: the products whose three
sizes all exceed 64, so not the rank-8 LoRA ones) through kernels.bf16: a and W
rounded to bf16 (to_bf16), then oneDNN's bf16 product with float32 accumulation. W is
the step's float32 dequantized copy rounded here, which costs what dequantizing
straight to bf16 (bf16.dequantize_into: dequant into an L2-sized scratch, then round)
adds to today's dequantization. The LoRA path stays float32 and is not merged into W
(merging s B A into a bf16 W would round the adapter's share away).

Rounds alternate f32 step, bf16 step; printed: each step's best and worst time, the
share of the f32 step spent in base products, the bf16 step's split (products,
rounding of a, rounding of W), and both losses.

    python bench/bf16_step.py [--type q4_k] [--mode selective] [--rounds 4] [--workdir /tmp/llamatune-bench]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


class Products:
    """A stand-in for numpy as the graph's `xp`: `matmul` of a base product in bf16
    (or timed float32 with bf16=False); everything else is numpy's."""

    def __init__(self, bf16: bool):
        import numpy as np
        from llamatune.kernels import bf16 as k
        self.np, self.k, self.bf16 = np, k, bf16
        self.seconds: dict[str, float] = defaultdict(float)
        self.buffers: dict[tuple, object] = {}

    def __getattr__(self, name):
        return getattr(self.np, name)

    def _rounded(self, x, slot):
        """x (float32, rows contiguous: C order or a column slice) rounded to bf16 into
        a kept buffer."""
        key = (slot, x.shape)
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = self.np.empty(x.shape, self.np.uint16)
        self.k.to_bf16(buf, x)
        return buf

    def matmul(self, a, b, out=None):
        np = self.np
        base = (out is not None and a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype == np.float32
                and min(a.shape[0], a.shape[1], b.shape[1]) > 64)
        if not base:
            return np.matmul(a, b, out=out)
        t0 = time.perf_counter()
        if not self.bf16:
            np.matmul(a, b, out=out)
            self.seconds["f32 products"] += time.perf_counter() - t0
            return out
        trans_b = not b.flags.c_contiguous                   # W.T: pass W, transposed
        ab = self._rounded(a, "a")
        t1 = time.perf_counter()
        bb = self._rounded(b.T if trans_b else b, "w")
        t2 = time.perf_counter()
        self.k.gemm(out, ab, bb, trans_b=trans_b)
        t3 = time.perf_counter()
        self.seconds["a->bf16"] += t1 - t0
        self.seconds["W->bf16"] += t2 - t1
        self.seconds["bf16 products"] += t3 - t2
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--mode", default="selective")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/llamatune-bench")
    a = ap.parse_args()
    import llamatune  # noqa: F401  (first: the threading policy)
    import numpy as np
    from finetune_step import B, R, T, TARGETS, build
    from llamatune.models.model import Model
    from llamatune.options import FinetuneOptions
    from llamatune.train.graph import FrozenBase, Graph
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
    runs = {}
    for name in ("f32", "bf16"):                       # one graph and parameter set each
        params = ParamBuffer(lora_specs(targets))
        init_lora(params, targets, np.random.default_rng(0))
        graph = Graph(cfg, FrozenBase(model), params, targets, B, T, a.mode)
        graph.xp = Products(bf16=name == "bf16")
        if name == "bf16":
            graph.merge_lora = False
        runs[name] = (graph, params)
    opts = FinetuneOptions(warmup=1)
    times, losses, split = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in range(a.rounds + 1):                      # round 0 warms up (compiles, builds primitives)
        for name, (graph, params) in runs.items():
            graph.xp.seconds.clear()
            t = time.perf_counter()
            params.zero_grad()
            loss = graph.step(inputs, labels, w, (0, i, 0))
            optimizer_step(params, i, opts)
            if i:
                times[name].append(time.perf_counter() - t)
                losses[name].append(loss)
                split[name].append(dict(graph.xp.seconds))
    tok = B * T
    print(f"bench shape ({cfg.n_layer} layers, embd {cfg.n_embd}, ffn {cfg.n_ff}, vocab {cfg.n_vocab}), "
          f"{a.type}, {a.mode}, batch {B} x ctx {T}, {a.rounds} alternating rounds")
    for name in runs:
        best = min(range(a.rounds), key=lambda r: times[name][r])
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in split[name][best].items())
        print(f"{name:5} step {min(times[name]):.3f}-{max(times[name]):.3f} s "
              f"({tok / min(times[name]):.0f}-{tok / max(times[name]):.0f} tokens/s); best step: {parts}; "
              f"losses {' '.join(f'{x:.5f}' for x in losses[name])}")
    f32_best = min(range(a.rounds), key=lambda r: times["f32"][r])
    share = split["f32"][f32_best]["f32 products"] / times["f32"][f32_best]
    print(f"base products: {share:.0%} of the f32 step; bf16 step / f32 step (best): "
          f"{min(times['f32']) / min(times['bf16']):.2f}x faster")


if __name__ == "__main__":
    main()
