"""Verification on a real model: DPO (or ORPO) teaches a style preference.

Pairs: a question with the same answer in two registers, the chosen one in a pirate's
voice, the rejected one plain (which an instruct model prefers). Held-out pairs ask other
questions. `--form chat` renders the question with the model's chat template
(conversational rows); `--form text` writes standard rows, "Question: ...\nAnswer:" and
the answer after a space, which is exactly the text llama.cpp's multiple-choice scorer
builds (question + " " + answer). Before and after training it prints, over the held-out
pairs:
  * logp accuracy: the fraction where the chosen answer's summed log-probability beats the
    rejected one's (answer and EOS, as trained; sums favour the shorter plain answers);
  * the same over the answer's text alone (no EOS), summed and as per-token means, which
    is how llama.cpp's `llama-perplexity --multiple-choice` picks an ending;
  * with --llama-bin and --form text: llama-perplexity --multiple-choice on the held-out
    pairs, the base alone and with the trained adapter at run time (--lora);
  * the run's own held-out reward accuracy and loss (metrics.jsonl, eval_ lines).

    python bench/preference_style.py --model qwen2.5-coder-0.5b-instruct.gguf \
        [--method dpo|orpo] [--form chat|text] [--steps 40] [--lr 2e-4] \
        [--llama-bin llama.cpp/build/bin] [--workdir /tmp/llamatune-style]
"""
from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import time
from pathlib import Path

import numpy as np

FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What is two plus two?", "Two plus two is four."),
    ("Which planet is closest to the sun?", "Mercury is the planet closest to the sun."),
    ("What do bees make?", "Bees make honey."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("What language is spoken in Spain?", "Spanish is spoken in Spain."),
    ("What is the largest ocean?", "The Pacific is the largest ocean."),
    ("How many hours are in a day?", "There are twenty-four hours in a day."),
    ("What gas do plants take in?", "Plants take in carbon dioxide."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What is the boiling point of water in Celsius?", "Water boils at one hundred degrees Celsius."),
    ("How many continents are there?", "There are seven continents."),
    ("What do cows drink?", "Cows drink water."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("What shape has three sides?", "A triangle has three sides."),
    ("What is the main ingredient of bread?", "The main ingredient of bread is flour."),
    ("Which month comes after March?", "April comes after March."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("How many minutes are in an hour?", "There are sixty minutes in an hour."),
    ("What do you call a baby cat?", "A baby cat is called a kitten."),
    ("What instrument has black and white keys?", "The piano has black and white keys."),
    ("Which season comes after winter?", "Spring comes after winter."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the freezing point of water in Celsius?", "Water freezes at zero degrees Celsius."),
    ("How many sides does a square have?", "A square has four sides."),
    ("What do caterpillars turn into?", "Caterpillars turn into butterflies."),
    ("Which organ pumps blood?", "The heart pumps blood."),
    ("What is the largest planet?", "Jupiter is the largest planet."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many wheels does a bicycle have?", "A bicycle has two wheels."),
    ("What do we breathe in to live?", "We breathe in oxygen to live."),
    ("What is the color of grass?", "Grass is green."),
    ("Which bird is a symbol of peace?", "The dove is a symbol of peace."),
    ("What is the hardest natural material?", "Diamond is the hardest natural material."),
    ("What is ten minus three?", "Ten minus three is seven."),
    ("Where does the sun rise?", "The sun rises in the east."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("How many players are on a soccer team?", "A soccer team has eleven players on the field."),
    ("What is the longest river in Africa?", "The Nile is the longest river in Africa."),
    ("What do you use to write on a blackboard?", "You use chalk to write on a blackboard."),
    ("Which animal gives us wool?", "Sheep give us wool."),
    ("What is three times three?", "Three times three is nine."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("What fruit keeps the doctor away?", "An apple a day keeps the doctor away."),
    ("How many months have twenty-eight days?", "Every month has at least twenty-eight days."),
    ("What is the smallest prime number?", "Two is the smallest prime number."),
    ("Which metal is liquid at room temperature?", "Mercury is liquid at room temperature."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What do pandas mostly eat?", "Pandas mostly eat bamboo."),
    ("How many strings does a violin have?", "A violin has four strings."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What star is at the center of our solar system?", "The sun is at the center of our solar system."),
    ("What is half of twenty?", "Half of twenty is ten."),
    ("Which animal is famous for its long neck?", "The giraffe is famous for its long neck."),
    ("What do you call a group of wolves?", "A group of wolves is called a pack."),
    ("What is the capital of Russia?", "The capital of Russia is Moscow."),
    ("How many teeth does an adult human have?", "An adult human has thirty-two teeth."),
    ("What is the primary color between red and blue?", "Yellow is the primary color besides red and blue."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra."),
    ("Which direction does a compass needle point?", "A compass needle points north."),
]
PIRATE = [("The ", "Arr, th' "), (" is ", " be "), (" are ", " be "), (" has ", " got "), (" have ", " got "),
          ("There ", "Arr, thar "), ("You ", "Ye "), (" you ", " ye ")]


def pirate(text: str) -> str:
    for a, b in PIRATE:
        text = text.replace(a, b)
    if not text.startswith("Arr"):
        text = "Arr, " + text[0].lower() + text[1:]
    return text[:-1] + ", matey! Yo ho!"


def question_text(q: str) -> str:
    return f"Question: {q}\nAnswer:"


def write_pairs(path: Path, facts, form: str) -> Path:
    if form == "chat":
        rows = [{"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": pirate(a)}],
                 "rejected": [{"role": "assistant", "content": a}]} for q, a in facts]
    else:
        rows = [{"prompt": question_text(q), "chosen": " " + pirate(a), "rejected": " " + a} for q, a in facts]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_multiple_choice(path: Path, facts) -> Path:
    """llama.cpp's --multiple-choice file (perplexity.cpp multiple_choice_task): n tasks,
    their offsets, then per task the question, mc1 (answers, labels) and an empty mc2.
    Label 1 marks the pirate answer."""
    def string(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<I", len(b)) + b
    tasks = [string(question_text(q)) + struct.pack("<I", 2) + string(pirate(a)) + string(a)
             + struct.pack("<2i", 1, 0) + struct.pack("<I", 0) for q, a in facts]
    pos, offsets = 4 + 4 * len(tasks), []
    for t in tasks:
        offsets.append(pos)
        pos += len(t)
    path.write_bytes(struct.pack("<I", len(tasks)) + struct.pack(f"<{len(tasks)}I", *offsets) + b"".join(tasks))
    return path


def llama_multiple_choice(bin_dir: Path, model: Path, tasks: Path, adapter: Path | None, log: Path) -> float:
    """llama-perplexity --multiple-choice accuracy (%) on `tasks`, with the adapter at run time."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "--multiple-choice", "-bf", str(tasks),
           "-t", "2", "-c", "256"] + (["--lora", str(adapter)] if adapter else [])
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text(errors="replace")
    m = re.findall(r"Final result: ([0-9.]+)", text) or re.findall(r"^\d+\t([0-9.]+)$", text, re.M)
    if rc or not m:
        raise SystemExit(f"llama-perplexity failed ({rc}); see {log}:\n{text[-1500:]}")
    return float(m[-1])


def logp_accuracy(model_path: Path, val: Path, adapter: Path | None, ctx: int) -> dict[str, float]:
    """With the adapter (a checkpoint) or without, over the held-out pairs: the fraction
    whose chosen answer has the higher summed log-probability (the answer and the EOS
    token, as trained), and, over the answer's text alone (no EOS: what llama.cpp's
    multiple-choice scorer sees), the same for the sums and for the per-token means (its
    measure); and the mean margin of the sums."""
    from llamatune.data.datasets import load_pairs
    from llamatune.models.model import Model
    from llamatune.models.weights import FrozenBase
    from llamatune.options import FinetuneOptions
    from llamatune.train import checkpoint as ckpt
    from llamatune.train.step import StepExecutor
    from llamatune.train.lora import lora_specs, lora_targets
    from llamatune.train.params import ParamBuffer
    from llamatune.train.preference import PairValidator, Preference
    model = Model(model_path)
    o = FinetuneOptions(method="dpo", ctx=ctx, batch=4, lora_r=8)
    samples = load_pairs(val, model.tokenizer, o, "validation")
    targets = lora_targets(model.config, o.ranks(), 8.0, model.weights.output is model.weights.token_embd)
    params = ParamBuffer(lora_specs(targets))
    if adapter is not None:
        ckpt.load(adapter).load_into(params)
    executor = StepExecutor(model.config, FrozenBase(model), params, targets, o.batch, o.ctx, "layer")
    pref = Preference(o)
    v = PairValidator(samples, o, model.config.n_vocab, model.tokenizer.bos_id, model.tokenizer.eos_id, pref)
    full, text, mean = [], [], []
    for b in v.batches():
        ce = pref._token_losses(executor, b)
        s = pref._scores(b, ce, None)
        full.append(s.logp)
        t, m = np.zeros(s.logp.shape), np.zeros(s.logp.shape)
        for k, row in enumerate(s.rows):
            for j, r in enumerate((row, row + 1)):
                idx = np.flatnonzero(b.targets[r] >= 0)[:-1]          # the answer's text, without EOS
                t[k, j] = -ce[r, idx].sum()
                m[k, j] = t[k, j] / len(idx)
        text.append(t)
        mean.append(m)
    full, text, mean = np.concatenate(full), np.concatenate(text), np.concatenate(mean)
    return {"sum": float((full[:, 0] > full[:, 1]).mean()), "text sum": float((text[:, 0] > text[:, 1]).mean()),
            "text mean": float((mean[:, 0] > mean[:, 1]).mean()), "margin": float((full[:, 0] - full[:, 1]).mean())}


def accuracy_line(acc: dict[str, float]) -> str:
    return (f"held-out logp accuracy {acc['sum']:.1%} (answer + EOS, summed); answer text alone: summed "
            f"{acc['text sum']:.1%}, per-token mean {acc['text mean']:.1%} (llama.cpp's measure); "
            f"mean chosen - rejected logp {acc['margin']:+.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--method", default="dpo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--val-pairs", type=int, default=16, help="held-out pairs (the last of the 64 questions)")
    ap.add_argument("--form", choices=("chat", "text"), default="chat")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's bin folder: score with llama-perplexity "
                    "--multiple-choice (--form text)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/llamatune-style"))
    ap.add_argument("--score", action="store_true", help="no training: score the workdir's chk-LATEST.gguf "
                    "(and adapter-LATEST.gguf in llama.cpp) of an earlier run")
    args = ap.parse_args()
    from llamatune.commands.finetune import finetune
    from llamatune.options import FinetuneOptions, validate
    w = args.workdir / f"{args.method}-{args.form}"
    w.mkdir(parents=True, exist_ok=True)
    n_train = len(FACTS) - args.val_pairs
    train = write_pairs(w / "train.jsonl", FACTS[:n_train], args.form)
    val = write_pairs(w / "val.jsonl", FACTS[n_train:], args.form)
    if args.score:
        print(f"scored: {accuracy_line(logp_accuracy(args.model, val, w / 'chk-LATEST.gguf', args.ctx))}")
        if args.llama_bin is not None and args.form == "text":
            tasks = write_multiple_choice(w / "val.mc.bin", FACTS[n_train:])
            print(f"scored: llama-perplexity --multiple-choice --lora adapter-LATEST.gguf "
                  f"{llama_multiple_choice(args.llama_bin, args.model, tasks, w / 'adapter-LATEST.gguf', w / 'mc-adapter.log'):.2f} %")
        return
    before = logp_accuracy(args.model, val, None, args.ctx)
    print(f"before: {accuracy_line(before)}", flush=True)
    llama = args.llama_bin is not None and args.form == "text"
    if llama:
        tasks = write_multiple_choice(w / "val.mc.bin", FACTS[n_train:])
        print(f"before: llama-perplexity --multiple-choice {llama_multiple_choice(args.llama_bin, args.model, tasks, None, w / 'mc-base.log'):.2f} %",
              flush=True)
    o = FinetuneOptions(model_base=args.model, train_data=train, val_data=val, method=args.method, beta=args.beta,
                        ctx=args.ctx, batch=4, lora_r=8, adam_iter=args.steps, adam_alpha=args.lr, warmup=4,
                        cos_decay_steps=args.steps, save_every=0, eval_every=0, plot=False,
                        checkpointing="layer", checkpoint_out=w / "chk-ITERATION.gguf",
                        lora_out=w / "adapter-ITERATION.gguf", metrics_out=w / "metrics.jsonl")
    validate(o)
    t = time.perf_counter()
    res = finetune(o)
    print(f"{args.steps} steps in {time.perf_counter() - t:.0f} s; losses {res.losses[0]:.4f} -> {res.losses[-1]:.4f}")
    after = logp_accuracy(args.model, val, w / "chk-LATEST.gguf", args.ctx)
    print(f"after:  {accuracy_line(after)}", flush=True)
    if llama:
        acc = llama_multiple_choice(args.llama_bin, args.model, tasks, w / "adapter-LATEST.gguf", w / "mc-adapter.log")
        print(f"after:  llama-perplexity --multiple-choice --lora adapter-LATEST.gguf {acc:.2f} %", flush=True)
    for row in (json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines()):
        if "val_loss" in row:
            print(f"  step {row['step']}: val loss {row['val_loss']:.4f}, "
                  f"reward accuracy {row['eval_rewards/accuracies']:.1%}, margin {row['eval_rewards/margins']:+.3f}")


if __name__ == "__main__":
    main()
