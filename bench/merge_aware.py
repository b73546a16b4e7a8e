"""How much of a LoRA finetune a plain (round-to-nearest) merge keeps, trained normally
and with --merge-aware (#31), measured as bench/merge_quality.py measures it.

For each mode the same finetune (same data, seed, steps) writes an adapter; export-lora
--merge-method plain merges it into the quantized base; the merged model is scored
against the adapter applied at run time, and against the base, on held-out text:

  ppl            perplexity (llama-perplexity's protocol: windows of --ctx, second half scored)
  KL shift kept  1 - KLD(adapter || merged) / KLD(adapter || base)
  same top       share of scored tokens whose most likely token is the adapter's

A merge-aware adapter at run time (W + s B A, unrounded) is not what it was trained
as; its merged model is. So the merged rows' ppl is the figure to compare first.

Usage:
  python bench/merge_aware.py --model ../shared/models/tiny-Q4_K_M.gguf \
      --train ../shared/data/shakespeare.txt --eval ../shared/data/shakespeare-eval.txt [--steps 40]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from merge_quality import score

from llamatune.commands.export import export_lora
from llamatune.commands.finetune import finetune
from llamatune.commands.perplexity import make_windows
from llamatune.formats.adapter import load_runtime_adapters
from llamatune.models.infer import Runner
from llamatune.models.model import Model
from llamatune.options import FinetuneOptions, MergeOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--train", type=Path, required=True)
    ap.add_argument("--eval", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-merge-aware"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--train-ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = Model(args.model)
    tok = model.tokenizer
    windows = make_windows(tok.encode(args.eval.read_text(encoding="utf-8"), add_special=True), args.ctx,
                           tok.bos_id, tok.add_bos, str(args.eval))[: args.windows]
    results = {}
    for mode in ("normal", "merge-aware"):
        d = args.workdir / mode
        d.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        finetune(FinetuneOptions(model_base=args.model, train_data=args.train, ctx=args.train_ctx, batch=args.batch,
                                 lora_r=args.rank, adam_iter=args.steps, adam_alpha=args.lr, warmup=0, save_every=0,
                                 merge_aware=mode == "merge-aware", checkpoint_out=d / "chk-ITERATION.gguf",
                                 lora_out=d / "adapter-ITERATION.gguf", plot=False), quiet=True)
        seconds = time.perf_counter() - t0
        adapter = d / "adapter-LATEST.gguf"
        merged = d / "merged-plain.gguf"
        export_lora(args.model, [(adapter, 1.0)], merged, merge=MergeOptions(merge_method="plain"))
        runtime = load_runtime_adapters(model, [(str(adapter), 1.0)])
        runners = {"base": Runner(model), "adapter": Runner(model, runtime), "merged": Runner(Model(merged))}
        s = score(runners, "adapter", windows)
        for k, v in s.items():
            v["kl_shift_kept"] = 1 - v["kld"] / s["base"]["kld"] if k != "adapter" else 1.0
        s["train_s"] = seconds
        results[mode] = s
        print(f"\n{mode} ({args.steps} steps, {seconds:.0f} s)\n| | ppl | KL shift kept | same top token |\n|---|---|---|---|")
        for k in ("base", "adapter", "merged"):
            v = s[k]
            print(f"| {k} | {v['ppl']:.2f} | {100 * v['kl_shift_kept']:.1f} % | {100 * v['top']:.1f} % |", flush=True)
    (args.workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
