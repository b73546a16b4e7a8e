"""Check: the memory estimate against the measured peak RSS of real finetune runs.

Each (model, mode) runs `finetune` for a few steps in a fresh process; the process
reports the estimate the trainer printed and its peak resident memory (VmHWM).
The estimate should be within 3 % of the peak.

    python -m checks.memory_check MODEL.gguf [MODEL2.gguf ...] [--ctx 256] [--batch 4]
        [--modes layer,selective,none] [--compute-dtypes f32,bf16] [--steps 2] [--text FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "llamatune" / "assets" / "shakespeare-sample.txt"


def run_one(model: Path, mode: str, ctx: int, batch: int, steps: int, text: Path, extra: dict) -> dict:
    import llamatune.train.trainer as trainer
    from llamatune.commands.finetune import finetune
    from llamatune.train.memory import peak_resident_bytes
    from llamatune.options import FinetuneOptions
    seen = {}
    estimate = trainer.memory_estimate

    def keep(*args, **kwargs):
        seen["e"] = estimate(*args, **kwargs)
        return seen["e"]
    trainer.memory_estimate = keep
    with tempfile.TemporaryDirectory() as tmp:
        o = FinetuneOptions(model_base=model, train_data=text, ctx=ctx, batch=batch, adam_iter=steps,
                            checkpointing=mode, save_every=0, checkpoint_out=Path(tmp) / "c-ITERATION.gguf",
                            lora_out=Path(tmp) / "a-ITERATION.gguf", **extra)
        res = finetune(o, quiet=True)
    e = seen["e"]
    return {"mode": e.mode, "estimate": e.total, "runtime": e.runtime, "graph": e.graph, "model": e.model,
            "scratch": e.scratch, "peak": peak_resident_bytes(), "seconds_per_step": res.seconds / steps,
            "steady_tokens_per_s": res.steady_tokens_per_second}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", default="layer,selective,none")
    ap.add_argument("--compute-dtypes", default="f32,bf16", help="--compute-dtype of each run, comma-separated")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--options", default="{}", help="extra FinetuneOptions as JSON, e.g. '{\"lora_dropout\": 0.1}'")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        extra = {**json.loads(a.options), "compute_dtype": a.one[2]}
        r = run_one(Path(a.one[0]), a.one[1], a.ctx, a.batch, a.steps, a.text, extra)
        print(json.dumps(r))
        return
    mb = lambda n: f"{n / 2**20:8.0f}"  # noqa: E731
    print(f"ctx {a.ctx}, batch {a.batch}, {a.steps} steps; figures in MiB")
    print(f"{'model':40} {'dtype':5} {'mode':9} {'estimate':>8} {'peak RSS':>8} {'est/peak':>8} {'runtime':>8} "
          f"{'graph':>8} {'s/step':>7}")
    for model in a.models:
        for dtype in a.compute_dtypes.split(","):
            for mode in a.modes.split(","):
                out = subprocess.run([sys.executable, __file__, str(model), "--one", str(model), mode, dtype,
                                      "--ctx", str(a.ctx), "--batch", str(a.batch), "--steps", str(a.steps),
                                      "--text", str(a.text), "--options", a.options], capture_output=True, text=True)
                if out.returncode:
                    print(f"{model.name:40} {dtype:5} {mode:9} failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{model.name:40} {dtype:5} {r['mode']:9} {mb(r['estimate'])} {mb(r['peak'])} "
                      f"{r['estimate'] / r['peak']:8.1%} {mb(r['runtime'])} {mb(r['graph'])} "
                      f"{r['seconds_per_step']:7.1f}", flush=True)

if __name__ == "__main__":
    main()
