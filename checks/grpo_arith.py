"""GRPO's real task: arithmetic word problems answered as \\boxed{N} within a token budget.

The task (configs/prompts-example.jsonl shows its rows): "NAME has a THINGS. A friend
gives NAME b more, then NAME gives away c. How many THINGS does NAME have now?", with
two-digit a, b, c and a + b - c >= 0, the answer in the row's `answer` field for
`--reward boxed-answer`. The base model reasons correctly but at length; the reward
teaches it to reason briefly enough to finish within --max-completion-length.

    python -m checks.grpo_arith data DIR [--train 256] [--val 16] [--test 64] [--seed 0]
        writes DIR/train.jsonl, val.jsonl, test.jsonl (no (a, b, c) shared between them)
    python -m checks.grpo_arith accuracy --model M.gguf [--lora A.gguf] --data DIR/test.jsonl
        [--n-predict 128] [--bin LLAMA_BIN_DIR] [--threads 2]
        llama.cpp's own greedy completions (llama-completion --temp 0 -n N, the adapter with
        --lora) of each prompt rendered by the model's chat template, scored by the same
        reward: prints one JSON line {"correct", "total", "accuracy", "mean_length_chars"}

A training run that fits 2 cores (see README, "Online RL"):
    llamatune finetune -m qwen2.5-coder-0.5b-instruct.gguf --method grpo --reward boxed-answer
        --train-data DIR/train.jsonl --val-data DIR/val.jsonl --max-completion-length 128
        --num-generations 4 --batch 8 --ctx 320 --lora-r 8 --lr 2e-5 --adam-iter 60
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Keiko", "Liam",
         "Mira", "Nils", "Olga", "Pedro", "Rosa", "Sami", "Tara", "Umar"]
THINGS = ["apples", "marbles", "stamps", "books", "coins", "stickers", "pencils", "shells", "cards", "buttons"]
DONE_RE = re.compile(r"common_perf_print: +total time =")     # llama-completion's last line (stderr)


def problems(seed: int) -> list[dict]:
    """Every (a, b, c) with two-digit values and a + b - c >= 0, shuffled by seed, each as a
    prompt-only row with its answer."""
    import numpy as np
    rng = np.random.default_rng(seed)
    triples = [(a, b, c) for a in range(10, 100) for b in range(10, 100) for c in range(10, 100) if a + b - c >= 0]
    rows = []
    for k in rng.permutation(len(triples))[:4096]:
        a, b, c = triples[k]
        who, what = NAMES[int(rng.integers(len(NAMES)))], THINGS[int(rng.integers(len(THINGS)))]
        text = (f"{who} has {a} {what}. A friend gives {who} {b} more, then {who} gives away {c}. "
                f"How many {what} does {who} have now? Put the final answer in \\boxed{{}}.")
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": str(a + b - c)})
    return rows


def write_data(out: Path, n_train: int, n_val: int, n_test: int, seed: int) -> dict[str, Path]:
    rows = problems(seed)
    if n_train + n_val + n_test > len(rows):
        raise SystemExit(f"at most {len(rows)} problems in all")
    out.mkdir(parents=True, exist_ok=True)
    parts, start = {}, 0
    for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[start:start + n]), encoding="utf-8")
        parts[name], start = path, start + n
    return parts


def rendered_prompt(model: Path, messages: list[dict]) -> str:
    """The conversation as the model's chat template renders it, generation prompt included."""
    from llamatune.formats.gguf_io import GGUFFile
    from llamatune.models.chat_template import load_template
    from llamatune.models.tokenizer import Tokenizer
    template = load_template(Tokenizer.from_gguf(GGUFFile(model)), None)
    if template is None:
        raise SystemExit(f"{model}: no chat template")
    return template.render(messages, add_generation_prompt=True)


def llama_completion(bin_dir: Path, model: Path, lora: Path | None, prompt: str, n: int, threads: int) -> str:
    """llama.cpp's greedy continuation of prompt (the text after it), run until its
    closing line shows that the whole output arrived (its logger may drop the last lines)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(prompt)
    args = [str(bin_dir / "llama-completion"), "-m", str(model), "-f", f.name, "-n", str(n), "--temp", "0",
            "-no-cnv", "--no-display-prompt", "-nr", "-t", str(threads), "-c", "1024", "--no-warmup"]
    if lora is not None:
        args += ["--lora", str(lora)]
    try:
        for _ in range(4):
            p = subprocess.run(args, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"llama-completion failed ({p.returncode}): {p.stderr[-400:]}")
            if DONE_RE.search(p.stderr):
                return p.stdout.replace(" [end of text]\n", "")
        raise SystemExit("llama-completion: 4 runs, none printed its closing line")
    finally:
        os.unlink(f.name)


def score(rows: list[dict], texts: list[str]) -> dict:
    """The boxed-answer reward of each completion: the share right."""
    from llamatune.data.rewards import boxed_answer
    got = boxed_answer(None, texts, [r["answer"] for r in rows])
    return {"correct": int(sum(got)), "total": len(rows), "accuracy": sum(got) / max(len(rows), 1),
            "mean_length_chars": sum(len(t) for t in texts) / max(len(texts), 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("out", type=Path)
    d.add_argument("--train", type=int, default=256)
    d.add_argument("--val", type=int, default=16)
    d.add_argument("--test", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("accuracy")
    a.add_argument("--model", type=Path, required=True)
    a.add_argument("--lora", type=Path)
    a.add_argument("--data", type=Path, required=True)
    a.add_argument("--n-predict", type=int, default=128)
    a.add_argument("--bin", type=Path, default=Path(os.environ.get("LLAMA_BIN_DIR", "llama.cpp/build/bin")))
    a.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "data":
        for name, path in write_data(args.out, args.train, args.val, args.test, args.seed).items():
            print(f"{name}: {path}")
        return 0
    rows = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = []
    for k, r in enumerate(rows):
        texts.append(llama_completion(args.bin, args.model, args.lora, rendered_prompt(args.model, r["prompt"]),
                                      args.n_predict, args.threads))
        print(f"{k + 1}/{len(rows)} {'right' if score([r], texts[-1:])['correct'] else 'wrong'}", file=sys.stderr)
    print(json.dumps(score(rows, texts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
