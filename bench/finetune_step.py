"""Benchmark: LoRA training steps (tokens/s, peak RSS, share of the sgemm rate).

Model shape (issue #3): embd 512, 8 layers, 8 heads, 4 KV heads, ffn 1536, vocab
32000, random weights written with llamatune's own writer in Q8_0 and Q4_K.
Training: ctx 256, batch 8, rank 8 on q,k,v,o,gate,up,down, AdamW, in each
--checkpointing mode. Each configuration runs in a fresh process so its peak RSS
is its own; step times are steady-state (the first step, which compiles or loads
the kernels, is left out) and the fastest of `--steps`, compared with the fastest
of sixty reference products, thirty before the steps and thirty after, in rounds
of ten (the least disturbed by other processes on a shared machine; now and then a
whole round runs at half the rate, which alone would double the share). `cpu share`
is the same ratio per CPU-second of the process (with NUMBA_NUM_THREADS=1
OPENBLAS_NUM_THREADS=1, the single-core share, which other processes hardly
disturb). `--profile` prints where one step's time goes: a
cProfile of one step and the same step split into phases (each matmul product,
dequantization, each kernel), exclusive seconds. `--bound` times each matmul product
of a step where it runs and again alone (hot, same shapes and layouts), against the
step time that 80 % of the sgemm rate allows (docs/performance.md). `--model` runs a given GGUF
(e.g. a real model) instead of the bench shape, at `--batch` x `--ctx`. `--arch
gemma2` builds the bench shape as a Gemma 2 model (GEGLU, soft-capped attention
scores and logits, a 128-token window on every other layer; tied head).

    python bench/finetune_step.py [--steps 3] [--types q8_0,q4_k] [--modes selective,layer,none] [--arch gemma2]
        [--workdir /tmp/llamatune-bench] [--profile [--cpu-clock]] [--bound] [--model M.gguf --batch 8 --ctx 256]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(arch="llama", n_vocab=32000, n_ctx_train=256, n_embd=512, n_layer=8, n_ff=1536, n_head=8,
             n_head_kv=4, head_dim=64, n_rot=64, norm_eps=1e-5)
# --arch gemma2: the same sizes as a Gemma 2 model (GEGLU, soft-capped scores and
# logits, a sliding window on every other layer), for the kernels llama does not use
GEMMA2 = dict(arch="gemma2", attn_softcap=50.0, final_softcap=30.0, sliding_window=128, swa_pattern=2)
B, T, R = 8, 256, 8
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def bench_shape(arch: str) -> dict:
    """The bench model's ModelConfig fields as `arch` (llama or gemma2)."""
    return dict(SHAPE, **({} if arch == "llama" else GEMMA2))


def dummy_vocab(n: int):
    from gguf import GGUFValueType as V
    from llamatune.formats.gguf_io import KV, kv
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, n)]
    return [kv("tokenizer.ggml.model", "llama"), KV("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            KV("tokenizer.ggml.scores", [0.0] * n, V.ARRAY, V.FLOAT32),
            KV("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (n - 3), V.ARRAY, V.INT32),
            kv("tokenizer.ggml.bos_token_id", 1), kv("tokenizer.ggml.eos_token_id", 2)]


def build(path: Path, qtype: str, arch: str = "llama") -> None:
    from llamatune.models.config import ModelConfig
    from llamatune.models.writer import parse_outtype, random_weights, write_model
    if path.exists():
        return
    cfg = ModelConfig(**bench_shape(arch))
    write_model(path, cfg, random_weights(cfg, seed=0), dummy_vocab(cfg.n_vocab), parse_outtype(qtype))


def step_flops(cfg, B: int = B, T: int = T) -> float:
    """Matmul FLOPs of one training step: forward, backward dx (frozen weights), LoRA, causal attention."""
    N = B * T
    mats = {"attn_q": (cfg.n_embd_q, cfg.n_embd), "attn_k": (cfg.n_embd_kv, cfg.n_embd),
            "attn_v": (cfg.n_embd_kv, cfg.n_embd), "attn_output": (cfg.n_embd, cfg.n_embd_q),
            "ffn_gate": (cfg.n_ff, cfg.n_embd), "ffn_up": (cfg.n_ff, cfg.n_embd), "ffn_down": (cfg.n_embd, cfg.n_ff)}
    per_layer = sum(2 * N * o * i * 2 + 2 * N * R * (o + i) * 3 for o, i in mats.values())
    attn = 2 * 2 * B * cfg.n_head * T * T * cfg.head_dim / 2          # QK^T and PV, causal half
    per_layer += attn * (1 + 2.5)                                      # backward: recompute + 4 products
    head = 2 * N * cfg.n_embd * cfg.n_vocab * 2
    return cfg.n_layer * per_layer + head


def sgemm_gflops(cpu: bool = False) -> float:
    """The reference rate: (B*T, 512) x (512, 1536) f32 products, the best of three
    rounds of 10 a short pause apart (the least disturbed by other processes; a round
    can run at half the rate throughout, as if one of the two cores were held);
    `cpu`: per CPU-second of this process."""
    import numpy as np
    a = np.random.rand(B * T, 512).astype(np.float32)
    w = np.random.rand(1536, 512).astype(np.float32)
    out = np.empty((B * T, 1536), np.float32)
    np.matmul(a, w.T, out=out)
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(3):
        time.sleep(0.05)
        for _ in range(10):
            t = clock()
            np.matmul(a, w.T, out=out)
            best = min(best, clock() - t)
    return 2 * a.shape[0] * 512 * 1536 / best / 1e9


def bound_table(rows, step_flops_: float, sgemm: float) -> str:
    """`phases.product_bound`'s groups as a table, and what they leave of the step time
    that 80 % of the sgemm rate allows."""
    lines = [f"{'products':14} {'calls':>6} {'GFLOP':>7} {'in step s':>10} {'alone s':>8} {'alone GFLOP/s':>14}"]
    for g, n, fl, step_s, alone_s in rows + [("all", *(sum(r[i] for r in rows) for i in range(1, 5)))]:
        lines.append(f"{g:14} {n:6d} {fl / 1e9:7.1f} {step_s:10.3f} {alone_s:8.3f} {fl / alone_s / 1e9:14.1f}")
    budget, alone = step_flops_ / (0.8 * sgemm * 1e9), sum(r[4] for r in rows)
    lines.append(f"80 % of {sgemm:.0f} GFLOP/s allows {budget:.3f} s a step for its {step_flops_ / 1e9:.0f} GFLOP; "
                 f"these products alone take {alone:.3f} s of it ({alone / budget:.0%}), leaving "
                 f"{budget - alone:.3f} s for attention and everything else")
    return "\n".join(lines)


def run_one(path: Path, mode: str, steps: int, profile: bool = False, B: int = B, T: int = T,
            cpu_clock: bool = False, bound: bool = False, dtype: str = "f32") -> dict:
    """One configuration in this process: returns tokens/s, RSS, shares."""
    import llamatune  # noqa: F401  (first: sets the threading policy before numpy loads)
    from llamatune.precision import policy, prepare_threads
    prepare_threads(dtype)  # the OpenMP spin the CLI sets for these products, before OpenMP starts
    import numpy as np
    from llamatune.models.weights import FrozenBase
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import init_lora, lora_specs, lora_targets
    from llamatune.models.model import Model
    from llamatune.train.optimizer import optimizer_step
    from llamatune.options import FinetuneOptions
    from llamatune.train.params import ParamBuffer
    model = Model(path)
    cfg = model.config
    ranks = {k: R for k in TARGETS}
    targets = lora_targets(cfg, ranks, float(R), tied=False)
    params = ParamBuffer(lora_specs(targets))
    init_lora(params, targets, np.random.default_rng(0))
    executor = StepExecutor(cfg, FrozenBase(model), params, targets, B, T, mode, policy=policy(dtype))
    rng = np.random.default_rng(1)
    opts = FinetuneOptions(warmup=1)
    inputs = rng.integers(0, cfg.n_vocab, (B, T))
    targets_ids = rng.integers(0, cfg.n_vocab, (B, T))
    w = np.full((B, T), 1.0 / (B * T), np.float32)
    gf_before = sgemm_gflops(), sgemm_gflops(cpu=True)  # and after the steps: the faster counts
    times, cpu = [], []
    for i in range(steps + 1):                      # first step warms up (numba compile/cache load)
        t, c = time.perf_counter(), time.process_time()
        params.zero_grad()
        loss = executor.step(inputs, targets_ids, w, (0, i, 0))
        optimizer_step(params, i, opts)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    step_s, cpu_s = min(times[1:]), min(cpu[1:])   # the least disturbed step, as the sgemm rate
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # before the profile's, bound's arrays
    if profile:                                     # one more step under cProfile, to stderr
        import cProfile
        import pstats
        with cProfile.Profile() as pr:
            params.zero_grad()
            executor.step(inputs, targets_ids, w, (0, steps + 1, 0))
            optimizer_step(params, steps + 1, opts)
        pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(14)
        from phases import profile_steps                # and three more split into phases
        clock = time.process_time if cpu_clock else time.perf_counter
        print(profile_steps(executor, params, inputs, targets_ids, w, steps + 2, opts, clock), file=sys.stderr)
    if bound:                                       # each product of a step, in it and alone
        from phases import product_bound
        rows = product_bound(executor, params, inputs, targets_ids, w, steps + 1, opts)
    gf, gf_cpu = max(gf_before[0], sgemm_gflops()), max(gf_before[1], sgemm_gflops(cpu=True))
    flops = step_flops(cfg, B, T)
    if bound:
        print(bound_table(rows, flops, gf), file=sys.stderr)
    return {"tokens_per_s": B * T / step_s, "step_s": step_s, "peak_rss_mb": peak_mb,
            "activations_mb": executor.activation_bytes() / 2**20, "step_gflop": flops / 1e9,
            "achieved_gflops": flops / step_s / 1e9, "sgemm_gflops": gf, "share_of_sgemm": flops / step_s / 1e9 / gf,
            "cpu_share_of_sgemm": flops / cpu_s / 1e9 / gf_cpu,
            "loss": loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--types", default="q8_0,q4_k")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-bench"))
    ap.add_argument("--modes", default="selective,layer,none")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one step of each configuration")
    ap.add_argument("--bound", action="store_true",
                    help="time each matmul product of a step in the step and alone (hot, best of 10)")
    ap.add_argument("--cpu-clock", action="store_true", help="phases in CPU seconds of the process (for 1 thread)")
    ap.add_argument("--arch", choices=("llama", "gemma2"), default="llama",
                    help="the bench shape as this architecture")
    ap.add_argument("--model", type=Path, help="this GGUF instead of the bench shape (--types is ignored)")
    ap.add_argument("--batch", type=int, default=B)
    ap.add_argument("--ctx", type=int, default=T)
    ap.add_argument("--compute-dtype", default="f32", help="the base's products: f32 or bf16 (products.py)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "CHECKPOINTING"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(Path(a.one[0]), a.one[1], a.steps, a.profile, a.batch, a.ctx, a.cpu_clock,
                                 a.bound, a.compute_dtype)))
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"LoRA r={R} on {','.join(TARGETS)}; ctx {a.ctx}, batch {a.batch}; "
          f"model {a.model or bench_shape(a.arch)}; {os.cpu_count()} CPUs")
    print(f"{'type':6} {'mode':9} {'tok/s':>8} {'step s':>7} {'peak RSS MB':>12} {'acts MB':>8} "
          f"{'GFLOP/s':>8} {'sgemm':>7} {'share':>6} {'cpu share':>9}")
    for qtype in a.types.split(",") if a.model is None else ["model"]:
        arch = "" if a.arch == "llama" else f"-{a.arch}"
        path = a.model or a.workdir / f"bench-512x8{arch}.{qtype}.gguf"
        build(path, qtype, a.arch)
        for mode in a.modes.split(","):
            run = subprocess.run([sys.executable, __file__, "--steps", str(a.steps), "--one", str(path), mode,
                                  "--batch", str(a.batch), "--ctx", str(a.ctx), "--compute-dtype", a.compute_dtype]
                                 + (["--profile"] if a.profile else []) + (["--cpu-clock"] if a.cpu_clock else [])
                                 + (["--bound"] if a.bound else []),
                                 capture_output=True, text=True, check=True)
            if a.profile or a.bound:
                print(run.stderr)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"{qtype:6} {mode:9} {r['tokens_per_s']:8.0f} {r['step_s']:7.2f} "
                  f"{r['peak_rss_mb']:12.0f} {r['activations_mb']:8.0f} {r['achieved_gflops']:8.1f} "
                  f"{r['sgemm_gflops']:7.1f} {r['share_of_sgemm']:6.0%} {r['cpu_share_of_sgemm']:9.0%}", flush=True)


if __name__ == "__main__":
    main()
