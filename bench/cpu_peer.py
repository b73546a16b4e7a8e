"""Benchmark: llamatune's CPU step (f32 and bf16 products) against PyTorch + PEFT on the
CPU, on bench/finetune_step.py's shape (llama, 8 layers, embd 512, ffn 1536, vocab
32000; batch 8 x ctx 256, LoRA r 8 on q,k,v,o,gate,up,down, AdamW), alternating runs,
each in a fresh process: tokens/s of the best of --steps steps after a warm-up step,
and the process's peak RSS.

  llamatune   finetune_step.py's child (Q4_K base, --checkpointing selective) with
              --compute-dtype f32 and bf16;
  torch+peft  transformers.LlamaForCausalLM of the same shape with random bf16 weights
              (`model.to(torch.bfloat16)`), peft LoraConfig(r=8, lora_alpha=8), its
              gradient checkpointing, AdamW + clip_grad_norm_, torch.set_num_threads(2).
              It runs in its own venv (never a project dependency):
                  python -m venv venv-torch
                  venv-torch/bin/pip install torch==2.13.0 transformers peft

    python bench/cpu_peer.py [--torch-python venv-torch/bin/python] [--rounds 2] [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from finetune_step import B, R, SHAPE, T, build  # bench/ is sys.path[0] when run as a script

HERE = Path(__file__).resolve().parent
# The environment as the user started this script: each child gets it, not this process's after
# `build` imported llamatune (whose start-up sets GOMP_SPINCOUNT=2000 and OPENBLAS_THREAD_TIMEOUT=4:
# PyTorch runs on GNU OpenMP too, and inheriting the short spin cost it 0-13 %, a median of about
# 4 %, in six alternating pairs; llamatune's children set their own policy when they start)
USER_ENV = dict(os.environ)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_torch(steps: int) -> dict:
    import torch
    import peft
    import transformers
    s = SHAPE
    torch.set_num_threads(2)
    hf = transformers.LlamaConfig(
        vocab_size=s["n_vocab"], hidden_size=s["n_embd"], intermediate_size=s["n_ff"], num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_head"], num_key_value_heads=s["n_head_kv"], max_position_embeddings=s["n_ctx_train"],
        rms_norm_eps=s["norm_eps"], tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=R, lora_alpha=R, lora_dropout=0.0,
                                                       target_modules=HF_TARGETS, task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, s["n_vocab"], (2, B, T), generator=gen)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    step_s = min(times[1:])
    return {"tokens_per_s": B * T / step_s, "step_s": step_s,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "torch": torch.__version__, "attn": getattr(model.config, "_attn_implementation", None)}


def child(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=USER_ENV)
    if r.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-python", default="venv-torch/bin/python")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", default="selective")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-bench"))
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.torch_child:
        print(json.dumps(run_torch(a.steps)))
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    model = a.workdir / "bench-512x8.q4_k.gguf"
    build(model, "q4_k")
    res: dict[str, list[dict]] = {"llamatune f32": [], "llamatune bf16": [], "torch+peft bf16": []}
    for r in range(a.rounds):
        for dtype in ("f32", "bf16"):
            res[f"llamatune {dtype}"].append(child([sys.executable, str(HERE / "finetune_step.py"), "--steps",
                                                    str(a.steps), "--one", str(model), a.mode,
                                                    "--compute-dtype", dtype]))
        res["torch+peft bf16"].append(child([a.torch_python, __file__, "--torch-child", "--steps", str(a.steps)]))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.0f} tok/s {v[-1]['peak_rss_mb']:.0f} MB"
                                         for k, v in res.items()), flush=True)
    print(f"\nbench shape, Q4_K, --checkpointing {a.mode}; best step of {a.steps} per run; {a.rounds} rounds")
    for k, v in res.items():
        tps, rss = [x["tokens_per_s"] for x in v], [x["peak_rss_mb"] for x in v]
        print(f"{k:16} {statistics.median(tps):7.0f} tok/s ({min(tps):.0f}-{max(tps):.0f})  "
              f"peak RSS {statistics.median(rss):6.0f} MB ({min(rss):.0f}-{max(rss):.0f})")
    t = res["torch+peft bf16"]
    for k in ("llamatune f32", "llamatune bf16"):
        speed = statistics.median(x["tokens_per_s"] for x in res[k]) / statistics.median(x["tokens_per_s"] for x in t)
        mem = statistics.median(x["peak_rss_mb"] for x in res[k]) / statistics.median(x["peak_rss_mb"] for x in t)
        print(f"{k} / torch+peft bf16: {speed:.2f}x tokens/s, {mem:.2f}x peak RSS")


if __name__ == "__main__":
    main()
